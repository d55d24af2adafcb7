"""Host-memory tier: evicted device blocks, one entry per (cache group, chained block hash), under a
byte budget with LRU eviction. Entries are page-locked where the device runtime supports it, so a
hit goes back to the device with an asynchronous copy."""
from __future__ import annotations

from collections import OrderedDict

import torch

Key = tuple[str, bytes]  # (group name, chained block hash)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostPool:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"kv_host_bytes must be >= 0, got {budget_bytes}")
        self.budget = budget_bytes
        self.entries: OrderedDict[Key, torch.Tensor] = OrderedDict()
        self.ready: dict[Key, object] = {}  # device -> host copy still in flight: its event
        self.bytes = 0
        self.num_evicted = 0

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def get(self, key: Key) -> torch.Tensor | None:
        t = self.entries.get(key)
        if t is not None:
            self.entries.move_to_end(key)
        return t

    def put(self, key: Key, t: torch.Tensor, ready=None) -> bool:
        """Keep `t` (LRU entries go first); False when it alone exceeds the budget."""
        size = nbytes(t)
        if size > self.budget:
            return False
        if key in self.entries:
            self._drop(key)
        while self.bytes + size > self.budget:
            self._drop(next(iter(self.entries)))
            self.num_evicted += 1
        self.entries[key] = t
        if ready is not None:
            self.ready[key] = ready
        self.bytes += size
        return True

    def _drop(self, key: Key) -> None:
        self.bytes -= nbytes(self.entries.pop(key))
        self.ready.pop(key, None)

    def check(self) -> None:
        assert self.bytes == sum(nbytes(t) for t in self.entries.values()), "host pool byte count drifted"
        assert self.bytes <= self.budget, "host pool over its budget"
        assert set(self.ready) <= set(self.entries), "host pool: event of a dropped entry"
