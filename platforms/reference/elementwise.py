"""Row-local ops: SwiGLU and embedding lookup."""
from __future__ import annotations

import torch

from shuili.hal import numerics
from shuili.platforms.reference import native


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); silu from `numerics` (float64, rounded
    once), the product in float32. Returns gate_up's dtype, [T, I].
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim (gate ++ up), got {gate_up.shape[-1]}")
    if gate_up.dtype == torch.float32 and native.enabled("rowops"):  # one compiled loop, same bits
        return native.swiglu(gate_up, limit)
    return swiglu_torch(gate_up, limit)


def swiglu_torch(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """`swiglu` as torch ops: the definition the compiled loop is checked against."""
    inter = gate_up.shape[-1] // 2
    g = gate_up[..., :inter].to(torch.float32)
    u = gate_up[..., inter:].to(torch.float32)
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return (numerics.silu(g) * u).to(gate_up.dtype)


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[ids]; ids outside [0, V) raise."""
    ids = ids.to(torch.int64)
    v = table.shape[0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
        raise ValueError(f"token ids must lie in [0, {v}) (the vocabulary); got range "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    return table[ids]
