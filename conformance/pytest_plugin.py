"""The conformance checks as pytest items, for a vendor's own CI.

    # conftest.py (root)                      # test_shuili_conformance.py
    pytest_plugins = ["shuili.conformance.pytest_plugin"]
                                              from shuili.conformance.pytest_plugin import (  # noqa: F401
                                                  test_shuili_op, test_shuili_engine)

    pytest --shuili-platform myvendor [--shuili-op linear ...] [--shuili-workload tiny-v4]
           [--shuili-seed N] [--shuili-report DIR]

(or `pytest -p shuili.conformance.pytest_plugin ...` instead of the conftest line). One item per
op (`test_shuili_op[linear]`) and per workload; an item fails with each failing check's first
divergence. `--shuili-report DIR` also writes report.json / report.md for the whole session.
Without --shuili-platform (or SHUILI_PLATFORM) the items are skipped.
"""
from __future__ import annotations

import os

import pytest

from shuili.conformance.report import Report
from shuili.hal.ops import OP_NAMES

_STATE: dict = {}


def pytest_addoption(parser) -> None:
    g = parser.getgroup("shuili", "shuili conformance")
    g.addoption("--shuili-platform", default=os.environ.get("SHUILI_PLATFORM"),
                help="platform to check (default $SHUILI_PLATFORM; unset skips the items)")
    g.addoption("--shuili-op", action="append", default=None, help="only these ops (repeatable)")
    g.addoption("--shuili-workload", action="append", default=None,
                help="engine workloads (repeatable); none: no engine items")
    g.addoption("--shuili-seed", type=int, default=None, help="replay a run's seed")
    g.addoption("--shuili-cases", type=int, default=3, help="fuzzed cases per op, dtype and format")
    g.addoption("--shuili-report", default=None, metavar="DIR", help="write report.json/.md here")


def pytest_configure(config) -> None:
    from shuili.conformance.runner import new_seed

    seed = config.getoption("--shuili-seed")
    _STATE["seed"] = new_seed() if seed is None else seed
    _STATE["report"] = None


def pytest_report_header(config):
    platform = config.getoption("--shuili-platform")
    if platform:
        return f"shuili conformance: platform {platform}, seed {_STATE['seed']} (--shuili-seed to replay)"
    return None


def pytest_generate_tests(metafunc) -> None:
    cfg = metafunc.config
    if "shuili_op_name" in metafunc.fixturenames:
        ops = cfg.getoption("--shuili-op") or list(OP_NAMES)
        metafunc.parametrize("shuili_op_name", ops, ids=ops)
    if "shuili_workload_name" in metafunc.fixturenames:
        names = cfg.getoption("--shuili-workload") or []
        metafunc.parametrize("shuili_workload_name", names, ids=names)


@pytest.fixture(scope="session")
def shuili_conformance(request):
    """(resolved platform, resolved reference, seed, cases, Report) for the session."""
    from shuili.conformance import baselines
    from shuili.hal import PlatformConfig, resolve_platform

    name = request.config.getoption("--shuili-platform")
    if not name:
        pytest.skip("no platform to check: pass --shuili-platform NAME (or set SHUILI_PLATFORM)")
    resolved = resolve_platform(PlatformConfig(platform=name))
    reference = resolve_platform(PlatformConfig(platform="reference"))
    report = Report(platform=resolved.name, seed=_STATE["seed"], command="pytest (shuili plugin)",
                    fingerprint=baselines.stack_fingerprint(resolved))
    _STATE["report"] = report
    return resolved, reference, _STATE["seed"], request.config.getoption("--shuili-cases"), report


def _fail_text(results) -> str:
    lines = []
    for r in results:
        if r.failed:
            lines.append(f"{r.name} [{r.level}]: {r.message}")
            if r.divergence is not None:
                lines.append(f"    first divergence {r.divergence.line()}")
            if r.details.get("case"):
                lines.append(f"    case {r.details['case']}")
    return "\n".join(lines)


def test_shuili_op(shuili_op_name, shuili_conformance):
    """Op-level conformance of one op: vs reference, run-to-run, batch invariance."""
    from shuili.conformance.ops_check import check_op

    resolved, reference, seed, cases, report = shuili_conformance
    results = check_op(resolved, reference, shuili_op_name, seed, cases)
    report.add(results)
    if any(r.failed for r in results):
        pytest.fail(_fail_text(results), pytrace=False)


def test_shuili_engine(shuili_workload_name, shuili_conformance):
    """Engine-level conformance of one workload (see shuili.conformance.engine_check)."""
    from shuili.conformance import workloads
    from shuili.conformance.engine_check import check_workload

    resolved, _, seed, _, report = shuili_conformance
    results, _ = check_workload(workloads.get(shuili_workload_name), resolved.name, seed)
    report.add(results)
    if any(r.failed for r in results):
        pytest.fail(_fail_text(results), pytrace=False)


def pytest_sessionfinish(session, exitstatus) -> None:
    out = session.config.getoption("--shuili-report")
    report = _STATE.get("report")
    if out and report is not None:
        from shuili.conformance.report import write

        write(report, out)
