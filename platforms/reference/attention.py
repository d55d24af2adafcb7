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

from typing import NamedTuple, Sequence

import torch

from shuili.hal import numerics
from shuili.platforms.reference import native


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


class _Softmax(NamedTuple):
    """Where each query row's keys sit in a [T, n] logits block: query t sees keys first[t] ..
    first[t] + count[t] - 1, moved to the front of a row of `width` columns."""
    n: int
    width: int
    invalid: torch.Tensor  # [T, 1, width] bool: padding columns of the moved rows
    src: torch.Tensor | None  # [T, H, width] source column of each moved entry (n: the spare -inf
    # column); None when every row's keys already start at column 0


def _softmax_plan(first: torch.Tensor, count: torch.Tensor, n: int, h: int) -> _Softmax:
    t = first.shape[0]
    width = int(count.max()) if t else 0
    j = torch.arange(width)
    valid = j[None, :] < count[:, None]  # [T, width]
    if t and not bool(first.any()):
        return _Softmax(n, width, ~valid[:, None, :], None)
    # padding reads and writes column n, a spare one, so no two writes of a row hit one column
    src = torch.where(valid, first[:, None] + j[None, :], torch.full((t, width), n))
    return _Softmax(n, width, ~valid[:, None, :], src[:, None, :].expand(t, h, width))


def _aligned_softmax(logits: torch.Tensor, sm: _Softmax, sinks: torch.Tensor | None) -> torch.Tensor:
    """logits [T, H, n] over a shared key range (consumed: masked in place) -> p [T, H, n], zero
    outside each query's keys, each row's softmax taken over its keys moved to the front of a -inf
    padded row, so its bits do not depend on the shared range."""
    t, h, n = logits.shape
    extra = None if sinks is None else sinks.to(torch.float32)
    if sm.src is None:
        # every row's keys already start at column 0: masking in place is the same move
        rows = logits[..., :sm.width].masked_fill_(sm.invalid, float("-inf"))
        if sm.width == n:
            return numerics.softmax_last(rows, extra)
        p = torch.zeros(t, h, n, dtype=torch.float32)
        p[..., :sm.width] = numerics.softmax_last(rows, extra)
        return p
    spare = torch.cat([logits, torch.full((t, h, 1), float("-inf"))], 2)
    pr = numerics.softmax_last(torch.gather(spare, 2, sm.src), extra)
    p = torch.zeros(t, h, n + 1, dtype=torch.float32)
    return p.scatter_(2, sm.src, pr)[..., :n]


def _slots(block_table: torch.Tensor, entries: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table.to(torch.int64)[entries // block_size] * block_size + entries % block_size


class _Group(NamedTuple):
    """The index work of one group of sequences (see `_group_plan`); it depends only on the
    block tables, lengths and query layout, so every layer of a step shares it."""
    rows_kv: torch.Tensor  # [B, KVH, N] rows of a cache viewed as [slots * KVH, D]
    pad: torch.Tensor | None  # flat rows of [B * KVH * N] that are padding (values zeroed)
    q_rows: torch.Tensor | None  # [B, Tq] rows of q; None: q itself, one query per sequence
    real: torch.Tensor  # [B, Tq] bool
    out_rows: torch.Tensor  # [real queries] rows of the output
    softmax: _Softmax


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    t, h, d = q.shape
    nb, bs, kvh, dk = k_cache.shape
    if v_cache.shape[:3] != k_cache.shape[:3] or dk != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} do not "
                         f"match q {tuple(q.shape)} (want [num_blocks, block_size, KVH, {d}])")
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")


