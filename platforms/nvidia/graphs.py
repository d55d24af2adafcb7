"""CUDA graphs: capture a step function once for fixed shapes, replay it.

Every op of this platform is capture-safe: no host syncs while capturing (input checks are
device-side asserts in eager mode, left out of a capture and of the engine's steps: common.check
says why; grids depend on shapes only, sampling always takes the filtering path).
The engine's buckets, static buffers and padding live in `shuili.core.graphs`; this module only
records and replays.
"""
from __future__ import annotations

from typing import Callable

import torch


class GraphedStep:
    """fn() -> tensor or tuple of tensors, recorded once for fixed shapes. fn reads static buffers
    its caller refills before each call (the HAL capture contract); a call replays and returns the
    capture-time outputs, refilled."""

    def __init__(self, fn: Callable[[], object], warmup: int = 2, pool=None):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):  # compiles kernels and settles the allocator outside the graph
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn()

    def __call__(self):
        self.graph.replay()
        return self.outputs


class Capturer:
    """The HAL's `capture(fn) -> replay` for this platform: every graph it records shares one memory
    pool (the engine replays one graph at a time, so their intermediates may overlap)."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.pool = None

    def __call__(self, fn: Callable[[], object]) -> Callable[[], object]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return GraphedStep(fn, warmup=self.warmup, pool=self.pool)
