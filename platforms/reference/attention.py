"""Attention: paged causal attention and sparse (index-selected, K = V) attention.

Per-query by construction: each query gathers exactly its visible keys into a fresh contiguous
buffer, in a fixed order, and runs its own matmuls (shapes depend only on its own key count), so
its bits depend only on its own keys: prefill, chunked prefill and decode of one token give
identical results, whatever the batch. Only the softmax is shared across the queries of one call:
logits are padded at the end with -inf, which `numerics.softmax_last` provably ignores bit for bit
(exact zeros, appended zeros in the fixed tree). Softmax in float32 with the sink in the
denominator.
"""
from __future__ import annotations

from typing import Sequence

import torch

from shuili.platforms.reference import numerics


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous buffer (fresh allocations are 64-byte aligned): matmul inputs never start
    at an offset that depends on where the query sat in its batch."""
    return x.clone(memory_format=torch.contiguous_format)


def _logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D]; k [n, KVH, D] -> float32 [H, n]; head h reads kv head h // (H / KVH)."""
    h, d = q.shape
    n, kvh, _ = k.shape
    qg = _fresh(q.reshape(kvh, h // kvh, d))
    kt = _fresh(k.permute(1, 2, 0))  # [KVH, D, n]
    return torch.bmm(qg, kt).reshape(h, n) * scale


def _weighted(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [H, n]; v [n, KVH, Dv] -> [H, Dv]."""
    h, n = p.shape
    kvh, dv = v.shape[1], v.shape[2]
    if n == 0:
        return torch.zeros(h, dv, dtype=torch.float32)
    vg = _fresh(v.permute(1, 0, 2))  # [KVH, n, Dv]
    return torch.bmm(_fresh(p.reshape(kvh, h // kvh, n)), vg).reshape(h, dv)


def _attend_many(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor],
                 scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Queries qs[i] [H, D] over their own keys ks[i], values vs[i] [n_i, KVH, D] -> [len, H, Dv]."""
    logits = [_logits(q, k, scale) for q, k in zip(qs, ks)]
    width = max((lg.shape[1] for lg in logits), default=0)
    padded = torch.full((len(qs), qs[0].shape[0] if qs else 0, width), float("-inf"))
    for i, lg in enumerate(logits):
        padded[i, :, :lg.shape[1]] = lg
    p = numerics.softmax_last(padded, None if sinks is None else sinks.to(torch.float32))
    return torch.stack([_weighted(p[i, :, :lg.shape[1]], v) for i, (lg, v) in enumerate(zip(logits, vs))])


def _slots(block_table: torch.Tensor, entries: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table.to(torch.int64)[entries // block_size] * block_size + entries % block_size


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, window: int = 0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention: query at position p reads kv positions
    max(0, p - window + 1) .. p in increasing order; logits q K^T * scale by one matmul per query,
    softmax as in the module doc, output p V by one matmul per query.
    """
    t, h, d = q.shape
    nb, bs, kvh, dk = k_cache.shape
    if v_cache.shape[:3] != k_cache.shape[:3] or dk != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} do not "
                         f"match q {tuple(q.shape)} (want [num_blocks, block_size, KVH, {d}])")
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if len(qsl) != len(lens) + 1 or qsl[0] != 0 or qsl[-1] != t:
        raise ValueError(f"query_start_loc {qsl} must have B+1 = {len(lens) + 1} entries from 0 to "
                         f"the {t} query tokens")
    kf = k_cache.view(nb * bs, kvh, dk)
    vf = v_cache.view(nb * bs, kvh, v_cache.shape[-1])
    qf = q.to(torch.float32)
    qs, ks, vs = [], [], []
    for b, length in enumerate(lens):
        q_len = qsl[b + 1] - qsl[b]
        if q_len > length:
            raise ValueError(f"sequence {b} has {q_len} queries but only {length} cached tokens; "
                             "seq_lens must include this step's tokens")
        if -(-length // bs) > block_tables.shape[1]:
            raise ValueError(f"sequence {b} needs {-(-length // bs)} blocks, block_tables has "
                             f"{block_tables.shape[1]} columns")
        if q_len == 0:
            continue
        first = length - q_len
        lo0 = max(0, first - window + 1) if window > 0 else 0
        slots = _slots(block_tables[b], torch.arange(lo0, length), bs)
        kseq, vseq = kf[slots].to(torch.float32), vf[slots].to(torch.float32)
        for i in range(q_len):
            p = first + i
            lo = max(0, p - window + 1) if window > 0 else 0
            qs.append(qf[qsl[b] + i])
            ks.append(kseq[lo - lo0:p + 1 - lo0])
            vs.append(vseq[lo - lo0:p + 1 - lo0])
    out = torch.zeros(t, h, v_cache.shape[-1], dtype=torch.float32)
    if qs:
        out[:] = _attend_many(qs, ks, vs, scale, sinks)
    return out.to(q.dtype)


def _rows(cache: torch.Tensor, fmt: str, dim: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a cache viewed as [num_slots, row], as float32 [n, dim]."""
    from shuili.platforms.reference.quant import bytes_per_row, kv_dequantize

    flat = cache.reshape(-1, cache.shape[-1])
    if ids.numel() and int(ids.max()) >= flat.shape[0]:
        raise ValueError(f"slot id {int(ids.max())} is past the cache's {flat.shape[0]} slots")
    if fmt == "none":
        if flat.shape[-1] != dim:
            raise ValueError(f"unpacked cache rows have {flat.shape[-1]} values, queries have {dim}")
        return flat[ids].to(torch.float32)
    want = bytes_per_row(fmt, dim)
    if flat.dtype != torch.uint8 or flat.shape[-1] != want:
        raise ValueError(f"a {fmt!r} cache needs uint8 rows of {want} bytes for dim {dim}; got "
                         f"{flat.dtype} rows of {flat.shape[-1]}")
    return kv_dequantize(flat[ids], fmt, dim)


def sparse_attention(q: torch.Tensor, kv: Sequence[torch.Tensor], indices: Sequence[torch.Tensor],
                     scale: float, sinks: torch.Tensor | None = None,
                     kv_formats: Sequence[str] | None = None) -> torch.Tensor:
    """Per query t: the valid entries of cache 0 (in index order), then of cache 1, ..., are
    dequantized into one [n, D] buffer K; logits q_t K^T * scale, softmax with sinks, output p K.
    """
    t, h, d = q.shape
    if len(kv) != len(indices):
        raise ValueError(f"{len(kv)} caches but {len(indices)} index tensors; pass one per cache")
    fmts = list(kv_formats) if kv_formats is not None else ["none"] * len(kv)
    if len(fmts) != len(kv):
        raise ValueError(f"kv_formats has {len(fmts)} entries for {len(kv)} caches")
    for i, idx in enumerate(indices):
        if idx.dim() != 2 or idx.shape[0] != t:
            raise ValueError(f"indices[{i}] has shape {tuple(idx.shape)}, expected [{t}, L]")
    qf = q.to(torch.float32)
    ks = []
    for ti in range(t):
        parts = [torch.zeros(0, d)]
        for cache, idx, fmt in zip(kv, indices, fmts):
            row = idx[ti].to(torch.int64)
            parts.append(_rows(cache, fmt, d, row[row >= 0]))
        ks.append(torch.cat(parts)[:, None, :])
    if t == 0:
        return torch.zeros(0, h, d, dtype=q.dtype)
    out = _attend_many(list(qf), ks, ks, scale, sinks)
    return out.to(q.dtype)
