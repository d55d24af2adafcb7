"""Split-K's ordered sum, done by the GEMM launch itself.

A split-K GEMM writes float32 partials [SPLIT, M, N], one per fixed K chunk, and their sum in chunk
order is the output. A second kernel used to add them: one launch more per linear (85 in a mid-v4
decode step, about 1.8 us each on an H100). Here every program of an output tile, after storing
its partial, bumps the tile's arrival counter; the program that arrives last adds the tile's
SPLIT partials in chunk order (0, 1, ..., the same order and the same float32 adds as the second
kernel, so the same bits whichever program comes last), adds the bias, stores the tile and puts
its counter back to zero. So the counters are zero between launches, a captured graph replays
with no reset, and nothing depends on which program arrives when.

Ordering: a CTA barrier, then one thread's acq_rel atomic at GPU scope publishes the CTA's partial
(the barrier orders every thread's stores before that release, as CUTLASS's semaphore does); the
last program's acquire is broadcast to its threads, which read the partials through L2 (.cg), never
a stale L1 line.

The counters are one int32 buffer per device, allocated once, zero, COUNTERS long. Launches on a
stream run one after another, so a launch's tiles own the buffer's head while it runs. Where the
buffer is too short, or would be first allocated inside a CUDA graph capture, `counters` returns
None and the caller runs `split_sum`, the standalone kernel with the same sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import capturing, cdiv

COUNTERS = 1 << 15
_BUFFERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The zeroed arrival counters of `device`, or None where the fused sum cannot run."""
    buf = _BUFFERS.get(device)
    if buf is None:
        if capturing():
            return None
        buf = _BUFFERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf if tiles <= COUNTERS else None


@triton.jit
def _sum_tile(p_ptr, b_ptr, y_ptr, rows, cols, ok, M, N, s_ym, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[rows, cols] = sum over s in order of p[s, rows, cols] (+ bias[cols])."""
    off = rows[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.load(p_ptr + off, mask=ok, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * M * N + off, mask=ok, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * s_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def finish_tile(p_ptr, cnt_ptr, tile, b_ptr, y_ptr, rows, cols, ok, M, N, s_ym, SPLIT: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """Called by each of a tile's SPLIT programs once its partial is stored; the last one sums."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        _sum_tile(p_ptr, b_ptr, y_ptr, rows, cols, ok, M, N, s_ym, SPLIT, HAS_BIAS)
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _split_sum_kernel(p_ptr, b_ptr, y_ptr, M, N, s_ym, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    _sum_tile(p_ptr, b_ptr, y_ptr, rows, cols, ok, M, N, s_ym, SPLIT, HAS_BIAS)


def split_sum(p: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y [M, N] = sum of the partials p [S, M, N] in order (+ bias): the unfused path."""
    s, m, n = p.shape
    bm, bn = 16, 64
    _split_sum_kernel[(cdiv(m, bm), cdiv(n, bn))](p, bias if bias is not None else p, y, m, n, y.stride(0),
                                                  SPLIT=s, HAS_BIAS=bias is not None, BM=bm, BN=bn)
    return y
