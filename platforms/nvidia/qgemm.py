"""Weight-only quantized GEMMs (fp8_block128, mxfp4) for the sizes decode runs at, and the MoE expert
pipeline built on them.

Decode reads each weight once per step and multiplies it by few rows, so these kernels are judged
by weight bytes per second. What the older kernel in gemm.py did per element and this one does per
tile:
- mxfp4 bytes load as int32 words [BN, BK/32, 4]: the 32-element scale group is an axis, so one
  e8m0 byte per group broadcasts in registers (the old kernel gathered a scale byte per element, one
  load instruction each);
- e2m1 decodes with two shifts and a mask per element into float32 bits worth e2m1 * 2^-126, and
  two exact multiplies apply 2^126 times the scale (quant.e2m1_x8); the bf16 operand is the high
  half of those bits. On the GPU, bf16 activations take quant.e2m1_bf16_x8 instead: byte permutes
  look the bf16 values up and packed bf16 multiplies scale them (the same bits, fewer instructions).
  Row tiles under 64 (mma.sync) dot the even-K and odd-K halves against the
  activation's even and odd columns; 64-row tiles interleave them back into K order for one
  warpgroup MMA;
- fp8_block128 scales (one power of two per 128 x 128 block) multiply the [BM, BN] partial of each
  K step, not the [BN, BK] weight tile: exact either way, since a power of two commutes with
  rounding, and the weight tile goes straight from e4m3 to the dot's dtype.

Determinism. Every output element is a fixed-order sum over K in BK steps; K is cut into SPLIT
fixed chunks whose fp32 partials are added in chunk order by a second kernel (splitk.py).
Default mode picks tiles and split from (M, weight shape): run to run deterministic.
Batch-invariant mode fixes the tile (BI_TILE; grouped GEMMs BI_GROUP_BM rows) and takes the split
from the weight's shape alone, so a row's bits never depend on M or on its position. The dense
format stays in gemm.py (cuBLAS, or its locked batch-invariant tile).

MoE (moe_experts): one tile map serves both expert GEMMs; GEMM1 reads its rows through the sort
order (no gathered copy of x) and applies the clamp and SwiGLU in its epilogue (it computes the
gate and the up columns of a tile together), GEMM2 multiplies each row by its routing weight and
stores it at its (token, slot) place, and one kernel adds the k slots in slot order. float32 stays
float32 throughout, as the contract asks. With bf16 activations GEMM2 dots the float32 intermediate
as bf16 hi + lo parts, which GEMM1's epilogue stores (two bf16 planes, the bytes of one float32).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from shuili.hal.types import Weight
from shuili.platforms.nvidia.common import as_u8, cdiv, check, in_range, interpreting, pow2
from shuili.platforms.nvidia import splitk
from shuili.platforms.nvidia.moe_prep import moe_prep
from shuili.platforms.nvidia.quant import e2m1_bf16_x8, e2m1_x8, e4m3_to_f32, e8m0_bf16_pair

FMT_ID = {"dense": 0, "fp8_block128": 1, "mxfp4": 2}
BI_TILE = (64, 64, 128)  # BM, BN, BK in batch-invariant mode, for every M
# default mode; fp8 needs BK | 128 (one scale per step)
BK_OF = {"dense": 64, "fp8_block128": 128, "mxfp4": 128}
BN_DEFAULT = 64
# split K until about MIN_PROGRAMS programs stream the weight, chunks of at least MIN_KC
MIN_PROGRAMS = 264
MIN_KC = 512
BI_MIN_PROGRAMS = int(os.environ.get("SHUILI_NVIDIA_QGEMM_BI_PROGRAMS", "132"))
# batch-invariant row tile of grouped GEMMs (MoE experts, grouped o-projection), fixed for every M: 16
# fits decode's few rows per expert (mid-v4 batch 64: 12); at 64 a decode step took 11.3 ms, not 9.8
BI_GROUP_BM = int(os.environ.get("SHUILI_NVIDIA_QGEMM_BI_GROUP_BM", "16"))
# row tiles of 64 (one Hopper warpgroup MMA) at most: a 128-row tile needs 120 KB of shared memory
# for 3 stages (one program per SM), where 64 rows leave room for three
MAX_BM = 64
NUM_WARPS = None  # None: 4 warps for 16-row tiles, 8 above (no spills: benchmarks/qgemm_sass.py)
NUM_STAGES = None  # None: 4 for 16-row tiles, 3 above (shared memory)
# default-mode MoE launches of 16-row tiles (decode: a few rows per expert): "gemm1" (gate + up +
# SwiGLU) and "gemm2" (down, weighted scatter) -> (BN, BK, warps, stages); absent: the defaults above.
# benchmarks/nvidia_qgemm.py --sweep-moe times the candidates: on the H200 (2026-12-05, mid-v4's MoE
# at T64, mxfp4) this pair took the MoE from 128.1 to 115.8 us; on an H100 (2026-12-06, --moe-ab)
# 1.15x at T1, 1.07x at T16, 0.99x at T64 and T256 (docs/performance.md). Batch-invariant launches
# never read it: their tile is fixed for every batch.
MOE_TILES: dict[str, tuple[int, ...]] = {"gemm1": (32, 64, 4, 3), "gemm2": (128, 64, 4, 3)}
# the same for default mode's MoE on dense experts (gemm.py's dense copy at many rows, bf16 experts),
# MAX_BM-row tiles, bf16 activations only (float32 ones would need twice the shared memory).
# benchmarks/nvidia_qgemm.py --sweep-moe-dense 4096 on an H100 (2026-12-07, mid-v4's MoE at T4096,
# bf16 experts, 768 rows an expert): this pair 981 us against 1774 on the generic 64 x 64 x 64 tile,
# the same outputs (BK stays 64); GEMM2 alone 1078 at BN 256, GEMM1 alone 1677
DENSE_MOE_TILES: dict[str, tuple[int, ...]] = {"gemm1": (256, 64, 8, 3), "gemm2": (256, 64, 4, 3)}


def _tiles_env(name: str) -> dict[str, tuple[int, ...]] | None:
    """{"gemm1": tile, "gemm2": tile} from a variable holding "BN,BK,warps,stages;BN,BK,warps,stages"."""
    text = os.environ.get(name, "")
    if not text:
        return None
    try:
        tiles = [tuple(int(v) for v in t.split(",")) for t in text.split(";")]
    except ValueError:
        tiles = []
    if len(tiles) != 2 or any(len(t) != 4 or min(t) <= 0 for t in tiles):
        raise ValueError(f"{name}={text!r}: give GEMM1's and GEMM2's tiles as 'BN,BK,warps,stages;BN,BK,warps,"
                         f"stages' (positive integers), e.g. '128,64,8,3;256,64,8,3', or unset it")
    return dict(zip(("gemm1", "gemm2"), tiles))


DENSE_MOE_TILES = _tiles_env("SHUILI_NVIDIA_DENSE_MOE_TILES") or DENSE_MOE_TILES
# the row tile of those launches (the tile map's, so both GEMMs'), where group_bm gives MAX_BM: 128
# rows with 48-64 KB of operands a stage fit three stages; DENSE_MOE_TILES' 256 columns at 128 rows
# would hold 256 float32 accumulators a thread, so 128 goes with narrower tiles
# (benchmarks/nvidia_qgemm.py --moe-dense-configs times the pairs)
DENSE_MOE_BM = int(os.environ.get("SHUILI_NVIDIA_DENSE_MOE_BM", str(MAX_BM)))
# those launches' weight tiles by TMA (host-side tensor descriptors: the copy engine fetches each
# [BN, BK] tile, where the pointer loads had every thread compute addresses and issue cp.async; the
# gathered activation rows stay cp.async, Hopper's TMA has no row gather). The same values reach the
# same dots. Off until a GPU has timed it: no GPU was lent to the session that wrote it
DENSE_MOE_TMA = os.environ.get("SHUILI_NVIDIA_DENSE_MOE_TMA", "0") == "1"
# bf16 activations decode mxfp4 weights with quant.e2m1_bf16_x8 (PTX byte permutes, bf16 multiplies) on
# the GPU: the same bits as the float32 decode (quant.e2m1_x8), which SHUILI_NVIDIA_ASM_E2M1=0 and the
# interpreter take. On an H100 (2026-12-06, nvidia_qgemm.py --asm-ab) the MoE at T1 1.15x, T16 1.05x,
# T64 and T256 even: the loop's instructions fell by a quarter, and only the smallest batches were
# bound by them
ASM_E2M1 = os.environ.get("SHUILI_NVIDIA_ASM_E2M1", "1") == "1"
# mxfp4 against bf16 activations in tiles under 64 rows: 1 dots the even-K and odd-K halves (the
# activations split into even and odd columns by byte permutes), 0 dots the tile in K order (each
# MMA's activation fragment then gathered by register moves). The same values summed in another
# order, so other bits. Compiled for sm_90 (benchmarks/qgemm_sass.py), the halves take fewer
# instructions a K step (MoE GEMM1 at 16 x 32 x 64: 203 against 252); nvidia_qgemm.py --korder-ab
# times the two
MXFP4_BF16_EVEN_ODD = os.environ.get("SHUILI_NVIDIA_MXFP4_BF16_EVEN_ODD", "1") == "1"
# float32 activations (IEEE dots, FMA on CUDA cores) take K in steps of 32: at 128 the operand
# tiles spill by kilobytes per thread
F32_BK = 32


# ------------------------------------------------------------------------------------ weight tiles
@triton.jit
def _to_bf16(v):
    """float32 -> bfloat16 by taking the high half of the bits: exact for values with at most 8
    significant bits (dequantized e2m1: 2), subnormals included, with no rounding conversion to
    trust (the interpreter's cast flushes bf16 subnormals)."""
    return (v.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mxfp4_tile(w_ptr, s_ptr, e, cols, cok, k0, k_hi, s_we, s_wn, s_se, s_sn, s_sg, BN: tl.constexpr,
                BK: tl.constexpr, BF16: tl.constexpr, EVEN_ODD: tl.constexpr):
    """Weight tile of an mxfp4 weight: float32 (exact) as its even-K and odd-K halves [BN, BK / 2]
    (low and high nibbles); BF16 (quant.e2m1_bf16_x8, GPU only): bf16, the halves if EVEN_ODD, else
    [BN, BK] in K order, twice.
    The bytes load as int32 words [BN, BK/32, 4]: the 32-element scale group is an axis, so one e8m0
    byte per group broadcasts in registers. Byte strides are multiples of 4 and the data 4-byte aligned
    (_weight_args)."""
    G: tl.constexpr = BK // 32
    gi = tl.arange(0, G)
    jj = tl.arange(0, 4)
    gk = k0 + gi * 32  # first K of each scale group; K and every chunk bound are multiples of 32
    gok = cok[:, None] & (gk < k_hi)[None, :]  # [BN, G]
    off = e * (s_we // 4) + cols[:, None, None] * (s_wn // 4) + (gk // 8)[None, :, None] + jj[None, None, :]
    word = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + off, mask=gok[:, :, None], other=0)  # [BN, G, 4]
    sb = tl.load(s_ptr + e * s_se + cols[:, None] * s_sn + (gk // 32)[None, :] * s_sg, mask=gok, other=127)
    if BF16:
        pair = tl.broadcast_to(e8m0_bf16_pair(sb.to(tl.int32))[:, :, None], (BN, G, 4))
        if EVEN_ODD:
            lo, hi = e2m1_bf16_x8(word, pair, True)
            lo = tl.reshape(lo, (BN, BK // 2))
            hi = tl.reshape(hi, (BN, BK // 2))
        else:
            lo, hi = e2m1_bf16_x8(word, pair)
            lo = tl.reshape(lo, (BN, BK))
            hi = lo
    else:
        lo, hi = e2m1_x8(word, sb.to(tl.int32)[:, :, None])
        lo = tl.reshape(lo, (BN, BK // 2))
        hi = tl.reshape(hi, (BN, BK // 2))
    return lo, hi


@triton.jit
def _fp8_tile(w_ptr, e, cols, cok, kk, kok, s_we, s_wn, NATIVE_FP8: tl.constexpr):
    """Weight tile [BN, BK] of e4m3 codes as float32 (exact), unscaled."""
    c = tl.load(w_ptr + e * s_we + cols[:, None] * s_wn + kk[None, :], mask=cok[:, None] & kok[None, :], other=0)
    if NATIVE_FP8:
        v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = e4m3_to_f32(c)
    return v


@triton.jit
def _dot(acc, a, al, w, F32: tl.constexpr, HILO: tl.constexpr, PLANES: tl.constexpr):
    """acc + a @ w^T. F32: float32 operands, IEEE dot. HILO: float32 a against a bf16 weight as two
    bf16 dots (hi + lo parts of a: about 16 of its 24 bits); PLANES: a and al are those parts."""
    wt = tl.trans(w)
    if F32:
        out = tl.dot(a, wt, acc, input_precision="ieee")
    elif HILO:
        hi = a
        lo = al
        if not PLANES:
            hi = a.to(tl.bfloat16)
            lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        out = tl.dot(lo, wt, tl.dot(hi, wt, acc))
    else:
        out = tl.dot(a, wt, acc)
    return out


@triton.jit
def _k_step(acc, a, al, ae, ao, ale, alo, w_ptr, s_ptr, e, cols, cok, k0, k_hi, s_we, s_wn, s_se, s_sn,
            s_sg, FMT: tl.constexpr, F32: tl.constexpr, HILO: tl.constexpr, PLANES: tl.constexpr,
            NATIVE_FP8: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            EVEN_ODD: tl.constexpr, ASM_E2M1: tl.constexpr, wd, c0, DESC: tl.constexpr):
    """acc + a @ W[e, cols, k0:k0+BK]^T (al: a's lo part, see _dot). EVEN_ODD (mxfp4, float32 dots):
    as ae @ W_even^T + ao @ W_odd^T, where ae, ao [BM, BK/2] are a's even and odd columns (ale, alo:
    al's). DESC (dense): the tile by the tensor descriptor wd over the weight as [E * N, K] rows, from
    row e * N + c0 (c0 = cols' first); rows past the expert's N are another expert's or zeros, in
    columns never stored, and K past the weight's end loads as zeros."""
    wt = a.dtype
    if HILO:
        wt = tl.bfloat16
    if FMT == 0:  # dense (dequant.dense's copy at many rows): the tile as it lies
        if DESC:
            w = wd.load([(e * (s_we // s_wn) + c0).to(tl.int32), k0])
        else:
            kk = k0 + tl.arange(0, BK)
            wok = cok[:, None] & (kk < k_hi)[None, :]
            w = tl.load(w_ptr + e * s_we + cols[:, None] * s_wn + kk[None, :], mask=wok, other=0.0)
        out = _dot(acc, a, al, w.to(wt), F32, HILO, PLANES)
    elif FMT == 1:
        kk = k0 + tl.arange(0, BK)
        w = _fp8_tile(w_ptr, e, cols, cok, kk, kk < k_hi, s_we, s_wn, NATIVE_FP8).to(wt)
        sc = tl.load(s_ptr + e * s_se + (cols // 128) * s_sn + (k0 // 128) * s_sg, mask=cok, other=0.0)
        part = _dot(tl.zeros([BM, BN], tl.float32), a, al, w, F32, HILO, PLANES)
        out = acc + part * sc[None, :]
    else:
        asm: tl.constexpr = wt == tl.bfloat16 and ASM_E2M1
        lo, hi = _mxfp4_tile(w_ptr, s_ptr, e, cols, cok, k0, k_hi, s_we, s_wn, s_se, s_sn, s_sg, BN, BK, asm,
                             EVEN_ODD)
        if wt == tl.bfloat16 and not asm:
            lo = _to_bf16(lo)
            hi = _to_bf16(hi)
        if EVEN_ODD:
            out = _dot(_dot(acc, ae, ale, lo.to(wt), F32, HILO, PLANES), ao, alo, hi.to(wt), F32, HILO, PLANES)
        elif asm:
            out = _dot(acc, a, al, lo, F32, HILO, PLANES)  # lo is the whole tile, in K order
        else:
            w = tl.reshape(tl.join(lo, hi), (BN, BK))  # low nibble = even K
            out = _dot(acc, a, al, w.to(wt), F32, HILO, PLANES)
    return out


# ------------------------------------------------------------------------------------------ kernel
@triton.jit
def _qgemm_kernel(x_ptr, xi_ptr, w_ptr, s_ptr, b_ptr, y_ptr, yi_ptr, yw_ptr, te_ptr, t0_ptr, t1_ptr,
                  M, N, K, KC, UP, TOPK, s_xm, s_ym, s_we, s_wn, s_se, s_sn, s_sg, s_plane, limit,
                  FMT: tl.constexpr, GROUPED: tl.constexpr, X_IDX: tl.constexpr, Y_IDX: tl.constexpr,
                  HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
                  F32: tl.constexpr, HILO: tl.constexpr, PLANES: tl.constexpr, NATIVE_FP8: tl.constexpr,
                  ASM_E2M1: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, DIAG: tl.constexpr = False, BF16_EVEN_ODD: tl.constexpr = False, wd=None,
                  DESC: tl.constexpr = False):
    """y[rows, cols] = x[rows] @ W[e, cols]^T over K chunk program_id(2).
    GROUPED: program_id(0) indexes the tile map (group, first row, end row; group -1 = unused).
    DIAG (with GROUPED, no tile map): block diagonal, M rows in every group; program_id(0) is
    group e's row tile, its rows read x's columns [e*K, (e+1)*K) and write y's (and the partials')
    [e*N, (e+1)*N), whose row stride is s_ym.
    X_IDX: row r reads x[xi[r] // TOPK]. SWIGLU: N is I; also computes columns cols + UP and stores
    silu(min(g, limit)) * clamp(u, -limit, limit). Y_IDX: row r is stored, times yw[yi[r]], at row
    yi[r] of y. SPLIT > 1: float32 partials [SPLIT, M, N] into y. PLANES: float32 values travel as
    bf16 hi and lo parts s_plane elements apart; SWIGLU stores its output so, HILO reads x so.
    DESC (dense weights): the weight tiles come through the tensor descriptor wd (see _k_step)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED and DIAG:
        tpg = tl.cdiv(M, BM)
        e = pid_m // tpg
        r0 = (pid_m % tpg) * BM
        r1 = M
    elif GROUPED:
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
    if X_IDX:
        src = tl.load(xi_ptr + rows, mask=rok, other=0).to(tl.int64) // TOPK
    else:
        src = rows.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    cok = cols < N
    if DIAG:  # group e's columns of x, and of y and the partials
        x_ptr += e * K
        y_ptr += e * N
    acc = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    k_lo = tl.program_id(2) * KC
    k_hi = tl.minimum(k_lo + KC, K)
    # float32 dots below 64 rows take mxfp4 as two dots over the even and odd K: the operand layout
    # then holds each thread's nibbles in its own registers (the K-order interleave cost register
    # moves). bf16 dots do so with BF16_EVEN_ODD (see MXFP4_BF16_EVEN_ODD), else take the tile in K
    # order (the PTX decode pairs K-adjacent codes; the float32 decode's halves interleave back)
    EVEN_ODD: tl.constexpr = FMT == 2 and BM < 64 and (F32 or BF16_EVEN_ODD)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        xo = src[:, None] * s_xm + kk[None, :]
        xok = rok[:, None] & (kk < k_hi)[None, :]
        a = tl.load(x_ptr + xo, mask=xok, other=0.0)
        al = a
        if HILO and PLANES:
            al = tl.load(x_ptr + s_plane + xo, mask=xok, other=0.0)
        ae = a
        ao = a
        ale = al
        alo = al
        if EVEN_ODD:
            ae, ao = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
            if HILO and PLANES:
                ale, alo = tl.split(tl.reshape(al, (BM, BK // 2, 2)))
        acc = _k_step(acc, a, al, ae, ao, ale, alo, w_ptr, s_ptr, e, cols, cok, k0, k_hi, s_we, s_wn, s_se,
                      s_sn, s_sg, FMT, F32, HILO, PLANES, NATIVE_FP8, BM, BN, BK, EVEN_ODD, ASM_E2M1, wd,
                      pid_n * BN, DESC)
        if SWIGLU:
            acc_u = _k_step(acc_u, a, al, ae, ao, ale, alo, w_ptr, s_ptr, e, cols + UP, cok, k0, k_hi, s_we,
                            s_wn, s_se, s_sn, s_sg, FMT, F32, HILO, PLANES, NATIVE_FP8, BM, BN, BK, EVEN_ODD,
                            ASM_E2M1, wd, pid_n * BN + UP, DESC)
    ok = rok[:, None] & cok[None, :]
    if SPLIT > 1:
        ps = N
        if DIAG:
            ps = s_ym
        part = y_ptr + tl.program_id(2).to(tl.int64) * M * ps
        tl.store(part + rows[:, None].to(tl.int64) * ps + cols[None, :], acc, mask=ok)
    else:
        if SWIGLU:
            g = acc
            u = acc_u
            if HAS_LIMIT:
                g = tl.minimum(g, limit)
                u = tl.minimum(tl.maximum(u, -limit), limit)
            acc = g / (1.0 + tl.exp(-g)) * u
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cok, other=0.0).to(tl.float32)[None, :]
        if Y_IDX:
            dst = tl.load(yi_ptr + rows, mask=rok, other=0).to(tl.int64)
            acc = acc * tl.load(yw_ptr + dst, mask=rok, other=0.0)[:, None]
        else:
            dst = rows.to(tl.int64)
        yo = dst[:, None] * s_ym + cols[None, :]
        if SWIGLU and PLANES:
            # the split _dot does per K step when it reads float32, done once here (same bits)
            hi = acc.to(tl.bfloat16)
            tl.store(y_ptr + yo, hi, mask=ok)
            tl.store(y_ptr + s_plane + yo, (acc - hi.to(tl.float32)).to(tl.bfloat16), mask=ok)
        else:
            tl.store(y_ptr + yo, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_kernel(p_ptr, y_ptr, D, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """y[t] = sum_j p[t * TOPK + j] in increasing j (p already holds weight x expert output)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < D
    acc = tl.load(p_ptr + t * TOPK * D + c, mask=ok, other=0.0)
    for j in tl.static_range(1, TOPK):
        acc += tl.load(p_ptr + (t * TOPK + j) * D + c, mask=ok, other=0.0)
    tl.store(y_ptr + t * D + c, acc.to(y_ptr.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------- host side
def supports(w: Weight) -> bool:
    """The quantized formats these kernels serve; a dense weight comes only through moe_experts (many
    rows in default mode, the dequantized copy: dequant.py)."""
    return w.format in FMT_ID and w.format != "dense"


def _weight_args(w: Weight, grouped: bool):
    """(data, scale, expert stride, row stride, scale expert stride, scale row stride, scale group
    stride). The scale is read through its strides, so a scale in another layout (mxfp4's
    K-group-major, a [E, K/32, N] tensor seen as [E, N, K/32]) needs no copy."""
    if w.format == "dense":
        data = w.data.contiguous()
        if grouped and data.dim() != 3:
            raise ValueError(f"grouped weights are [E, N, K]; got data {tuple(data.shape)}")
        return data, data, data.stride(0) if grouped else 0, data.stride(-2), 0, 0, 0
    data = as_u8(w.data).contiguous()
    if w.format == "mxfp4" and data.data_ptr() % 4:
        data = data.clone()  # the kernel reads 4-byte words (a view at an odd offset)
    if grouped and data.dim() != 3:
        raise ValueError(f"grouped weights are [E, N, ...]; got data {tuple(data.shape)}")
    scale = w.scale
    if w.format.startswith("fp8") and scale.dtype != torch.float32:  # fp8_block32: dequant.py reads it
        scale = scale.float()
    return (data, scale, data.stride(0) if grouped else 0, data.stride(-2),
            scale.stride(0) if grouped else 0, scale.stride(-2), scale.stride(-1))


def tiles_for(m: int, fmt: str, batch_invariant: bool) -> tuple[int, int, int]:
    """(BM, BN, BK). Default mode: the row tile covers M (up to MAX_BM), so the weight is read and
    dequantized once per M tile; batch-invariant mode: one tile for every M."""
    if batch_invariant:
        return BI_TILE
    return min(MAX_BM, pow2(m, 16)), BN_DEFAULT, BK_OF[fmt]


def split_for(programs: int, k: int, bk: int, want_programs: int) -> tuple[int, int]:
    """(splits, K per split): cut K into chunks (multiples of bk, at least MIN_KC) until about
    want_programs programs stream the weight."""
    if programs >= want_programs or k < 2 * MIN_KC:
        return 1, k
    want = min(cdiv(want_programs, programs), k // MIN_KC)
    kc = cdiv(cdiv(k, want), bk) * bk
    return cdiv(k, kc), kc


def bi_split(n: int, k: int, groups: int = 1) -> tuple[int, int]:
    """Batch-invariant split: from the weight's shape alone, never from M."""
    return split_for(cdiv(n, BI_TILE[1]) * groups, k, BI_TILE[2], BI_MIN_PROGRAMS)


def _launch(x, w: Weight, y, *, bias=None, tiles=None, xi=None, topk=1, yi=None, yw=None, swiglu=False,
            limit=None, hilo=False, batch_invariant=False, bm=None, plane=0, tile=None, diag=False, desc=False):
    """One qgemm launch (plus the ordered split-K sum where K is split). Returns y. plane > 0: the
    SwiGLU output (y) or the hi/lo input (x) is bf16 hi and lo planes that many elements apart.
    desc: a dense grouped weight's tiles through a TMA tensor descriptor (_tma_weight), where it can.
    tile: (BN, BK, warps, stages[, maxnreg]) in place of the defaults. diag: block diagonal (x
    [M, G*K], y [M, G*N]), launched as the grouped GEMM of the G*M rows regrouped by block."""
    m, k = x.shape[0], w.shape[-1]
    grouped = tiles is not None or diag
    n = w.shape[-2] // 2 if swiglu else w.shape[-2]
    data, scale, s_we, s_wn, s_se, s_sn, s_sg = _weight_args(w, grouped)
    bm0, bn, bk = tiles_for(m, w.format, batch_invariant)
    bm = bm or bm0
    warps, stages = NUM_WARPS or (4 if bm <= 16 else 8), NUM_STAGES or (4 if bm <= 16 else 3)
    regs = {}
    if tile is not None:
        bn, bk, warps, stages = tile[:4]
        regs = {"maxnreg": tile[4]} if len(tile) > 4 and not interpreting() else {}
        if w.format == "fp8_block128" and 128 % bk:
            raise ValueError(f"qgemm tile {tile}: fp8_block128 needs a BK dividing 128 (one scale per K step)")
        if w.format == "mxfp4" and bk < 64 and (x.dtype != torch.float32 or hilo):
            # one scale group a step: on an H100 (2026-12-06, nvidia_qgemm.py --sweep-moe) both MoE GEMMs
            # gave wrong values (rel err 1.0-1.5) with bf16 operands; the interpreter's are right
            raise ValueError(f"qgemm tile {tile}: mxfp4 with bf16 operands needs BK >= 64")
    if x.dtype == torch.float32 and not hilo:
        bk = F32_BK
    if diag:
        te = t0 = t1 = x
        groups = w.shape[0]
        nt = groups * cdiv(m, bm)
    elif grouped:
        te, t0, t1, nt = tiles
        groups = w.shape[0]
    else:
        te = t0 = t1 = x
        nt = cdiv(m, bm)
        groups = 1
    if swiglu or yi is not None:
        split, kc = 1, k  # their epilogues need the whole sum
    elif batch_invariant:
        split, kc = bi_split(n, k, groups)
    else:
        rows = m * groups if diag else m  # the grouped GEMM's rows
        split, kc = split_for(cdiv(n, bn) * (min(groups, rows) if grouped else nt), k, bk, MIN_PROGRAMS)
    out = y if split == 1 else torch.empty(split, m, n * groups if diag else n, dtype=torch.float32,
                                           device=x.device)
    f32 = x.dtype == torch.float32 and not hilo
    wd = _tma_weight(data, bn, bk) if desc and w.format == "dense" and grouped and split == 1 else None
    _qgemm_kernel[(nt, cdiv(n, bn), split)](
        x, xi if xi is not None else x, data, scale, bias if bias is not None else x, out,
        yi if yi is not None else x, yw if yw is not None else x, te, t0, t1,
        m, n, k, kc, n, topk, x.stride(0), y.stride(0), s_we, s_wn, s_se, s_sn, s_sg, plane,
        float(limit) if limit is not None else 0.0,
        FMT=FMT_ID[w.format], GROUPED=grouped, X_IDX=xi is not None, Y_IDX=yi is not None,
        HAS_BIAS=bias is not None, SWIGLU=swiglu, HAS_LIMIT=limit is not None, F32=f32, HILO=hilo,
        PLANES=plane > 0, NATIVE_FP8=not interpreting(),
        ASM_E2M1=ASM_E2M1 and not interpreting(), SPLIT=split, BM=bm, BN=bn, BK=bk, DIAG=diag,
        BF16_EVEN_ODD=MXFP4_BF16_EVEN_ODD, wd=wd, DESC=wd is not None, num_warps=warps, num_stages=stages,
        **regs)
    if split > 1:
        splitk.split_sum(out, bias, y)
    return y


def _tma_weight(data: torch.Tensor, bn: int, bk: int):
    """A host-side TMA descriptor over a contiguous [E, N, K] weight seen as [E * N, K] rows, [bn, bk]
    tiles; None where TMA cannot take it (K * itemsize not a multiple of 16 bytes, an unaligned
    base, a tile side over 256 or not a power of two)."""
    e, n, k = data.shape
    ok = (data.is_contiguous() and (k * data.element_size()) % 16 == 0 and data.data_ptr() % 16 == 0
          and bn <= 256 and bk <= 256 and bn == pow2(bn) and bk == pow2(bk) and e * n < 2 ** 31)
    return TensorDescriptor.from_tensor(data.view(e * n, k), [bn, bk]) if ok else None


def linear(x2: torch.Tensor, w: Weight, bias, y: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """x2 [M, K] contiguous, y [M, N] preallocated (M, N > 0)."""
    return _launch(x2, w, y, bias=bias, batch_invariant=batch_invariant)


def grouped(x, w: Weight, tiles, y, batch_invariant: bool, hilo: bool, bm: int) -> torch.Tensor:
    return _launch(x, w, y, tiles=tiles, hilo=hilo, batch_invariant=batch_invariant, bm=bm)


def block_diagonal(x, w: Weight, y, batch_invariant: bool) -> torch.Tensor:
    """x [T, G*K] contiguous, y [T, G*N]: grouped()'s launch for the T*G rows regrouped by block,
    with its tiles, split and bits, reading and writing each block where it lies (no regrouping
    copies, no tile map: every group has T rows)."""
    bm = group_bm(x.shape[0] * w.shape[0], w.shape[0], batch_invariant)
    return _launch(x, w, y, batch_invariant=batch_invariant, bm=bm, diag=True)


def group_bm(m: int, e: int, batch_invariant: bool) -> int:
    """Row tile of a grouped GEMM: by rows per group (decode: a few rows per expert)."""
    return BI_GROUP_BM if batch_invariant else min(64, pow2(cdiv(m, max(e, 1)), 16))


def moe_experts(x, topk_ids, topk_weights, w13: Weight, w2: Weight, swiglu_limit, batch_invariant):
    """Routed experts, both weights quantized (see the module docstring); moe_prep gives the rows'
    stable order by expert and the device-side tile map."""
    t, k = topk_ids.shape
    e, d = w13.shape[0], x.shape[1]
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if t == 0 or d == 0:
        return out.zero_()
    flat = topk_ids.reshape(-1).to(torch.int64)
    check(flat, in_range(0, e), f"moe_experts: topk_ids must lie in [0, {e})")
    bm = group_bm(t * k, e, batch_invariant)
    if batch_invariant:
        tiles_of = {}
    else:
        dense_bf16 = w13.format == "dense" and x.dtype == torch.bfloat16  # float32 tiles need 2x the smem
        tiles_of = MOE_TILES if bm == 16 else DENSE_MOE_TILES if dense_bf16 else {}
        if dense_bf16 and bm == MAX_BM:
            bm = DENSE_MOE_BM
    desc = not batch_invariant and w13.format == "dense" and x.dtype == torch.bfloat16 and DENSE_MOE_TMA
    order, _, tiles = moe_prep(flat, e, bm)
    tile1, tile2 = tiles_of.get("gemm1"), tiles_of.get("gemm2")
    inter = w13.shape[1] // 2
    hilo = x.dtype != torch.float32
    if hilo:
        # GEMM2 dots the float32 intermediate as bf16 hi + lo parts; GEMM1 stores them, so GEMM2's
        # programs (one per column tile, each reading all of it) do not split it every K step
        planes = torch.empty(2, t * k, inter, dtype=torch.bfloat16, device=x.device)
        a, plane = planes[0], planes.stride(0)
    else:
        a, plane = torch.empty(t * k, inter, dtype=torch.float32, device=x.device), 0
    _launch(x.contiguous(), w13, a, tiles=tiles, xi=order, topk=k, swiglu=True, limit=swiglu_limit,
            batch_invariant=batch_invariant, bm=bm, plane=plane, tile=tile1, desc=desc)
    parts = torch.empty(t * k, d, dtype=torch.float32, device=x.device)
    _launch(a, w2, parts, tiles=tiles, yi=order, yw=topk_weights.float().reshape(-1).contiguous(),
            hilo=hilo, batch_invariant=batch_invariant, bm=bm, plane=plane, tile=tile2, desc=desc)
    block = min(1024, pow2(d))
    _combine_kernel[(t, cdiv(d, block))](parts, out, d, TOPK=k, BLOCK=block)
    return out
