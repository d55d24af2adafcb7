"""Layering rules that keep contract facts in hal/ and vendor code out of the core."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_IMPORT = re.compile(r"shuili\.platforms\.reference\.(\w+)")


def _sources(*dirs: str):
    for d in dirs:
        yield from sorted((ROOT / d).rglob("*.py"))


def test_vendor_backends_use_only_the_public_reference_module():
    bad = [f"{p.relative_to(ROOT)}: {m.group(0)}"
           for p in _sources("platforms/nvidia", "platforms/ascend", "conformance", "core", "tests/plugins")
           for m in REFERENCE_IMPORT.finditer(p.read_text()) if m.group(1) != "public"]
    assert not bad, "import the helper from shuili.platforms.reference.public instead:\n" + "\n".join(bad)


def test_the_kv_row_formula_is_written_once():
    hits = [p.relative_to(ROOT) for p in _sources("core", "platforms", "conformance", "hal")
            if re.search(r"def (bytes_per_row|row_bytes)\(", p.read_text())]
    assert [str(h) for h in hits] == ["hal/formats.py"]
