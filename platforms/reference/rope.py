"""Rotary embedding on the trailing rope_dim channels; elementwise float32."""
from __future__ import annotations

import torch


def check_rope_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    rope_dim: int) -> tuple[int, int, int]:
    """The contract's shape preconditions of `rope`, shared by every platform; returns (T, D, half)."""
    if x.dim() != 3:
        raise ValueError(f"rope takes x [T, H, D], got shape {tuple(x.shape)}")
    t, _, d = x.shape
    half = rope_dim // 2
    if rope_dim % 2 or rope_dim > d or rope_dim <= 0:
        raise ValueError(f"rope_dim {rope_dim} must be even, positive and at most the head dim {d}")
    if cos.shape[-1] != half or sin.shape[-1] != half:
        raise ValueError(f"cos/sin tables have {cos.shape[-1]} columns, expected rope_dim/2 = {half}")
    return t, d, half


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         rope_dim: int, interleaved: bool = True, inverse: bool = False) -> torch.Tensor:
    """(a, b) -> (a c - b s, a s + b c) with s negated for inverse, each product and sum rounded
    in float32 (no fused multiply-add). Returns a new tensor of x's dtype and shape.
    """
    t, d, half = check_rope_args(x, cos, sin, rope_dim)
    pos = positions.to(torch.int64)
    if pos.shape != (t,):
        raise ValueError(f"positions has shape {tuple(pos.shape)}, expected ({t},)")
    if t and (int(pos.min()) < 0 or int(pos.max()) >= cos.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (the cos/sin table length)")
    c = cos.to(torch.float32)[pos][:, None, :]  # [T, 1, half]
    s = sin.to(torch.float32)[pos][:, None, :]
    if inverse:
        s = -s
    out = x.to(torch.float32).clone()
    r = out[..., d - rope_dim:]
    if interleaved:
        a, b = r[..., 0::2].clone(), r[..., 1::2].clone()
        r[..., 0::2] = a * c - b * s
        r[..., 1::2] = a * s + b * c
    else:
        a, b = r[..., :half].clone(), r[..., half:].clone()
        r[..., :half] = a * c - b * s
        r[..., half:] = a * s + b * c
    return out.to(x.dtype)
