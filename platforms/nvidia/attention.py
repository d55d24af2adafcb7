"""Paged causal attention (prefill and decode, sliding window, sinks) and sparse top-k attention.

Both kernels write per-split softmax partials (running max m, sum l, unnormalised acc) that one
combine kernel merges in split order. A split is a fixed span of absolute kv positions, so which
splits a query reads, and the order its blocks are folded in, depend only on the query itself:
in batch-invariant mode the span is a constant (BI_SPLIT) and prefill and decode take the same path.
The default mode sizes the span to fill the GPU for decode and skips the combine for prefill.

A query tile is BT consecutive tokens of one sequence times the GP (padded) query heads of one kv
head, so MQA/GQA heads share each K/V load. Rows that a tile holds for other tokens do not change a
row's result: a block fully masked for a row leaves (m, l, acc) bit-identical (m starts finite).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import cdiv, num_sms, pow2
from shuili.platforms.nvidia.quant import FORMAT_ID, bytes_per_row, load_packed_rows

BI_SPLIT = 1024  # kv positions per split in batch-invariant mode
NEG = tl.constexpr(-1e30)  # finite start of the running max (see the module docstring)


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    if F32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _finish(acc, m, l, sink, HAS_SINK: tl.constexpr):
    if HAS_SINK:
        top = tl.maximum(m, sink)
    else:
        top = m
    w = tl.exp(m - top)
    den = l * w
    if HAS_SINK:
        den = den + tl.exp(sink - top)
    den2 = tl.where(den > 0, den, 1.0)
    return tl.where(den[:, None] > 0, (acc * w[:, None]) / den2[:, None], 0.0)


@triton.jit
def _paged_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, qsl_ptr, sink_ptr, o_ptr, pm_ptr, pl_ptr,
                  pacc_ptr, scale, window, NQT, SPLIT, NS, H, G, s_qt, s_qh, s_ks, s_vs, s_bt,
                  BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, GP: tl.constexpr,
                  BT: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
                  DIRECT: tl.constexpr, HAS_SINK: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    b = pid // NQT
    j = pid % NQT
    q0 = tl.load(qsl_ptr + b)
    qlen = tl.load(qsl_ptr + b + 1) - q0
    if j * BT >= qlen:
        return
    seq_len = tl.load(seq_ptr + b)
    r = tl.arange(0, BT * GP)
    ti = j * BT + r // GP
    g = r % GP
    rok = (ti < qlen) & (g < G)
    pos = seq_len - qlen + ti
    h = kvh * G + g
    d = tl.arange(0, DP)
    dok = d < D
    tok = (q0 + ti).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                mask=rok[:, None] & dok[None, :], other=0.0)
    p_lo = seq_len - qlen + j * BT
    p_hi = tl.minimum(p_lo + BT - 1, seq_len - 1)
    hi = tl.minimum(p_hi + 1, (s + 1) * SPLIT)
    lo = s * SPLIT
    if window > 0:
        lo = tl.maximum(lo, p_lo - window + 1)
    lo = (lo // BLOCK_N) * BLOCK_N
    m = tl.full([BT * GP], NEG, tl.float32)
    l = tl.zeros([BT * GP], tl.float32)
    acc = tl.zeros([BT * GP, DP], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nok = n < hi
        page = tl.load(bt_ptr + b * s_bt + n // BS, mask=nok, other=0)
        slot = page.to(tl.int64) * BS + n % BS
        kk = tl.load(k_ptr + slot[:, None] * s_ks + kvh * D + d[None, :],
                     mask=nok[:, None] & dok[None, :], other=0.0)
        sc = _dot(q, tl.trans(kk), F32) * scale
        vis = (n[None, :] <= pos[:, None]) & nok[None, :]
        if window > 0:
            vis = vis & (n[None, :] > pos[:, None] - window)
        sc = tl.where(vis, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(sc - m_new[:, None])
        l = l * alpha + tl.sum(pr, axis=1)
        vv = tl.load(v_ptr + slot[:, None] * s_vs + kvh * D + d[None, :],
                     mask=nok[:, None] & dok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(pr.to(vv.dtype), vv, F32)
        m = m_new
    if DIRECT:
        sink = 0.0
        if HAS_SINK:
            sink = tl.load(sink_ptr + h, mask=rok, other=0.0)
        o = _finish(acc, m, l, sink, HAS_SINK)
        tl.store(o_ptr + tok[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=rok[:, None] & dok[None, :])
    else:
        row = (tok * H + h) * NS + s
        tl.store(pm_ptr + row, m, mask=rok)
        tl.store(pl_ptr + row, l, mask=rok)
        tl.store(pacc_ptr + row[:, None] * D + d[None, :], acc, mask=rok[:, None] & dok[None, :])


@triton.jit
def _sparse_kernel(q_ptr, kv_ptr, idx_ptr, pm_ptr, pl_ptr, pacc_ptr, scale, L, H, NS, ci, s_qt, s_qh,
                   ROW, s_it, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr,
                   BL: tl.constexpr, FMT: tl.constexpr, F32: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hok = h < H
    d = tl.arange(0, DP)
    dok = d < D
    q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + d[None, :], mask=hok[:, None] & dok[None, :],
                other=0.0)
    m = tl.full([BH], NEG, tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, DP], tl.float32)
    for l0 in range(0, L, BL):
        li = l0 + tl.arange(0, BL)
        idx = tl.load(idx_ptr + t * s_it + li, mask=li < L, other=-1)
        ok = idx >= 0
        if FMT == 0:
            kv = tl.load(kv_ptr + idx[:, None].to(tl.int64) * ROW + d[None, :],
                         mask=ok[:, None] & dok[None, :], other=0.0)
        else:
            kv = load_packed_rows(kv_ptr + idx.to(tl.int64) * ROW, ok, d, D, FMT)
        kv = kv.to(q.dtype)
        sc = _dot(q, tl.trans(kv), F32) * scale
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(sc - m_new[:, None])
        l = l * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + _dot(pr.to(kv.dtype), kv, F32)
        m = m_new
    row = (t * H + h) * NS + ci
    tl.store(pm_ptr + row, m, mask=hok)
    tl.store(pl_ptr + row, l, mask=hok)
    tl.store(pacc_ptr + row[:, None] * D + d[None, :], acc, mask=hok[:, None] & dok[None, :])


@triton.jit
def _combine_kernel(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, o_ptr, H, NS, s_ot, s_oh, D: tl.constexpr,
                    DP: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr, HAS_SINK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hok = h < H
    d = tl.arange(0, DP)
    dok = d < D
    sp = tl.arange(0, BS)
    rows = (t * H + h) * NS
    mm = tl.load(pm_ptr + rows[:, None] + sp[None, :], mask=hok[:, None] & (sp[None, :] < NS),
                 other=NEG)
    top = tl.max(mm, axis=1)
    sink = 0.0
    if HAS_SINK:
        sink = tl.load(sink_ptr + h, mask=hok, other=0.0)
        top = tl.maximum(top, sink)
    den = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, DP], tl.float32)
    for s in range(0, NS):
        w = tl.exp(tl.load(pm_ptr + rows + s, mask=hok, other=NEG) - top)
        den = den + tl.load(pl_ptr + rows + s, mask=hok, other=0.0) * w
        a = tl.load(pacc_ptr + (rows + s)[:, None] * D + d[None, :], mask=hok[:, None] & dok[None, :],
                    other=0.0)
        acc = acc + a * w[:, None]
    if HAS_SINK:
        den = den + tl.exp(sink - top)
    den2 = tl.where(den > 0, den, 1.0)
    o = tl.where(den[:, None] > 0, acc / den2[:, None], 0.0)
    tl.store(o_ptr + t * s_ot + h[:, None] * s_oh + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=hok[:, None] & dok[None, :])


def _combine(pm, pl, pacc, sinks, out):
    t, h, ns = pm.shape
    d = out.shape[-1]
    bh = min(pow2(h), 8)
    _combine_kernel[(t, cdiv(h, bh))](pm, pl, pacc, sinks if sinks is not None else pm, out, h, ns,
                                      out.stride(0), out.stride(1), D=d, DP=pow2(d, 16), BH=bh,
                                      BS=pow2(ns), HAS_SINK=sinks is not None)
    return out


def _partials(t, h, ns, d, device):
    return (torch.empty(t, h, ns, device=device), torch.empty(t, h, ns, device=device),
            torch.empty(t, h, ns, d, device=device))


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window=0,
                    sinks=None, *, batch_invariant: bool = False):
    t, h, d = q.shape
    _, bs, kvh, dk = k_cache.shape
    if h % kvh or dk != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}"
                         f" / {tuple(v_cache.shape)} (need H % KVH == 0 and equal head dims)")
    if d < 16:
        raise ValueError(f"paged_attention on nvidia needs head dim >= 16, got {d}")
    out = torch.empty_like(q)
    b = block_tables.shape[0]
    if t == 0 or b == 0:
        return out
    g = h // kvh
    gp = pow2(g)
    decode = t == b
    bt = max(1, 16 // gp) if (batch_invariant or decode) else max(1, 64 // gp)
    nqt = cdiv(max(t - b + 1, 1), bt)
    max_kv = block_tables.shape[1] * bs
    block_n = 64 if d <= 128 else (32 if d <= 256 else 16)
    if batch_invariant:
        split = BI_SPLIT
    elif decode:
        span = min(max_kv, window + 1) if window > 0 else max_kv
        want = cdiv(2 * num_sms(str(q.device)), b * nqt * kvh)
        ns = max(1, min(want, cdiv(span, 256)))
        split = cdiv(cdiv(max_kv if window <= 0 else span, ns), block_n) * block_n
    else:
        split = cdiv(max_kv, block_n) * block_n
    ns = cdiv(max_kv, split)
    direct = ns == 1 and not batch_invariant
    pm, pl, pacc = (out, out, out) if direct else _partials(t, h, ns, d, q.device)
    q = q.contiguous()
    k_cache = k_cache.contiguous()
    v_cache = v_cache.contiguous()
    _paged_kernel[(b * nqt, kvh, ns)](
        q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32),
        query_start_loc.to(torch.int32), sinks.float().contiguous() if sinks is not None else q,
        out, pm, pl, pacc, float(scale), int(window), nqt, split, ns, h, g, q.stride(0), q.stride(1),
        k_cache.stride(1), v_cache.stride(1), block_tables.shape[1], BS=bs, D=d, DP=pow2(d, 16),
        GP=gp, BT=bt, BLOCK_N=block_n, F32=q.dtype == torch.float32, DIRECT=direct,
        HAS_SINK=sinks is not None, num_warps=4 if d <= 128 else 8, num_stages=2)
    if not direct:
        _combine(pm, pl, pacc, sinks.float().contiguous() if sinks is not None else None, out)
    return out


def sparse_attention(q, kv, indices, scale, sinks=None, kv_formats=None):
    t, h, d = q.shape
    kv = list(kv)
    indices = list(indices)
    fmts = list(kv_formats) if kv_formats is not None else ["none"] * len(kv)
    if not (len(kv) == len(indices) == len(fmts)) or not kv:
        raise ValueError(f"sparse_attention: {len(kv)} caches, {len(indices)} index tensors and "
                         f"{len(fmts)} formats; give one index tensor and format per cache")
    out = torch.empty_like(q)
    if t == 0:
        return out
    nc = len(kv)
    pm, pl, pacc = _partials(t, h, nc, d, q.device)
    q = q.contiguous()
    bh = min(pow2(h, 16), 16 if d > 128 else 32)
    for ci, (cache, idx, fmt) in enumerate(zip(kv, indices, fmts)):
        if fmt == "none":
            rows = cache.reshape(-1, d)
            row = d
        else:
            rb = bytes_per_row(fmt, d)
            rows = cache.reshape(-1, rb)
            row = rb
        idx = idx.to(torch.int32).contiguous()
        if idx.shape[0] != t:
            raise ValueError(f"sparse_attention: indices[{ci}] has {idx.shape[0]} rows, q has {t}")
        ln = idx.shape[1]
        _sparse_kernel[(t, cdiv(h, bh))](
            q, rows.contiguous(), idx, pm, pl, pacc, float(scale), ln, h, nc, ci, q.stride(0),
            q.stride(1), row, idx.stride(0), D=d, DP=pow2(d, 16), BH=bh,
            BL=32 if d <= 128 else 16, FMT=FORMAT_ID[fmt], F32=q.dtype == torch.float32,
            num_warps=4 if d <= 128 else 8)
    return _combine(pm, pl, pacc, sinks.float().contiguous() if sinks is not None else None, out)
