"""Keep glibc malloc from returning large freed blocks to the kernel between ops.

The reference ops allocate many short-lived tensors of a few MB (float64 fixed-point grids,
exp's Horner temporaries). glibc serves blocks above its mmap threshold (dynamic, from 128 KiB)
with mmap and unmaps them on free, and trims the heap's top above its trim threshold, so the next
op of the same shape takes fresh zeroed pages and a page fault per 4 KiB again: on SmolLM2 decode
this cost more CPU time than many of the ops themselves. Raising both thresholds once lets freed
blocks be reused, as a caching allocator would. Bits are unaffected (it only decides where memory
comes from); the process's resident size stays near its high-water mark instead of shrinking.

Applied once, when the reference platform's op table is built, on glibc only, and not where the
user set MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ or SHUILI_REFERENCE_MALLOC=0.
"""
from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit hosts
TRIM_THRESHOLD = 256 * 1024 * 1024
_applied: bool | None = None


def keep_freed_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); True when they were set."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    user_set = any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"))
    if not sys.platform.startswith("linux") or user_set or os.environ.get("SHUILI_REFERENCE_MALLOC") == "0":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other C libraries: leave their policy alone
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
