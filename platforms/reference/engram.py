"""DeepSeek-V4.1 Engram gated write, float32 with exact dots and fixed-tree means of squares."""
from __future__ import annotations

import torch

from shuili.hal import numerics

_CLAMP = 1e-6  # |dot| floor before the signed square root


def engram_gate(x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """dot_k = numerics.dot(x_k * w_k, key_k) scaled by two rsqrt(tree_sum(.^2) / D + eps) and D^-1/2;
    gate = numerics.sigmoid of the signed sqrt; out = x + gate * value (float32, cast to x's dtype)."""
    if x.ndim != 3:
        raise ValueError(f"engram_gate x must be [T, m, D], got {tuple(x.shape)}")
    t, m, d = x.shape
    if kv.shape != (t, (m + 1) * d):
        raise ValueError(f"engram_gate kv must be [T, (m + 1) * D] = [{t}, {(m + 1) * d}], got {tuple(kv.shape)}")
    if q_weight.shape != (m, d) or k_weight.shape != (m, d):
        raise ValueError(f"engram_gate q_weight and k_weight must be [m, D] = [{m}, {d}], got "
                         f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    h = x.to(torch.float32)
    kvf = kv.to(torch.float32)
    key = kvf[:, :m * d].reshape(t, m, d)
    value = kvf[:, m * d:]
    w = q_weight.to(torch.float32) * k_weight.to(torch.float32)
    dot = numerics.dot((h * w)[..., None, :], key[..., None, :])[..., 0, 0]  # [T, m]
    rstd = numerics.rsqrt(numerics.tree_sum(h * h) / d + eps) * numerics.rsqrt(numerics.tree_sum(key * key) / d + eps)
    dot = dot * rstd * (d ** -0.5)
    gate = numerics.sigmoid(torch.copysign(numerics.sqrt(dot.abs().clamp_min(_CLAMP)), dot))
    return (h + gate[..., None] * value[:, None, :]).to(x.dtype)
