"""Quantized weights decoded once into a dense bf16 (or float32) copy, for the GEMMs of many rows.

Per-tile decode (qgemm.py) reads each weight byte once per row tile. At decode's few rows that is once
per step, and the decode is nearly free; at prefill's thousands of rows every row tile decodes the
whole weight again and the decode, not the tensor cores, sets the pace (an H100, 2026-12-07,
benchmarks/nvidia_prefill.py: the mxfp4 MoE held 83 of a 171 ms mid-v4 4k prefill). Decoding once
costs one pass at memory speed, and the dense GEMM then runs at tensor-core speed.

Exact: the copy holds the very values the per-tile decode feeds the dot (e2m1 or e4m3 times a power
of two has at most 4 significant bits, so bf16 holds it; qgemm's decode helpers make the float32 and
_to_bf16 keeps subnormals). Only the order of the dot's additions may change, which default mode
allows; batch-invariant mode never comes here (its tile may not depend on M).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shuili.hal.formats import FP8_WEIGHT_BLOCKS, fp8_weight_block
from shuili.hal.types import Weight
from shuili.platforms.nvidia.common import cdiv, interpreting
from shuili.platforms.nvidia.qgemm import _fp8_tile, _mxfp4_tile, _to_bf16, _weight_args

# a dense copy larger than this is not made (the caller keeps the per-tile decode): mid-v4's experts
# take 302 MB a layer in bf16; DeepSeek-V4-Flash's 256 would take 12.9 GB, so only an expert-parallel
# share of them comes here
MAX_BYTES = 1 << 30
BN, BK = 64, 128


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, s_we, s_wn, s_se, s_sn, s_sg, FMT: tl.constexpr,
                    SB: tl.constexpr, BF16: tl.constexpr, NATIVE_FP8: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """out[e, cols, k0:k0+BK] = W[e, cols, k0:k0+BK] decoded; grid (E * n tiles, K tiles)."""
    nt = tl.cdiv(N, BN)
    e = (tl.program_id(0) // nt).to(tl.int64)
    cols = (tl.program_id(0) % nt) * BN + tl.arange(0, BN)
    cok = cols < N
    k0 = tl.program_id(1) * BK
    kk = k0 + tl.arange(0, BK)
    kok = kk < K
    if FMT == 2:
        lo, hi = _mxfp4_tile(w_ptr, s_ptr, e, cols, cok, k0, K, s_we, s_wn, s_se, s_sn, s_sg, BN, BK, False,
                             False)
        v = tl.reshape(tl.join(lo, hi), (BN, BK))  # low nibble = even K
    else:
        v = _fp8_tile(w_ptr, e, cols, cok, kk, kok, s_we, s_wn, NATIVE_FP8)
        sc = tl.load(s_ptr + e * s_se + (cols // SB)[:, None] * s_sn + (kk // SB)[None, :] * s_sg,
                     mask=cok[:, None] & kok[None, :], other=0.0)
        v = v * sc
    at = out_ptr + (e * N + cols[:, None]) * K + kk[None, :]
    ok = cok[:, None] & kok[None, :]
    if BF16:
        tl.store(at, _to_bf16(v), mask=ok)
    else:
        tl.store(at, v, mask=ok)


def supports(w: Weight) -> bool:
    return w.format == "mxfp4" or w.format in FP8_WEIGHT_BLOCKS


def dense_bytes(w: Weight, dtype: torch.dtype) -> int:
    return math.prod(w.shape) * dtype.itemsize


def dense(w: Weight, dtype: torch.dtype = torch.bfloat16) -> Weight:
    """The dense copy of w ([N, K] or grouped [E, N, K]) in bf16 or float32: the values w stands for."""
    if not supports(w):
        raise ValueError(f"dequant.dense: weight format {w.format} is not a quantized format")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dequant.dense: dtype {dtype} (bf16 or float32)")
    grouped = len(w.shape) == 3
    *lead, n, k = w.shape
    e = lead[0] if grouped else 1
    if w.format == "mxfp4" and k % 32:
        raise ValueError(f"mxfp4 weights need K % 32 == 0, got K={k}")
    data, scale, s_we, s_wn, s_se, s_sn, s_sg = _weight_args(w, grouped)
    fp8 = w.format != "mxfp4"
    out = torch.empty(*lead, n, k, dtype=dtype, device=data.device)
    if out.numel():
        _dequant_kernel[(e * cdiv(n, BN), cdiv(k, BK))](
            data, scale, out, n, k, s_we, s_wn, s_se, s_sn, s_sg, FMT=1 if fp8 else 2,
            SB=fp8_weight_block(w.format) if fp8 else 0, BF16=dtype == torch.bfloat16,
            NATIVE_FP8=not interpreting(), BN=BN, BK=BK, num_warps=4)
    return Weight.dense(out)
