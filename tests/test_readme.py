"""README's two set-up commands are what CI and newcomers run; keep them exact and in sync."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_has_exactly_two_setup_commands():
    setup = ROOT.joinpath("README.md").read_text().split("## Set-up: two commands", 1)[1]
    setup = setup.split("\n## ", 1)[0]
    blocks = bash_blocks(setup)
    assert len(blocks) == 2 and all("\n" not in b for b in blocks), blocks
    assert "shuili generate" in blocks[0] and "pip install" in blocks[0]
    assert "pytest" in blocks[1] and "pip install" in blocks[1]


def test_ci_runs_the_readme_test_command_verbatim():
    setup = ROOT.joinpath("README.md").read_text().split("## Set-up: two commands", 1)[1]
    test_cmd = bash_blocks(setup)[1]
    ci = ROOT.joinpath(".ci", "run").read_text().split("# README:test\n", 1)[1].strip()
    assert ci == test_cmd
