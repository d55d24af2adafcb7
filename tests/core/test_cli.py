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
        assert {"text", "token_ids", "logprobs", "seed", "finish_reason"} <= set(rec)
        assert len(rec["token_ids"]) == 3 == len(rec["logprobs"]) and rec["seed"] == 5


def test_generate_jsonl_batch_with_a_bad_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('"first"\n{"prompt": "second", "max_tokens": 2}\n{"prompt": ""}\n')
    dst = tmp_path / "out.jsonl"
    rc = main(["generate", *BASE, "--input", str(src), "--output", str(dst), "--max-tokens", "3"])
    recs = [json.loads(x) for x in dst.read_text().splitlines()]
    assert rc == 1  # one request failed; the others were still answered
    assert [len(r["token_ids"]) for r in recs] == [3, 2, 0]
    assert recs[2]["finish_reason"] == "error" and "empty prompt" in recs[2]["error"]


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
