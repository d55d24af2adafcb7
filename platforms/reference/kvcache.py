"""KV-cache writes and the KV storage formats (packing lives in quant.py)."""
from __future__ import annotations

import torch

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
    if int(slots.min()) >= 0:  # the usual case: no slot skipped, no boolean masks to build
        if int(slots.max()) >= rows.shape[0]:
            raise ValueError(f"slot {int(slots.max())} is past the cache's {rows.shape[0]} slots")
        rows[slots] = values
        return
    keep = slots >= 0
    if keep.any() and int(slots[keep].max()) >= rows.shape[0]:
        raise ValueError(f"slot {int(slots[keep].max())} is past the cache's {rows.shape[0]} slots")
    rows[slots[keep]] = values[keep]


def kv_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Pack float rows [N, D] into uint8 [N, bytes_per_row(fmt, D)]; see quant.py for each format."""
    return quant.kv_quantize(x, fmt)


def kv_dequantize(packed: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """Exact inverse of `kv_quantize`: float32 [N, dim]."""
    return quant.kv_dequantize(packed, fmt, dim)
