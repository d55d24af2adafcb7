"""`shuili generate --input/--output` as a batch job: per-line errors, output checks, SIGINT and
--resume (a real signal to a real subprocess), torn-line repair. tiny-v4, a few tokens each."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shuili.cli import main
from shuili.core import batch

pytest.importorskip("shuili.core.models.deepseek_v4")

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--platform", "reference", "--model", "tiny-v4", "--max-num-batched-tokens", "64"]


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def by_line(recs: list[dict]) -> dict[int, dict]:
    return {r["line"]: r for r in recs}


def test_three_bad_lines_among_twenty(tmp_path, capsys):
    good = [json.dumps({"prompt": f"p{i}", "id": f"q{i}"}) for i in range(17)]
    bad = {4: "{not json", 11: '{"prompt": "x", "temperature": -1}', 17: "[1, 2]"}
    lines = iter(good)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(bad.get(n) or next(lines) for n in range(1, 21)) + "\n")
    dst = tmp_path / "out.jsonl"
    rc = main(["generate", *BASE, "--input", str(src), "--output", str(dst), "--max-tokens", "2"])
    err = capsys.readouterr().err
    recs = by_line(records(dst))
    assert rc == 1 and sorted(recs) == list(range(1, 21))
    failed = {n: r["error"] for n, r in recs.items() if r["error"]}
    assert sorted(failed) == sorted(bad)
    assert failed[4].startswith(f"{src}:4: not valid JSON")
    assert failed[11] == f"{src}:11: temperature: must be >= 0 (0 = greedy), got -1"
    assert failed[17].startswith(f"{src}:17: expected a string or an object")
    ok = [r for n, r in recs.items() if n not in bad]
    assert len(ok) == 17 and all(len(r["outputs"][0]["token_ids"]) == 2 for r in ok)
    assert [r["id"] for r in sorted(ok, key=lambda r: r["line"])] == [f"q{i}" for i in range(17)]
    assert "20 of 20 lines written" in err and "3 failed" in err


def test_without_output_records_go_to_stdout(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Hi", "id": 7}\n')
    assert main(["generate", *BASE, "--input", str(src), "--max-tokens", "1"]) == 0
    (rec,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rec["line"] == 1 and rec["id"] == 7 and len(rec["outputs"][0]["token_ids"]) == 1
    assert main(["generate", *BASE, "--input", str(src), "--resume"]) == 1
    assert "--resume needs --output" in capsys.readouterr().err


def test_output_path_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    from shuili.core import cli

    monkeypatch.setattr(cli, "_llm", lambda args: pytest.fail("the model was loaded"))
    src = tmp_path / "in.jsonl"
    src.write_text('"a"\n')
    assert main(["generate", *BASE, "--input", str(src), "--output", str(tmp_path / "no" / "o.jsonl")]) == 1
    assert "cannot write --output" in capsys.readouterr().err
    full = tmp_path / "full.jsonl"
    full.write_text('{"line": 1}\n')
    assert main(["generate", *BASE, "--input", str(src), "--output", str(full)]) == 1
    assert "--resume" in capsys.readouterr().err and full.read_text() == '{"line": 1}\n'
    # everything already answered: --resume has nothing to do and loads no model
    assert main(["generate", *BASE, "--input", str(src), "--output", str(full), "--resume"]) == 0


def test_resume_drops_a_torn_last_line(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"line": 2, "outputs": []}\n{"line": 5, "outp')
    assert batch.done_lines(str(out)) == {2: None}  # a record without a digest is not checked
    assert out.read_text() == '{"line": 2, "outputs": []}\n'
    out.write_text('{"line": 2}\nnot a record\n')
    with pytest.raises(ValueError, match=r"o.jsonl:2 is not a result record"):
        batch.done_lines(str(out))


def test_sigint_keeps_finished_results_and_resume_matches_an_uninterrupted_run(tmp_path):
    n = 5
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n" for i in range(n)))
    # one line at a time, so the signal lands with lines both finished and not started
    flags = [*BASE, "--max-num-seqs", "1", "--max-tokens", "8", "--ignore-eos", "--temperature", "0.8",
             "--seed", "7", "--input", str(src)]
    whole = tmp_path / "whole.jsonl"
    assert main(["generate", *flags, "--output", str(whole)]) == 0

    part = tmp_path / "part.jsonl"
    cmd = [sys.executable, "-m", "shuili", "generate", *flags, "--output", str(part)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while (not part.exists() or not part.read_text()) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    done = records(part)
    assert proc.returncode == 130, err
    assert 1 <= len(done) < n, "the run finished before the signal; make it longer"
    assert "interrupted" in err and "--resume" in err

    assert main(["generate", *flags, "--output", str(part), "--resume"]) == 0
    resumed = records(part)
    assert len(resumed) == n and resumed[:len(done)] == done
    assert by_line(resumed) == by_line(records(whole))  # token ids, logprob bits, seeds


def test_sigterm_stops_admitting_and_keeps_what_finished(tmp_path):
    from shuili import LLM

    llm = LLM(model="tiny-v4", platform="reference", max_num_seqs=1, max_num_batched_tokens=64)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'"prompt {i}"\n' for i in range(6)))
    lines = batch.read_input(str(src), {"max_tokens": 2, "temperature": 0.0})
    fd, _ = batch.open_output(str(tmp_path / "o.jsonl"), resume=False)
    sink = batch.Sink(fd)

    def signal_after_first(written):
        if written == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    summary = batch.run(llm, lines, sink, chat=False, progress=signal_after_first)
    sink.close()
    assert summary.signum == signal.SIGTERM and batch.INTERRUPT_EXIT[summary.signum] == 143
    assert 1 <= summary.written < 6 and summary.remaining == 6 - summary.written
    assert len(records(tmp_path / "o.jsonl")) == summary.written
    assert not llm.engine.has_unfinished()  # the running requests were aborted
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_resume_refuses_an_input_whose_answered_lines_changed(tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    src.write_text('"first"\n"second"\n')
    assert main(["generate", *BASE, "--input", str(src), "--output", str(out), "--max-tokens", "1"]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(len(r["input_digest"]) == 16 for r in recs)
    out.write_text(next(json.dumps(r) for r in recs if r["line"] == 1) + "\n")  # line 2 still to do
    src.write_text('"edited"\n"second"\n')
    assert main(["generate", *BASE, "--input", str(src), "--output", str(out), "--resume"]) == 1
    err = capsys.readouterr().err
    assert "line 1 has changed" in err and "--resume" in err
    src.write_text('"first"\n"second"\n')  # restored: resume answers line 2 only
    assert main(["generate", *BASE, "--input", str(src), "--output", str(out), "--resume"]) == 0
    assert sorted(json.loads(x)["line"] for x in out.read_text().splitlines()) == [1, 2]
