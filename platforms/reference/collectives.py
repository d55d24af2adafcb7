"""Collectives. The reference platform runs in one process; with torch.distributed initialised
and more than one rank (gloo on the CPU) it gathers every rank's tensor and sums in rank order
(deterministic); all_to_all copies rows, so it is exact by construction.
"""
from __future__ import annotations

import torch


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


def check_counts(x: torch.Tensor, send_counts, recv_counts, world: int) -> tuple[list[int], list[int]]:
    """The counts as host ints, checked against x and the group size (shared by the platforms)."""
    send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send) != world or len(recv) != world:
        raise ValueError(f"all_to_all: send_counts ({len(send)}) and recv_counts ({len(recv)}) need one "
                         f"entry per rank of the group ({world})")
    if min(send + recv, default=0) < 0 or sum(send) != x.shape[0]:
        raise ValueError(f"all_to_all: send_counts {send} must be >= 0 and sum to x's {x.shape[0]} rows")
    return send, recv


def all_to_all(x: torch.Tensor, send_counts, recv_counts, group: object | None = None) -> torch.Tensor:
    """Rows to their ranks (torch.distributed.all_to_all_single); one rank: x itself."""
    world = _world(group)
    send, recv = check_counts(x, send_counts, recv_counts, world)
    if world == 1:
        if recv != send:
            raise ValueError(f"all_to_all on one rank: recv_counts {recv} must equal send_counts {send}")
        return x
    import torch.distributed as dist

    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out
