"""Sparse attention at prefill sizes with TOKENS neighbouring queries a program (default mode).

At a prefill the sparse kernel's direct path (attention.py) runs one program per (token, head
block): 16 query rows of V4's 16 heads against the token's own gathered rows, so every KV row
travels from L2 once per token that selects it (a 4k prefill reads each window row 128 times) and
the products run as 16-row MMAs. Neighbouring tokens select mostly the same rows: the window rows
of TOKENS consecutive positions are 128 + TOKENS - 1 slots, and their CSA top-k and HCA entries
come from the same few compressed slots. Here one program takes TOKENS tokens (TOKENS x 16 rows,
one Hopper warpgroup MMA) over the columns their index rows share:

- _columns_kernel, one program per group of TOKENS tokens and cache: when the group's valid slot
  ids span no more slots than the group has valid entries, the columns are that slot range,
  densely, and each token's count of every slot in it (a histogram of its index row: a slot a row
  lists twice counts twice, as the contract's softmax has no de-duplication); else the columns are
  the TOKENS index rows one after the other (W = TOKENS x LP columns, LP: the index width as a
  power of two), each token counting only its own row's (no row is shared, no work is saved).
- _group_kernel, one program per (group, head block): the softmax state of its TOKENS x BH rows
  carried over every cache's columns in order; a column a token does not count is -inf in that
  token's rows (a column no token counts loads as zeros: a slot in a dense range may belong to
  another sequence, or never have been written), and the output is written with the sinks folded
  in, as the direct path does. No step is skipped: a branch around the step kept Triton from
  pipelining the row loads (no cp.async in the sm_90 SASS), and in a dense CSA range a block of 32
  slots that none of four tokens selects is rare.

Determinism: each token's keys are summed in the columns' order (slot order in the dense case),
fixed by its group's index rows, so bits depend on which tokens share a group, that is on T:
run-to-run deterministic, as the direct path is. Batch-invariant mode never takes this path."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import cdiv, pow2
from shuili.platforms.nvidia.softmax import NEG, dot, finish

# tokens a program: TOKENS x BH (16) = 64 rows, one warpgroup MMA. 2 (32 rows) compiles too (159
# registers, 66 KB of shared memory); benchmarks/nvidia_sparse_prefill.py times both
TOKENS = int(os.environ.get("SHUILI_SPARSE_GROUP_TOKENS", "4"))
if TOKENS < 1 or TOKENS & (TOKENS - 1):
    raise ValueError(f"SHUILI_SPARSE_GROUP_TOKENS={TOKENS}: tokens a program must be a power of two (2 or 4)")
# from this many query tokens (a prefill; the path must also be the direct one): below it the
# direct path's per-token programs fill the GPU well enough and the columns kernel is not paid.
# 0 turns the path off, the default until a GPU has timed it (benchmarks/nvidia_sparse_prefill.py):
# no GPU was lent to the session that wrote it. 1024 is the value it was written for.
MIN_TOKENS = int(os.environ.get("SHUILI_SPARSE_GROUP_MIN_TOKENS", "0"))
BL = 32  # columns a step
NUM_WARPS = 8
NUM_STAGES = 2
# q's dtypes: float32 would double the registers of q and of the products' operands (the interpreter's
# tests add it: it has no bf16)
DTYPES = (torch.bfloat16, torch.float16)
# columns a group's index rows may take (TOKENS x the index width as a power of two): the columns
# kernel holds them in registers, and compiled for sm_90 (Triton 3.6, 4 warps) it fits 2,048 (168
# registers) and spills at 4,096. V4's window (128) and CSA top-k (512) fit, and HCA's ctx/128 up to
# 64k positions; wider index rows keep the direct path
MAX_COLUMNS = 2048


@triton.jit
def _columns_kernel(idx_ptr, cols_ptr, cnt_ptr, ncols_ptr, T, L, TOK: tl.constexpr, LP: tl.constexpr):
    """Group g's columns [W] (slot ids, -1 past the last) and its tokens' counts [TOK, W] (uint8;
    rows past T are not written), W = TOK * LP; ncols[g]: the columns up to the last valid one."""
    g = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = TOK * LP
    j = tl.arange(0, LP)
    w = tl.arange(0, W)
    lo = tl.full([], 2147483647, tl.int32)
    hi = tl.full([], -1, tl.int32)
    valid = tl.full([], 0, tl.int32)
    for i in tl.static_range(TOK):
        t = g * TOK + i
        v = tl.load(idx_ptr + t * L + j, mask=(j < L) & (j * 0 + t < T), other=-1)
        lo = tl.minimum(lo, tl.min(tl.where(v >= 0, v, 2147483647), 0))
        hi = tl.maximum(hi, tl.max(v, 0))
        valid += tl.sum((v >= 0).to(tl.int32), 0)
    # dense when the range is no wider than the entries: then it fits W, and trailing -1 columns
    # (padding) never change the choice, so neither do they change a bit
    dense = (hi >= 0) & (hi - lo < valid)
    if dense:  # counts past a uint8 (a row listing a slot 256 times or more): the rows instead
        big = tl.full([], 0, tl.int32)
        for i in tl.static_range(TOK):
            t = g * TOK + i
            v = tl.load(idx_ptr + t * L + j, mask=(j < L) & (j * 0 + t < T), other=-1)
            big = tl.maximum(big, tl.max(tl.histogram(tl.where(v >= 0, v - lo, 0), W, mask=v >= 0), 0))
        dense = big < 256
    if hi < 0:  # no valid entry in the group: no columns
        tl.store(ncols_ptr + g, 0)
    elif dense:  # slots lo .. hi, each token's count of each
        tl.store(cols_ptr + g * W + w, tl.where(w <= hi - lo, lo + w, -1))
        tl.store(ncols_ptr + g, hi - lo + 1)
        for i in tl.static_range(TOK):
            t = g * TOK + i
            v = tl.load(idx_ptr + t * L + j, mask=(j < L) & (j * 0 + t < T), other=-1)
            cnt = tl.histogram(tl.where(v >= 0, v - lo, 0), W, mask=v >= 0)
            tl.store(cnt_ptr + t * W + w, cnt.to(tl.uint8), mask=w * 0 + t < T)
    else:  # the rows one after the other: token i counts its valid columns of [i * LP, (i + 1) * LP)
        last = tl.full([], -1, tl.int32)
        for i in tl.static_range(TOK):
            t = g * TOK + i
            v = tl.load(idx_ptr + t * L + j, mask=(j < L) & (j * 0 + t < T), other=-1)
            tl.store(cols_ptr + g * W + i * LP + j, v)
            last = tl.maximum(last, tl.max(tl.where(v >= 0, i * LP + j, -1), 0))
            for k in tl.static_range(TOK):
                own = (v >= 0) & (j * 0 + k == i)
                tl.store(cnt_ptr + t * W + k * LP + j, own.to(tl.uint8), mask=j * 0 + t < T)
        tl.store(ncols_ptr + g, last + 1)


@triton.jit
def _group_cache(qt, m, l, acc, kv_ptr, cols_ptr, cnt_ptr, ncols_ptr, g, tok, tok_ok, scale, d, dok,
                 W: tl.constexpr, ROW: tl.constexpr, TOK: tl.constexpr, BH: tl.constexpr, BL: tl.constexpr,
                 F32: tl.constexpr):
    """The state (m [M], l [M], acc^T [DP, M]) of the group's M = TOK * BH rows carried over one
    cache's columns; qt is q^T [DP, M]. Transposed, as the packed tile of attention.py: the scores
    k q^T and acc^T += K^T p^T take q^T and p^T as the MMAs' shared-memory operand, where q as the
    register operand of q k^T held 128 registers a thread at D 512 and spilled. tok [TOK]: the
    group's tokens (tok_ok: below T)."""
    M: tl.constexpr = TOK * BH
    n = tl.load(ncols_ptr + g)
    for b in range(0, tl.cdiv(n, BL)):
        c = b * BL + tl.arange(0, BL)
        slot = tl.load(cols_ptr + g * W + c, mask=c < n, other=-1)
        cnt = tl.load(cnt_ptr + tok[None, :] * W + c[:, None], mask=tok_ok[None, :] & (c < n)[:, None],
                      other=0).to(tl.float32)  # [BL, TOK]
        live = tl.max(cnt, 1) > 0  # [BL]: some token counts the column
        kv = tl.load(kv_ptr + slot[:, None].to(tl.int64) * ROW + d[None, :],
                     mask=live[:, None] & dok[None, :], other=0.0).to(qt.dtype)  # [BL, DP]
        rc = tl.reshape(tl.broadcast_to(cnt[:, :, None], (BL, TOK, BH)), (BL, M))  # a row's token's counts
        sc = dot(kv, qt, F32) * scale  # [BL, M]
        sc = tl.where(rc > 0, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(sc - m_new[None, :]) * rc
        l = l * alpha + tl.sum(pr, axis=0)
        acc = acc * alpha[None, :] + dot(tl.trans(kv), pr.to(kv.dtype), F32)
        m = m_new
    return m, l, acc


@triton.jit
def _group_kernel(q_ptr, sink_ptr, o_ptr, scale, T, H, s_qt, s_qh, s_ot, s_oh,
                  kv0, c0, n0, k0, kv1, c1, n1, k1, kv2, c2, n2, k2,
                  NC: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
                  D: tl.constexpr, DP: tl.constexpr, TOK: tl.constexpr, BH: tl.constexpr, BL: tl.constexpr,
                  F32: tl.constexpr, HAS_SINK: tl.constexpr):
    """Grid (groups, head blocks). Row r of the program is token g * TOK + r // BH, head
    hb * BH + r % BH; caches in order 0, 1, 2 (kv, columns, ncols, counts each)."""
    g = tl.program_id(0).to(tl.int64)
    M: tl.constexpr = TOK * BH
    r = tl.arange(0, M)
    t = g * TOK + r // BH
    h = tl.program_id(1) * BH + r % BH
    rok = (t < T) & (h < H)
    tok = g * TOK + tl.arange(0, TOK)
    tok_ok = tok < T
    d = tl.arange(0, DP)
    dok = d < D
    at = t[None, :] * s_qt + h[None, :] * s_qh + d[:, None]  # [DP, M]
    ok = rok[None, :] & dok[:, None]
    qt = tl.load(q_ptr + at, mask=ok, other=0.0)
    m = tl.full([M], NEG, tl.float32)
    l = tl.zeros([M], tl.float32)
    acc = tl.zeros([DP, M], tl.float32)
    m, l, acc = _group_cache(qt, m, l, acc, kv0, c0, k0, n0, g, tok, tok_ok, scale, d, dok, W0, D, TOK, BH, BL,
                             F32)
    if NC >= 2:
        m, l, acc = _group_cache(qt, m, l, acc, kv1, c1, k1, n1, g, tok, tok_ok, scale, d, dok, W1, D, TOK, BH,
                                 BL, F32)
    if NC >= 3:
        m, l, acc = _group_cache(qt, m, l, acc, kv2, c2, k2, n2, g, tok, tok_ok, scale, d, dok, W2, D, TOK, BH,
                                 BL, F32)
    sink = 0.0
    if HAS_SINK:
        sink = tl.load(sink_ptr + h, mask=rok, other=0.0)
    o = tl.trans(finish(tl.trans(acc), m, l, sink, HAS_SINK))  # [DP, M]
    at = t[None, :] * s_ot + h[None, :] * s_oh + d[:, None]
    tl.store(o_ptr + at, o.to(o_ptr.dtype.element_ty), mask=ok)


def applies(t: int, q: torch.Tensor, indices, fmts, direct: bool) -> bool:
    """Host-known shapes only: the direct path's sizes, from MIN_TOKENS tokens, q in DTYPES, unpacked
    rows (attention._decode_once's, at these sizes) and at most three caches, none of them empty and
    none wider than MAX_COLUMNS columns a group."""
    return (direct and 0 < MIN_TOKENS <= t and q.dtype in DTYPES and len(indices) <= 3
            and all(f == "none" for f in fmts)
            and all(0 < i.shape[1] and TOKENS * pow2(i.shape[1]) <= MAX_COLUMNS for i in indices))


def sparse_attention(q, rows, indices, scale, sinks, bh: int, out: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] contiguous; rows: each cache as [slots, D] in q's dtype; indices int32 [T, L_i]
    contiguous; out [T, H, D], written and returned."""
    t, h, d = q.shape
    groups = cdiv(t, TOKENS)
    args, widths = [], []
    for idx in indices:
        lp = pow2(idx.shape[1])
        w = TOKENS * lp
        cols = torch.empty(groups, w, dtype=torch.int32, device=q.device)
        cnt = torch.empty(t, w, dtype=torch.uint8, device=q.device)
        ncols = torch.empty(groups, dtype=torch.int32, device=q.device)
        _columns_kernel[(groups,)](idx, cols, cnt, ncols, t, idx.shape[1], TOK=TOKENS, LP=lp, num_warps=4)
        args.append((cols, ncols, cnt))
        widths.append(w)
    pad = list(zip(rows, args)) + [(rows[0], args[0])] * (3 - len(rows))
    flat = [x for r, (c, n, k) in pad for x in (r, c, n, k)]
    _group_kernel[(groups, cdiv(h, bh))](
        q, sinks if sinks is not None else q, out, float(scale), t, h, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), *flat, NC=len(rows), W0=widths[0],
        W1=widths[min(1, len(widths) - 1)], W2=widths[min(2, len(widths) - 1)], D=d, DP=pow2(d, 16),
        TOK=TOKENS, BH=bh, BL=BL, F32=q.dtype == torch.float32, HAS_SINK=sinks is not None, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    return out
