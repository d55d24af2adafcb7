"""Platform "ascend-sim": the Ascend backend bound to the CPU simulator of torch_npu.

Not registered by entry point; tests and the conformance suite inject it:
`resolve_platform(PlatformConfig(platform="ascend-sim"), extra_plugins={"ascend-sim": sim_plugin})`.
It runs the real backend code against the real operator schemas with simulated semantics, so the
op-level conformance checks the backend's calls without hardware. Determinism settings are not
applied (they would flip process-global torch flags in the test process).
"""
from __future__ import annotations

from shuili.hal import HAL_API_VERSION, Availability, PlatformInfo
from shuili.hal.hookspecs import hookimpl

NAME = "ascend-sim"


@hookimpl
def shuili_platform_info():
    return PlatformInfo(name=NAME, vendor="Huawei (simulated)", priority=-10,
                        hal_api_version=HAL_API_VERSION,
                        description="the Ascend backend over CPU simulations of torch_npu 2.13 schemas")


@hookimpl
def shuili_platform_probe(platform):
    if platform != NAME:
        return None
    return Availability.yes("CPU simulation of the torch_npu operators (schema-checked); not an NPU")


@hookimpl
def shuili_platform_capabilities(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.ascend.capabilities import capabilities

    return capabilities(config).model_copy(update={"device_type": "cpu", "graph_capture": False})


@hookimpl
def shuili_platform_ops(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.ascend.plugin import op_table
    from shuili.platforms.ascend.sim import simulated_api

    return op_table(config, api=simulated_api(), apply_settings=False)


@hookimpl
def shuili_platform_transfer(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.ascend.sim import FakeNpu
    from shuili.platforms.ascend.transfer import NpuTransfer

    return NpuTransfer(FakeNpu())  # tensors are on the CPU here: NpuTransfer copies plainly
