"""KVTiers: the prefix cache continued below the device.

device --evicted--> host pool        a cached block leaving a device pool is copied to host memory
device --published--> block store    every newly published full block, all groups in one file, one
                                     section each; a hit reads only the sections it uses
admission (find_cached)              per block i and group g: device, else host, else store
A hit's host / store blocks get fresh device blocks (`LOAD` in the hit table), are copied in at
allocation, before the step that reads them, and are published like computed blocks. What the
device prefix cache needs of a hit, the tiers need too: every full / compressed group has blocks
[0, n); a sliding group has the blocks of the window before the hit end. So the window and
compressor-state groups of DeepSeek-V4 (and any group a model declares) come back as stored bits,
nothing is replayed. A store block that fails verification is dropped from the search, which then
settles on a shorter prefix: the rest is recomputed.
"""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from shuili.core.kv_cache import LOAD, KVCacheManager
from shuili.core.kv_tiers.disk_store import DiskStore
from shuili.core.kv_tiers.host_pool import HostPool, nbytes
from shuili.core.kv_tiers.mover import BlockMover
from shuili.core.kv_tiers.store import BlockStore
from shuili.core.model_api import CacheGroupSpec
from shuili.core.request import Request

log = logging.getLogger("shuili.kv_tiers")
RANK = {"device": 0, "host": 1, "disk": 2}
RECENT = 1 << 16  # keys this engine stored lately: not copied out again


@dataclass
class Staged:
    """A lookup's plan, applied when its allocation succeeds."""
    request_id: str
    hashes: list[bytes]
    loads: dict[tuple[str, int], tuple[str, torch.Tensor]] = field(default_factory=dict)  # (group, i) -> (tier, data)
    tier: list[str] = field(default_factory=list)  # per block: the lowest tier any group came from


