"""The HAL transfer service on CUDA: one pinned asynchronous upload, event-ordered downloads.

A plain `torch.tensor(list, device="cuda")` is a blocking copy that waits for every kernel already
queued, and `.tolist()` on a device tensor is ordered after everything queued since (in overlap
mode, the next step); either would make building step N+1 wait for step N.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from shuili.hal.transfer import Arrays, EventDownload, HostTransfer, Pending, packed_upload


class CudaTransfer:
    def __init__(self):
        self._host = HostTransfer()

    def upload(self, arrays: Arrays, device: str | torch.device) -> dict[str, torch.Tensor]:
        if torch.device(device).type != "cuda":
            return self._host.upload(arrays, device)
        return packed_upload(arrays, device, pin=True)

    def download(self, tensors: Sequence[torch.Tensor | None]) -> Pending:
        live = [t for t in tensors if t is not None]
        if not live or live[0].device.type != "cuda":
            return self._host.download(tensors)
        return EventDownload(tensors, torch.cuda)
