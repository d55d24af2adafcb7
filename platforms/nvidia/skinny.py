"""Float32 GEMMs with few output columns: a decode step's mHC mixing linears (N = m(m+2) = 24,
K = m*D = 8192 on mid-v4) and MoE routers (N = E = 32, K = D = 2048), whose weights are float32.
cuBLAS ran each as a SIMT sgemm plus a split-K reduce: two kernels and about 10 us for 1-3 MB (an
H200 profile of 2026-12-06 put the 37 pairs of a mid-v4 step at 380 us).

Here K is cut into chunks whose size comes from K alone; program (row tile, chunk) computes its
[BM, all N] float32 partial with an IEEE dot (FMA over the chunk's K in order) and stores it, and
the partials are added in a fixed order by the kernel that needs the sum: splitk.py's for a
linear (chunk order), the Sinkhorn kernel for hc_mix (mhc.py). SUMSQ also stores each
row's partial sum of squares over the chunk (hc_mix's unweighted RMSNorm, folded in: the rows
are never normalised in memory). The tile and the chunking never depend on M, so a row's bits
never depend on the batch or on its place in it.

At many rows that FMA dot is far from the hardware: an H100 prefill of 2 x 4096 tokens spent 18 ms
in its 37 calls, 679 us for one hc_mix's partials whose FMA floor is near 70 us. So default mode, from
SPLIT3_MIN_ROWS rows of bf16 x, runs split3_partials instead: w cut in the kernel into three bf16
pieces, hi + mid + lo == w exactly (24 significand bits as 8 + 8 + 8), each x * piece product exact
in float32, summed by the tensor cores in float32 (their own order and rounding: accurate as a
float32 sum, not its bits), a row's bits still independent of the other rows. Switching on the row
count makes the bits depend on the batch, hence default mode only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia import splitk
from shuili.platforms.nvidia.common import cdiv, pow2

MAX_N = 64  # wider outputs go to the general GEMMs: one program holds all N columns
BK = 64
# (BM rows a program, MIN_KC, CHUNKS, warps[, stages]): K in about CHUNKS chunks of at least MIN_KC (a
# multiple of BK). benchmarks/nvidia_skinny.py times candidates on a GPU: on an H100 (2026-12-07,
# graphs of 20 calls) mid-v4's hc_mix took 13.2 us here against 17.1 at (16, 128, 32, 4), its router
# 8.3 against 10.0, the head's mix 12.3 against 10.5. Both tiles cut any K <= 4096 into chunks of
# 128, so tiny-v4's sums (K <= 1024) and nvidia's locked baseline are unchanged; mid-v4's hc_mix
# (K = 8192) now sums 64 chunks of 128, not 32 of 256 (other bits)
TILE = (16, 128, 64, 2)


@triton.jit
def _tile(M, N, K, KC, NP: tl.constexpr, BM: tl.constexpr):
    """Program (row tile, K chunk)'s rows, columns (with their masks) and K range [k_lo, k_hi)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, NP)
    k_lo = tl.program_id(1) * KC
    return rows, rows < M, cols, cols < N, k_lo, tl.minimum(k_lo + KC, K)


@triton.jit
def _operands(x_ptr, w_ptr, rows, rok, cols, cok, k0, k_hi, s_xm, s_wn, BK: tl.constexpr):
    """The K step's x tile [BM, BK] (x's dtype) and w tile [NP, BK], zero past the masks and k_hi."""
    kk = k0 + tl.arange(0, BK)
    kok = kk < k_hi
    a = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xm + kk[None, :], mask=rok[:, None] & kok[None, :],
                other=0.0)
    w = tl.load(w_ptr + cols[:, None] * s_wn + kk[None, :], mask=cok[:, None] & kok[None, :], other=0.0)
    return a, w


@triton.jit
def _store(p_ptr, acc, ss, rows, rok, cols, cok, N, s_pm, s_ps, SUMSQ: tl.constexpr):
    """The program's partial [BM, N] into p[chunk, rows], and (SUMSQ) its sums of squares into column N."""
    part = p_ptr + tl.program_id(1).to(tl.int64) * s_ps + rows.to(tl.int64) * s_pm
    tl.store(part[:, None] + cols[None, :], acc, mask=rok[:, None] & cok[None, :])
    if SUMSQ:
        tl.store(part + N, ss, mask=rok)


