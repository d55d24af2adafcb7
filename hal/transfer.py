"""Host <-> device transfer, a platform service (HAL 1.3, hook `shuili_platform_transfer`).

The engine moves two things per step: the step's small input arrays up (ids, positions, lengths,
block tables, slots, logits rows, sampling parameters) and the sampled tokens and logprobs down.
Both must not wait for the device: an upload that blocks until queued kernels finish, or a
download ordered after the next step's kernels, serialises an overlapped engine. How to avoid that
is device-specific (page-locked buffers, streams, events), so each platform provides a `Transfer`;
`HostTransfer`, plain synchronous copies, is right for the CPU and the default for a platform
that provides none. `pack` / `unpack` are the shared half of a packed upload: every array's bytes
in one buffer, so one copy moves them all.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

ALIGN = 8
Arrays = Mapping[str, tuple[Sequence, torch.dtype]]


class Pending(Protocol):
    def wait(self) -> list[list]:
        """Python lists, one per tensor ([] for None); waits for the producing step only."""


class Transfer(Protocol):
    def upload(self, arrays: Arrays, device: str | torch.device) -> dict[str, torch.Tensor]:
        """{name: (values, dtype)} -> {name: 1-D tensor on `device`}, without waiting for the device."""

    def download(self, tensors: Sequence[torch.Tensor | None]) -> Pending:
        """Start copying `tensors` to the host now (ordered after the work that produced them)."""

    # optional (HAL 1.3 transfers without them get `upload_tensor`'s plain copy / no mapping):
    # upload_tensor(host: torch.Tensor, device) -> torch.Tensor, a bulk host buffer up, not waiting
    # map_host(array: numpy uint8, device) -> torch.Tensor, device-readable view of host memory


class _Ready:
    def __init__(self, tensors: Sequence[torch.Tensor | None]):
        self.tensors = list(tensors)

    def wait(self) -> list[list]:
        return [[] if t is None else t.tolist() for t in self.tensors]


class HostTransfer:
    """Synchronous copies: exact on any device, overlapping nothing (the CPU has nothing to hide)."""

    def upload(self, arrays: Arrays, device: str | torch.device) -> dict[str, torch.Tensor]:
        dev = torch.device(device)
        return {k: torch.tensor(list(v), dtype=dt, device=dev) for k, (v, dt) in arrays.items()}

    def download(self, tensors: Sequence[torch.Tensor | None]) -> Pending:
        return _Ready(tensors)

    def upload_tensor(self, host: torch.Tensor, device: str | torch.device) -> torch.Tensor:
        return host.to(torch.device(device))


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


def packed_upload(arrays: Arrays, device: str | torch.device, pin: bool) -> dict[str, torch.Tensor]:
    """One buffer, one asynchronous copy; the device tensors are dtype views of its slices. The
    caching host allocator keeps a pinned buffer out of reuse until the copy reading it is done,
    so a fresh buffer per step is safe."""
    buf, views = pack(list(arrays.values()), pin=pin)
    return dict(zip(arrays, unpack(buf.to(torch.device(device), non_blocking=True), views)))


class EventDownload:
    """Copies into page-locked host buffers behind an event of the device runtime `runtime`
    (torch.cuda, torch.npu): `wait` blocks until this step's results are there, not the next's."""

    def __init__(self, tensors: Sequence[torch.Tensor | None], runtime):
        self.tensors = [None if t is None else _pinned_copy(t) for t in tensors]
        self.event = runtime.Event()
        self.event.record()

    def wait(self) -> list[list]:
        self.event.synchronize()
        return [[] if t is None else t.tolist() for t in self.tensors]


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class EventTransfer:
    """The transfer service of an asynchronous device: one pinned packed upload and event-ordered
    downloads for tensors on `device_type`, `HostTransfer`'s plain copies for anything else.
    `runtime` is the device module that makes events (torch.cuda, torch_npu's npu)."""

    def __init__(self, device_type: str, runtime):
        self.device_type = device_type
        self.runtime = runtime
        self._host = HostTransfer()

    def upload(self, arrays: Arrays, device: str | torch.device) -> dict[str, torch.Tensor]:
        if torch.device(device).type != self.device_type:
            return self._host.upload(arrays, device)
        return packed_upload(arrays, device, pin=True)

    def upload_tensor(self, host: torch.Tensor, device: str | torch.device) -> torch.Tensor:
        """A bulk host buffer (e.g. gathered Engram rows) up in one asynchronous copy from page-locked
        memory; the caching host allocator keeps the buffer alive until the copy is done."""
        if torch.device(device).type != self.device_type:
            return self._host.upload_tensor(host, device)
        return (host if host.is_pinned() else host.pin_memory()).to(torch.device(device), non_blocking=True)

    def download(self, tensors: Sequence[torch.Tensor | None]) -> Pending:
        live = [t for t in tensors if t is not None]
        if not live or live[0].device.type != self.device_type:
            return self._host.download(tensors)
        return EventDownload(tensors, self.runtime)


def upload_tensor(transfer: Transfer | None, host: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """`host` on `device` through the platform transfer service (its `upload_tensor` when it has one),
    else a plain copy (non-blocking when `host` is pinned)."""
    fn = getattr(transfer, "upload_tensor", None)
    if fn is not None:
        return fn(host, device)
    dev = torch.device(device)
    return host.to(dev, non_blocking=host.device.type == "cpu" and dev.type != "cpu" and host.is_pinned())
