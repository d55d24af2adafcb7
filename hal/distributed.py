"""Device facts a multi-rank engine needs, kept out of the platform-neutral core: the
torch.distributed backend of a device type, how many devices a host has, binding a rank to one."""
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
