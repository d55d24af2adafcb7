"""RMSNorm and fused residual-add RMSNorm, float32, fixed-tree mean of squares."""
from __future__ import annotations

import torch

from shuili.hal.numerics import rsqrt, tree_sum
from shuili.platforms.reference import native


def _check(x: torch.Tensor, weight: torch.Tensor | None) -> None:
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")


def _native(*ts: torch.Tensor | None) -> bool:
    return native.enabled("rowops") and all(t is None or t.dtype == torch.float32 for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = x * (1 / sqrt(tree_sum(x^2) / D + eps)) * weight, all float32, cast to x's dtype."""
    if _native(x, weight):  # the same IEEE operations in one compiled loop (native.py)
        _check(x, weight)
        return native.rms_norm(x, weight, eps)[0]
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm` as torch ops: the definition the compiled loop is checked against."""
    xf = x.to(torch.float32)
    d = xf.shape[-1]
    _check(x, weight)
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
    if _native(x, residual, weight):
        _check(x, weight)
        return native.rms_norm(x, weight, eps, residual)
    return add_rms_norm_torch(x, residual, weight, eps)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` as torch ops."""
    s = x + residual.to(x.dtype)
    return rms_norm_torch(s, weight, eps), s
