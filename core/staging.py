"""Host-to-device upload of a step's small input arrays: one packed buffer, one copy.

A plain `torch.tensor(list, device="cuda")` is a blocking copy: it waits for every kernel already
queued on the stream, so in overlap mode building step N+1 would wait for step N to finish, and
even without overlap each of the ~20 per-step arrays costs a host/device round trip. Here the
arrays are packed as bytes into one page-locked buffer and sent with one asynchronous copy; the
device tensors are dtype views of slices of the copied bytes (each slice 8-byte aligned). The
caching host allocator keeps a pinned buffer out of reuse until the copy that reads it is done,
so a fresh buffer per step is safe.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

ALIGN = 8


def upload(arrays: Mapping[str, tuple[Sequence, torch.dtype]], device: str | torch.device) -> dict[str, torch.Tensor]:
    """{name: (values, dtype)} -> {name: 1-D tensor on `device`}."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {k: torch.tensor(list(v), dtype=dt, device=dev) for k, (v, dt) in arrays.items()}
    buf, views = pack(list(arrays.values()), pin=True)
    return dict(zip(arrays, unpack(buf.to(dev, non_blocking=True), views)))


def pack(arrays: Sequence[tuple[Sequence, torch.dtype]], pin: bool = False):
    """-> (uint8 buffer, [(offset, numel, dtype)]): each array's bytes at an 8-byte aligned offset."""
    host = [torch.tensor(list(v), dtype=dt) for v, dt in arrays]
    views, n = [], 0
    for t in host:
        views.append((n, t.numel(), t.dtype))
        n += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buf = torch.empty(max(n, ALIGN), dtype=torch.uint8, pin_memory=pin)
    for t, (o, _, _) in zip(host, views):
        buf[o:o + t.numel() * t.element_size()] = t.view(torch.uint8)
    return buf, views


def unpack(buf: torch.Tensor, views) -> list[torch.Tensor]:
    return [buf[o:o + k * dt.itemsize].view(dt) for o, k, dt in views]


class Download:
    """Device tensors on their way to the host. On CUDA the copies go to page-locked buffers
    behind an event, so `wait` blocks only until this step's results are there. A plain
    `.tolist()` is a copy ordered after everything queued since, which in overlap mode is the
    next step: the host would wait for step N+1 to read step N."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]):
        self.event = None
        self.tensors = list(tensors)
        live = [t for t in self.tensors if t is not None]
        if live and live[0].device.type == "cuda":
            self.tensors = [None if t is None else _pinned_copy(t) for t in self.tensors]
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> list[list]:
        """Python lists, one per tensor ([] for None)."""
        if self.event is not None:
            self.event.synchronize()
        return [[] if t is None else t.tolist() for t in self.tensors]


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
