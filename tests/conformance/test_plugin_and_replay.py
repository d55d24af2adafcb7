"""The pytest plugin's items, and the bounded-replay check's sensitivity."""
import os
import subprocess
import sys

import pytest

from shuili.conformance import replay, workloads
from shuili.core.kv_cache import KVCacheManager
from shuili.hal.registry import list_platforms


@pytest.mark.skipif(not any(e.name == "perturbed" and e.usable for e in list_platforms().entries),
                    reason="pip install -e tests/plugins/perturbed_backend")
def test_pytest_plugin_items_fail_with_divergence(tmp_path):
    (tmp_path / "test_vendor.py").write_text(
        "from shuili.conformance.pytest_plugin import test_shuili_op, test_shuili_engine  # noqa: F401\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "shuili.conformance.pytest_plugin",
         str(tmp_path / "test_vendor.py"), "--shuili-platform", "perturbed", "--shuili-op", "rms_norm",
         "--shuili-op", "swiglu", "--shuili-cases", "1", "--shuili-report", str(tmp_path / "rep"),
         "--rootdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out  # and test_shuili_engine skipped: no --shuili-workload
    assert "test_shuili_op[rms_norm]" in out and "first divergence" in out
    assert (tmp_path / "rep" / "report.json").is_file()


def test_pytest_plugin_skips_without_platform(tmp_path):
    (tmp_path / "test_vendor.py").write_text(
        "from shuili.conformance.pytest_plugin import test_shuili_op  # noqa: F401\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "shuili.conformance.pytest_plugin",
         str(tmp_path / "test_vendor.py"), "--shuili-op", "swiglu", "--rootdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "SHUILI_PLATFORM"})
    assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout + proc.stderr


def test_bounded_replay_catches_a_block_freed_inside_the_window(monkeypatch):
    first_needed = KVCacheManager._first_needed

    def one_too_many(self, g, position):  # frees the oldest block a query still reads
        return first_needed(self, g, position) + 1

    monkeypatch.setattr(KVCacheManager, "_first_needed", one_too_many)
    w = workloads.get("tiny-v4-quick")
    results = {r.name: r for r in replay.check_bounded_replay(w, "reference", seed=3)}
    meta = results["replay.tiny-v4-quick.metadata"]
    assert meta.status == "fail", meta
    # the model maps a slot of a freed block to "no entry" (-1); -2 would be a dangling index
    assert meta.divergence.got in (-1, -2) and meta.divergence.expected >= 0
    assert meta.divergence.where["cache"] == "swa_kv"
