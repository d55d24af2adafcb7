"""Copies of one block of one cache group between the device caches and host memory.

A block of group g is [len(g.layers), entries_per_block, *entry_shape]: layer l's rows of the
block. On an asynchronous device the host side is page-locked and both directions are queued on
the compute stream without waiting: a save reads the block before any later kernel can overwrite
it, a load lands before the step that reads it, and neither blocks the host. `runtime` (the
transfer service's device runtime) makes the event a reader of a saved block waits on.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("shuili.kv_tiers")


class BlockMover:
    def __init__(self, caches: dict[str, list[torch.Tensor]], device, runtime=None):
        self.caches = caches
        self.device = torch.device(device)
        self.runtime = runtime  # None: plain synchronous copies (the CPU)
        self.pin = runtime is not None and self.device.type != "cpu"

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError:  # no page-locked memory here: pageable copies, still correct
                self.pin = False
                log.warning("kv tiers: page-locked host memory is not available; host copies are synchronous")
        return torch.empty(t.shape, dtype=t.dtype)

    def to_host(self, group: str, block: int):
        """-> (host tensor, event or None). With an event, the host bytes are valid once it is done."""
        dev = torch.stack([layer[block] for layer in self.caches[group]])
        if self.runtime is None:
            return (dev if dev.device.type == "cpu" else dev.cpu()), None
        host = self._host_like(dev)
        host.copy_(dev, non_blocking=True)
        ev = self.runtime.Event()
        ev.record()
        return host, ev

    def to_device(self, group: str, block: int, host: torch.Tensor) -> None:
        if self.pin and not host.is_pinned():  # a block read from the store: stage it page-locked
            host = self._host_like(host).copy_(host)
        src = host.to(self.device, non_blocking=self.runtime is not None)
        for layer, rows in zip(self.caches[group], src):
            layer[block].copy_(rows, non_blocking=self.runtime is not None)
