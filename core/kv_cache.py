"""Paged KV-cache manager: one block pool per cache group, prefix caching, integrity checks.

Every group's logical block i covers tokens [i * P, (i + 1) * P) (core/model_api.py), so one chain
of block hashes serves all groups. A block is in exactly one state:
  used    ref > 0 (in some request's block table)
  cached  ref == 0, holds a published hash (evictable, in the LRU free list)
  free    ref == 0, no hash (in the LRU free list)
The free list is an insertion-ordered dict: pop oldest, remove on hit and append are O(1).
A block's hash is published only after its KV was written (after the step that computed it).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

from shuili.core.model_api import CacheGroupSpec
from shuili.core.request import Request

ROOT_HASH = b"shuili-kv-root"
LOAD = -2  # in a hit table: allocate a block and fill it from a lower tier (core/kv_tiers)


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    h = hashlib.sha256(parent)
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


class BlockPool:
    def __init__(self, name: str, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"cache group {name}: num_blocks must be >= 1, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.on_evict = None  # (block, hash) -> None, before a cached block is reused (core/kv_tiers)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def allocate(self) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.hash[b]
        if h is not None:  # evict the least recently used cached block
            if self.on_evict is not None:
                self.on_evict(b, h)
            del self.cached[h]
            self.hash[b] = None
        self.ref[b] = 1
        return b

    def touch(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def release(self, b: int) -> None:
        assert self.ref[b] > 0, f"{self.name}: block {b} released more often than taken"
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free[b] = None

    def publish(self, b: int, h: bytes) -> None:
        if h in self.cached or self.hash[b] is not None:
            return  # the same content is cached in another block already, or b is published
        self.cached[h] = b
        self.hash[b] = h

    def counts(self) -> dict[str, int]:
        used = sum(1 for r in self.ref if r > 0)
        cached = sum(1 for b, r in enumerate(self.ref) if r == 0 and self.hash[b] is not None)
        return {"used": used, "cached": cached, "free": self.num_blocks - used - cached}

    def check(self) -> None:
        c = self.counts()
        assert c["used"] + c["cached"] + c["free"] == self.num_blocks
        zero = {b for b, r in enumerate(self.ref) if r == 0}
        assert set(self.free) == zero, f"{self.name}: free list != blocks with ref 0"
        assert len(self.free) == c["cached"] + c["free"], f"{self.name}: duplicate free entries"
        for h, b in self.cached.items():
            assert self.hash[b] == h, f"{self.name}: hash map entry for block {b} is stale"
        assert sum(h is not None for h in self.hash) == len(self.cached), f"{self.name}: orphan hash"


class KVCacheManager:
    """Block tables live on the Request (`req.block_ids[group]`); -1 marks a freed sliding block."""

    def __init__(self, groups: list[CacheGroupSpec], num_blocks: int | dict[str, int], tokens_per_block: int,
                 enable_prefix_caching: bool = True):
        """num_blocks: one count for every group, or per group name (core/kv_sizing.py)."""
        if not groups:
            raise ValueError("the model declares no cache groups")
        for g in groups:
            g.entries_per_block(tokens_per_block)  # raises when P is not a multiple of the ratio
        self.groups = list(groups)
        self.P = tokens_per_block
        self.enable_prefix_caching = enable_prefix_caching
        sizes = num_blocks if isinstance(num_blocks, dict) else {g.name: num_blocks for g in groups}
        self.pools = {g.name: BlockPool(g.name, sizes[g.name]) for g in groups}
        self.requests: dict[str, Request] = {}
        self._sliding = [g for g in groups if g.kind == "sliding"]
        self._prefix = [g for g in groups if g.kind != "sliding"]
        # the pools that bound a sequence's length (sliding pools hold a window, not a sequence)
        self.num_blocks = min(sizes[g.name] for g in (self._prefix or self.groups))
        # admissions only (hits passed): the prefix-cache hit rate is hit / queried tokens
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.tiers = None  # core/kv_tiers.KVTiers: host / store tiers below the device, or None

    # ------------------------------------------------------------------------------ hashing
    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        hs = req.block_hashes
        P = self.P
        while len(hs) < num_blocks:
            i = len(hs)
            hs.append(chain_hash(hs[-1] if hs else ROOT_HASH, req.tokens(i * P, (i + 1) * P)))
        return hs

    def _first_needed(self, g: CacheGroupSpec, position: int) -> int:
        """First logical block a query at `position` reads in a sliding group."""
        return max(0, position - g.window + 1) // self.P

    # ---------------------------------------------------------------------------- prefix hits
    def find_cached(self, req: Request) -> tuple[int, dict[str, list[int]]]:
        """Longest usable cached prefix: (num tokens, block ids per group). Leaves one token to compute."""
        if self.tiers is not None:
            return self.tiers.find_cached(self, req)
        if not self.enable_prefix_caching or req.params.prompt_logprobs:
            return 0, {}
        max_blocks = (req.num_real_tokens - 1) // self.P
        hs = self._hashes(req, max_blocks)
        n = 0
        while n < max_blocks and all(self.pools[g.name].lookup(hs[n]) is not None for g in self._prefix):
            n += 1
        while n > 0 and not all(self._window_cached(g, hs, n) for g in self._sliding):
            n -= 1
        if n == 0:
            return 0, {}
        hits = {}
        for g in self.groups:
            pool = self.pools[g.name]
            start = self._first_needed(g, n * self.P) if g.kind == "sliding" else 0
            hits[g.name] = [-1] * start + [pool.lookup(hs[i]) for i in range(start, n)]
        return n * self.P, hits

    def _window_cached(self, g: CacheGroupSpec, hs: list[bytes], n: int) -> bool:
        pool = self.pools[g.name]
        return all(pool.lookup(hs[i]) is not None for i in range(self._first_needed(g, n * self.P), n))

    # ----------------------------------------------------------------------------- allocation
    def allocate(self, req: Request, num_new_tokens: int, hits: dict[str, list[int]] | None = None) -> bool:
        """Blocks for tokens up to num_computed + num_new (after applying `hits`); False = no room."""
        ok = self._allocate(req, num_new_tokens, hits)
        if self.tiers is not None and hits:
            self.tiers.after_allocate(self, req, ok)
        if ok and hits is not None:
            self.num_queried_tokens += req.num_real_tokens
            self.num_hit_tokens += req.num_computed_tokens
        return ok

    def _allocate(self, req: Request, num_new_tokens: int, hits: dict[str, list[int]] | None) -> bool:
        need = -(-(req.num_computed_tokens + num_new_tokens) // self.P)
        if not hits:
            tables = req.block_ids
            short = [g for g in self.groups if len(tables.get(g.name, ())) < need]
            if not short:
                return True  # the common decode step: the last block has room
            for g in short:
                if need - len(tables.get(g.name, ())) > self.pools[g.name].num_free:
                    return False
            for g in short:
                pool, table = self.pools[g.name], tables.setdefault(g.name, [])
                table.extend(pool.allocate() for _ in range(need - len(table)))
            self.requests[req.request_id] = req
            return True
        for g in self.groups:
            pool, hit = self.pools[g.name], hits[g.name]
            revive = sum(1 for b in hit if b >= 0 and pool.ref[b] == 0) + hit.count(LOAD)
            if max(0, need - len(hit)) + revive > pool.num_free:
                return False
        for g in self.groups:
            pool = self.pools[g.name]
            for b in hits[g.name]:
                if b >= 0:
                    pool.touch(b)  # before allocating, so a hit block is never evicted for itself
            table = req.block_ids[g.name] = [pool.allocate() if b == LOAD else b for b in hits[g.name]]
            table.extend(pool.allocate() for _ in range(max(0, need - len(table))))
        req.num_published_blocks = len(next(iter(hits.values())))
        self.requests[req.request_id] = req
        return True

    def free(self, req: Request) -> None:
        for g in self.groups:
            pool = self.pools[g.name]
            for b in reversed(req.block_ids.get(g.name, ())):  # tail blocks are evicted first
                if b >= 0:
                    pool.release(b)
        req.block_ids = {}
        req.num_published_blocks = 0
        self.requests.pop(req.request_id, None)

    def release_out_of_window(self, req: Request) -> int:
        """Free sliding blocks no query at >= req.num_computed_tokens can read; returns how many."""
        freed = 0
        for g in self._sliding:
            table = req.block_ids.get(g.name)
            if not table:
                continue
            i = min(self._first_needed(g, req.num_computed_tokens), len(table)) - 1
            while i >= 0 and table[i] >= 0:
                self.pools[g.name].release(table[i])
                table[i] = -1
                freed += 1
                i -= 1
        return freed

    def trim(self, req: Request, num_tokens: int) -> int:
        """Release every block past the ones covering tokens [0, num_tokens): the tail that held
        rejected draft tokens (core/spec). Returns how many blocks were released."""
        keep = -(-num_tokens // self.P)
        freed = 0
        for g in self.groups:
            table = req.block_ids.get(g.name)
            while table and len(table) > keep:
                b = table.pop()
                if b >= 0:
                    self.pools[g.name].release(b)
                    freed += 1
        return freed

    def publish(self, req: Request, num_computed: int) -> None:
        """Cache the full blocks whose KV is written (tokens < num_computed, real tokens only)."""
        if not self.enable_prefix_caching:
            return
        n_full = min(num_computed, req.num_real_tokens) // self.P
        if n_full <= req.num_published_blocks:
            return
        hs = self._hashes(req, n_full)
        first = req.num_published_blocks
        for g in self.groups:
            pool, table = self.pools[g.name], req.block_ids.get(g.name, [])
            for i in range(req.num_published_blocks, min(n_full, len(table))):
                if table[i] >= 0:
                    pool.publish(table[i], hs[i])
        req.num_published_blocks = n_full
        if self.tiers is not None:
            self.tiers.on_published(self, req, first, n_full)

    # ------------------------------------------------------------------------------ accounting
    def num_free_blocks(self) -> dict[str, int]:
        return {n: p.num_free for n, p in self.pools.items()}

    def usage(self) -> dict[str, dict[str, int]]:
        return {n: p.counts() for n, p in self.pools.items()}

    def reset_prefix_cache(self) -> None:
        """Forget every cached (unreferenced) block; running requests keep theirs."""
        for pool in self.pools.values():
            for h, b in list(pool.cached.items()):
                if pool.ref[b] == 0:
                    del pool.cached[h]
                    pool.hash[b] = None

    def check_integrity(self) -> None:
        """free + cached + used == total per pool, and ref counts equal block-table references."""
        if self.tiers is not None:
            self.tiers.check()
        for g in self.groups:
            pool = self.pools[g.name]
            pool.check()
            refs = [0] * pool.num_blocks
            for req in self.requests.values():
                for b in req.block_ids.get(g.name, ()):
                    if b >= 0:
                        refs[b] += 1
            assert refs == pool.ref, f"{g.name}: ref counts do not match the block tables"
            for req in self.requests.values():
                table = req.block_ids.get(g.name, [])
                assert len(table) * self.P >= req.num_computed_tokens, (
                    f"{req.request_id}: {g.name} table too short for its computed tokens")
                if g.kind == "sliding":
                    live = [b >= 0 for b in table]
                    assert live == sorted(live), f"{req.request_id}: {g.name} freed a block inside its window"
