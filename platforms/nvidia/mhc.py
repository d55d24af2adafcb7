"""The mHC ops. hc_split_sinkhorn and hc_mix: one program per token computes its coefficients;
hc_mix first adds the partials of skinny.py's split-K float32 GEMM (its norm folded in as the
rows' sums of squares), so the norm, the mixing linear (cuBLAS sgemm + split-K reduce before) and
the Sinkhorn take two launches where a float32 copy, the norm, two cuBLAS kernels and the
Sinkhorn took five. Every tile is fixed: batch-invariant in batch-invariant mode, and in default
mode below skinny.SPLIT3_MIN_ROWS rows (from there, bf16 streams: the tensor-core partials).

hc_collapse and hc_expand: the mHC stream collapse and expand, one program per (token, D tile),
all m streams of the token in registers. As torch glue they were many small elementwise kernels
per layer; as these kernels they took mid-v4's decode step (released formats, batch 64, H200)
from 9.15 to 8.14 ms.
Float32 math in the reference's order (collapse: its pairwise tree over the streams; expand: j =
0, 1, ...) with FMA contraction off, so each product rounds before its add as in the reference;
a row's program never depends on the batch: batch-invariant."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.hal.types import Weight
from shuili.platforms.nvidia import gemm, norm_rope, skinny
from shuili.platforms.nvidia.common import cdiv, pow2
from shuili.platforms.reference.public import check_hc_args, check_hc_mix_args, composed_hc_mix

_TILE = 4096  # values of x per program: [MP, BD]


@triton.jit
def _mix(ptr, t, off, ok, sidx, S, s_t, s_part, r, PARTS: tl.constexpr):
    """Token t's mix at columns off: ptr[t, off], or (PARTS) r times the sum of the partials
    ptr[s, t, off] over s < S (sidx: arange(SP) shaped to broadcast against off, leading)."""
    if PARTS:
        p = tl.load(ptr + sidx * s_part + t * s_t + tl.expand_dims(off, 0),
                    mask=(sidx < S) & tl.expand_dims(ok, 0), other=0.0)
        v = tl.sum(p, axis=0) * r
    else:
        v = tl.load(ptr + t * s_t + off, mask=ok, other=0.0)
    return v


@triton.jit
def _sinkhorn_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps, s_t, s_part, S,
                     K, norm_eps, M: tl.constexpr, MP: tl.constexpr, PARTS: tl.constexpr, SP: tl.constexpr):
    """hc_split_sinkhorn of token t's mix [M(M+2)] (row stride s_t). PARTS (hc_mix): the mix is the
    sum of S partials s_part apart, times 1 / rms of the row, whose partial sums of squares over its
    K values sit in column M(M+2)."""
    t = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = M * (M + 2)
    s = tl.arange(0, SP)
    r = 1.0
    if PARTS:
        ss = tl.sum(tl.load(mix_ptr + s * s_part + t * s_t + W, mask=s < S, other=0.0), axis=0)
        r = 1.0 / tl.sqrt_rn(ss / K + norm_eps)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    i = tl.arange(0, MP)
    iok = i < M
    a = _mix(mix_ptr, t, i, iok, s[:, None], S, s_t, s_part, r, PARTS) * s0 \
        + tl.load(base_ptr + i, mask=iok, other=0.0)
    tl.store(pre_ptr + t * M + i, 1.0 / (1.0 + tl.exp(-a)) + eps, mask=iok)
    b = _mix(mix_ptr, t, M + i, iok, s[:, None], S, s_t, s_part, r, PARTS) * s1 \
        + tl.load(base_ptr + M + i, mask=iok, other=0.0)
    tl.store(post_ptr + t * M + i, 2.0 / (1.0 + tl.exp(-b)), mask=iok)
    rr = tl.arange(0, MP)[:, None]
    c = tl.arange(0, MP)[None, :]
    ok = (rr < M) & (c < M)
    z = _mix(mix_ptr, t, 2 * M + rr * M + c, ok, s[:, None, None], S, s_t, s_part, r, PARTS) * s2 \
        + tl.load(base_ptr + 2 * M + rr * M + c, mask=ok, other=0.0)
    z = tl.where(ok, z, float("-inf"))
    ez = tl.where(ok, tl.exp(z - tl.max(z, axis=1)[:, None]), 0.0)
    den = tl.sum(ez, axis=1)[:, None]
    cm = tl.where(ok, ez / tl.where(den > 0, den, 1.0) + eps, 0.0)
    cm = cm / (tl.sum(cm, axis=0)[None, :] + eps)
    for _ in range(1, iters):
        cm = cm / (tl.sum(cm, axis=1)[:, None] + eps)
        cm = cm / (tl.sum(cm, axis=0)[None, :] + eps)
    tl.store(comb_ptr + t * M * M + rr * M + c, cm, mask=ok)


def _coefficients(src, scale, base, m, iters, eps, k=1, norm_eps=0.0):
    """(pre, post, comb) from mix [T, m(m+2)], or from hc_mix's partials [S, T, m(m+2) + 1] (3-D)
    of a K-wide row."""
    parts = src.dim() == 3
    t = src.shape[-2]
    dev = src.device
    pre = torch.empty(t, m, device=dev)
    post = torch.empty(t, m, device=dev)
    comb = torch.empty(t, m, m, device=dev)
    if t:
        s_part, n_parts = (src.stride(0), src.shape[0]) if parts else (0, 1)
        _sinkhorn_kernel[(t,)](src, scale.float().contiguous(), base.float().contiguous(), pre, post, comb,
                               int(iters), float(eps), src.stride(-2), s_part, n_parts, k, float(norm_eps),
                               M=m, MP=pow2(m, 2), PARTS=parts, SP=pow2(n_parts))
    return pre, post, comb


def hc_split_sinkhorn(mix, scale, base, hc_mult, iters, eps):
    m = int(hc_mult)
    if mix.shape[-1] != m * (m + 2):
        raise ValueError(f"hc_split_sinkhorn: mix must be [T, {m * (m + 2)}] for hc_mult={m}")
    return _coefficients(mix.float().contiguous(), scale, base, m, iters, eps)


def hc_mix(x: torch.Tensor, fn: Weight, scale, base, iters, eps, norm_eps, *, batch_invariant: bool = False):
    check_hc_mix_args(x, fn)
    t, m, d = x.shape
    if m * (m + 2) > skinny.MAX_N:  # one program holds every mixing column: else the three ops, with the
        # fixed-tile linear, so the op is batch-invariant in both modes (DeepSeek's m = 4 never comes here)
        lin = lambda a, w: gemm.linear(a, w, batch_invariant=True)  # noqa: E731
        return composed_hc_mix(norm_rope.rms_norm, lin, hc_split_sinkhorn)(x, fn, scale, base, iters, eps,
                                                                           norm_eps)
    flat = x.reshape(t, m * d)
    if skinny.split3_ok(flat, batch_invariant):
        parts = skinny.split3_partials(flat, fn.data, sumsq=True)
    else:
        parts = skinny.partials(flat, fn.data, sumsq=True)
    return _coefficients(parts, scale, base, m, iters, eps, m * d, norm_eps)


@triton.jit
def _collapse_kernel(x_ptr, pre_ptr, y_ptr, D, M: tl.constexpr, MP: tl.constexpr, LEVELS: tl.constexpr,
                     BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    k = tl.arange(0, MP)
    dok = d < D
    w = tl.load(pre_ptr + t * M + k, mask=k < M, other=0.0)
    ok = (k < M)[:, None] & dok[None, :]
    x = tl.load(x_ptr + (t * M + k[:, None]) * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    p = w[:, None] * x  # [MP, BD]; the padded streams are zeros, as tree_sum pads
    for lvl in tl.static_range(LEVELS):  # tree_sum: stream k pairs with k + half
        p = tl.sum(tl.reshape(p, (2, MP >> (lvl + 1), BD)), axis=0)
    y = tl.reshape(p, (BD,))
    tl.store(y_ptr + t * D + d, y.to(y_ptr.dtype.element_ty), mask=dok)


@triton.jit
def _expand_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, D, M: tl.constexpr, MP: tl.constexpr,
                   BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    k = tl.arange(0, MP)  # output stream
    dok = d < D
    f = tl.load(f_ptr + t * D + d, mask=dok, other=0.0).to(tl.float32)
    acc = tl.load(post_ptr + t * M + k, mask=k < M, other=0.0)[:, None] * f[None, :]  # [MP, BD]
    for j in tl.static_range(M):
        xj = tl.load(x_ptr + (t * M + j) * D + d, mask=dok, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + (t * M + j) * M + k, mask=k < M, other=0.0)  # comb[t, j, :]
        acc = acc + cj[:, None] * xj[None, :]
    ok = (k < M)[:, None] & dok[None, :]
    tl.store(y_ptr + (t * M + k[:, None]) * D + d[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)


def _tiles(m: int, d: int) -> tuple[int, int]:
    mp = pow2(m)
    return mp, max(16, min(pow2(d), _TILE // mp))


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    check_hc_args("hc_collapse", x, pre=pre)
    t, m, d = x.shape
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if t == 0 or d == 0:
        return y
    mp, bd = _tiles(m, d)
    _collapse_kernel[(t, cdiv(d, bd))](x.contiguous(), pre.float().contiguous(), y, d, M=m, MP=mp,
                                       LEVELS=mp.bit_length() - 1, BD=bd, enable_fp_fusion=False)
    return y


def hc_expand(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    check_hc_args("hc_expand", x, f=f, post=post, comb=comb)
    t, m, d = x.shape
    y = torch.empty(t, m, d, dtype=x.dtype, device=x.device)
    if t == 0 or d == 0:
        return y
    mp, bd = _tiles(m, d)
    _expand_kernel[(t, cdiv(d, bd))](f.contiguous(), x.contiguous(), post.float().contiguous(),
                                     comb.float().contiguous(), y, d, M=m, MP=mp, BD=bd,
                                     enable_fp_fusion=False)
    return y
