"""pluggy hook specs (project "shuili"). Hooks are factories called at start-up, never per op.

A platform plugin is one module or object implementing these four hooks. The three hooks taking a
`platform` argument are `firstresult`: a plugin returns None for every platform name but its own.
"""
from __future__ import annotations

import pluggy

PROJECT = "shuili"
ENTRY_POINT_GROUP = "shuili.platforms"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def shuili_platform_info():
    """Register a platform: return a `PlatformInfo` (name, vendor, priority, hal_api_version).

    Must be cheap and must not import vendor runtimes (torch_npu, triton): `shuili platforms`
    calls it for every installed plugin.
    """


@hookspec(firstresult=True)
def shuili_platform_probe(platform: str):
    """For your own platform name, return an `Availability`; the reason says why not, in words an
    operator can act on ("torch_npu not installed: pip install shuili[ascend]"). Import vendor
    runtimes lazily here. Return None for other names.
    """


@hookspec(firstresult=True)
def shuili_platform_capabilities(platform: str, config):
    """For your own platform name, return its `PlatformCapabilities` under `config` (a
    `PlatformConfig`: e.g. batch-invariant mode changes determinism levels). None otherwise.
    """


@hookspec(firstresult=True)
def shuili_platform_ops(platform: str, config):
    """For your own platform name, return a dict {op name: plain callable} for the ops of
    `shuili.hal.ops` it implements. Ops left out need `allow_reference_fallback`. None otherwise.
    Called once, after a successful probe; it may import vendor runtimes and compile kernels.
    """
