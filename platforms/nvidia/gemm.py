"""GEMMs with weights in the checkpoint formats, dequantized in-kernel (weight-only: activations stay
in the compute dtype, as the contract says), plus the grouped (MoE) variant.

One Triton kernel serves dense, fp8_block128, fp8_block32 and mxfp4 weights and plain or grouped rows. It never
splits K: every output element is one fixed-order pass over K in BK steps, so a row's result does
not depend on the other rows of its tile. Batch-invariant mode pins the tile shape (BI_TILE) so the
same compiled kernel serves every batch; the default mode picks tiles by M and sends dense weights
to cuBLAS. SM100's FP4 tensor cores are not used: e2m1/e4m3 codes are expanded to bf16 in
registers (exactly: every e2m1 x e8m0 and e4m3 x 2^k value is a bf16), which is also the only
path on SM90.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from shuili.hal.types import Weight
from shuili.platforms.nvidia import dequant, qgemm, skinny, splitk
from shuili.platforms.nvidia.common import as_u8, cdiv, check, in_range, interpreting
from shuili.platforms.nvidia.moe_prep import group_tiles, moe_prep
from shuili.platforms.nvidia.quant import e2m1_to_f32, e4m3_to_f32, e8m0_to_f32
from shuili.platforms.reference.public import check_block_diagonal_args, composed_block_diagonal_linear

FMT_ID = {"dense": 0, "fp8_block128": 1, "mxfp4": 2, "fp8_block32": 3}
BI_TILE = (64, 64, 64)  # BM, BN, BK in batch-invariant mode, for every M
BI_GROUP_TILE = (64, 64, 64)  # grouped GEMMs in batch-invariant mode: tuned apart from plain linears
# batch-invariant float32 activations (IEEE dots: FMA on CUDA cores, not tensor cores): BM, BN, BK
# and warps, for every M. These are mid-v4's mHC mixing linears (N = 24, K = 8192) and routers
# (N = 32, K = 2048). The 64 x 64 x 64 tile of the bf16 linears took 1,069 us for a decode step's 37
# of them at batch 64, against cuBLAS's 390 us in default mode; this one 449 us, with K split as
# before (H100, benchmarks/nvidia_bi_linear.py, docs/performance.md, 2026-12-06)
BI_TILE_F32 = (16, 32, 32, 2)
# batch-invariant split-K: below this many column tiles, K is cut into chunks of at least
# BI_MIN_KC so that a decode-sized linear (N = 24 .. 2048) is not streamed by a few SMs
BI_MIN_PROGRAMS = 128
BI_MIN_KC = 256
# default mode, quantized weights at decode sizes (M <= Q_MAX_M): 64-column tiles and a split of
# K (chunks of at least Q_MIN_KC) until about two waves of programs stream the weight. One tile of
# 128 columns per program left a 512 x 2048 fp8 linear to 4 programs and a 4096 x 4096 mxfp4 one to
# 32 (286 us for 8 MB); each program dequantizes its own tiles, so more programs is more bandwidth.
Q_MAX_M = 128
Q_MIN_PROGRAMS = 264
Q_MIN_KC = 256
# quantized weights (fp8_block128, mxfp4) go to qgemm.py's decode-tuned kernels; SHUILI_NVIDIA_QGEMM=0
# sends them to this file's tile instead. On by default since the H200 run of 2026-12-04: mid-v4
# released-format decode through captured graphs ran 1.12x (batch 1) to 1.49x (batch 16, 64) faster
# with it (benchmarks/nvidia_decode_ctx.py, docs/performance.md).
USE_QGEMM = os.environ.get("SHUILI_NVIDIA_QGEMM", "1") != "0"
# default mode, many rows (prefill): quantized weights decoded once into a dense copy (dequant.py), then
# the dense GEMM: cuBLAS for a linear of at least DENSE_MIN_ROWS rows, qgemm's MoE pipeline for experts
# with at least DENSE_MOE_MIN_ROWS rows each on average (bf16 experts take that pipeline there too, in
# place of the composed one below). benchmarks/nvidia_qgemm.py --dense-ab on an H100 (2026-12-07):
# the 4096 x 4096 fp8 linear 1.27x at M 256, 2.67x at 1024, 3.06x at 4096; mid-v4's mxfp4 MoE 0.93x at
# 96 rows an expert (T512), 1.13x at 192 (T1024), 1.45x at 768 (T4096); its bf16 MoE 1.03-1.39x at
# T128-4096 (not below: decode's bf16 MoE keeps its path until measured)
DENSE_MIN_ROWS = 256
DENSE_MOE_MIN_ROWS = 160


@triton.jit
def _w_tile(a, w_ptr, s_ptr, e, cols, cok, kk, kok, k0, s_we, s_wn, s_se, s_sn,
            FMT: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """Weight tile [BN, BK] in the activation tile a's dtype (exact for the quantized formats)."""
    m = cok[:, None] & kok[None, :]
    if FMT == 0:
        w = tl.load(w_ptr + e * s_we + cols[:, None] * s_wn + kk[None, :], mask=m, other=0.0).to(a.dtype)
    elif FMT == 1 or FMT == 3:
        c = tl.load(w_ptr + e * s_we + cols[:, None] * s_wn + kk[None, :], mask=m, other=0)
        if NATIVE_FP8:
            v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = e4m3_to_f32(c)
        if FMT == 1:  # 128x128: one scale per row of the tile (BK divides 128, chunks start on 128)
            sc = tl.load(s_ptr + e * s_se + (cols // 128) * s_sn + k0 // 128, mask=cok, other=0.0)
            w = (v * sc[:, None]).to(a.dtype)
        else:  # 32x32: BK / 32 scales per row of the tile, gathered per element (cached loads)
            sc = tl.load(s_ptr + e * s_se + (cols // 32)[:, None] * s_sn + (kk // 32)[None, :], mask=m,
                         other=0.0)
            w = (v * sc).to(a.dtype)
    else:
        byte = tl.load(w_ptr + e * s_we + cols[:, None] * s_wn + kk[None, :] // 2, mask=m, other=0)
        nib = (byte.to(tl.int32) >> ((kk[None, :] & 1) * 4)) & 15
        sc = tl.load(s_ptr + e * s_se + cols[:, None] * s_sn + kk[None, :] // 32, mask=m, other=127)
        w = (e2m1_to_f32(nib) * e8m0_to_f32(sc)).to(a.dtype)
    return w


@triton.jit
def _dot_acc(acc, a, w, F32: tl.constexpr, HILO: tl.constexpr):
    """acc + a @ w^T; w is bf16-exact. HILO: float32 a as two bf16 dots (hi + lo)."""
    if HILO:
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        wb = w.to(tl.bfloat16)
        acc += tl.dot(hi, tl.trans(wb))
        acc += tl.dot(lo, tl.trans(wb))
    elif F32:
        acc += tl.dot(a, tl.trans(w), input_precision="ieee")
    else:
        acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    return acc


@triton.jit
def _mxfp4_step(acc, x_ptr, w_ptr, s_ptr, e, rows, rok, cols, cok, k0, k_hi, s_xm, s_we, s_wn, s_se, s_sn,
                F32: tl.constexpr, HILO: tl.constexpr, BK: tl.constexpr):
    """One BK step of an mxfp4 weight: bytes [BN, BK/2] hold elements k0 + 2j (low nibble) and
    k0 + 2j + 1 (high nibble); x @ W^T = x_even @ W_lo^T + x_odd @ W_hi^T. Each byte is loaded once
    and each scale once per pair, where the element-wise tile loaded both per element."""
    j = tl.arange(0, BK // 2)
    kev = k0 + 2 * j
    jok = kev < k_hi  # K and every chunk bound are even
    m = cok[:, None] & jok[None, :]
    byte = tl.load(w_ptr + e * s_we + cols[:, None] * s_wn + (kev // 2)[None, :], mask=m, other=0).to(tl.int32)
    sc = e8m0_to_f32(tl.load(s_ptr + e * s_se + cols[:, None] * s_sn + (kev // 32)[None, :], mask=m, other=127))
    w_lo = e2m1_to_f32(byte & 15) * sc
    w_hi = e2m1_to_f32(byte >> 4) * sc
    am = rok[:, None] & jok[None, :]
    xrow = x_ptr + rows[:, None].to(tl.int64) * s_xm
    a_ev = tl.load(xrow + kev[None, :], mask=am, other=0.0)
    a_od = tl.load(xrow + kev[None, :] + 1, mask=am, other=0.0)
    acc = _dot_acc(acc, a_ev, w_lo, F32, HILO)
    return _dot_acc(acc, a_od, w_hi, F32, HILO)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, te_ptr, t0_ptr, t1_ptr, M, N, K, KC, s_xm, s_ym,
                 s_we, s_wn, s_se, s_sn, FMT: tl.constexpr, GROUPED: tl.constexpr,
                 HAS_BIAS: tl.constexpr, F32: tl.constexpr, HILO: tl.constexpr, NATIVE_FP8: tl.constexpr,
                 SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        e = tl.load(te_ptr + pid_m)
        if e < 0:
            return
        r0 = tl.load(t0_ptr + pid_m)
        r1 = tl.load(t1_ptr + pid_m)
    else:
        e = pid_m * 0
        r0 = pid_m * BM
        r1 = M
    e = e.to(tl.int64)
    rows = r0 + tl.arange(0, BM)
    rok = rows < r1
    cols = pid_n * BN + tl.arange(0, BN)
    cok = cols < N
    acc = tl.zeros([BM, BN], tl.float32)
    k_lo = tl.program_id(2) * KC  # SPLIT > 1: this program's fixed K chunk [k_lo, k_lo + KC)
    k_hi = tl.minimum(k_lo + KC, K)
    for k0 in range(k_lo, k_hi, BK):
        if FMT == 2:  # mxfp4: K split into even and odd elements, one byte load per pair
            acc = _mxfp4_step(acc, x_ptr, w_ptr, s_ptr, e, rows, rok, cols, cok, k0, k_hi, s_xm, s_we, s_wn,
                              s_se, s_sn, F32, HILO, BK)
        else:
            kk = k0 + tl.arange(0, BK)
            kok = kk < k_hi
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xm + kk[None, :],
                        mask=rok[:, None] & kok[None, :], other=0.0)
            w = _w_tile(a, w_ptr, s_ptr, e, cols, cok, kk, kok, k0, s_we, s_wn, s_se, s_sn, FMT, NATIVE_FP8)
            acc = _dot_acc(acc, a, w, F32, HILO)
    if SPLIT > 1:  # fp32 partials [SPLIT, M, N]; splitk.split_sum adds them in split order
        part = y_ptr + tl.program_id(2).to(tl.int64) * M * N
        tl.store(part + rows[:, None].to(tl.int64) * N + cols[None, :], acc, mask=rok[:, None] & cok[None, :])
        return
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * s_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rok[:, None] & cok[None, :])


def _tiles_for(m: int, batch_invariant: bool, f32: bool = False):
    if batch_invariant:
        return BI_TILE_F32[:3] if f32 else BI_TILE
    if m <= 16:
        return 16, 128, 128
    if m <= 32:
        return 32, 128, 128
    if m <= 64:
        return 64, 128, 64
    return 128, 128, 64


def _weight_args(w: Weight, grouped: bool):
    """(data, scale, expert stride, row stride, scale expert stride, scale row stride)."""
    if w.format not in FMT_ID:
        raise ValueError(f"unknown weight format {w.format!r}; use one of {sorted(FMT_ID)}")
    data = w.data if w.format == "dense" else as_u8(w.data)
    data = data.contiguous()
    if grouped and data.dim() != 3:
        raise ValueError(f"grouped weights are [E, N, ...]; got data {tuple(data.shape)}")
    s_we = data.stride(0) if grouped else 0
    s_wn = data.stride(-2)
    if w.format == "dense":
        return data, data, s_we, s_wn, 0, 0
    scale = w.scale.contiguous()
    if w.format in ("fp8_block128", "fp8_block32"):
        scale = scale.float()
    return data, scale, s_we, s_wn, scale.stride(0) if grouped else 0, scale.stride(-2)


def bi_split(n: int, k: int, groups: int = 1, tile: tuple | None = None) -> tuple[int, int]:
    """(splits, K per split) for batch-invariant mode: a fixed split of K chosen from the weight's
    shape and the tile alone (never from M, so a row's sum order is the same in every batch). Narrow
    outputs get several K chunks so that more than a handful of programs stream the weight; wide
    ones get one."""
    bn, bk = (tile or BI_TILE)[1:3]
    tiles = cdiv(n, bn) * groups
    if tiles >= BI_MIN_PROGRAMS or k < 2 * BI_MIN_KC:
        return 1, k
    want = min(cdiv(BI_MIN_PROGRAMS, tiles), k // BI_MIN_KC)
    kc = cdiv(cdiv(k, want), bk) * bk
    return cdiv(k, kc), kc


def _grouped_tile(m: int, e: int, batch_invariant: bool):
    """Tile of a grouped GEMM: by rows per group (decode: a few rows per expert), not all rows."""
    return BI_GROUP_TILE if batch_invariant else _tiles_for(cdiv(m, max(e, 1)), False)


def fill_split(tiles: int, k: int, bk: int) -> tuple[int, int]:
    """(splits, K per split) so that tiles x splits reaches Q_MIN_PROGRAMS, chunks >= Q_MIN_KC."""
    if tiles >= Q_MIN_PROGRAMS or k < 2 * Q_MIN_KC:
        return 1, k
    want = min(cdiv(Q_MIN_PROGRAMS, tiles), k // Q_MIN_KC)
    kc = cdiv(cdiv(k, want), bk) * bk
    return cdiv(k, kc), kc


def _launch(x, w: Weight, bias, y, tiles, batch_invariant, grouped, hilo=False):
    m, k = x.shape
    n = w.shape[-2]
    f32 = x.dtype == torch.float32 and not hilo  # the IEEE FMA dot
    warps = BI_TILE_F32[3] if f32 and batch_invariant and not grouped else 4
    data, scale, s_we, s_wn, s_se, s_sn = _weight_args(w, grouped)
    if grouped:
        te, t0, t1, nt = tiles
        bm, bn, bk = _grouped_tile(m, w.shape[0], batch_invariant)
    else:
        bm, bn, bk = _tiles_for(m, batch_invariant, f32)
        te = t0 = t1 = x
        nt = cdiv(m, bm)
    if batch_invariant:
        split, kc = bi_split(n, k, w.shape[0] if grouped else 1, (bm, bn, bk))
    elif w.format != "dense" and (cdiv(m, w.shape[0]) if grouped else m) <= Q_MAX_M:
        bn = 64
        split, kc = fill_split(cdiv(n, bn) * (min(w.shape[0], m) if grouped else nt), k, bk)
    else:
        split, kc = 1, k
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _gemm_kernel[(nt, cdiv(n, bn), split)](
        x, data, scale, bias if bias is not None else x, out, te, t0, t1, m, n, k, kc, x.stride(0),
        y.stride(0), s_we, s_wn, s_se, s_sn, FMT=FMT_ID[w.format], GROUPED=grouped,
        HAS_BIAS=bias is not None, F32=x.dtype == torch.float32, HILO=hilo, NATIVE_FP8=not interpreting(),
        SPLIT=split, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=3)
    if split > 1:
        splitk.split_sum(out, bias, y)
    return y


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, *,
           batch_invariant: bool = False) -> torch.Tensor:
    if x.shape[-1] != w.in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} features, weight expects {w.in_features}")
    if w.format in ("mxfp4", "fp8_block32") and w.in_features % 32:
        raise ValueError(f"{w.format} weights need K % 32 == 0, got K={w.in_features}")
    # float32 with few columns: skinny.py's split-K, in batch-invariant mode and below DENSE_MIN_ROWS
    # rows (a 4k prefill's router: 172 us there, 46 on cuBLAS's sgemm, H100)
    few = (w.format == "dense" and w.data.dtype == torch.float32 and x.dim() == 2
           and skinny.supports(x, w.out_features) and (batch_invariant or x.shape[0] < DENSE_MIN_ROWS))
    if not batch_invariant and not few and (w.format == "dense" or (
            math.prod(x.shape[:-1]) >= DENSE_MIN_ROWS and _dense_ok(w, x.dtype))):
        y = torch.matmul(x, _dense_data(w, x.dtype).t())
        return y + bias.to(y.dtype) if bias is not None else y
    x2 = x.contiguous()
    y = torch.empty(x2.shape[0], w.out_features, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or y.shape[1] == 0:
        return y
    if few:
        return skinny.linear(x2, w.data, bias.float().contiguous() if bias is not None else None, y)
    if w.format == "dense" and w.data.dtype != x.dtype:
        w = Weight.dense(w.data.to(x.dtype))
    if USE_QGEMM and qgemm.supports(w):
        return qgemm.linear(x2, w, bias.contiguous() if bias is not None else None, y, batch_invariant)
    return _launch(x2, w, bias.contiguous() if bias is not None else None, y, None, batch_invariant,
                   False)


def _dense_ok(w: Weight, dtype: torch.dtype) -> bool:
    """w is dense, or its dense `dtype` copy may be made (a quantized format within dequant.MAX_BYTES)."""
    return w.format == "dense" or (dequant.supports(w) and dequant.dense_bytes(w, dtype) <= dequant.MAX_BYTES)


def _dense_data(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """w's values as a dense `dtype` tensor: a dense weight cast, a quantized one decoded (dequant.py)."""
    return w.data.to(dtype) if w.format == "dense" else dequant.dense(w, dtype).data


def _dense_experts(rows: int, w13: Weight, w2: Weight, dtype: torch.dtype) -> tuple[Weight, Weight] | None:
    """Both expert weights as dense `dtype` copies when default mode's MoE has many rows per expert
    (DENSE_MOE_MIN_ROWS) and both copies may be made (_dense_ok); else None, before decoding either."""
    if rows < DENSE_MOE_MIN_ROWS * w13.shape[0] or not (_dense_ok(w13, dtype) and _dense_ok(w2, dtype)):
        return None
    return Weight.dense(_dense_data(w13, dtype)), Weight.dense(_dense_data(w2, dtype))


def block_diagonal_linear(x: torch.Tensor, w: Weight, *, batch_invariant: bool = False) -> torch.Tensor:
    """x [T, G*K], W [G, N, K] -> [T, G*N]. qgemm's formats: the grouped launch on the blocks where
    they lie (grouped_linear's bits for the regrouped rows); others: grouped_linear on regrouped
    copies."""
    if not batch_invariant and x.dim() == 2 and x.shape[0] >= DENSE_MIN_ROWS and _dense_ok(w, x.dtype):
        check_block_diagonal_args(x, w)
        return _dense_block_diagonal(x.contiguous(), w)
    if not (USE_QGEMM and qgemm.supports(w)):  # the composition checks the arguments
        grouped = functools.partial(grouped_linear, batch_invariant=batch_invariant)
        return composed_block_diagonal_linear(grouped)(x, w)
    check_block_diagonal_args(x, w)
    g, n, _ = w.shape
    y = torch.empty(x.shape[0], g * n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or n == 0:
        return y
    return qgemm.block_diagonal(x.contiguous(), w, y, batch_invariant)


def _dense_block_diagonal(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """Default mode, many rows: one cuBLAS batched GEMM over the G blocks of the dense copy, x's
    blocks read and y's written where they lie (batch stride K or N, row stride G*K or G*N)."""
    g, n, k = w.shape
    t = x.shape[0]
    y = torch.empty(t, g * n, dtype=x.dtype, device=x.device)
    if t and n:
        torch.bmm(x.view(t, g, k).transpose(0, 1), _dense_data(w, x.dtype).transpose(1, 2),
                  out=y.view(t, g, n).transpose(0, 1))
    return y


def grouped_linear(x: torch.Tensor, w: Weight, group_sizes: torch.Tensor, *,
                   batch_invariant: bool = False, out_dtype: torch.dtype | None = None,
                   weight_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows of x sorted by group times W[group]^T. out_dtype (default x's) lets MoE keep float32
    intermediates; float32 x with weight_dtype bf16 runs the hi/lo split (two bf16 dots, about
    16 mantissa bits of x) instead of float32 FMA."""
    m, k = x.shape
    if len(w.shape) != 3 or w.shape[-1] != k or group_sizes.numel() != w.shape[0]:
        raise ValueError(f"grouped_linear: x {tuple(x.shape)}, weight {w.shape}, "
                         f"{group_sizes.numel()} groups do not fit (W is [E, N, K], one size per E)")
    check(group_sizes, lambda g: g.sum() == m, f"grouped_linear: group_sizes must sum to M={m}")
    return _grouped(x, w, group_sizes, None, batch_invariant, out_dtype, weight_dtype)


def _grouped(x, w: Weight, group_sizes, tiles, batch_invariant, out_dtype=None, weight_dtype=None):
    """grouped_linear without the size check; `tiles` (group_tiles of these sizes) may be shared."""
    m = x.shape[0]
    y = torch.empty(m, w.shape[-2], dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or y.shape[1] == 0:
        return y
    hilo = x.dtype == torch.float32 and weight_dtype == torch.bfloat16
    wdt = torch.bfloat16 if hilo else x.dtype
    if w.format == "dense" and w.data.dtype != wdt:
        w = Weight("dense", w.data.to(wdt), None, w.shape)
    if USE_QGEMM and qgemm.supports(w):
        bm = qgemm.group_bm(m, w.shape[0], batch_invariant)
        return qgemm.grouped(x.contiguous(), w, group_tiles(group_sizes, m, bm), y, batch_invariant, hilo, bm)
    if tiles is None:
        tiles = group_tiles(group_sizes, m, _grouped_tile(m, w.shape[0], batch_invariant)[0])
    return _launch(x.contiguous(), w, None, y, tiles, batch_invariant, True, hilo)


def moe_experts(x, topk_ids, topk_weights, w13: Weight, w2: Weight, swiglu_limit=None, *,
                batch_invariant: bool = False):
    """The contract keeps g, u, the SwiGLU product and each expert's output in float32: GEMM1
    accumulates bf16 x against bf16-exact weights into float32, GEMM2 feeds the float32 product
    through the hi/lo split. Rounding any of them to bf16 put bf16 mxfp4 cases outside tolerance."""
    dense = None if batch_invariant else _dense_experts(topk_ids.numel(), w13, w2, x.dtype)
    if dense is not None:
        return qgemm.moe_experts(x, topk_ids, topk_weights, *dense, swiglu_limit, False)
    if USE_QGEMM and qgemm.supports(w13) and qgemm.supports(w2):
        return qgemm.moe_experts(x, topk_ids, topk_weights, w13, w2, swiglu_limit, batch_invariant)
    t, k = topk_ids.shape
    e = w13.shape[0]
    flat = topk_ids.reshape(-1).to(torch.int64)
    check(flat, in_range(0, e), f"moe_experts: topk_ids must lie in [0, {e})")
    # both GEMMs have t * k rows in the same groups: one tile map (built on the device) serves both
    order, sizes, tiles = moe_prep(flat, e, _grouped_tile(t * k, e, batch_invariant)[0])
    tiles = tiles if t else None
    xs = x[order // k]
    h = _grouped(xs, w13, sizes, tiles, batch_invariant, out_dtype=torch.float32)
    inter = h.shape[1] // 2
    g, u = h[:, :inter], h[:, inter:]
    if swiglu_limit is not None:
        g = g.clamp(max=swiglu_limit)
        u = u.clamp(-swiglu_limit, swiglu_limit)
    a = torch.nn.functional.silu(g) * u
    y = _grouped(a, w2, sizes, tiles, batch_invariant, weight_dtype=x.dtype)
    ys = torch.empty_like(y)
    ys[order] = y
    ys = ys.view(t, k, -1)
    wts = topk_weights.float()
    out = wts[:, 0, None] * ys[:, 0]
    for j in range(1, k):
        out = out + wts[:, j, None] * ys[:, j]
    return out.to(x.dtype)
