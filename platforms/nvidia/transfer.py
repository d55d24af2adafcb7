"""The HAL transfer service on CUDA: one pinned asynchronous upload, event-ordered downloads.

A plain `torch.tensor(list, device="cuda")` is a blocking copy that waits for every kernel already
queued, and `.tolist()` on a device tensor is ordered after everything queued since (in overlap
mode, the next step); either would make building step N+1 wait for step N.
"""
from __future__ import annotations

import torch

from shuili.hal.transfer import EventTransfer


class CudaTransfer(EventTransfer):
    def __init__(self):
        super().__init__("cuda", torch.cuda)
