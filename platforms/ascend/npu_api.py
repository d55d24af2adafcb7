"""The one indirection between the backend and torch_npu.

Every torch_npu operator the backend calls is `api.ops.npu_xxx(...)` with keyword arguments named
as in the operator schema, and every device-runtime call (device count, SoC version,
streams) is `api.device.xxx(...)`. On an Ascend host `load()` returns an `NpuApi` whose `ops` is the
`torch_npu` module and whose `device` is `torch_npu.npu`; in CI `shuili.platforms.ascend.sim`
returns one whose ops are `torch.ops.<test namespace>.npu_xxx` (the real schemas, CPU
implementations of their documented semantics) and whose device is a fake runtime.

This module never imports torch_npu at import time; only `load()` does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# torch_npu dtype enums that are not torch dtypes (op_plugin meta registrations; ascend.md 1):
# ops taking `int? x_dtype` / `int dst_type` receive these integers.
DTYPE_CODES: dict[str, int] = {
    "int4": 285,
    "hifloat8": 290,
    "float8_e5m2": 291,
    "float8_e4m3fn": 292,
    "float8_e8m0fnu": 293,
    "float4_e2m1fn_x2": 296,
    "float4_e1m2fn_x2": 297,
}
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29


@dataclass(frozen=True)
class NpuApi:
    """ops: namespace of npu_* operators; device: the torch.npu-like runtime module."""

    ops: Any
    device: Any
    device_type: str  # "npu" on hardware, "cpu" under the simulator
    simulated: bool
    codes: dict[str, int] = field(default_factory=lambda: dict(DTYPE_CODES))

    def code(self, name: str) -> int:
        if name not in self.codes:
            raise KeyError(f"unknown torch_npu dtype enum {name!r}; known: {sorted(self.codes)}")
        return self.codes[name]


def _codes_from(module: Any) -> dict[str, int]:
    codes = dict(DTYPE_CODES)
    for name in DTYPE_CODES:
        value = getattr(module, name, None)
        if isinstance(value, int):
            codes[name] = int(value)
    return codes


def load() -> NpuApi:
    """The real torch_npu. Call only after `device.probe()` said the platform is available."""
    import torch_npu  # noqa: F401  (registers torch.npu, the npu device and the hccl backend)

    return NpuApi(ops=torch_npu, device=torch_npu.npu, device_type="npu", simulated=False,
                  codes=_codes_from(torch_npu))