def _check_lens(t: int, bs: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's preconditions of `paged_attention` on the lengths; returns (q_lens, seq_lens)
    as int64 [B]."""
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


def _group_plan(table: torch.Tensor, length: torch.Tensor, q_len: torch.Tensor, start: torch.Tensor,
                t: int, h: int, kvh: int, bs: int, window: int) -> _Group:
    """Sequences b (table [B, blocks], length, q_len, start [B]) of a call with t queries.
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
    rows_kv = (slots * kvh)[:, None, :] + torch.arange(kvh)[None, :, None]  # [B, KVH, N]
    # padded keys' logits never reach a softmax row (masked or not gathered), but their values are
    # zeroed, so that no 0 * inf can reach a real row's p V
    pad = torch.nonzero((~seen)[:, None, :].expand(rows_kv.shape).reshape(-1)).flatten()
    i = torch.arange(int(q_len.max()))
    real = i[None, :] < q_len[:, None]  # [B, Tq]
    rows = torch.where(real, start[:, None] + i[None, :], 0)
    pos = first_pos[:, None] + i[None, :]
    lo = (pos - window + 1).clamp_min(0) if window > 0 else torch.zeros_like(pos)
    count = torch.where(real, pos + 1 - lo, 0)
    first = torch.where(real, lo - lo0[:, None], 0)
    one_each = rows.shape == (t, 1) and torch.equal(rows[:, 0], torch.arange(t))
    return _Group(rows_kv, pad if pad.numel() else None, None if one_each else rows, real, rows[real],
                  _softmax_plan(first.reshape(-1), count.reshape(-1), rows_kv.shape[2], h))


_PLANS: dict[tuple, tuple] = {}  # (T, H, KVH, block size, window) -> (copies of the inputs, groups)
_MAX_PLANS = 8


def _plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
          t: int, h: int, kvh: int, bs: int, window: int) -> list[_Group]:
    """The groups of a call, reused while the block tables, lengths and query layout are equal in
    value to the last call's (every layer of one step): a few comparisons instead of ~60 small ops."""
    key = (t, h, kvh, bs, window)
    args = (block_tables, seq_lens, query_start_loc)
    hit = _PLANS.get(key)
    if hit is not None and all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                               for a, b in zip(hit[0], args)):
        return hit[1]
    q_lens, lens = _check_lens(t, bs, block_tables, seq_lens, query_start_loc)
    starts = query_start_loc.to(torch.int64)[:-1]
    table = block_tables.to(torch.int64)
    groups = []
    for group in (q_lens == 1, q_lens > 1):
        seqs = torch.nonzero(group).flatten()
        if seqs.numel():
            groups.append(_group_plan(table[seqs], lens[seqs], q_lens[seqs], starts[seqs], t, h, kvh,
                                      bs, window))
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = (tuple(a.clone() for a in args), groups)
    return groups


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, window: int = 0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention: query at position p reads kv positions
    max(0, p - window + 1) .. p in increasing order; logits q K^T * scale (`numerics.dot`), softmax
    as in the module doc, output p V (`numerics.dot_pv`). Runs `native.paged_attention` (one
    compiled loop, the bits of `paged_attention_torch`) on contiguous float32 caches where it builds.
    """
    _check_shapes(q, k_cache, v_cache)
    if not (native.enabled("attention") and k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous() and q.shape[0] and q.shape[2]
            and v_cache.shape[3]):
        return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     window, sinks)
    args = _native_args(block_tables, seq_lens, query_start_loc, q.shape[0], k_cache.shape[1])
    return native.paged_attention(q, k_cache, v_cache, *args, scale, window, sinks).to(q.dtype)


_NATIVE_ARGS: dict[tuple, tuple] = {}  # (T, block size) -> (copies of the inputs, int64 forms)


def _native_args(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 t: int, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_tables, seq_lens, query_start_loc) checked and as contiguous int64, reused while equal in
    value to the last call's (every layer of a step), as `_plan` is."""
    key = (t, bs)
    args = (block_tables, seq_lens, query_start_loc)
    hit = _NATIVE_ARGS.get(key)
    if hit is not None and all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                               for a, b in zip(hit[0], args)):
        return hit[1]
    _check_lens(t, bs, block_tables, seq_lens, query_start_loc)
    forms = tuple(a.to(torch.int64).contiguous() for a in args)
    if len(_NATIVE_ARGS) >= _MAX_PLANS:
        _NATIVE_ARGS.clear()
    _NATIVE_ARGS[key] = (tuple(a.clone() for a in args), forms)
    return forms


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, scale: float, window: int = 0,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention` in torch ops (the oracle's form; the compiled loop is held to its bits).

    Sequences are attended together, decode rows (one query) in one batch and longer query runs in
    another (so a prefill's query padding does not multiply the decode rows' work), keys and
    queries padded with zeros, which changes no bit of a real row (see the module doc).
    """
    _check_shapes(q, k_cache, v_cache)
    t, h, d = q.shape
    nb, bs, kvh, dk = k_cache.shape
    groups = _plan(block_tables, seq_lens, query_start_loc, t, h, kvh, bs, window)
    kf = k_cache.view(nb * bs, kvh, dk)
    vf = v_cache.view(nb * bs, kvh, v_cache.shape[-1])
    qf = q.to(torch.float32)
    if len(groups) == 1 and groups[0].q_rows is None:  # decode: one query per sequence, in order
        return _attend_group(groups[0], qf, kf, vf, scale, sinks).reshape(t, h, -1).to(q.dtype)
    out = torch.zeros(t, h, v_cache.shape[-1], dtype=torch.float32)
    for g in groups:
        out[g.out_rows] = _attend_group(g, qf, kf, vf, scale, sinks)[g.real]
    return out.to(q.dtype)


def _take_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cache [slots, KVH, D] viewed as [slots * KVH, D]: rows `rows` [...] -> [..., D]. index_select
    copies whole rows; advanced indexing with a multi-dim index goes element by element."""
    flat = cache.reshape(-1, cache.shape[-1])
    return flat.index_select(0, rows.reshape(-1)).view(*rows.shape, flat.shape[-1])


def _attend_group(g: _Group, qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, scale: float,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """One group's queries over its keys -> float32 [B, Tq, H, Dv] (padded queries included)."""
    k = _take_rows(kf, g.rows_kv).to(torch.float32)
    v = _take_rows(vf, g.rows_kv).to(torch.float32)  # a fresh copy: zeroed in place
    if g.pad is not None:
        v.view(-1, v.shape[-1]).index_fill_(0, g.pad, 0.0)
    if g.q_rows is None:
        qb = qf.view(qf.shape[0], 1, *qf.shape[1:])
    else:
        qb = torch.where(g.real[:, :, None, None], qf[g.q_rows], 0.0)  # [B, Tq, H, D]
    bsz, tq, h, _ = qb.shape
    logits = _gqa_logits(qb, k, scale)  # a fresh tensor: masked in place by the softmax
    n = logits.shape[-1]
    p = _aligned_softmax(logits.reshape(bsz * tq, h, n), g.softmax, sinks)
    return _gqa_weighted(p.reshape(bsz, tq, h, n), v)


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
