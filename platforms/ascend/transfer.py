"""The HAL transfer service on Ascend: the same pinned packed upload and event-ordered download
as CUDA, through the NPU runtime (`torch_npu.npu`: pinned host memory, `Event`), so an
overlapped engine does not get blocking copies. Under the CPU simulator tensors live on the host
and plain copies are used. Not yet run on an NPU (docs/platforms/ascend.md).
"""
from __future__ import annotations

import torch

from shuili.hal.transfer import EventTransfer


class NpuTransfer(EventTransfer):
    def __init__(self, runtime):
        super().__init__("npu", runtime)  # torch_npu.npu, or the simulator's FakeNpu
