"""The conformance suite's op-level checks against the Ascend backend over the simulator.

Every op of the contract runs through `shuili.conformance.ops_check.check_ops` (vs reference at
the declared level, run-to-run, batch invariance) on fixed seeds, in the default and the
batch-invariant configuration. Note: the suite's fuzzed shapes are mostly outside the envelope of
the fused attention / indexer kernels (small block sizes, float32), so for those two ops this runs
the host path; test_ops_vs_reference.py covers their NPU paths.
"""
from __future__ import annotations

import pytest

ops_check = pytest.importorskip("shuili.conformance.ops_check")

from shuili.hal import PlatformConfig, resolve_platform  # noqa: E402
from shuili.platforms.ascend import sim_plugin  # noqa: E402


@pytest.mark.parametrize("config", [dict(), dict(batch_invariant=True, deterministic=True)],
                         ids=["default", "batch_invariant"])
def test_op_level_conformance(config):
    platform = resolve_platform(PlatformConfig(platform="ascend-sim", **config),
                                extra_plugins={"ascend-sim": sim_plugin})
    reference = resolve_platform(PlatformConfig(platform="reference"))
    results = ops_check.check_ops(platform, reference, seed=20261202, cases=1)
    bad = [f"{r.name}: {r.status}: {r.message} {r.details.get('case', '')}" for r in results
           if r.status in ("fail", "error")]
    assert not bad, "\n".join(bad)
    assert sum(r.status == "pass" for r in results) >= 22
