"""hc_collapse and hc_expand: the mHC stream collapse and expand, one program per (token, D tile),
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

from shuili.platforms.nvidia.common import cdiv, pow2
from shuili.platforms.reference.public import check_hc_args

_TILE = 4096  # values of x per program: [MP, BD]


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
