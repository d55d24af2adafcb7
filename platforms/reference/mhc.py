"""DeepSeek-V4 mHC: the coefficients (split + Sinkhorn, and hc_mix: norm + mixing linear +
Sinkhorn), the stream collapse and expand; float32 with fixed-tree or fixed-order sums."""
from __future__ import annotations

from typing import Callable

import torch

from shuili.hal import numerics
from shuili.hal.types import Weight
from shuili.platforms.reference import gemm, norm


def hc_split_sinkhorn(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
                      iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre, post from `numerics.sigmoid`; comb = softmax (`numerics.softmax_last`) + eps, one column
    normalisation, then (iters - 1) x (row, column); every sum is a `tree_sum` over m values.
    """
    m = hc_mult
    if mix.shape[-1] != m * (m + 2) or base.shape[-1] != m * (m + 2):
        raise ValueError(f"mix and base need {m * (m + 2)} = m(m+2) columns for hc_mult {m}; got "
                         f"{mix.shape[-1]} and {base.shape[-1]}")
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    x = mix.to(torch.float32)
    sc = scale.to(torch.float32)
    bs = base.to(torch.float32)
    pre = numerics.sigmoid(x[:, :m] * sc[0] + bs[:m]) + eps
    post = 2.0 * numerics.sigmoid(x[:, m:2 * m] * sc[1] + bs[m:2 * m])
    logits = x[:, 2 * m:].reshape(-1, m, m) * sc[2] + bs[2 * m:].reshape(m, m)
    c = numerics.softmax_last(logits) + eps
    c = c / (numerics.tree_sum(c, dim=-2)[:, None, :] + eps)
    for _ in range(iters - 1):
        c = c / (numerics.tree_sum(c, dim=-1)[:, :, None] + eps)
        c = c / (numerics.tree_sum(c, dim=-2)[:, None, :] + eps)
    return pre, post, c


_HC_DIMS = {"pre": "[T, m]", "post": "[T, m]", "f": "[T, D]", "comb": "[T, m, m]"}


def check_hc_args(op: str, x: torch.Tensor, **parts: torch.Tensor) -> None:
    """x must be [T, m, D], each named part (pre, post, f, comb) the shape x's T, m, D give it;
    the ValueError names the argument that does not fit."""
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be [T, m, D], got {tuple(x.shape)}")
    t, m, d = x.shape
    want = {"pre": (t, m), "post": (t, m), "f": (t, d), "comb": (t, m, m)}
    for name, v in parts.items():
        if tuple(v.shape) != want[name]:
            raise ValueError(f"{op}: {name} must be {_HC_DIMS[name]} = {list(want[name])} for x "
                             f"{tuple(x.shape)}, got {tuple(v.shape)}")


def check_hc_mix_args(x: torch.Tensor, fn: Weight) -> None:
    """hc_mix's x must be [T, m, D] and fn a dense [m(m+2), m*D] weight; the error names the fix."""
    if x.dim() != 3:
        raise ValueError(f"hc_mix: x must be the streams [T, m, D], got {tuple(x.shape)}")
    _, m, d = x.shape
    want = (m * (m + 2), m * d)
    if fn.format != "dense" or tuple(fn.shape) != want:
        raise ValueError(f"hc_mix: fn must be a dense weight [m(m+2), m*D] = {list(want)} for x "
                         f"{tuple(x.shape)}, got {fn.format} {tuple(fn.shape)}")


def composed_hc_mix(rms_norm: Callable, linear: Callable, split_sinkhorn: Callable) -> Callable:
    """hc_mix as the three ops that define it, from one op table (the reference's, or a platform's
    own where it has no fused kernel)."""

    def hc_mix(x: torch.Tensor, fn: Weight, scale: torch.Tensor, base: torch.Tensor, iters: int,
               eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_hc_mix_args(x, fn)
        t, m, d = x.shape
        flat = rms_norm(x.reshape(t, m * d).float(), None, norm_eps)
        return split_sinkhorn(linear(flat, fn).float(), scale, base, m, iters, eps)

    return hc_mix


hc_mix = composed_hc_mix(norm.rms_norm, gemm.linear, hc_split_sinkhorn)


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[T, D] in x's dtype: sum_k pre[:, k] x[:, k], float32 products, a `tree_sum` over the m streams."""
    check_hc_args("hc_collapse", x, pre=pre)
    return numerics.tree_sum(pre[..., None] * x.float(), dim=1).to(x.dtype)


def hc_expand(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """[T, m, D] in x's dtype: post[k] f + sum_j comb[j, k] x[j], float32, summed in j order."""
    check_hc_args("hc_expand", x, f=f, post=post, comb=comb)
    out = post[..., None] * f.float()[:, None, :]
    xf = x.float()
    for j in range(x.shape[1]):
        out = out + comb[:, j, :, None] * xf[:, j, None, :]
    return out.to(x.dtype)
