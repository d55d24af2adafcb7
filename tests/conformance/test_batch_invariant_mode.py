"""`--batch-invariant` reaches every engine the engine checks build, and the CLI accepts it."""
from __future__ import annotations

from shuili.conformance import engine_check, workloads
from shuili.conformance.cli import add_parser


def test_session_engines_resolve_the_platform_in_batch_invariant_mode():
    w = workloads.get("tiny-v4-quick")
    for flag in (False, True):
        llm = engine_check.Session(w, "reference", batch_invariant=flag).llm()
        assert llm.engine.config.platform.batch_invariant is flag
        assert llm.engine.platform.config.batch_invariant is flag


def test_cli_has_the_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["conformance", "run", "--platform", "reference", "--out", "x",
                              "--batch-invariant"])
    assert args.batch_invariant is True


def test_run_logs_each_stage(caplog):
    """`shuili -v conformance run` says how far it got, stage by stage: a run cut by a timeout
    (the CLI prints its report only at the end) still shows its finished stages."""
    import logging

    from shuili.conformance.runner import run_conformance

    with caplog.at_level(logging.INFO, logger="shuili.conformance"):
        rep = run_conformance("reference", ops=["rms_norm"], cases=1, engine=False, seed=5)
    lines = [r.getMessage() for r in caplog.records if r.name == "shuili.conformance"]
    ops = sum(c.name.startswith("op.") for c in rep.checks)
    assert any(m.startswith(f"op checks: {ops} checks, 0 failed, at ") for m in lines), lines
    assert any(m.startswith("negative control: ") for m in lines), lines