class KVTiers:
    def __init__(self, groups: list[CacheGroupSpec], tokens_per_block: int, mover: BlockMover,
                 host: HostPool | None, store: BlockStore | None, fingerprint: str):
        self.groups = list(groups)
        self.P = tokens_per_block
        self.mover = mover
        self.host = host
        self.store = store
        self.fingerprint = fingerprint
        # the store file's section order: the groups every hit through a block reads (full,
        # compressed) first and adjacent, so a block before the last window is one read
        self.file_order = [g.name for g in groups if g.kind != "sliding"] + \
            [g.name for g in groups if g.kind == "sliding"]
        self.expect = {g.name: ((len(g.layers), g.entries_per_block(tokens_per_block), *g.entry_shape),
                                getattr(torch, g.dtype)) for g in groups}
        self.hit_tokens = {"device": 0, "host": 0, "disk": 0}
        self.loaded_blocks = {"host": 0, "disk": 0}  # (group, block) copies into the device
        self.bytes = {"device_to_host": 0, "host_to_device": 0, "disk_to_device": 0, "device_to_disk": 0}
        self._staged: Staged | None = None
        self._recent: OrderedDict[str, None] = OrderedDict()

    def attach(self, kv: KVCacheManager) -> None:
        kv.tiers = self
        if self.host is not None:
            for name, pool in kv.pools.items():
                pool.on_evict = lambda b, h, name=name: self._evicted(name, b, h)

    def key(self, h: bytes) -> str:
        return hashlib.sha256(self.fingerprint.encode() + h).hexdigest()

    # ------------------------------------------------------------------------------ saving
    def _evicted(self, group: str, block: int, h: bytes) -> None:
        """A cached device block is about to be reused: keep its bits in host memory."""
        t, ready = self.mover.to_host(group, block)
        if self.host.put((group, h), t, ready):
            self.bytes["device_to_host"] += nbytes(t)

    def evict_device_cache(self, kv: KVCacheManager, keep: bool = True) -> int:
        """Move every cached, unreferenced device block down a tier (to the host pool if there is
        one and `keep`, else just forget it); returns how many. Running requests keep theirs."""
        n = 0
        for name, pool in kv.pools.items():
            for h, b in list(pool.cached.items()):
                if pool.ref[b] == 0:
                    if self.host is not None and keep:
                        self._evicted(name, b, h)
                    del pool.cached[h]
                    pool.hash[b] = None
                    n += 1
        return n

    def on_published(self, kv: KVCacheManager, req: Request, first: int, last: int) -> None:
        """Blocks [first, last) of req just got published: write them through to the store."""
        if self.store is None:
            return
        for i in range(first, last):
            h = req.block_hashes[i]
            key = self.key(h)
            if key in self._recent:
                self._recent.move_to_end(key)
                continue
            ids = {name: req.block_ids.get(name, [])[i] if i < len(req.block_ids.get(name, [])) else -1
                   for name in self.file_order}
            if min(ids.values()) < 0:
                continue  # some group no longer holds it: the file would be incomplete
            data, ready = {}, None
            for name, b in ids.items():
                data[name], ev = self.mover.to_host(name, b)
                ready = ev or ready  # one stream: the last event covers every copy before it
            self.store.put(key, h, data, ready)
            self.bytes["device_to_disk"] += sum(nbytes(t) for t in data.values())
            self._recent[key] = None
            if len(self._recent) > RECENT:
                self._recent.popitem(last=False)

    # ------------------------------------------------------------------------------ lookup
    def find_cached(self, kv: KVCacheManager, req: Request) -> tuple[int, dict[str, list[int]]]:
        """KVCacheManager.find_cached over all tiers: (hit tokens, block table per group, LOAD
        where a block comes from below). Leaves the last prompt token to compute."""
        self._staged = None
        if not kv.enable_prefix_caching or req.params.prompt_logprobs:
            return 0, {}
        P = self.P
        max_blocks = (req.num_real_tokens - 1) // P
        hs = kv._hashes(req, max_blocks)
        on_disk: dict[int, bool] = {}
        files: dict[tuple[int, str], torch.Tensor] = {}

        def where(g: CacheGroupSpec, i: int) -> str | None:
            if kv.pools[g.name].lookup(hs[i]) is not None:
                return "device"
            if self.host is not None and (g.name, hs[i]) in self.host:
                return "host"
            if self.store is not None:
                if i not in on_disk:
                    on_disk[i] = self.store.contains(self.key(hs[i]))
                if on_disk[i]:
                    return "disk"
            return None

        while True:
            n = 0
            while n < max_blocks and all(where(g, n) for g in kv._prefix):
                n += 1
            while n > 0 and not all(where(g, i) for g in kv._sliding
                                    for i in range(kv._first_needed(g, n * P), n)):
                n -= 1
            if n == 0:
                return 0, {}
            plan = self._plan(kv, req, hs, n, where, on_disk, files)
            if plan is not None:
                return n * P, plan

    def _plan(self, kv, req, hs, n, where, on_disk, files) -> dict[str, list[int]] | None:
        """The hit table of n blocks, or None when a store block was rejected (on_disk says so,
        the caller searches again). `files[(i, group)]`: store sections read so far."""
        P = self.P
        need = {g.name: range(kv._first_needed(g, n * P) if g.kind == "sliding" else 0, n) for g in kv.groups}
        tier = {(g.name, i): where(g, i) for g in kv.groups for i in need[g.name]}
        from_disk: dict[int, list[str]] = {}
        for (name, i), w in tier.items():
            if w == "disk" and (i, name) not in files:
                from_disk.setdefault(i, []).append(name)
        for i, names in sorted(from_disk.items()):
            # only the sections this hit reads: a sliding group's only inside the last window
            got = self.store.get(self.key(hs[i]), {name: self.expect[name] for name in names})
            if got is None:  # rejected or gone: search again without it
                on_disk[i] = False
                return None
            files.update({(i, name): t for name, t in got.items()})
        staged = Staged(req.request_id, hs[:n], tier=["device"] * n)
        hits = {}
        for g in kv.groups:
            row = [-1] * need[g.name].start
            for i in need[g.name]:
                w = tier[(g.name, i)]
                if w == "device":
                    row.append(kv.pools[g.name].lookup(hs[i]))
                    continue
                data = self.host.get((g.name, hs[i])) if w == "host" else files[(i, g.name)]
                staged.loads[(g.name, i)] = (w, data)
                if RANK[w] > RANK[staged.tier[i]]:
                    staged.tier[i] = w
                row.append(LOAD)
            hits[g.name] = row
        self._staged = staged
        return hits

    def after_allocate(self, kv: KVCacheManager, req: Request, ok: bool) -> None:
        """The hit's blocks are allocated (ok) or the request waits (not ok: the plan is dropped)."""
        staged, self._staged = self._staged, None
        if not ok or staged is None or staged.request_id != req.request_id:
            return
        for (name, i), (tier, data) in staged.loads.items():
            b = req.block_ids[name][i]
            self.mover.to_device(name, b, data)
            kv.pools[name].publish(b, staged.hashes[i])
            self.loaded_blocks[tier] += 1
            self.bytes[f"{tier}_to_device"] += nbytes(data)
        for t in staged.tier:
            self.hit_tokens[t] += self.P

    # -------------------------------------------------------------------------- accounting
    def stats(self) -> dict[str, int]:
        out = {f"kv_hit_tokens_{t}": n for t, n in self.hit_tokens.items()}
        out.update({f"kv_loaded_blocks_{t}": n for t, n in self.loaded_blocks.items()})
        out.update({f"kv_bytes_{k}": n for k, n in self.bytes.items()})
        if self.host is not None:
            out.update(kv_host_bytes_used=self.host.bytes, kv_host_entries=len(self.host.entries),
                       kv_host_evicted=self.host.num_evicted)
        if self.store is not None:
            out.update({f"kv_store_{k}": v for k, v in self.store.stats().items()})
        return out

    def flush(self) -> None:
        if self.store is not None:
            self.store.flush()

    def check(self) -> None:
        if self.host is not None:
            self.host.check()
        assert self._staged is None, "a tier lookup's plan outlived its allocation"


def build_tiers(config, model, groups: list[CacheGroupSpec], tokens_per_block: int, caches, platform,
                model_given: bool) -> KVTiers | None:
    """The tiers EngineConfig asks for (kv_host_bytes, kv_store...), or None."""
    if not config.kv_host_bytes and not config.kv_store:
        return None
    if not config.enable_prefix_caching:
        raise ValueError("kv_host_bytes / kv_store extend the prefix cache: set enable_prefix_caching=True "
                         "or drop them")
    from shuili.core.kv_tiers.fingerprint import kv_fingerprint

    fp = kv_fingerprint(config, model, groups, tokens_per_block, platform, model_given)
    store = None
    if config.kv_store:
        if fp is None:
            log.warning("kv store %s not used: the model was passed as an object without a "
                        "`kv_fingerprint` string, so its weights cannot be identified", config.kv_store)
        else:
            store = DiskStore(config.kv_store, fp["sha256"], config.kv_store_ttl, config.kv_store_bytes)
    host = HostPool(config.kv_host_bytes) if config.kv_host_bytes else None
    if host is None and store is None:
        return None
    # an accelerator's transfer service has an event runtime (EventTransfer); the CPU copies plainly
    runtime = getattr(platform.transfer, "runtime", None) if torch.device(platform.device).type != "cpu" else None
    mover = BlockMover(caches, platform.device, runtime)
    return KVTiers(groups, tokens_per_block, mover, host, store, fp["sha256"] if fp else "in-process")
