"""A CPU stand-in for torch_npu, for CI: the real operator schemas, simulated semantics.

`simulated_api()` registers every schema of `schemas.py` with `torch.library` in the test-only
namespace `shuili_npu_sim` (once per process), backs each with its CPU implementation from
`sim_impls.py`, and returns an `NpuApi` whose `ops.npu_xxx` are those `torch.ops` packets. Calls
therefore go through torch's schema binding: an unknown keyword, a missing required argument or a
wrong argument type raises exactly as it would against torch_npu. The device side is `FakeNpu`
(SoC id, device name, streams) so probe and SoC detection run too.

Nothing here imports torch_npu; it is safe on any machine.
"""
from __future__ import annotations

import types

import torch

from shuili.platforms.ascend.npu_api import DTYPE_CODES, NpuApi
from shuili.platforms.ascend.schemas import SCHEMAS
from shuili.platforms.ascend.sim_impls import IMPLS

NAMESPACE = "shuili_npu_sim"
_LIB: torch.library.Library | None = None


def register() -> str:
    """Define the schemas in NAMESPACE and attach the CPU impls (idempotent). Returns NAMESPACE."""
    global _LIB
    if _LIB is not None:
        return NAMESPACE
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in SCHEMAS.items():
        if name in IMPLS:
            lib.define(schema)
            lib.impl(name, IMPLS[name], "CPU")
    _LIB = lib
    return NAMESPACE


class FakeStream:
    def synchronize(self):
        return None

    def wait_stream(self, other):
        return None


class FakeNpu:
    """The subset of `torch_npu.npu` the backend calls, for an Ascend 950 unless told otherwise."""

    def __init__(self, soc_version: int = 260, device_name: str = "Ascend950DT_9582", count: int = 1):
        self.soc_version = soc_version
        self.device_name = device_name
        self.count = count
        self.deterministic_level: int | None = None
        self.Stream = FakeStream

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def get_soc_version(self) -> int:
        return self.soc_version

    def get_device_name(self, device=None) -> str:
        return self.device_name

    def set_device(self, device) -> None:
        return None

    def current_device(self) -> int:
        return 0

    def synchronize(self, device=None) -> None:
        return None

    def current_stream(self, device=None) -> FakeStream:
        return FakeStream()

    def set_deterministic_level(self, level: int) -> None:
        self.deterministic_level = int(level)


def simulated_api(device: FakeNpu | None = None) -> NpuApi:
    """An NpuApi whose operators are the schema-checked CPU simulations."""
    register()
    packets = getattr(torch.ops, NAMESPACE)
    ops = types.SimpleNamespace(**{name: getattr(packets, name) for name in SCHEMAS if name in IMPLS})
    return NpuApi(ops=ops, device=device or FakeNpu(), device_type="cpu", simulated=True,
                  codes=dict(DTYPE_CODES))
