"""Paged causal attention (prefill and decode, sliding window, sinks) and sparse top-k attention.

Both kernels write per-split softmax partials (running max m, sum l, unnormalised acc) that one
combine kernel merges in split order. A split is a fixed span of absolute kv positions, so which
splits a query reads, and the order its blocks are folded in, depend only on the query itself:
in batch-invariant mode the span is a constant (BI_SPLIT) and prefill and decode take the same path.
The default mode sizes the span to fill the GPU for decode and skips the combine for prefill.
Sparse attention's splits are fixed chunks of SPARSE_SPLIT index columns (so in batch-invariant mode
the op is batch invariant); an empty split (l = 0) adds exactly nothing in the combine, so index
padding is free. Default mode at prefill sizes skips the split and the combine (DIRECT_WAVES) and
decodes packed caches once (DECODE_MIN_ROWS).

A query tile is BT consecutive tokens of one sequence times the GP (padded) query heads of one kv
head, so MQA/GQA heads share each K/V load. Rows that a tile holds for other tokens do not change a
row's result: a block fully masked for a row leaves (m, l, acc) bit-identical (m starts finite).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import cdiv, interpreting, num_sms, pow2
from shuili.platforms.nvidia import dequant, quant, sparse_group
from shuili.platforms.nvidia.quant import FORMAT_ID, bytes_per_row, split_rows
from shuili.platforms.nvidia.softmax import NEG, dot, finish

BI_SPLIT = 1024  # kv positions per split in batch-invariant mode


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
        sc = dot(q, tl.trans(kk), F32) * scale
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
        acc = acc * alpha[:, None] + dot(pr.to(vv.dtype), vv, F32)
        m = m_new
    if DIRECT:
        sink = 0.0
        if HAS_SINK:
            sink = tl.load(sink_ptr + h, mask=rok, other=0.0)
        o = finish(acc, m, l, sink, HAS_SINK)
        tl.store(o_ptr + tok[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=rok[:, None] & dok[None, :])
    else:
        row = (tok * H + h) * NS + s
        tl.store(pm_ptr + row, m, mask=rok)
        tl.store(pl_ptr + row, l, mask=rok)
        tl.store(pacc_ptr + row[:, None] * D + d[None, :], acc, mask=rok[:, None] & dok[None, :])


@triton.jit
def _merge_kernel(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, o_ptr, H, NS, s_ot, s_oh, D: tl.constexpr,
                  BD: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr, HAS_SINK: tl.constexpr):
    """Grid (T, head blocks, D blocks). Folds partials 0 .. NS-1 in order. An empty partial (l = 0,
    m = NEG) adds exactly nothing: its acc is not read (it may be unwritten) and acc keeps its bits
    (even a -0.0), so trailing empty splits/chunks (index padding) never change a result. D blocks
    repeat the same per-row scalar work, so every output element's bits are those of one program
    over all of D."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hok = h < H
    d = tl.program_id(2) * BD + tl.arange(0, BD)
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
    acc = tl.zeros([BH, BD], tl.float32)
    for s in range(0, NS):
        lv = tl.load(pl_ptr + rows + s, mask=hok, other=0.0)
        live = lv > 0
        w = tl.exp(tl.load(pm_ptr + rows + s, mask=hok, other=NEG) - top)
        den = den + lv * w
        a = tl.load(pacc_ptr + (rows + s)[:, None] * D + d[None, :],
                    mask=(hok & live)[:, None] & dok[None, :], other=0.0)
        acc = tl.where(live[:, None], acc + a * w[:, None], acc)
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
    bd = min(pow2(d, 16), 128)  # D blocks: 4x the programs at D = 512 (decode grids are small)
    _merge_kernel[(t, cdiv(h, bh), cdiv(d, bd))](
        pm, pl, pacc, sinks if sinks is not None else pm, out, h, ns, out.stride(0), out.stride(1),
        D=d, BD=bd, BH=bh, BS=pow2(ns), HAS_SINK=sinks is not None)
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


