"""Determinism settings, declared capabilities per config, platform resolution."""
from __future__ import annotations

import pytest
import torch

from shuili.hal import DeterminismLevel as L, PlatformConfig, resolve_platform
from shuili.hal.ops import OP_NAMES
from shuili.platforms.ascend import device, sim_plugin
from shuili.platforms.ascend.capabilities import capabilities
from shuili.platforms.ascend.sim import FakeNpu, simulated_api


@pytest.mark.parametrize("det,bi", [(False, False), (True, False), (False, True)])
def test_apply_determinism(det, bi):
    env, calls = {}, []
    api = simulated_api(FakeNpu())
    applied = device.apply_determinism(PlatformConfig(deterministic=det, batch_invariant=bi), api,
                                       environ=env, set_torch_deterministic=calls.append)
    if not (det or bi):
        assert applied == {} and env == {} and calls == [] and api.device.deterministic_level is None
        return
    assert env["HCCL_DETERMINISTIC"] == "true" and env["LCCL_DETERMINISTIC"] == "1"
    assert calls == [True] and api.device.deterministic_level == 1
    assert applied["torch.use_deterministic_algorithms"] is True


def test_capabilities_are_conditional():
    plain = capabilities(PlatformConfig())
    det = capabilities(PlatformConfig(deterministic=True))
    bi = capabilities(PlatformConfig(batch_invariant=True))
    assert set(plain.ops) == set(OP_NAMES)
    assert plain.collectives_backend == "hccl" and plain.graph_capture and plain.device_type == "npu"
    # kernels with batch-dependent tiling: nothing without settings, run_to_run when deterministic,
    # batch_invariant only in batch-invariant mode (where they are replaced by fixed-tile paths)
    for op in ("linear", "paged_attention", "moe_experts", "add_rms_norm", "indexer_topk"):
        assert plain.ops[op].determinism == L.none
        assert det.ops[op].determinism == L.run_to_run and det.ops[op].determinism_requires == "deterministic"
        assert bi.ops[op].determinism == L.batch_invariant
        assert bi.ops[op].determinism_requires == "batch_invariant"
    assert det.ops["rms_norm"].determinism == L.batch_invariant
    assert all(c.determinism < L.portable_bitwise or "host" in c.notes for c in bi.ops.values())


def test_sim_platform_resolves_with_every_op_native():
    r = resolve_platform(PlatformConfig(platform="ascend-sim"), extra_plugins={"ascend-sim": sim_plugin})
    assert r.fallbacks == () and set(r.ops.sources.values()) == {"ascend-sim"}
    assert r.capabilities.collectives_backend == "hccl"


def test_real_platform_is_refused_here_with_the_reason():
    from shuili.hal import PlatformUnavailableError

    with pytest.raises(PlatformUnavailableError, match="torch_npu not installed"):
        resolve_platform(PlatformConfig(platform="ascend"))
