"""Ascend platform plugin. torch_npu is imported lazily, only inside the probe and op loading."""
from __future__ import annotations

from shuili.hal import HAL_API_VERSION, Availability, PlatformInfo
from shuili.hal.hookspecs import hookimpl

NAME = "ascend"


@hookimpl
def shuili_platform_info():
    return PlatformInfo(name=NAME, vendor="Huawei", priority=90, hal_api_version=HAL_API_VERSION,
                        description="Ascend 950 NPUs via torch_npu (not yet run on Ascend hardware)")


def probe() -> Availability:
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return Availability.no("torch_npu not installed (pip install 'shuili[ascend]' on a host with CANN)")
    return Availability.no("probe not implemented yet")


@hookimpl
def shuili_platform_probe(platform):
    return probe() if platform == NAME else None
