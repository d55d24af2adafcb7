"""RMSNorm (plain and fused with the residual add) and rotary embedding: one program per row, the
row's reduction over a fixed-size block, so every row is computed the same way in any batch."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import pow2
from shuili.platforms.reference.public import check_rope_args


@triton.jit
def _rstd(xf, D, eps):
    """1 / rms of a row's float32 values xf [BLOCK] (zeros past D)."""
    return 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / D + eps)


@triton.jit
def _normed(xf, rstd, w_ptr, off, ok, HAS_W: tl.constexpr):
    """The norm's per-element value at channels off: xf * rstd, times the weight. One expression for
    rms_norm and rms_norm_rope, whose bits must agree."""
    y = xf * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + off, mask=ok, other=0.0).to(tl.float32)
    return y


@triton.jit
def _rms_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, D, eps, BLOCK: tl.constexpr,
                HAS_W: tl.constexpr, HAS_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < D
    x = tl.load(x_ptr + row * D + c, mask=ok, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + row * D + c, mask=ok, other=0.0)
        tl.store(s_ptr + row * D + c, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = _rstd(xf, D, eps)
    y = _normed(xf, rstd, w_ptr, c, ok, HAS_W)
    tl.store(y_ptr + row * D + c, y.to(y_ptr.dtype.element_ty), mask=ok)


def _norm(x, residual, weight, eps):
    shape = x.shape
    d = shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    y = torch.empty_like(x2)
    s = torch.empty_like(x2) if residual is not None else y
    r2 = residual.reshape(-1, d).contiguous() if residual is not None else x2
    if x2.shape[0]:
        _rms_kernel[(x2.shape[0],)](x2, r2, weight if weight is not None else x2, y, s, d, float(eps),
                                    BLOCK=pow2(d), HAS_W=weight is not None,
                                    HAS_R=residual is not None, num_warps=4 if d <= 4096 else 8)
    return y.view(shape), s.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x, residual, weight, eps):
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    return _norm(x, residual.to(x.dtype), weight, eps)


