"""Docs stay in sync with the code: every op signature and hook is documented (datasette-style)."""
from __future__ import annotations

from pathlib import Path

from shuili.hal import hookspecs
from shuili.hal.ops import OP_SPECS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_op_signature_is_in_docs_hal_md():
    text = (DOCS / "hal.md").read_text()
    stale = [n for n, s in OP_SPECS.items() if f"{n}{s.signature}".replace("'", "") not in text]
    assert not stale, f"docs/hal.md lacks or has stale signatures for {stale}"


def test_every_hook_is_in_the_backend_guide():
    text = (DOCS / "adding-a-backend.md").read_text()
    hooks = [n for n in dir(hookspecs) if n.startswith("shuili_platform_")]
    assert len(hooks) == 6
    assert all(f"`{h}(" in text for h in hooks)
