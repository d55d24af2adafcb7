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


def test_help_shows_a_line_and_a_default_for_every_flag():
    from shuili.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("generate", "bench", "perplexity"):
        for action in sub.choices[name]._actions:
            assert action.help, f"{name} {action.option_strings} has no help line"
    text = sub.choices["generate"].format_help()
    for flag in ("--n", "--stop", "--presence-penalty", "--frequency-penalty", "--repetition-penalty"):
        assert flag in text
    assert "--max-tokens MAX_TOKENS" in text and "(default: 16)" in text and "greedy (default: 0.0)" in text


def test_generate_needs_a_prompt(capsys):
    assert main(["generate", *BASE]) == 1
    assert "--prompt" in capsys.readouterr().err


def test_bench_json(capsys):
    rc = main(["bench", *BASE, "--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["output_tokens"] == 9 and res["errors"] == 0
    for key in ("ttft_mean_s", "tpot_mean_s", "output_tokens_per_s", "scheduler_us_per_step"):
        assert res[key] > 0


def test_enforce_eager_flag_reaches_the_config(tmp_path):
    import argparse

    from shuili.core.cli import _config

    base = dict(platform="reference", model="tiny-v4", config=None, max_num_seqs=None,
                max_num_batched_tokens=None, max_model_len=None, num_blocks=None, overlap=None)
    assert _config(argparse.Namespace(**base, enforce_eager=True)).enforce_eager is True
    assert _config(argparse.Namespace(**base, enforce_eager=None)).enforce_eager is False
    cfg = tmp_path / "e.json"
    cfg.write_text('{"model": "tiny-v4", "enforce_eager": true}')
    assert _config(argparse.Namespace(**{**base, "config": str(cfg)}, enforce_eager=None)).enforce_eager
