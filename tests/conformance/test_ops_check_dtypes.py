"""Op checks in a narrower dtype: portable_bitwise means the reference's result rounded to it."""
import dataclasses

import torch

from shuili.conformance import ops_check
from shuili.hal import DeterminismLevel, DtypeSupport, PlatformConfig, resolve_platform
from shuili.hal.ops import DispatchTable

REF = resolve_platform(PlatformConfig(platform="reference"))


def _platform(swiglu, level):
    ops = REF.ops.as_dict()
    ops["swiglu"] = swiglu
    cap = REF.capabilities.ops["swiglu"].model_copy(
        update={"dtypes": (DtypeSupport(name="bfloat16"),), "determinism": level})
    caps = REF.capabilities.model_copy(update={"ops": {**REF.capabilities.ops, "swiglu": cap}})
    return dataclasses.replace(REF, ops=DispatchTable("bf16-test", ops, {}), capabilities=caps)


def f32_then_round(gate_up, limit=None):
    return REF.ops.swiglu(gate_up.float(), limit).to(gate_up.dtype)


def native_bf16(gate_up, limit=None):  # bf16 arithmetic throughout: close, not the reference's bits
    g, u = gate_up.chunk(2, dim=-1)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return torch.nn.functional.silu(g) * u


def _status(platform, check="vs_reference"):
    res = {r.name: r for r in ops_check.check_op(platform, REF, "swiglu", seed=5, cases=4)}
    return res[f"op.swiglu.{check}"]


def test_rounded_reference_meets_portable_bitwise_in_bf16():
    r = _status(_platform(f32_then_round, DeterminismLevel.portable_bitwise))
    assert r.status == "pass" and r.details["dtypes"] == ["bfloat16"]


def test_native_bf16_fails_bitwise_but_meets_tolerance():
    bad = _status(_platform(native_bf16, DeterminismLevel.portable_bitwise))
    assert bad.status == "fail" and bad.divergence.expected_bits.startswith("0x")
    assert len(bad.divergence.expected_bits) == 6  # a 16-bit pattern: compared in bf16
    ok = _status(_platform(native_bf16, DeterminismLevel.batch_invariant))
    assert ok.status == "pass" and ok.level == "batch_invariant (tolerance)"
