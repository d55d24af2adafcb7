"""KV-cache writes and the KV storage formats (packing lives in quant.py)."""
from __future__ import annotations

from typing import Callable

import torch

from shuili.hal import numerics
from shuili.platforms.reference import quant


def cache_write(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """In place: row slot_mapping[i] of cache (viewed as [slots, ...]) = values[i]; slot < 0 skips."""
    if values.dtype != cache.dtype:
        raise ValueError(f"values are {values.dtype} but the cache is {cache.dtype}; quantize or "
                         "cast before writing")
    rows = cache.view(-1, *values.shape[1:])
    slots = slot_mapping.to(torch.int64)
    if slots.shape != (values.shape[0],):
        raise ValueError(f"slot_mapping has shape {tuple(slots.shape)}, expected ({values.shape[0]},)")
    if not slots.numel():
        return
    # index_copy_, not rows[slots] = values: the same rows written (a step's slots are distinct), in
    # a third of index_put's time on a decode step's few rows
    if _all_valid(slot_mapping, rows.shape[0]):  # the usual case: no slot skipped, no masks to build
        rows.index_copy_(0, slots, values)
        return
    keep = slots >= 0
    if keep.any() and int(slots[keep].max()) >= rows.shape[0]:
        raise ValueError(f"slot {int(slots[keep].max())} is past the cache's {rows.shape[0]} slots")
    rows.index_copy_(0, slots[keep], values[keep])


# (slot_mapping, its version, the cache's slot count) last found all in [0, slots): a step writes
# the same mapping into every layer's caches, so it is checked once (two reductions and host reads)
_VALID: list = [None]


def _all_valid(slot_mapping: torch.Tensor, n: int) -> bool:
    """True when every slot is in [0, n); False when some is negative (skipped); raises past n."""
    hit = _VALID[0]
    if hit is not None and hit[0] is slot_mapping and hit[1] == slot_mapping._version and hit[2] == n:
        return True
    lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
    if lo < 0:
        return False
    if hi >= n:
        raise ValueError(f"slot {hi} is past the cache's {n} slots")
    _VALID[0] = (slot_mapping, slot_mapping._version, n)
    return True


def check_slots_args(block_tables: torch.Tensor, per_block: int) -> None:
    """paged_slots' argument checks (shared, so every platform's errors read the same)."""
    if block_tables.dim() != 2 or per_block <= 0:
        raise ValueError(f"paged_slots: block_tables must be [B, max_blocks] and per_block > 0, got "
                         f"{tuple(block_tables.shape)} and {per_block}")


def paged_slots(block_tables: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor,
                per_block: int) -> torch.Tensor:
    """Slots of entries pos of sequences seq_idx (broadcast together); -1 before 0, past the table or
    in a -1 block. The block index is clamped before the gather, so every read is in bounds. The
    sequence bounds are checked on the host only (a device tensor would need a sync)."""
    check_slots_args(block_tables, per_block)
    seq = seq_idx.long()
    rows = block_tables.shape[0]
    if seq.device.type == "cpu" and seq.numel() and (int(seq.min()) < 0 or int(seq.max()) >= rows):
        raise ValueError(f"paged_slots: seq_idx must lie in [0, {rows}) (the block table's rows)")
    nb = block_tables.shape[1]
    pos = pos.long()
    p = pos.clamp(min=0)
    blk = torch.div(p, per_block, rounding_mode="floor")
    if nb == 0:
        return torch.full(torch.broadcast_shapes(seq.shape, pos.shape), -1, dtype=torch.int64,
                          device=pos.device)
    phys = block_tables[seq, blk.clamp(max=nb - 1)].long()  # widened after the gather: N values
    slot = phys * per_block + p % per_block
    return torch.where((pos >= 0) & (blk < nb) & (phys >= 0), slot, -1)


def composed_kv_write(kv_quantize: Callable, cache_write: Callable) -> Callable:
    """kv_write as the ops that define it, from one op table (the reference's, or a platform's
    without a fused kernel)."""

    def kv_write(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor, fmt: str) -> None:
        check_kv_write_args(cache, rows, fmt)
        cache_write(cache, slot_mapping, rows.to(cache.dtype) if fmt == "none" else kv_quantize(rows, fmt))

    return kv_write


def check_kv_write_args(cache: torch.Tensor, rows: torch.Tensor, fmt: str) -> None:
    """kv_write's argument checks (shared, so every platform's errors read the same)."""
    if rows.dim() != 2:
        raise ValueError(f"kv_write: rows must be [N, D], got shape {tuple(rows.shape)}")
    if fmt != "none" and cache.dtype != torch.uint8:
        raise ValueError(f"kv_write: a {fmt} cache holds packed uint8 rows, got a {cache.dtype} cache; "
                         "allocate it as uint8 [blocks, block_size, bytes_per_row(fmt, D)]")


def kv_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Pack float rows [N, D] into uint8 [N, bytes_per_row(fmt, D)]; see quant.py for each format."""
    return quant.kv_quantize(x, fmt)


def kv_dequantize(packed: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """Exact inverse of `kv_quantize`: float32 [N, dim]."""
    return quant.kv_dequantize(packed, fmt, dim)


def check_pool_args(state: torch.Tensor, src_slots: torch.Tensor, out_slots: torch.Tensor, offset: int,
                    dim: int, overlap: bool) -> int:
    """compress_pool's shape checks (shared, so every platform's errors read the same); returns the
    state columns an entry's token spans from offset."""
    n, span = src_slots.shape
    width = 4 * dim if overlap else 2 * dim
    if state.shape[-1] < offset + width:
        raise ValueError(f"compress_pool: state rows of {state.shape[-1]} values cannot hold offset {offset} "
                         f"+ {width} (dim {dim}, overlap {overlap})")
    if overlap and span % 2:
        raise ValueError(f"compress_pool: overlap needs an even number of source tokens, got {span}")
    if out_slots.shape != (n,):
        raise ValueError(f"compress_pool: out_slots {tuple(out_slots.shape)} must be [{n}]")
    return width


def compress_pool(state: torch.Tensor, src_slots: torch.Tensor, out_slots: torch.Tensor, offset: int,
                  dim: int, overlap: bool) -> torch.Tensor:
    """float32 [N, dim]: per-channel softmax of the gates over each entry's tokens, then the
    weighted sum of their kv, both from `hal.numerics` (fixed-tree sums, host-independent exp)."""
    width = check_pool_args(state, src_slots, out_slots, offset, dim, overlap)
    span = src_slots.shape[1]
    src = src_slots.to(torch.int64)
    rows = state.reshape(-1, state.shape[-1])[src.clamp(min=0)][..., offset:offset + width]  # [N, L, width]
    if overlap:  # tokens [0, r): the previous block's Ca half; [r, 2r): this block's Cb half
        r = span // 2
        kv = torch.cat([rows[:, :r, :dim], rows[:, r:, dim:2 * dim]], dim=1)
        gate = torch.cat([rows[:, :r, 2 * dim:3 * dim], rows[:, r:, 3 * dim:]], dim=1)
    else:
        kv, gate = rows[..., :dim], rows[..., dim:]
    keep = ((src >= 0) & (out_slots >= 0)[:, None])[..., None]
    kv = torch.where(keep, kv.float(), torch.zeros((), dtype=torch.float32, device=kv.device))
    gate = torch.where(keep, gate.float(), torch.full((), float("-inf"), device=gate.device))
    p = numerics.softmax_last(gate.transpose(1, 2)).transpose(1, 2)
    return numerics.tree_sum(kv * p, dim=1)


kv_write = composed_kv_write(kv_quantize, cache_write)
