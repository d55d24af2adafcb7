"""pluggy hook specs (project "shuili"). Hooks are factories called at start-up, never per op.

A platform plugin is one module or object implementing these hooks (the first four are required,
`shuili_platform_graph_capture` and `shuili_platform_transfer` are optional). The hooks taking a `platform` argument are
`firstresult`: a plugin returns None for every platform name but its own.
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


@hookspec(firstresult=True)
def shuili_platform_graph_capture(platform: str, config):
    """Optional (HAL 1.1). For your own platform name, return `capture(fn) -> replay`: `fn` takes no
    arguments and reads and writes only tensors its caller keeps alive (static input buffers, caches,
    weights); `capture` warms it up, records it as a device graph and returns a no-argument `replay`
    that re-runs the recorded work and returns the tensors `fn` returned at capture (the same objects,
    refilled). The engine uses it for decode steps when capabilities.graph_capture is true. Graphs
    captured by one `capture` may share one memory pool: only one replays at a time. None otherwise.
    """


@hookspec(firstresult=True)
def shuili_platform_transfer(platform: str, config):
    """Optional (HAL 1.3). For your own platform name, return a `shuili.hal.transfer.Transfer`:
    `upload(arrays, device)` puts a step's small host arrays on the device without waiting for
    queued kernels, `download(tensors)` starts copying results to the host and returns a `Pending`
    whose `wait()` waits for those results only. Without it the engine uses `HostTransfer`
    (synchronous copies: correct everywhere, but an overlapped engine then overlaps nothing).
    None otherwise.
    """
