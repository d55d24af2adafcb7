"""Split-K's ordered sum: a split-K GEMM (qgemm's linears, the batch-invariant tile in gemm.py, the
skinny float32 linears) stores float32 partials [SPLIT, M, N], one per fixed K chunk; this kernel
adds them in chunk order (0, 1, ...) with the bias, so an element's sum order never depends on M.

Done by each tile's last-arriving program instead (an arrival counter per tile, a CTA barrier
and one acq_rel atomic), the sum removed 85 launches from a mid-v4 decode step but made each
linear slower, not faster: on an H100 (2026-12-07, benchmarks/nvidia_skinny.py at commit
bccd30d, CUDA-graph replay at M = 64, fp8_block128) 12.32 against 12.00 us for 512x2048, 27.30
against 26.72 for 4096x4096: the last program's serial sum sits on the GEMM's critical path
where this kernel's many programs add in parallel. So the sum stays a launch of its own (docs/performance.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import cdiv


@triton.jit
def _split_sum_kernel(p_ptr, b_ptr, y_ptr, M, N, s_ym, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.load(p_ptr + i, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * M * N + i, mask=ok, other=0.0)
    col = i % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + (i // N).to(tl.int64) * s_ym + col, acc.to(y_ptr.dtype.element_ty), mask=ok)


def split_sum(p: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y [M, N] = the partials p [S, M, N] (contiguous) added in order s = 0, 1, ... (+ bias)."""
    s, m, n = p.shape
    block = 1024
    _split_sum_kernel[(cdiv(m * n, block),)](p, bias if bias is not None else p, y, m, n, y.stride(0),
                                             SPLIT=s, HAS_BIAS=bias is not None, BLOCK=block)
    return y
