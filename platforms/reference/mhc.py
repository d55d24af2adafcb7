"""DeepSeek-V4 mHC coefficients (split + Sinkhorn), float32 with fixed-tree sums."""
from __future__ import annotations

import torch

from shuili.hal import numerics


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
