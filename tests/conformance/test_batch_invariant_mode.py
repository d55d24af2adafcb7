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
