"""Collectives. The reference platform runs in one process; with torch.distributed initialised
and more than one rank (gloo on the CPU) it gathers every rank's tensor and sums in rank order
(deterministic); all_to_all copies rows, so it is exact by construction.
"""
from __future__ import annotations

import torch

from shuili.hal import distributed


def _world(group: object | None) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised; "
                             "pass group=None for a single process")
        return 1
    return dist.get_world_size(group)


def _gather(x: torch.Tensor, group: object | None) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def all_reduce(x: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """Sum over ranks, added left to right in rank order. One rank: x itself."""
    if _world(group) == 1:
        return x
    parts = _gather(x, group)
    out = parts[0].clone()
    for p in parts[1:]:
        out = out + p
    return out


def all_gather(x: torch.Tensor, group: object | None = None, dim: int = 0) -> torch.Tensor:
    """Concatenation along dim in rank order. One rank: x itself."""
    if _world(group) == 1:
        return x
    return torch.cat(_gather(x, group), dim=dim)


def all_to_all(x: torch.Tensor, send_counts, recv_counts, group: object | None = None) -> torch.Tensor:
    """Rows to their ranks (torch.distributed.all_to_all_single); one rank: x itself."""
    return distributed.all_to_all(x, send_counts, recv_counts, group, _world(group))
