"""Reference platform plugin: registration, probe, capabilities and the op table."""
from __future__ import annotations

from shuili.hal import (
    HAL_API_VERSION, Availability, DeterminismLevel, DtypeSupport, OpCapability,
    PlatformCapabilities, PlatformInfo,
)
from shuili.hal.hookspecs import hookimpl

NAME = "reference"


@hookimpl
def shuili_platform_info():
    return PlatformInfo(name=NAME, vendor="shuili", priority=0, hal_api_version=HAL_API_VERSION,
                        description="CPU, pure torch, float32, the conformance oracle")


@hookimpl
def shuili_platform_probe(platform):
    if platform != NAME:
        return None
    return Availability.yes("pure torch on the CPU; always available")


def op_table() -> dict:
    from shuili.platforms.reference import malloc, ops

    malloc.keep_freed_blocks()  # performance only: freed temporaries are reused, not page-faulted
    return dict(ops.OPS)


@hookimpl
def shuili_platform_ops(platform, config):
    return op_table() if platform == NAME else None


_F32 = (DtypeSupport(name="float32"),)


@hookimpl
def shuili_platform_capabilities(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.reference import ops

    return PlatformCapabilities(
        ops={name: OpCapability(dtypes=_F32, formats=ops.FORMATS.get(name, ()),
                                determinism=DeterminismLevel.portable_bitwise,
                                notes="fixed-order float32; the oracle")
             for name in ops.OPS},
        compute_dtypes=("float32",), graph_capture=False, collectives_backend="single-process",
        device_type="cpu")


@hookimpl
def shuili_platform_transfer(platform, config):
    if platform != NAME:
        return None
    from shuili.hal.transfer import HostTransfer

    return HostTransfer()  # tensors already live on the host: plain copies hide nothing
