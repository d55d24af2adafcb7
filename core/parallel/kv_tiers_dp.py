"""KV tiers for every DP group of a parallel engine (docs/kv-tiers.md, docs/parallel.md).

Each DP group has its own Scheduler and KV manager on rank 0, and its own `KVTiers`: a host pool
per group (held by rank 0, kv_host_bytes each) and ONE disk store shared by all groups (the same
`DiskStore` object: one directory, one writer thread). A block published by group 0 is therefore
a disk hit for group 1. Bits may be shared because every DP group of one (TP, EP) configuration
computes the same bits (docs/parallel.md), and the store's fingerprint names that configuration.

Group 0's device caches are rank 0's own, so its mover copies directly (`BlockMover`). Group d's
caches live on the ranks d*TP.. (other processes): `RemoteMover` moves their blocks over the
control plane. Between steps every worker waits in the control broadcast, so rank 0 may send:
  ("kv_read", d, [(group, block), ...])         group d's first rank answers the blocks' bits
  ("kv_write", d, [(group, block, tensor), ...]) every rank of group d writes (the TP ranks of a
                                                 group hold the same, replicated KV)
Writes (hits copied in) are queued and sent once before the step that reads them; a read sends
the queued writes first, so it never sees a block older than what the scheduler believes is there.
"""
from __future__ import annotations

import torch

from shuili.core.kv_tiers.host_pool import HostPool
from shuili.core.kv_tiers.mover import BlockMover
from shuili.core.kv_tiers.tiers import KVTiers


class RemoteMover:
    """`BlockMover`'s interface for a DP group whose caches are on other ranks."""

    def __init__(self, engine, dp_rank: int):
        self.engine, self.d = engine, dp_rank
        self.pending: list[tuple[str, int, torch.Tensor]] = []
        self.round_trips = 0

    def to_host(self, group: str, block: int):
        self.flush()
        self.engine._control(("kv_read", self.d, [(group, block)]))
        out = self.engine._collect(None)[self.d * self.engine.world.tp]
        self.round_trips += 1
        return out[0], None

    def to_device(self, group: str, block: int, host: torch.Tensor) -> None:
        self.pending.append((group, block, host))

    def flush(self) -> None:
        if self.pending:
            msg, self.pending = ("kv_write", self.d, self.pending), []
            self.engine._control(msg)
            self.round_trips += 1


def serve_kv(runtime, msg) -> None:
    """A worker's side of kv_read / kv_write (every rank receives every message)."""
    kind, d, items = msg
    w = runtime.world
    mine = w.dp_rank == d
    if mine and getattr(runtime, "kv_mover", None) is None:
        runtime.kv_mover = BlockMover(runtime.runner.caches, runtime.platform.device, None)
    if kind == "kv_write":
        if mine:
            for group, block, t in items:
                runtime.kv_mover.to_device(group, block, t)
        return
    out = None
    if mine and w.tp_rank == 0:
        out = [runtime.kv_mover.to_host(group, block)[0].cpu() for group, block in items]
    w.gather(out)


def attach_dp_tiers(engine) -> list[KVTiers | None]:
    """One KVTiers per DP group (None for all when the config asks for no tiers): group 0's is the
    engine's own (`Engine.kv_tiers`); the others share its store and fingerprint."""
    first = engine.kv_tiers
    tiers: list[KVTiers | None] = [first]
    engine.remote_movers = []
    for d, sched in enumerate(engine.schedulers[1:], start=1):
        if first is None:
            tiers.append(None)
            continue
        mover = RemoteMover(engine, d)
        host = HostPool(engine.config.kv_host_bytes) if engine.config.kv_host_bytes else None
        t = KVTiers(first.groups, first.P, mover, host, first.store, first.fingerprint)
        t.attach(sched.kv)
        engine.remote_movers.append(mover)
        tiers.append(t)
    return tiers


def merged_stats(tiers: list[KVTiers | None]) -> dict[str, int]:
    """Per-tier hit counters summed over the DP groups (the store's own counters once: it is shared)."""
    out: dict[str, int] = {}
    for i, t in enumerate(tiers):
        if t is None:
            continue
        for k, v in t.stats().items():
            if k.startswith("kv_store_"):
                if i == 0:
                    out[k] = v
                continue
            out[k] = out.get(k, 0) + v
    return out
