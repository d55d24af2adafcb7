"""Device facts a multi-rank engine needs, kept out of the platform-neutral core: the
torch.distributed backend of a device type, how many devices a host has, binding a rank to one;
and the one all_to_all every platform runs (rows are copied, so any backend gives the same bits)."""
from __future__ import annotations

import torch

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}  # torch.distributed backend per device type


def backend_for(device: str) -> str:
    return BACKENDS.get(torch.device(device).type, "gloo")


def device_count(device: str) -> int | None:
    """Accelerators of the device's type on this host; None for the CPU (ranks are processes)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.device_count()
    module = getattr(torch, kind, None) if kind != "cpu" else None  # torch.npu, once torch_npu is imported
    return module.device_count() if module is not None and hasattr(module, "device_count") else None


def bind_device(device: str, local_rank: int) -> None:
    """Make the rank's own accelerator current (before the process group starts)."""
    kind = torch.device(device).type
    module = getattr(torch, kind, None) if kind != "cpu" else None
    if module is not None and hasattr(module, "set_device") and module.device_count():
        module.set_device(local_rank % module.device_count())


def check_counts(x: torch.Tensor, send_counts, recv_counts, world: int) -> tuple[list[int], list[int]]:
    """The counts as host ints, checked against x and the group size (shared by the platforms)."""
    send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send) != world or len(recv) != world:
        raise ValueError(f"all_to_all: send_counts ({len(send)}) and recv_counts ({len(recv)}) need one "
                         f"entry per rank of the group ({world})")
    if min(send + recv, default=0) < 0 or sum(send) != x.shape[0]:
        raise ValueError(f"all_to_all: send_counts {send} must be >= 0 and sum to x's {x.shape[0]} rows")
    return send, recv


def all_to_all(x: torch.Tensor, send_counts, recv_counts, group: object | None, world: int,
               on_exchange=None) -> torch.Tensor:
    """hal/ops.py `all_to_all` for every platform. `world` is the group's size as the platform finds it
    (1 without torch.distributed); one rank: x itself; more: torch.distributed.all_to_all_single.
    `on_exchange()`, when given, runs just before a multi-rank exchange (ascend counts its paths)."""
    send, recv = check_counts(x, send_counts, recv_counts, world)
    if world == 1:
        if recv != send:
            raise ValueError(f"all_to_all on one rank: recv_counts {recv} must equal send_counts {send}")
        return x
    import torch.distributed as dist

    if on_exchange is not None:
        on_exchange()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out