# ------------------------------------------------------------------------------ sparse attention
# Every (token, head block) splits each cache's index columns into fixed chunks of SPARSE_SPLIT
# columns; one program per chunk writes its own partial (m, l, acc) and the combine folds all
# partials in one fixed order: cache 0 chunk 0, chunk 1, ..., cache 1 chunk 0, ... The chunk size
# is a constant (never derived from T or the batch), so a token's partials, and the order they are
# folded in, depend only on its own index rows. SHUILI_SPARSE_SPLIT overrides it (benchmark sweeps;
# a power of two, at least the column block BL below).
SPARSE_SPLIT = int(os.environ.get("SHUILI_SPARSE_SPLIT", "128"))
_SPARSE_CACHES = 3  # caches folded into one launch (DeepSeek-V4 layers use 2: window + compressed)


def _sparse_tiles(d: int, h: int, packed: bool):
    """(BH heads, BL columns per step, num_warps, num_stages, TR) of the sparse kernel: the one place
    its launch constants live. They depend on the model's shapes and formats only, never on T.

    BH: tl.dot's smallest M is 16, which covers V4's 16 heads per GPU (each gathered row is read once
    per head block); small D affords 32. Measured on one H200 (CUDA-graph replay, T64 H16 D512,
    128 window + 512 selected rows, 2 caches, SPARSE_SPLIT 128; the old kernel: 92 us bf16, 228 us
    mxfp8):
    - bf16 rows: BL 32, 4 warps, 2 stages, q [BH, D] as the A operand: 29.5 us (134 registers, no
      spills, 2 programs an SM by shared memory). 8 warps 35 us, BL 16 31-63 us, BL 64 32 us,
      3 stages 34 us; TR 32 us.
    - packed rows (dequantized in registers, [BL, D] fp32 before the cast): the register-heavy
      case. TR (the transposed products k q^T, then acc^T = K^T p^T; q^T sits in the B operand)
      with BL 16, 4 warps, 2 stages: 65 us mxfp8 (197 registers, no spills); the same without TR
      85 us (254 registers), BL 32 71-76 us (spills), 8 warps 82-105 us. That was the row decode
      before quant.split_rows. With the even/odd halves (q^T and acc^T split with them) BL 32 is
      the faster tile though it spills more (Triton 3.6, sm_90: 255 registers and 192 B of stack,
      BL 16 16 B): on an H100 (2026-12-06, benchmarks/nvidia_sparse_decode.py --tiles, T64, 128
      mxfp8 window + 256 / 512 fp4_e4m3 selected rows) BL 32 with 3 stages took 53.3 / 79.9 us
      against BL 16's 65.8 / 96.6 (2 stages: 50.8 / 87.9; BL 64 127-263 us, split 256 60-92 us).
      Not timed at BL 32: layers of mostly mxfp8 rows (SWA; HCA at short context), where the halves
      were slower than the decode before them at BL 16 (58 against 42 us, 128 window + 8 compressed
      rows).
    SPARSE_SPLIT on the bf16 case: 64 -> 34 us, 128 -> 29.5 us, 256 -> 28.5 us; 128 keeps 5
    programs a token there (64 x 5 = 320 for 132 SMs) where 256 gives 3, for smaller T.
    """
    bh = min(pow2(h, 16), 16 if d > 128 else 32)
    if packed:
        return bh, 32, 4, 3, True
    return bh, 32, 4, 2, False


