"""Attention: paged causal attention and sparse (index-selected, K = V) attention.

Per-query by construction, with all of a sequence's queries computed at once: logits come from
`numerics.dot` (a logit's bits depend only on its query row and its key row, exactly, on any
BLAS), each query's visible keys are then aligned to the start of its own softmax row in a fixed
order, the rest padded with -inf, which `numerics.softmax_last` provably ignores bit for bit
(exact zeros, appended zeros in the fixed tree), and p V comes from `numerics.dot_pv`, where
masked keys (p exactly 0) add nothing. So prefill, chunked prefill and decode of one token give
identical results, whatever the batch or the host. Softmax in float32 with the sink in the
denominator.
"""
from __future__ import annotations

from typing import Sequence

import torch

from shuili.hal import numerics


def _gqa_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, T, H, D]; k [B, KVH, n, D] (head-major: the fixed-point passes and the batched matmul
    read it contiguously) -> float32 [B, T, H, n]; head h reads kv head h // (H / KVH)."""
    bsz, t, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(bsz, t, kvh, h // kvh, d).permute(0, 2, 1, 3, 4).reshape(bsz, kvh, t * (h // kvh), d)
    lg = numerics.dot(qg, k).mul_(scale)  # [B, KVH, T * G, n]
    return lg.reshape(bsz, kvh, t, h // kvh, -1).permute(0, 2, 1, 3, 4).reshape(bsz, t, h, -1)


def _gqa_weighted(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [B, T, H, n]; v [B, KVH, n, Dv] (head-major) -> float32 [B, T, H, Dv]."""
    bsz, t, h, n = p.shape
    kvh, dv = v.shape[1], v.shape[3]
    pg = p.reshape(bsz, t, kvh, h // kvh, n).permute(0, 2, 1, 3, 4).reshape(bsz, kvh, t * (h // kvh), n)
    out = numerics.dot_pv(pg, v)  # [B, KVH, T * G, Dv]
    return out.reshape(bsz, kvh, t, h // kvh, dv).permute(0, 2, 1, 3, 4).reshape(bsz, t, h, dv)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
            scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, T, H, D] over keys k, values v [B, KVH, n, *]; query (b, t) sees keys first[b, t] ..
    first[b, t] + count[b, t] - 1, and keys it does not see must be finite (zeros) -> [B, T, H, Dv]."""
    bsz, t, h, _ = q.shape
    logits = _gqa_logits(q, k, scale)
    n = logits.shape[-1]
    p = _aligned_softmax(logits.reshape(bsz * t, h, n), first.reshape(-1), count.reshape(-1), sinks)
    return _gqa_weighted(p.reshape(bsz, t, h, n), v)


def _aligned_softmax(logits: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """logits [T, H, n] over a shared key range; query t sees keys first[t] .. first[t] + count[t] - 1.
    Returns p [T, H, n] (zero outside each query's keys), each row's softmax taken over its keys
    moved to the front of a -inf padded row, so its bits do not depend on the shared range."""
    t, h, n = logits.shape
    width = int(count.max()) if t else 0
    j = torch.arange(width)
    valid = j[None, :] < count[:, None]  # [T, width]
    extra = None if sinks is None else sinks.to(torch.float32)
    if t and not bool(first.any()):
        # every row's keys already start at column 0: masking in place is the same move
        rows = torch.where(valid[:, None, :], logits[..., :width], float("-inf"))
        p = torch.zeros(t, h, n, dtype=torch.float32)
        p[..., :width] = numerics.softmax_last(rows, extra)
        return p
    # padding reads and writes column n, a spare one, so no two writes of a row hit one column
    src = torch.where(valid, first[:, None] + j[None, :], torch.full((t, width), n))
    spare = torch.cat([logits, torch.full((t, h, 1), float("-inf"))], 2)
    rows = torch.gather(spare, 2, src[:, None, :].expand(t, h, width))
    pr = numerics.softmax_last(rows, extra)
    p = torch.zeros(t, h, n + 1, dtype=torch.float32)
    return p.scatter_(2, src[:, None, :].expand(t, h, width), pr)[..., :n]


def _slots(block_table: torch.Tensor, entries: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table.to(torch.int64)[entries // block_size] * block_size + entries % block_size


def _check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's preconditions of `paged_attention`; returns (q_lens, seq_lens) as int64 [B]."""
    t, h, d = q.shape
    nb, bs, kvh, dk = k_cache.shape
    if v_cache.shape[:3] != k_cache.shape[:3] or dk != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} do not "
                         f"match q {tuple(q.shape)} (want [num_blocks, block_size, KVH, {d}])")
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    qsl = query_start_loc.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    if qsl.shape != (lens.shape[0] + 1,) or int(qsl[0]) != 0 or int(qsl[-1]) != t:
        raise ValueError(f"query_start_loc {qsl.tolist()} must have B+1 = {lens.shape[0] + 1} entries "
                         f"from 0 to the {t} query tokens")
    q_lens = qsl[1:] - qsl[:-1]
    bad = torch.nonzero(q_lens > lens).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"sequence {b} has {int(q_lens[b])} queries but only {int(lens[b])} cached "
                         "tokens; seq_lens must include this step's tokens")
    blocks = (lens + bs - 1) // bs
    bad = torch.nonzero(blocks > block_tables.shape[1]).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"sequence {b} needs {int(blocks[b])} blocks, block_tables has "
                         f"{block_tables.shape[1]} columns")
    return q_lens, lens


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, window: int = 0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention: query at position p reads kv positions
    max(0, p - window + 1) .. p in increasing order; logits q K^T * scale (`numerics.dot`), softmax
    as in the module doc, output p V (`numerics.dot_pv`).

    Sequences are attended together, decode rows (one query) in one batch and longer query runs in
    another (so a prefill's query padding does not multiply the decode rows' work), keys and
    queries padded with zeros, which changes no bit of a real row (see the module doc).
    """
    t, h, d = q.shape
    q_lens, lens = _check_paged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    nb, bs, kvh, dk = k_cache.shape
    kf = k_cache.view(nb * bs, kvh, dk)
    vf = v_cache.view(nb * bs, kvh, v_cache.shape[-1])
    qf = q.to(torch.float32)
    out = torch.zeros(t, h, v_cache.shape[-1], dtype=torch.float32)
    starts = query_start_loc.to(torch.int64)[:-1]
    for group in (q_lens == 1, q_lens > 1):
        seqs = torch.nonzero(group).flatten()
        if seqs.numel():
            _attend_group(out, qf, kf, vf, block_tables.to(torch.int64)[seqs], lens[seqs], q_lens[seqs],
                          starts[seqs], bs, scale, window, sinks)
    return out.to(q.dtype)


def _take_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cache [slots, KVH, D] viewed as [slots * KVH, D]: rows `rows` [...] -> [..., D]. index_select
    copies whole rows; advanced indexing with a multi-dim index goes element by element."""
    flat = cache.reshape(-1, cache.shape[-1])
    return flat.index_select(0, rows.reshape(-1)).view(*rows.shape, flat.shape[-1])


def _attend_group(out: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, table: torch.Tensor,
                  length: torch.Tensor, q_len: torch.Tensor, start: torch.Tensor, bs: int, scale: float,
                  window: int, sinks: torch.Tensor | None) -> None:
    """Sequences b (table [B, blocks], length, q_len, start [B]) into out[start_b : start_b + q_len_b].
    Keys lo0_b .. length_b - 1 (lo0 the window start of the first query) fill a zero-padded
    [B, KVH, N] key block; queries a zero-padded [B, Tq] block."""
    first_pos = length - q_len  # position of each sequence's first query
    lo0 = (first_pos - window + 1).clamp_min(0) if window > 0 else torch.zeros_like(length)
    n_keys = length - lo0
    j = torch.arange(int(n_keys.max()))
    seen = j[None, :] < n_keys[:, None]  # [B, N]
    entry = torch.where(seen, lo0[:, None] + j[None, :], 0)
    # padded keys read slot 0 of the cache: entry 0's block may be gone (-1, a slid-out window block)
    slots = torch.where(seen, torch.gather(table, 1, entry // bs) * bs + entry % bs, 0)
    # gathered head-major, [B, KVH, N, D], in one pass: row (slot, head) of the cache viewed as rows
    kvh = kf.shape[1]
    rows_kv = (slots * kvh)[:, None, :] + torch.arange(kvh)[None, :, None]  # [B, KVH, N]
    # padded keys' logits never reach a softmax row (masked or not gathered), but their values are
    # zeroed, so that no 0 * inf can reach a real row's p V
    k = _take_rows(kf, rows_kv).to(torch.float32)
    v = torch.where(seen[:, None, :, None], _take_rows(vf, rows_kv).to(torch.float32), 0.0)
    i = torch.arange(int(q_len.max()))
    real = i[None, :] < q_len[:, None]  # [B, Tq]
    rows = torch.where(real, start[:, None] + i[None, :], 0)
    qb = torch.where(real[:, :, None, None], qf[rows], 0.0)  # [B, Tq, H, D]
    pos = first_pos[:, None] + i[None, :]
    lo = (pos - window + 1).clamp_min(0) if window > 0 else torch.zeros_like(pos)
    count = torch.where(real, pos + 1 - lo, 0)
    first = torch.where(real, lo - lo0[:, None], 0)
    o = _attend(qb, k, v, first, count, scale, sinks)  # [B, Tq, H, Dv]
    out[rows[real]] = o[real]


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
    if t == 0:
        return torch.zeros(0, h, d, dtype=q.dtype)
    # per query: its valid entries of cache 0 in index order, then cache 1, ...; -1s moved last
    ids, src, valid = [], [], []
    for i, (idx, fmt) in enumerate(zip(indices, fmts)):
        row = idx.to(torch.int64)
        ids.append(row.clamp_min(0))
        src.append(torch.full_like(row, i))
        valid.append(row >= 0)
    ids, src, valid = torch.cat(ids, 1), torch.cat(src, 1), torch.cat(valid, 1)
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    ids, src, valid = ids.gather(1, order), src.gather(1, order), valid.gather(1, order)
    count = valid.sum(1)
    width = int(count.max())
    ids, src, valid = ids[:, :width], src[:, :width], valid[:, :width]
    keys = torch.zeros(t, width, d, dtype=torch.float32)
    for i, (cache, fmt) in enumerate(zip(kv, fmts)):
        sel = valid & (src == i)
        if sel.any():
            keys[sel] = _rows(cache, fmt, d, ids[sel])
    qf = q.to(torch.float32)
    logits = numerics.dot(qf, keys) * scale  # [T, H, width]
    logits = torch.where(valid[:, None, :], logits, torch.full_like(logits, float("-inf")))
    p = numerics.softmax_last(logits, None if sinks is None else sinks.to(torch.float32))
    out = numerics.dot_pv(p, keys)
    return out.to(q.dtype)
