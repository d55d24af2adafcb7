"""RMSNorm and fused residual-add RMSNorm, float32, fixed-tree mean of squares."""
from __future__ import annotations

import torch

from shuili.hal.numerics import rsqrt, tree_sum


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = x * (1 / sqrt(tree_sum(x^2) / D + eps)) * weight, all float32, cast to x's dtype."""
    xf = x.to(torch.float32)
    d = xf.shape[-1]
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"rms_norm weight has shape {tuple(weight.shape)}, expected ({d},)")
    inv = rsqrt(tree_sum(xf * xf) / d + eps)
    y = xf * inv[..., None]
    if weight is not None:
        y = y * weight.to(torch.float32)
    return y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual in x's dtype; returns (rms_norm(s, weight, eps), s)."""
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must match")
    s = x + residual.to(x.dtype)
    return rms_norm(s, weight, eps), s
