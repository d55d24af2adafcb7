"""`shuili generate` and `shuili bench` end to end on tiny-v4 (the real model registry path)."""
from __future__ import annotations

import json

import pytest

from shuili.cli import main

pytest.importorskip("shuili.core.models.deepseek_v4")

BASE = ["--platform", "reference", "--model", "tiny-v4", "--max-num-batched-tokens", "64"]


def test_generate_json(capsys):
    rc = main(["generate", *BASE, "--prompt", "Hello", "--prompt", "abc", "--max-tokens", "3",
               "--temperature", "0.8", "--seed", "5", "--json"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 0 and len(lines) == 2
    for rec in lines:
        (c,) = rec["outputs"]
        assert {"text", "token_ids", "logprobs", "seed", "finish_reason"} <= set(c)
        assert len(c["token_ids"]) == 3 == len(c["logprobs"]) and c["seed"] == 5


def test_generate_jsonl_batch_with_a_bad_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('"first"\n{"prompt": "second", "max_tokens": 2}\n{"prompt": ""}\n')
    dst = tmp_path / "out.jsonl"
    rc = main(["generate", *BASE, "--input", str(src), "--output", str(dst), "--max-tokens", "3"])
    recs = sorted((json.loads(x) for x in dst.read_text().splitlines()), key=lambda r: r["line"])
    assert rc == 1  # one request failed; the others were still answered
    assert [len(r["outputs"][0]["token_ids"]) for r in recs] == [3, 2, 0]
    assert recs[2]["outputs"][0]["finish_reason"] == "error"
    assert recs[2]["error"] == f"{src}:3: empty prompt: give at least one character (or one token id)"


def test_generate_n_groups_samples_per_prompt(capsys):
    rc = main(["generate", *BASE, "--prompt", "Hi", "--n", "2", "--max-tokens", "2", "--temperature", "1",
               "--seed", "3", "--json"])
    (rec,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 0 and [c["seed"] for c in rec["outputs"]] == [3, 4]


def subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from subparsers(sub)


def test_help_shows_a_line_and_a_default_for_every_flag():
    from shuili.cli import HelpFormatter, build_parser

    subs = dict(subparsers(build_parser()))
    for name, sub in subs.items():
        fmt = sub._get_formatter()
        assert isinstance(fmt, HelpFormatter), name
        for action in sub._actions:
            if not action.option_strings:  # a nested command list is described by its commands' help
                continue
            assert action.help, f"{name} {action.option_strings} has no help line"
            if action.default not in (None, False, [], "==SUPPRESS=="):
                assert "default" in fmt._get_help_string(action), f"{name} {action.option_strings}"
    text = subs["generate"].format_help()
    for flag in ("--n", "--stop", "--presence-penalty", "--frequency-penalty", "--repetition-penalty"):
        assert flag in text
    assert "--max-tokens MAX_TOKENS" in text and "(default: 16)" in text and "greedy (default: 0.0)" in text


def test_block_size_sets_tokens_per_block_and_bad_sizes_name_the_ratio(capsys):
    from shuili.cli import build_parser
    from shuili.core.cli import _config

    args = build_parser().parse_args(["generate", *BASE, "--block-size", "128", "--prompt", "x"])
    assert _config(args).tokens_per_block == 128
    rc = main(["generate", *BASE, "--block-size", "12", "--prompt", "x", "--max-tokens", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and "tokens_per_block" in err and "12" in err
