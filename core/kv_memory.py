"""KV cache tensors whose host memory becomes resident only where it is written.

`kv_cache_bytes` is a budget (1 GiB by default), and the engine allocates every pool up front so
that admission never fails for memory mid-run. On a GPU that memory is reserved either way. On the
CPU, `torch.zeros` writes every page, so the whole budget is resident from the start although a
short run (`shuili perplexity`: ~50 MB of KV on SmolLM2) touches a few percent of it. An anonymous
memory map is zero-filled by the OS page by page on first touch: the same zeros, resident only for
the blocks the run has written (or read), so the process's footprint follows its use up to the
budget. Bits are unaffected: the tensors hold the same values as `torch.zeros`.
"""
from __future__ import annotations

import math
import mmap

import torch


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU backed by its own anonymous mapping (pages resident on first touch)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor holds a reference to the map (frombuffer keeps its buffer alive); freed with it
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