@triton.jit
def _pairs(D, R, HALF, HP: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(i, i < HALF, channel a, channel b) of the rotation's HP (padded) pairs in the last R of D
    channels: (2i, 2i + 1) interleaved, else (i, i + HALF), offset by D - R."""
    i = tl.arange(0, HP)
    if INTERLEAVED:
        ia = D - R + 2 * i
        ib = ia + 1
    else:
        ia = D - R + i
        ib = ia + HALF
    return i, i < HALF, ia, ib


@triton.jit
def _rotate(a, b, cs, sn):
    """Pair (a, b) rotated by the angle of (cs, sn): one expression for rope and rms_norm_rope."""
    return a * cs - b * sn, a * sn + b * cs


@triton.jit
def _split_pairs(v, BH: tl.constexpr, HP: tl.constexpr):
    """v [BH, 2 HP], interleaved pairs in contiguous channels -> (a, b) [BH, HP]. Loading the rope
    channels as one run and splitting them in registers: an H100's ncu (2026-12-08) found the
    rotation bound by the L2's request rate with every other 2-byte channel loaded and stored alone
    (71-81% L2 throughput, 6-9% DRAM)."""
    return tl.split(tl.reshape(v, (BH, HP, 2)))


@triton.jit
def _join_pairs(a, b, BH: tl.constexpr, HP: tl.constexpr):
    """_split_pairs undone: (a, b) [BH, HP] -> [BH, 2 HP] interleaved."""
    return tl.reshape(tl.join(a, b), (BH, 2 * HP))


@triton.jit
def _rope_kernel(x_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, H, D, R, HALF, HP: tl.constexpr,
                 BH: tl.constexpr, BD: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
                 COPY: tl.constexpr = True):
    """Token t's heads BH*q .. of x [T, H, D]. COPY=False: y is x (rotated in place), so the
    pass-through channels are left where they lie."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hok = h < H
    base = x_ptr + t * H * D + h[:, None] * D
    obase = y_ptr + t * H * D + h[:, None] * D
    if COPY:
        c = tl.arange(0, BD)
        keep = hok[:, None] & (c[None, :] < D - R)
        tl.store(obase + c[None, :], tl.load(base + c[None, :], mask=keep), mask=keep)
    i, iok, ia, ib = _pairs(D, R, HALF, HP, INTERLEAVED)
    p = tl.load(pos_ptr + t)
    cs = tl.load(cos_ptr + p * HALF + i, mask=iok, other=0.0)[None, :]
    sn = tl.load(sin_ptr + p * HALF + i, mask=iok, other=0.0)[None, :]
    if INVERSE:
        sn = -sn
    if INTERLEAVED:
        c2 = D - R + tl.arange(0, 2 * HP)
        m2 = hok[:, None] & (c2 < D)[None, :]
        v = tl.load(base + c2[None, :], mask=m2, other=0.0).to(tl.float32)
        a, b = _split_pairs(v, BH, HP)
        ya, yb = _rotate(a, b, cs, sn)
        out = _join_pairs(ya.to(y_ptr.dtype.element_ty), yb.to(y_ptr.dtype.element_ty), BH, HP)
        tl.store(obase + c2[None, :], out, mask=m2)
    else:
        m = hok[:, None] & iok[None, :]
        a = tl.load(base + ia[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(base + ib[None, :], mask=m, other=0.0).to(tl.float32)
        ya, yb = _rotate(a, b, cs, sn)
        tl.store(obase + ia[None, :], ya.to(y_ptr.dtype.element_ty), mask=m)
        tl.store(obase + ib[None, :], yb.to(y_ptr.dtype.element_ty), mask=m)


def rope(x, positions, cos, sin, rope_dim, interleaved=True, inverse=False, *, may_overwrite=False):
    t, d, half = check_rope_args(x, cos, sin, rope_dim)
    h = x.shape[1]
    fresh = not x.is_contiguous()
    x = x.contiguous()
    # in place, the rotated channels alone are read and written: for V4's attention output 64 of
    # 512, an eighth of the copy's traffic
    inplace = may_overwrite or fresh
    y = x if inplace else torch.empty_like(x)
    if t:
        bh = min(pow2(h), 16)
        _rope_kernel[(t, triton.cdiv(h, bh))](
            x, y, positions.contiguous(), cos.float().contiguous(), sin.float().contiguous(), h, d,
            rope_dim, half, HP=pow2(half), BH=bh, BD=pow2(d), INTERLEAVED=interleaved, INVERSE=inverse,
            COPY=not inplace)
    return y


@triton.jit
def _rms_rope_kernel(x_ptr, w_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, N, H, D, R, HALF, eps,
                     BLOCK: tl.constexpr, HP: tl.constexpr, HAS_W: tl.constexpr, INTERLEAVED: tl.constexpr,
                     RB: tl.constexpr = 1):
    """Rows RB*p .. RB*p + RB - 1 (row = t * H + h) of x [T, H, D] (16-bit), N = T * H rows: each
    _rms_kernel's norm (the same reduction, so the same bits), stored rounded to y's dtype, then
    _rope_kernel's rotation of the last R channels from those rounded values: the two ops' bits in
    one launch (checked on an H100 for bf16 rows; float32 rows take the two kernels, see
    rms_norm_rope). The rope channels are normalised again from their own loads (elementwise, the
    same expression), so no value crosses threads."""
    c = tl.arange(0, BLOCK)
    i, iok, ia, ib = _pairs(D, R, HALF, HP, INTERLEAVED)
    c2 = D - R + tl.arange(0, 2 * HP)
    for j in tl.static_range(RB):
        row = tl.program_id(0).to(tl.int64) * RB + j
        live = c * 0 + row < N  # a vector compare: the interpreter masks with no 0-d bool
        ok = (c < D) & live
        x = tl.load(x_ptr + row * D + c, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        rstd = _rstd(xf, D, eps)
        y = _normed(xf, rstd, w_ptr, c, ok, HAS_W)
        keep = (c < D - R) & live
        tl.store(y_ptr + row * D + c, y.to(y_ptr.dtype.element_ty), mask=keep)
        p = tl.load(pos_ptr + tl.minimum(row, N - 1) // H)  # a row past N stores nothing
        cs = tl.load(cos_ptr + p * HALF + i, mask=iok, other=0.0)
        sn = tl.load(sin_ptr + p * HALF + i, mask=iok, other=0.0)
        if INTERLEAVED:
            ok2 = (c2 < D) & (c2 * 0 + row < N)
            v = tl.load(x_ptr + row * D + c2, mask=ok2, other=0.0).to(tl.float32)
            v = _normed(v, rstd, w_ptr, c2, ok2, HAS_W).to(y_ptr.dtype.element_ty).to(tl.float32)
            a, b = _split_pairs(v[None, :], 1, HP)
            ya, yb = _rotate(a, b, cs[None, :], sn[None, :])
            out = _join_pairs(ya.to(y_ptr.dtype.element_ty), yb.to(y_ptr.dtype.element_ty), 1, HP)
            tl.store(y_ptr + row * D + c2[None, :], out, mask=ok2[None, :])
        else:
            pok = iok & (i * 0 + row < N)
            xa = tl.load(x_ptr + row * D + ia, mask=pok, other=0.0).to(tl.float32)
            xb = tl.load(x_ptr + row * D + ib, mask=pok, other=0.0).to(tl.float32)
            a = _normed(xa, rstd, w_ptr, ia, pok, HAS_W)
            b = _normed(xb, rstd, w_ptr, ib, pok, HAS_W)
            a = a.to(y_ptr.dtype.element_ty).to(tl.float32)
            b = b.to(y_ptr.dtype.element_ty).to(tl.float32)
            ya, yb = _rotate(a, b, cs, sn)
            tl.store(y_ptr + row * D + ia, ya.to(y_ptr.dtype.element_ty), mask=pok)
            tl.store(y_ptr + row * D + ib, yb.to(y_ptr.dtype.element_ty), mask=pok)


# rows a program normalises and rotates in rms_norm_rope's one launch, from NORM_ROPE_MIN_ROWS rows
# (a prefill's q; a decode step's rows stay one a program, its launches being short). On an H100
# (2026-12-08, nvidia_kernels.py, V4's q at 8,192 tokens, the kernel before its contiguous rope loads)
# 4 rows took 120.6 us, 1 and 16 rows 143; not yet timed with those loads.
# SHUILI_NVIDIA_NORM_ROPE_ROWS is for the benchmark's A/B; each row's math, so its bits, never change
NORM_ROPE_ROWS = int(os.environ.get("SHUILI_NVIDIA_NORM_ROPE_ROWS", "4"))
NORM_ROPE_MIN_ROWS = 16384


def rms_norm_rope(x, weight, eps, positions, cos, sin, rope_dim, interleaved=True):
    t, d, half = check_rope_args(x, cos, sin, rope_dim)
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"rms_norm_rope: weight {tuple(weight.shape)} must be [{d}] (the head dim)")
    if x.dtype == torch.float32:
        # float32 rows are not rounded between the norm and the rotation, so the compiler sees the
        # normalised values as products and fuses the rotation's other product into an FMA (sm_90,
        # Triton 3.6: a s + b c became fma(b, c, a s), rope's is fma(a, s, b c)); the two kernels
        # keep rope's bits (a GPU run of 2026-12-07 found the one-launch kernel off in float32 only)
        return rope(rms_norm(x, weight, eps), positions, cos, sin, rope_dim, interleaved)
    return _fused(x, weight, eps, positions, cos, sin, rope_dim, interleaved)


def _fused(x, weight, eps, positions, cos, sin, rope_dim, interleaved):
    t, h, d = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    if t * h:
        rb = NORM_ROPE_ROWS if t * h >= NORM_ROPE_MIN_ROWS else 1
        _rms_rope_kernel[(triton.cdiv(t * h, rb),)](
            x, weight if weight is not None else x, y, positions.contiguous(), cos.float().contiguous(),
            sin.float().contiguous(), t * h, h, d, rope_dim, rope_dim // 2, float(eps), BLOCK=pow2(d),
            HP=pow2(rope_dim // 2), HAS_W=weight is not None, INTERLEAVED=interleaved, RB=rb,
            num_warps=4 if d <= 4096 else 8)
    return y