@triton.jit
def _partials_kernel(x_ptr, w_ptr, p_ptr, M, N, K, KC, s_xm, s_wn, s_pm, s_ps, SUMSQ: tl.constexpr,
                     NP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """p[chunk, row, :N] = x[row, chunk] @ w[:, chunk]^T, float32; SUMSQ: p[chunk, row, N] = the
    chunk's sum of x^2."""
    rows, rok, cols, cok, k_lo, k_hi = _tile(M, N, K, KC, NP, BM)
    acc = tl.zeros([BM, NP], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        a, w = _operands(x_ptr, w_ptr, rows, rok, cols, cok, k0, k_hi, s_xm, s_wn, BK)
        a = a.to(tl.float32)
        acc = tl.dot(a, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        if SUMSQ:
            ss += tl.sum(a * a, axis=1)
    _store(p_ptr, acc, ss, rows, rok, cols, cok, N, s_pm, s_ps, SUMSQ)


SPLIT3_MIN_ROWS = 256
# (BM, KC, warps, stages): rows a program, K a chunk (a multiple of BK), from K alone as above.
# `nvidia_skinny.py --many 8192` on an H100 (2026-12-07): mid-v4's hc_mix partials 60.7 us here,
# 64.3 at (64, 1024, 4, 3), 57.8 at (128, 2048, 8, 3) whose error against float64 doubles (0.092
# of conformance's float32 bound against 0.042); the FMA kernel 678.9 us at 0.008
SPLIT3_TILE = (128, 1024, 8, 3)


@triton.jit
def _split3_kernel(x_ptr, w_ptr, p_ptr, M, N, K, KC, s_xm, s_wn, s_pm, s_ps, SUMSQ: tl.constexpr,
                   NP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """_partials_kernel's partials of bf16 x on tensor cores: x @ hi^T + (x @ mid^T + x @ lo^T),
    hi, mid, lo the bf16 pieces of the float32 w tile (each residual is exact in float32)."""
    rows, rok, cols, cok, k_lo, k_hi = _tile(M, N, K, KC, NP, BM)
    acc_hi = tl.zeros([BM, NP], tl.float32)
    acc_mid = tl.zeros([BM, NP], tl.float32)
    acc_lo = tl.zeros([BM, NP], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        a, w = _operands(x_ptr, w_ptr, rows, rok, cols, cok, k0, k_hi, s_xm, s_wn, BK)
        hi = w.to(tl.bfloat16)
        r = w - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        acc_hi = tl.dot(a, tl.trans(hi), acc_hi)
        acc_mid = tl.dot(a, tl.trans(mid), acc_mid)
        acc_lo = tl.dot(a, tl.trans(lo), acc_lo)
        if SUMSQ:
            af = a.to(tl.float32)
            ss += tl.sum(af * af, axis=1)
    _store(p_ptr, acc_hi + (acc_mid + acc_lo), ss, rows, rok, cols, cok, N, s_pm, s_ps, SUMSQ)


def split3_ok(x: torch.Tensor, batch_invariant: bool) -> bool:
    """Whether `partials` of x [M, K] may run as split3_partials: default mode, bf16, many rows."""
    return not batch_invariant and x.dtype == torch.bfloat16 and x.shape[0] >= SPLIT3_MIN_ROWS


def split3_partials(x: torch.Tensor, w: torch.Tensor, sumsq: bool = False, tile=None) -> torch.Tensor:
    """`partials` of bf16 x [M, K] on tensor cores (the module docstring says how and at what
    accuracy): float32 [cdiv(K, KC), M, N (+1 with sumsq)]. tile: (BM, KC, warps, stages),
    SPLIT3_TILE if None."""
    if x.dtype != torch.bfloat16 or w.shape[1] != x.shape[1] or w.shape[0] > MAX_N:
        raise ValueError(f"skinny split3_partials: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} "
                         f"(bf16 x, at most {MAX_N} rows of w)")
    bm, kc, warps, stages = tile or SPLIT3_TILE
    if kc % BK:
        raise ValueError(f"skinny split3_partials: KC {kc} is not a multiple of {BK}")
    return _run(_split3_kernel, x, w, sumsq, bm, kc, num_warps=warps, num_stages=stages)


def _run(kernel, x: torch.Tensor, w: torch.Tensor, sumsq: bool, bm: int, kc: int, **launch) -> torch.Tensor:
    """kernel's partials of x [M, K] (unit stride along K) against w [N, K] read as float32, in
    programs of bm rows and chunks of kc: float32 [cdiv(K, kc), M, N (+1 with sumsq)]."""
    m, k = x.shape
    n = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    w = w.float().contiguous()
    s = cdiv(k, kc)
    p = torch.empty(s, m, n + int(sumsq), dtype=torch.float32, device=x.device)
    if m:
        kernel[(cdiv(m, bm), s)](x, w, p, m, n, k, kc, x.stride(0), w.stride(0), p.stride(1), p.stride(0),
                                 SUMSQ=sumsq, NP=pow2(n, 16), BM=bm, BK=BK, **launch)
    return p


def supports(x: torch.Tensor, n: int) -> bool:
    """x [M, K] float32 against a float32 weight of n <= MAX_N rows."""
    return x.dtype == torch.float32 and 0 < n <= MAX_N


def chunk(k: int, tile: tuple[int, ...] = TILE) -> int:
    """K per chunk: a multiple of BK, from K alone (never from M)."""
    min_kc, chunks = tile[1], tile[2]
    return max(min_kc, cdiv(cdiv(k, chunks), BK) * BK)


def partials(x: torch.Tensor, w: torch.Tensor, sumsq: bool = False, tile=None) -> torch.Tensor:
    """x [M, K] (any float dtype, read as float32; unit stride along K), w float32 [N, K] ->
    float32 partials [chunks, M, N (+1 with sumsq)]. tile: (BM, MIN_KC, CHUNKS, warps[, stages]), TILE
    if None."""
    k = x.shape[1]
    if w.shape[1] != k or w.shape[0] > MAX_N:
        raise ValueError(f"skinny partials: x {tuple(x.shape)} and w {tuple(w.shape)} (at most {MAX_N} rows)")
    tile = tile or TILE
    stages = {"num_stages": tile[4]} if len(tile) > 4 else {}
    return _run(_partials_kernel, x, w, sumsq, tile[0], chunk(k, tile), num_warps=tile[3], **stages)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x @ w^T (+ bias), x and w float32: the partials, then their sum in chunk order."""
    return splitk.split_sum(partials(x, w), bias, y)
