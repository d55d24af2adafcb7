"""Ascend platform plugin. torch_npu is imported lazily: only by the probe (after the package and
the CANN libraries were found) and by the op factory, never at module import."""
from __future__ import annotations

import logging
import os

from shuili.hal import HAL_API_VERSION, PlatformInfo
from shuili.hal.hookspecs import hookimpl

NAME = "ascend"
log = logging.getLogger("shuili.platforms.ascend")


@hookimpl
def shuili_platform_info():
    return PlatformInfo(name=NAME, vendor="Huawei", priority=90, hal_api_version=HAL_API_VERSION,
                        description="Ascend 950 NPUs via torch_npu (A2/A3 lesser targets); "
                                    "schema-checked on CPU, never run on an NPU")


def probe():
    from shuili.platforms.ascend.device import probe as _probe

    return _probe()


@hookimpl
def shuili_platform_probe(platform):
    return probe() if platform == NAME else None


@hookimpl
def shuili_platform_capabilities(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.ascend.capabilities import capabilities

    return capabilities(config)


def op_table(config, api=None, apply_settings: bool = True) -> dict:
    """Bind every op to `api` (default: the real torch_npu), after applying the determinism
    settings the config asks for."""
    from shuili.platforms.ascend import device, differential, npu_api
    from shuili.platforms.ascend.ops import build_ops, mode_for

    api = api or npu_api.load()
    if os.environ.get(differential.ENV) == "1":
        api = differential.differential(api)
        log.warning("ascend: differential mode, every torch_npu call is re-run on the simulator")
    soc = device.detect_soc(api)
    if apply_settings:
        applied = device.apply_determinism(config, api)
        if applied:
            log.info("ascend determinism settings: %s", applied)
    return build_ops(api, mode_for(config, soc.family))


@hookimpl
def shuili_platform_ops(platform, config):
    return op_table(config) if platform == NAME else None


@hookimpl
def shuili_platform_transfer(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.ascend import npu_api
    from shuili.platforms.ascend.transfer import NpuTransfer

    return NpuTransfer(npu_api.load().device)
