"""How many KV blocks each cache group's pool gets from a byte budget.

A full or compressed group keeps every block of every sequence, so its pool bounds how many
tokens the engine holds. A sliding group only ever holds the blocks its window reaches plus the
blocks of the chunk being computed, so it gets exactly that many (per running sequence: the
window's blocks, one partial block at each end and one in flight in overlap mode; plus one
step's token budget), and the rest of the budget goes to the groups that grow with context.
Sizing every pool alike would spend most of a DeepSeek-V4 budget on sliding state that is
freed as the window moves (its float32 compressor state alone is ~30x the compressed KV per
block), and cap the context at a fraction of what the memory holds.

The scheduler frees every running sequence's out-of-window blocks before it allocates
(`Scheduler.schedule`), so the sliding pools never run dry; if one did, allocation would fail
and the scheduler preempt, as for any full pool: slower, never wrong.
"""
from __future__ import annotations

import logging

from shuili.core.model_api import CacheGroupSpec

log = logging.getLogger("shuili.kv")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sliding_blocks(g: CacheGroupSpec, P: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a sliding group can have live at once: per sequence (window - 1) / P rounded up,
    + 2 partial ends + 1 in flight, and the blocks one step's budget of new tokens spans."""
    return max_num_seqs * (cdiv(g.window - 1, P) + 3) + cdiv(max_num_batched_tokens, P)


def pool_sizes(groups: list[CacheGroupSpec], P: int, budget_bytes: int, max_num_seqs: int,
               max_num_batched_tokens: int, max_model_len: int) -> dict[str, int]:
    """Blocks per group: sliding groups what their window needs, the others an equal share of the
    rest (every group's logical block i covers the same tokens), capped at what max_num_seqs
    sequences of max_model_len tokens can use."""
    cap = max_num_seqs * cdiv(max_model_len, P) + 1
    sliding = [g for g in groups if g.kind == "sliding"]

    def reserve(seqs: int) -> dict[str, int]:
        return {g.name: min(cap, sliding_blocks(g, P, seqs, max_num_batched_tokens)) for g in sliding}

    def cost(sz: dict[str, int]) -> int:
        return sum(sz[g.name] * g.bytes_per_block(P) for g in sliding)

    sizes = reserve(max_num_seqs)
    if len(sliding) < len(groups) and cost(sizes) > budget_bytes // 2:
        # the windows of max_num_seqs sequences would leave little or nothing for context (mid-v4:
        # ~41 MB of window state per sequence against a 1 GiB default): hold fewer sequences'
        # windows, in at most half the budget; beyond them the scheduler preempts (slower, never wrong)
        seqs = max_num_seqs
        while seqs > 1 and cost(reserve(seqs)) > budget_bytes // 2:
            seqs -= 1
        sizes = reserve(seqs)
        log.warning("kv_cache_bytes=%d holds the sliding-window state of %d sequences, not max_num_seqs=%d;"
                    " raise kv_cache_bytes to run more at once", budget_bytes, seqs, max_num_seqs)
    fixed = sum(sizes[g.name] * g.bytes_per_block(P) for g in groups if g.name in sizes)
    per_block = sum(g.bytes_per_block(P) for g in groups if g.name not in sizes)
    if per_block == 0:  # only sliding groups: nothing grows with context
        n = cap
    else:
        n = min(max(budget_bytes - fixed, 0) // per_block, cap)
    if n < 1:
        raise ValueError(f"kv_cache_bytes={budget_bytes} holds no KV block: the sliding groups take "
                         f"{fixed} bytes and each block of the others {per_block}; raise kv_cache_bytes "
                         "or set num_blocks")
    sizes.update({g.name: n for g in groups if g.name not in sizes})
    return sizes
