"""Rotary embedding on the trailing rope_dim channels; elementwise float32."""
from __future__ import annotations

from typing import Callable

import torch

from shuili.platforms.reference import native


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
         rope_dim: int, interleaved: bool = True, inverse: bool = False, *,
         may_overwrite: bool = False) -> torch.Tensor:
    """(a, b) -> (a c - b s, a s + b c) with s negated for inverse, each product and sum rounded
    in float32 (no fused multiply-add). Returns a new tensor of x's dtype and shape, whatever
    may_overwrite says (the oracle leaves its inputs alone).
    """
    t, d, half = check_rope_args(x, cos, sin, rope_dim)
    c, s = _angles(positions, cos, sin, t)
    if x.dtype == torch.float32 and native.enabled("rowops"):  # one compiled loop, same bits
        return native.rope(x, c.view(t, half), s.view(t, half), rope_dim, interleaved, inverse)
    return rope_rows(x, c, s, rope_dim, interleaved, inverse)


def rope_rows(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, rope_dim: int, interleaved: bool = True,
              inverse: bool = False) -> torch.Tensor:
    """`rope` as torch ops, from the tokens' table rows c, s [T, 1, rope_dim / 2]: the definition the
    compiled loop is checked against."""
    d, half = x.shape[-1], rope_dim // 2
    if inverse:
        s = -s
    xf = x.to(torch.float32)
    r = xf[..., d - rope_dim:]
    a, b = (r[..., 0::2], r[..., 1::2]) if interleaved else (r[..., :half], r[..., half:])
    ra, rb = a * c - b * s, a * s + b * c
    rot = torch.stack([ra, rb], -1).flatten(-2) if interleaved else torch.cat([ra, rb], -1)
    out = rot if rope_dim == d else torch.cat([xf[..., :d - rope_dim], rot], -1)
    return out.to(x.dtype)


# (cos, sin, a copy of the positions, (c, s), the tables' versions): a step's q, k and layers share it
_ANGLES: list = [None]


def _angles(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 rows of `positions` as [T, 1, half], checked and gathered once while the
    tables are the same objects and the positions equal in value to the last call's."""
    if positions.shape != (t,):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected ({t},)")
    hit = _ANGLES[0]
    versions = (cos._version, sin._version)
    if (hit is not None and hit[0] is cos and hit[1] is sin and hit[4] == versions
            and hit[2].dtype == positions.dtype and torch.equal(hit[2], positions)):
        return hit[3]
    pos = positions.to(torch.int64)
    if t and (int(pos.min()) < 0 or int(pos.max()) >= cos.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (the cos/sin table length)")
    cs = (cos.to(torch.float32)[pos][:, None, :], sin.to(torch.float32)[pos][:, None, :])
    _ANGLES[0] = (cos, sin, positions.clone(), cs, versions)
    return cs


def composed_rms_norm_rope(rms_norm: Callable, rope: Callable) -> Callable:
    """rms_norm_rope as the two ops that define it, from one op table (the reference's, or a
    platform's without a fused kernel)."""

    def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
                      interleaved: bool = True) -> torch.Tensor:
        check_rope_args(x, cos, sin, rope_dim)
        return rope(rms_norm(x, weight, eps), positions, cos, sin, rope_dim, interleaved)

    return rms_norm_rope
