"""Copies of one block of one cache group between the device caches and host memory.

A block of group g is [len(g.layers), entries_per_block, *entry_shape]: layer l's rows of the
block. On an asynchronous device the host side is page-locked and both directions are queued on
the compute stream without waiting: a save reads the block before any later kernel can overwrite
it, a load lands before the step that reads it, and neither blocks the host. `runtime` (the
transfer service's torch.cuda / torch.npu) makes the event a reader of a saved block waits on.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("shuili.kv_tiers")


class BlockMover:
    def __init__(self, caches: dict[str, list[torch.Tensor]], device, runtime=None):
        self.caches = caches
        self.device = torch.device(device)
        self.runtime = runtime if self.device.type != "cpu" else None
        self.pin = self.device.type != "cpu"

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError:  # no page-locked memory on this host: pageable, still correct
                self.pin = False
                log.warning("kv tiers: page-locked host memory is not available; host copies are synchronous")
        return torch.empty(t.shape, dtype=t.dtype)

    def to_host(self, group: str, block: int):
        """-> (host tensor, event or None). With an event, the host bytes are valid once it is done."""
        dev = torch.stack([layer[block] for layer in self.caches[group]])
        if self.device.type == "cpu":
            return dev, None  # stack copied it already
        host = self._host_like(dev)
        if self.runtime is None or not host.is_pinned():
            host.copy_(dev)
            return host, None
        host.copy_(dev, non_blocking=True)
        ev = self.runtime.Event()
        ev.record()
        return host, ev

    def to_device(self, group: str, block: int, host: torch.Tensor) -> None:
        if self.device.type != "cpu":
            if not host.is_pinned() and self.pin:
                host = self._host_like(host).copy_(host)
            host = host.to(self.device, non_blocking=True)
        for layer, rows in zip(self.caches[group], host):
            layer[block].copy_(rows, non_blocking=True)
