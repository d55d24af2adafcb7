"""A tl.dot for TRITON_INTERPRET whose bits are a function of the tile's inputs alone.

The interpreter's own dot is numpy's matmul, i.e. the host's BLAS: OpenBLAS sums a row in an order
that depends on the row's place in the tile and on the CPU kernel it picked (Haswell, SkylakeX,
...), so with it a bitwise batch-invariance test checks the BLAS, not the kernel, and passes or
fails by host. install() swaps this one in (the conftest does, for the session).
"""
from __future__ import annotations

import numpy as np


def fixed_order_sum(p: np.ndarray) -> np.ndarray:
    """Sums p over axis -2 as a fixed-shape pairwise tree of elementwise float64 adds: IEEE adds
    round the same on every CPU and numpy cannot reorder an elementwise op, unlike a reduction."""
    while p.shape[-2] > 1:
        if p.shape[-2] % 2:
            pad = np.zeros(p.shape[:-2] + (1, p.shape[-1]), p.dtype)
            p = np.concatenate([p, pad], axis=-2)
        p = p[..., 0::2, :] + p[..., 1::2, :]
    return p[..., 0, :]


def fixed_order_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc + a @ b, rounded once to acc's dtype. Every product of two operands of at most 24
    significand bits (fp32, tf32, fp16, bf16, fp8) is exact in float64, so the only roundings
    before the last one are the fixed tree's adds: a row's bits cannot depend on the other rows of
    its tile, while a kernel that changes how it cuts K still changes them (its f32 accumulator
    rounds between dots)."""
    prod = a.astype(np.float64)[..., :, :, None] * b.astype(np.float64)[..., None, :, :]
    return (fixed_order_sum(prod) + acc.astype(np.float64)).astype(acc.dtype)


def install(monkeypatch) -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    blas_dot = builder.create_dot

    def operand(h):
        if h.dtype.scalar == tl.bfloat16:  # the interpreter keeps bf16 as its raw uint16 bits
            return (h.data.astype(np.uint32) << 16).view(np.float32)
        if h.dtype.is_floating() and h.dtype.primitive_bitwidth == 8:
            return interpreter._convert_float(h.data, h.dtype, tl.float16, None).view(np.float16)
        return h.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.dtype.is_floating() and d.data.dtype.kind == "f"):
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)  # integer dots are exact
        return interpreter.TensorHandle(fixed_order_dot(operand(a), operand(b), d.data), d.dtype.scalar)

    monkeypatch.setattr(builder, "create_dot", create_dot)
