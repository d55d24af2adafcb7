"""Online-softmax pieces the attention kernels share (attention.py, sparse_group.py) and the dot
both they and the indexer take in either precision."""
from __future__ import annotations

import triton
import triton.language as tl

# finite start of the running max: a block fully masked for a row leaves (m, l, acc) bit-identical
# (exp(m - m) = 1 exactly), where -inf would give exp(-inf + inf) = NaN
NEG = tl.constexpr(-1e30)


@triton.jit
def dot(a, b, F32: tl.constexpr, acc=None):
    """acc + a @ b: IEEE float32 products for F32 (float32 operands), the tensor cores' otherwise."""
    if F32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def finish(acc, m, l, sink, HAS_SINK: tl.constexpr):
    """The output rows acc [R, D] / the softmax's sum, with per-row sinks (logits in the denominator
    only) folded into (m [R], l [R]); a row with nothing to sum (l = 0, no sink) is zeros."""
    if HAS_SINK:
        top = tl.maximum(m, sink)
    else:
        top = m
    w = tl.exp(m - top)
    den = l * w
    if HAS_SINK:
        den = den + tl.exp(sink - top)
    den2 = tl.where(den > 0, den, 1.0)
    return tl.where(den[:, None] > 0, (acc * w[:, None]) / den2[:, None], 0.0)
