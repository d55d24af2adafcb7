"""README's two set-up commands are what CI and newcomers run; keep them exact and in sync."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

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


# --- the Commands block: every line runs (short inputs), so the README cannot drift from the CLI

# a short, real value per flag; README placeholders (M, P, N, FILE, ...) are replaced by these
VALUES = {"--model": "tiny-v4", "--platform": "reference", "--max-tokens": "2", "--temperature": "0",
          "--seed": "3", "--n": "2", "--stop": "zz", "--presence-penalty": "0.5",
          "--frequency-penalty": "0.5", "--repetition-penalty": "1.1", "--prompt": "Hi",
          "--num-prompts": "2", "--input-len": "4", "--output-len": "2", "--workload": "tiny-v4-quick",
          "--host": "127.0.0.1", "--port": "8000", "--max-num-seqs": "4", "--max-waiting": "8",
          "--shutdown-timeout": "1"}
# keeps each run short without changing what the line exercises
EXTRA = {("generate",): ["--max-num-batched-tokens", "64"], ("perplexity",): ["--model", "tiny-v4"],
         ("conformance", "run"): ["--no-engine", "--op", "rms_norm", "--cases", "1"]}


def readme_commands() -> list[list[str]]:
    import shlex

    block = ROOT.joinpath("README.md").read_text().split("## Commands", 1)[1].split("```text\n", 1)[1]
    joined = re.sub(r"\n\s+(?=\[|--)", " ", block.split("```", 1)[0])
    lines = [re.split(r"\s{2,}(?=[a-z])", x.strip())[0] for x in joined.splitlines() if x.strip()]
    return [shlex.split(x.replace("[", " ").replace("]", " ")) for x in lines]


def subcommand(parser, words: list[str]):
    """The (sub)parser a README line names and the words that name it."""
    import argparse

    path = []
    for w in words:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or w not in sub.choices:
            break
        parser, path = sub.choices[w], [*path, w]
    return parser, tuple(path)


def concrete(words: list[str], parser, files: dict) -> list[str]:
    out, it = [], iter(words)
    opts = {s: a for a in parser._actions for s in a.option_strings}
    for w in it:
        if not w.startswith("--"):
            out.append(w)
            continue
        assert w in opts, f"README flag {w} is not a flag of this command"
        out.append(w)
        if opts[w].nargs != 0:
            next(it)
            out.append(files.get(w) or VALUES[w])
    return out


def test_every_readme_command_runs(tmp_path, capsys):
    pytest.importorskip("shuili.core.models.deepseek_v4")
    from shuili.cli import build_parser, main

    (tmp_path / "p.jsonl").write_text('"Hi"\n{"prompt": "Yo", "max_tokens": 1}\n')
    (tmp_path / "t.jsonl").write_text('{"id": "a", "text": "Water flows down the hill."}\n')
    (tmp_path / "c.toml").write_text('max_num_seqs = 4\n')
    files = {"--input": str(tmp_path / "p.jsonl"), "--output": str(tmp_path / "o.jsonl"),
             "--texts": str(tmp_path / "t.jsonl"), "--config": str(tmp_path / "c.toml"),
             "--out": str(tmp_path / "report"), "--baselines": str(tmp_path / "baselines")}
    parser = build_parser()
    seen = set()
    for words in readme_commands():
        assert words[0] == "shuili", words
        sub, path = subcommand(parser, words[1:])
        seen.add(path[0])
        argv = [*concrete([w for w in words[1:] if w != "..."], sub, files), *EXTRA.get(path, [])]
        if path == ("serve",):
            continue  # its flags are checked above; tests/server runs the server itself
        if path == ("conformance", "baseline", "update"):
            argv += ["--baselines", files["--baselines"]]  # never rewrite the package's locked baselines
        rc = main(argv)
        assert rc == 0, (argv, capsys.readouterr().err[-2000:])
    assert seen == set(next(a for a in parser._actions if a.dest == "command").choices), \
        "a subcommand is missing from README's Commands"
    assert Path(files["--baselines"], "reference", "tiny-v4-quick.json").exists()


def test_readme_python_example_runs(capsys):
    pytest.importorskip("shuili.core.models.deepseek_v4")
    code = ROOT.joinpath("README.md").read_text().split("## Python API", 1)[1].split("```python\n")[1]
    code = code.split("```", 1)[0]
    # tiny-v4 stands in for the default model: the point is that the calls and fields exist
    exec(code.replace("LLM()", 'LLM(model="tiny-v4", platform="reference")'), {})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith("[")
