"""Shared helpers of the NVIDIA kernels: launch-time shapes, checks that never sync a captured graph."""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

from shuili.hal.checks import inputs_are_checked


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


def check(x: torch.Tensor, ok: Callable[[torch.Tensor], torch.Tensor], msg: str) -> None:
    """Fail unless ok(x) holds everywhere: a ValueError for a CPU tensor, an async assert on the
    GPU (a host read would sync). A GPU check is left out, and ok never called, while a CUDA graph
    is captured or while the caller vouches for its inputs (`hal.checks.inputs_checked`: the
    engine's steps). A recorded check would replay its 3-5 tiny launches every step (about 400 us
    of a batch-64 mid-v4 decode step, docs/performance.md), and an eager prefill spends a fifth of
    its launches on them; what they guard is guarded before the step runs: the engine checks the
    token ids and block tables it builds on the host (core/runner.py), router ids and group sizes
    are in range by construction, and tid2eid is checked when the weights load. Any other caller
    keeps the check."""
    if x.device.type == "cpu":
        if not bool(ok(x).all()):
            raise ValueError(msg)
        return
    if capturing() or inputs_are_checked():
        return
    torch._assert_async(ok(x).all(), msg)


def in_range(lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: (t >= lo) & (t < hi)


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
from shuili.hal.numerics import tree_sum  # noqa: E402,F401
