"""Batch invariance by construction: a row's bits must not depend on its batch or its place in it."""
import pytest
import torch

from shuili.hal.types import Weight
from shuili.platforms.reference.quant import quantize_weight_fp8_block128, quantize_weight_mxfp4

SIZES = [1, 2, 5, 16, 17, 33, 70]


def _embed(row, m, pos, gen):
    x = torch.randn(m, row.shape[-1], generator=gen)
    x[pos] = row
    return x


@pytest.mark.parametrize("fmt", ["dense", "fp8_block128", "mxfp4"])
def test_linear_row_invariant(ops, gen, fmt):
    k, n = 256, 96
    w = torch.randn(n, k, generator=gen)
    weight = {"dense": Weight.dense(w), "fp8_block128": quantize_weight_fp8_block128(w),
              "mxfp4": quantize_weight_mxfp4(w)}[fmt]
    row = torch.randn(1, k, generator=gen)
    alone = ops["linear"](row, weight)
    for m in SIZES:
        for pos in sorted({0, m // 2, m - 1}):
            out = ops["linear"](_embed(row[0], m, pos, gen), weight)
            assert torch.equal(out[pos], alone[0]), (m, pos)