@triton.jit
def _sparse_state(BH: tl.constexpr, DP: tl.constexpr, TR: tl.constexpr):
    """The empty softmax state (m, l, acc, acc_o): see _sparse_chunk for the shapes."""
    m = tl.full([BH], NEG, tl.float32)
    l = tl.zeros([BH], tl.float32)
    if TR:
        acc = tl.zeros([DP // 2, BH], tl.float32)
        acc_o = tl.zeros([DP // 2, BH], tl.float32)
    else:
        acc = tl.zeros([BH, DP], tl.float32)
        acc_o = acc
    return m, l, acc, acc_o


@triton.jit
def _sparse_chunk(q, qo, m, l, acc, acc_o, kv_ptr, idx_ptr, t, c, L, scale, d, dok, ROW: tl.constexpr,
                  BH: tl.constexpr, DP: tl.constexpr, D: tl.constexpr, BL: tl.constexpr,
                  SPLIT: tl.constexpr, FMT: tl.constexpr, F32: tl.constexpr, TR: tl.constexpr,
                  WORDS: tl.constexpr, NATIVE: tl.constexpr):
    """The softmax state (m, l, acc, acc_o) carried on over columns c*SPLIT .. c*SPLIT+SPLIT-1 of
    token t's index row (idx rows are contiguous, L apart). The steps stop after the chunk's last
    valid (>= 0) column, so trailing -1 columns (padding) cost nothing and a chunk of only -1 takes
    no step (the state keeps its bits). Without TR, q is [BH, DP] and acc [BH, DP] (acc_o repeats
    it). With TR (the packed-row tile), q and qo are the even and odd rows of q^T, [DP/2, BH] each,
    and acc, acc_o the even and odd rows of acc^T: rows come in as even/odd halves
    (quant.split_rows), so k . q = k_e . q_e + k_o . q_o, and p V splits by column with no change
    to any sum."""
    irow = idx_ptr + t * L
    c0 = c * SPLIT
    col = tl.arange(0, SPLIT)
    ids = tl.load(irow + c0 + col, mask=c0 + col < L, other=-1)
    nblk = (tl.max(tl.where(ids >= 0, col, -1), axis=0) + BL) // BL
    for b in range(0, nblk):
        li = c0 + b * BL + tl.arange(0, BL)
        idx = tl.load(irow + li, mask=li < L, other=-1)
        ok = idx >= 0
        if TR:
            if FMT == 0:
                d2 = tl.arange(0, DP // 2)
                at = kv_ptr + idx[:, None].to(tl.int64) * ROW + 2 * d2[None, :]
                kok = ok[:, None] & (d2 < D // 2)[None, :]
                ke = tl.load(at, mask=kok, other=0.0)
                ko = tl.load(at + 1, mask=kok, other=0.0)
            else:
                ke, ko = split_rows(kv_ptr + idx.to(tl.int64) * ROW, ok, D, DP, FMT, WORDS, NATIVE)
            ke = ke.to(q.dtype)
            ko = ko.to(q.dtype)
            sc = dot(ko, qo, F32, dot(ke, q, F32))
            sc = tl.where(ok[:, None], sc * scale, float("-inf"))  # [BL, BH]
            m_new = tl.maximum(m, tl.max(sc, axis=0))
            alpha = tl.exp(m - m_new)
            pr = tl.exp(sc - m_new[None, :])
            l = l * alpha + tl.sum(pr, axis=0)
            pk = pr.to(ke.dtype)
            acc = acc * alpha[None, :] + dot(tl.trans(ke), pk, F32)
            acc_o = acc_o * alpha[None, :] + dot(tl.trans(ko), pk, F32)
        else:
            kv = tl.load(kv_ptr + idx[:, None].to(tl.int64) * ROW + d[None, :],
                         mask=ok[:, None] & dok[None, :], other=0.0).to(q.dtype)
            sc = dot(q, tl.trans(kv), F32) * scale  # [BH, BL]
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            alpha = tl.exp(m - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l = l * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None] + dot(pr.to(kv.dtype), kv, F32)
        m = m_new
    if not TR:
        acc_o = acc
    return m, l, acc, acc_o


@triton.jit
def _sparse_cache(q, qo, m, l, acc, acc_o, kv_ptr, idx_ptr, t, L, scale, d, dok, ROW: tl.constexpr,
                  BH: tl.constexpr, DP: tl.constexpr, D: tl.constexpr, BL: tl.constexpr,
                  SPLIT: tl.constexpr, FMT: tl.constexpr, F32: tl.constexpr, TR: tl.constexpr,
                  WORDS: tl.constexpr, NATIVE: tl.constexpr):
    """The state carried on over all of one cache's chunks, in order (the direct path)."""
    for c in range(0, tl.cdiv(L, SPLIT)):
        m, l, acc, acc_o = _sparse_chunk(q, qo, m, l, acc, acc_o, kv_ptr, idx_ptr, t, c, L, scale, d, dok,
                                         ROW, BH, DP, D, BL, SPLIT, FMT, F32, TR, WORDS, NATIVE)
    return m, l, acc, acc_o


@triton.jit
def _sparse_kernel(q_ptr, pm_ptr, pl_ptr, pacc_ptr, sink_ptr, o_ptr, scale, H, NS, P0, s_qt, s_qh, s_ot, s_oh,
                   kv0, ix0, L0, E0, kv1, ix1, L1, E1, kv2, ix2, L2,
                   NC: tl.constexpr, F0: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr,
                   R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr,
                   W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
                   D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr, BL: tl.constexpr,
                   SPLIT: tl.constexpr, F32: tl.constexpr, TR: tl.constexpr, NATIVE: tl.constexpr,
                   DIRECT: tl.constexpr = False, HAS_SINK: tl.constexpr = False):
    """Grid (T, head blocks, chunks of this launch's NC caches); chunk z is cache 0's chunk z while
    z < E0, then cache 1's chunk z - E0 while z < E1, then cache 2's; it writes partial P0 + z.
    DIRECT (grid (T, head blocks, 1)): one program carries the state over every chunk of the NC
    caches in that order and writes the output itself (the sinks folded in as the combine does)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    z = tl.program_id(2)
    hok = h < H
    d = tl.arange(0, DP)
    dok = d < D
    d2 = tl.arange(0, DP // 2)
    qrow = q_ptr + t * s_qt
    if TR:  # q^T's even and odd rows [DP/2, BH]
        qok = hok[None, :] & (d2 < D // 2)[:, None]
        q = tl.load(qrow + h[None, :] * s_qh + 2 * d2[:, None], mask=qok, other=0.0)
        qo = tl.load(qrow + h[None, :] * s_qh + 2 * d2[:, None] + 1, mask=qok, other=0.0)
    else:
        q = tl.load(qrow + h[:, None] * s_qh + d[None, :], mask=hok[:, None] & dok[None, :], other=0.0)
        qo = q
    m, l, acc, acc_o = _sparse_state(BH, DP, TR)
    if DIRECT:
        m, l, acc, acc_o = _sparse_cache(q, qo, m, l, acc, acc_o, kv0, ix0, t, L0, scale, d, dok, R0, BH, DP,
                                         D, BL, SPLIT, F0, F32, TR, W0, NATIVE)
        if NC >= 2:
            m, l, acc, acc_o = _sparse_cache(q, qo, m, l, acc, acc_o, kv1, ix1, t, L1, scale, d, dok, R1, BH,
                                             DP, D, BL, SPLIT, F1, F32, TR, W1, NATIVE)
        if NC >= 3:
            m, l, acc, acc_o = _sparse_cache(q, qo, m, l, acc, acc_o, kv2, ix2, t, L2, scale, d, dok, R2, BH,
                                             DP, D, BL, SPLIT, F2, F32, TR, W2, NATIVE)
        sink = 0.0
        if HAS_SINK:
            sink = tl.load(sink_ptr + h, mask=hok, other=0.0)
        orow = o_ptr + t * s_ot + h * s_oh
        if TR:
            at = orow[None, :] + 2 * d2[:, None]
            aok = hok[None, :] & (d2 < D // 2)[:, None]
            tl.store(at, tl.trans(finish(tl.trans(acc), m, l, sink, HAS_SINK)).to(o_ptr.dtype.element_ty),
                     mask=aok)
            tl.store(at + 1, tl.trans(finish(tl.trans(acc_o), m, l, sink, HAS_SINK)).to(o_ptr.dtype.element_ty),
                     mask=aok)
        else:
            tl.store(orow[:, None] + d[None, :], finish(acc, m, l, sink, HAS_SINK).to(o_ptr.dtype.element_ty),
                     mask=hok[:, None] & dok[None, :])
        return
    if NC == 1:
        m, l, acc, acc_o = _sparse_chunk(q, qo, m, l, acc, acc_o, kv0, ix0, t, z, L0, scale, d, dok, R0, BH,
                                         DP, D, BL, SPLIT, F0, F32, TR, W0, NATIVE)
    elif NC == 2:
        if z < E0:
            m, l, acc, acc_o = _sparse_chunk(q, qo, m, l, acc, acc_o, kv0, ix0, t, z, L0, scale, d, dok, R0,
                                             BH, DP, D, BL, SPLIT, F0, F32, TR, W0, NATIVE)
        else:
            m, l, acc, acc_o = _sparse_chunk(q, qo, m, l, acc, acc_o, kv1, ix1, t, z - E0, L1, scale, d, dok,
                                             R1, BH, DP, D, BL, SPLIT, F1, F32, TR, W1, NATIVE)
    else:
        if z < E0:
            m, l, acc, acc_o = _sparse_chunk(q, qo, m, l, acc, acc_o, kv0, ix0, t, z, L0, scale, d, dok, R0,
                                             BH, DP, D, BL, SPLIT, F0, F32, TR, W0, NATIVE)
        elif z < E1:
            m, l, acc, acc_o = _sparse_chunk(q, qo, m, l, acc, acc_o, kv1, ix1, t, z - E0, L1, scale, d, dok,
                                             R1, BH, DP, D, BL, SPLIT, F1, F32, TR, W1, NATIVE)
        else:
            m, l, acc, acc_o = _sparse_chunk(q, qo, m, l, acc, acc_o, kv2, ix2, t, z - E1, L2, scale, d, dok,
                                             R2, BH, DP, D, BL, SPLIT, F2, F32, TR, W2, NATIVE)
    row = (t * H + h) * NS + P0 + z
    tl.store(pm_ptr + row, m, mask=hok)
    tl.store(pl_ptr + row, l, mask=hok)
    # a row with l = 0 (an empty chunk) leaves acc unwritten: the combine reads acc only where l > 0
    live = hok & (l > 0)
    if TR:
        at = pacc_ptr + row[None, :] * D + 2 * d2[:, None]
        aok = live[None, :] & (d2 < D // 2)[:, None]
        tl.store(at, acc, mask=aok)
        tl.store(at + 1, acc_o, mask=aok)
    else:
        tl.store(pacc_ptr + row[:, None] * D + d[None, :], acc, mask=live[:, None] & dok[None, :])


# Default mode decodes packed caches once, whole, when the queries read their rows many times over
# (a prefill: neighbouring queries select mostly the same rows), and runs the kernel on the decoded
# rows: on an H100 (2026-12-07) the 4k prefill's sparse attention took 36.5 ms on packed rows
# against 11.8 on bf16 rows. From DECODE_MIN_ROWS queries reading at least DECODE_READS times as
# many rows as the packed pools hold, and within dequant.MAX_BYTES: host-known shapes only, no sync
DECODE_MIN_ROWS = 256
DECODE_READS = 4


def _decode_once(q, kv, indices, fmts):
    """(kv, fmts) with every packed cache decoded into rows of q's dtype (bf16 / float32 hold every
    format's values exactly), when _decode_once pays; else unchanged."""
    packed = [i for i, f in enumerate(fmts) if f != "none"]
    if not packed or q.shape[0] < DECODE_MIN_ROWS or q.dtype not in (torch.bfloat16, torch.float32):
        return kv, fmts
    d = q.shape[-1]
    slots = sum(kv[i].numel() // bytes_per_row(fmts[i], d) for i in packed)
    reads = q.shape[0] * sum(indices[i].shape[-1] for i in packed)
    if reads < DECODE_READS * slots or slots * d * q.element_size() > dequant.MAX_BYTES:
        return kv, fmts
    kv, fmts = list(kv), list(fmts)
    for i in packed:
        kv[i] = quant.dequantize_rows(kv[i].reshape(-1, bytes_per_row(fmts[i], d)), fmts[i], d, q.dtype)
        fmts[i] = "none"
    return kv, fmts


# Default mode with enough (token, head block) programs to fill the GPU DIRECT_WAVES times over (a
# prefill) runs one program per pair over all its chunks, writing the output itself: the split
# path's partials, [T, H, chunks, D] float32, are written and read back by the combine (at a 4k
# prefill of mid-v4, 5 chunks a CSA token: 1.3 GB a layer). Host-known shapes only; the fold's
# rounding differs from the combine's, so a token's bits depend on T here (run_to_run)
DIRECT_WAVES = 4


def _direct(t: int, head_blocks: int, caches: int, device, batch_invariant: bool) -> bool:
    return (not batch_invariant and caches <= _SPARSE_CACHES
            and t * head_blocks >= DIRECT_WAVES * num_sms(str(device)))


def sparse_attention(q, kv, indices, scale, sinks=None, kv_formats=None, *, batch_invariant: bool = False):
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
    if not batch_invariant:
        kv, fmts = _decode_once(q, kv, indices, fmts)
    split = SPARSE_SPLIT
    bh, bl, warps, stages, tr = _sparse_tiles(d, h, any(f != "none" for f in fmts))
    if split != pow2(split) or split < bl:
        raise ValueError(f"SPARSE_SPLIT must be a power of two >= {bl}, got {split}")
    caches = []
    for ci, (cache, idx, fmt) in enumerate(zip(kv, indices, fmts)):
        row = d if fmt == "none" else bytes_per_row(fmt, d)
        if idx.dim() != 2 or idx.shape[0] != t:
            raise ValueError(f"sparse_attention: indices[{ci}] has shape {tuple(idx.shape)}, "
                             f"expected [{t}, L]")
        idx = idx.to(torch.int32).contiguous()
        rows = cache.reshape(-1, row).contiguous()
        caches.append((rows, idx, idx.shape[1], cdiv(idx.shape[1], split), FORMAT_ID[fmt], row,
                       quant.word_loads(row, rows)))
    q = q.contiguous()
    sk = sinks.float().contiguous() if sinks is not None else None
    direct = _direct(t, cdiv(h, bh), len(caches), q.device, batch_invariant)
    idx_rows = [c[1] for c in caches]
    if sparse_group.applies(t, q, idx_rows, fmts, direct):
        return sparse_group.sparse_attention(q, [c[0] for c in caches], idx_rows, scale, sk, bh, out)
    ns = 1 if direct else sum(c[3] for c in caches)
    pm, pl, pacc = (out, out, out) if direct else _partials(t, h, ns, d, q.device)
    p0 = 0
    for g0 in range(0, len(caches), _SPARSE_CACHES):
        grp = caches[g0:g0 + _SPARSE_CACHES]
        nz = 1 if direct else sum(c[3] for c in grp)
        if nz == 0:
            continue
        pad = grp + [grp[0]] * (_SPARSE_CACHES - len(grp))  # unused slots (never reached)
        end = 0
        args = []
        for i, (rows, idx, ln, nch, *_) in enumerate(pad):
            end += nch if i < len(grp) else 0
            args += [rows, idx, ln] + ([end] if i < _SPARSE_CACHES - 1 else [])
        _sparse_kernel[(t, cdiv(h, bh), nz)](
            q, pm, pl, pacc, sk if sk is not None else q, out, float(scale), h, ns, p0, q.stride(0),
            q.stride(1), out.stride(0), out.stride(1), *args,
            NC=len(grp), F0=pad[0][4], F1=pad[1][4], F2=pad[2][4], R0=pad[0][5], R1=pad[1][5],
            R2=pad[2][5], W0=pad[0][6], W1=pad[1][6], W2=pad[2][6], D=d, DP=pow2(d, 16), BH=bh, BL=bl,
            SPLIT=split, F32=q.dtype == torch.float32, TR=tr, NATIVE=not interpreting(), DIRECT=direct,
            HAS_SINK=sk is not None, num_warps=warps, num_stages=stages)
        p0 += nz
    return out if direct else _combine(pm, pl, pacc, sk, out)
