"""Shared helpers of the NVIDIA kernels: launch-time shapes, checks that never sync a captured graph."""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=8)
def num_sms(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 4


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check(cond: torch.Tensor, msg: str) -> None:
    """Fail on a device-side condition: a ValueError on the CPU, an async assert on the GPU (a host
    check would sync, and a captured graph cannot sync)."""
    if cond.device.type == "cpu":
        if not bool(cond.all()):
            raise ValueError(msg)
        return
    torch._assert_async(cond.all(), msg)


def f32_dot(dtype: torch.dtype) -> bool:
    """float32 operands get IEEE dots (no tf32): the reference is float32 and so is the contract."""
    return dtype == torch.float32


def as_u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def desc_key(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 key ordering float32 x descending, ties by ascending id (ids < 2^32): a plain
    topk / sort on it is exact and tie-stable on any device."""
    b = x.to(torch.float32).contiguous().view(torch.int32)
    mono = torch.where(b >= 0, b, b ^ 0x7FFFFFFF).to(torch.int64)
    return (mono << 32) + (0xFFFFFFFF - ids.to(torch.int64))


def key_ids(key: torch.Tensor) -> torch.Tensor:
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


# the reference's fixed pairwise tree, pure torch, so it runs on the GPU unchanged and gives the
# same association as the reference for every width
from shuili.platforms.reference.public import tree_sum  # noqa: E402,F401
