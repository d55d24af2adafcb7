"""The HAL transfer service on Ascend: the same pinned packed upload and event-ordered download
as CUDA, through the NPU runtime (`torch_npu.npu`: pinned host memory, `Event`), so an
overlapped engine does not get blocking copies. Under the CPU simulator tensors live on the host
and plain copies are used. Not yet run on an NPU (docs/platforms/ascend.md).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from shuili.hal.transfer import Arrays, EventDownload, HostTransfer, Pending, packed_upload


class NpuTransfer:
    def __init__(self, runtime):
        self.runtime = runtime  # torch_npu.npu, or the simulator's FakeNpu
        self._host = HostTransfer()

    def upload(self, arrays: Arrays, device: str | torch.device) -> dict[str, torch.Tensor]:
        if torch.device(device).type != "npu":
            return self._host.upload(arrays, device)
        return packed_upload(arrays, device, pin=True)

    def download(self, tensors: Sequence[torch.Tensor | None]) -> Pending:
        live = [t for t in tensors if t is not None]
        if not live or live[0].device.type != "npu":
            return self._host.download(tensors)
        return EventDownload(tensors, self.runtime)
