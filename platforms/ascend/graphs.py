"""NPUGraph capture for fixed-shape steps (decode buckets): the aclgraph analogue of CUDA graphs.

`GraphRunner(api, fn, static_inputs)` warms `fn` up once, captures it with
`api.device.graph(NPUGraph(), pool=...)`, and `run(*inputs)` copies new inputs into the static
buffers and replays. Shapes must not change between replays (one runner per bucket). Ops whose
arguments are host lists (FIA's actual_seq_lengths) are baked into the graph at capture time, so a
captured attention step is only valid for the sequence lengths it was captured with, unless the
caller updates them through torch.npu.graph_task_update_* (not done here; see docs).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from shuili.platforms.ascend.npu_api import NpuApi


class GraphRunner:
    def __init__(self, api: NpuApi, fn: Callable[..., torch.Tensor], static_inputs: Sequence[torch.Tensor],
                 pool=None):
        self.api = api
        self.fn = fn
        self.static_inputs = list(static_inputs)
        fn(*self.static_inputs)  # warm-up: lazy kernel compilation must not happen under capture
        api.device.synchronize()
        self.graph = api.device.NPUGraph()
        with api.device.graph(self.graph, pool=pool):
            self.static_output = fn(*self.static_inputs)
        if api.simulated:  # the fake graph cannot record kernels: give it the callable to re-run
            self.graph._fn = self._rerun
        self.replays = 0

    def _rerun(self) -> None:
        out = self.fn(*self.static_inputs)
        self.static_output.copy_(out)

    def run(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"captured with {len(self.static_inputs)} inputs, got {len(inputs)}")
        for dst, src in zip(self.static_inputs, inputs):
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(f"graph captured for {dst.dtype}{tuple(dst.shape)}, got "
                                 f"{src.dtype}{tuple(src.shape)}: capture one runner per bucket")
            dst.copy_(src)
        self.graph.replay()
        self.replays += 1
        return self.static_output
