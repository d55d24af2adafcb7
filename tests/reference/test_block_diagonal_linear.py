"""block_diagonal_linear (HAL 1.10): x [T, G*K] times a block-diagonal weight given as its G
blocks [G, N, K]; the bits of grouped_linear over the rows regrouped by block, in every weight
format; the composition other platforms take gives them too; errors name the fix."""
import pytest
import torch

from shuili.hal.types import Weight
from shuili.platforms.reference.ops import OPS
from shuili.platforms.reference.public import (composed_block_diagonal_linear, quantize_weight_fp8_block32,
                                               quantize_weight_fp8_block128, quantize_weight_mxfp4)

QUANT = {"dense": Weight.dense, "fp8_block128": quantize_weight_fp8_block128,
         "fp8_block32": quantize_weight_fp8_block32, "mxfp4": quantize_weight_mxfp4}


def _regrouped(x, w):
    t, (g, n, k) = x.shape[0], w.shape
    xg = x.reshape(t, g, k).transpose(0, 1).reshape(g * t, k)
    y = OPS["grouped_linear"](xg, w, torch.full((g,), t, dtype=torch.int64))
    return y.view(g, t, n).transpose(0, 1).reshape(t, g * n)


@pytest.mark.parametrize("fmt", list(QUANT))
def test_block_diagonal_is_grouped_linear_regrouped(fmt):
    gen = torch.Generator().manual_seed(3)
    g, n, k, t = 3, 40, 64, 7
    w = QUANT[fmt](torch.randn(g, n, k, generator=gen) * 0.1)
    x = torch.randn(t, g * k, generator=gen).to(torch.bfloat16)
    got = OPS["block_diagonal_linear"](x, w)
    assert got.shape == (t, g * n) and got.dtype == torch.bfloat16
    assert torch.equal(got, _regrouped(x, w))
    assert torch.equal(composed_block_diagonal_linear(OPS["grouped_linear"])(x, w), got)
    # block 1 alone against linear on its columns: the blocks do not mix
    w1 = Weight(w.format, w.data[1], None if w.scale is None else w.scale[1], (n, k))
    one = OPS["linear"](x[:, k:2 * k], w1)
    assert torch.equal(got[:, n:2 * n], one)


def test_block_diagonal_rows_are_independent():
    gen = torch.Generator().manual_seed(4)
    w = Weight.dense(torch.randn(2, 16, 32, generator=gen))
    x = torch.randn(9, 64, generator=gen)
    full = OPS["block_diagonal_linear"](x, w)
    for i in (0, 4, 8):
        assert torch.equal(OPS["block_diagonal_linear"](x[i:i + 1], w), full[i:i + 1])


def test_block_diagonal_errors_name_the_fix():
    w = Weight.dense(torch.randn(2, 16, 32))
    with pytest.raises(ValueError, match=r"takes x \[T, G\*K\] = \[T, 64\] for 2 blocks of K=32"):
        OPS["block_diagonal_linear"](torch.randn(3, 32), w)
    with pytest.raises(ValueError, match=r"needs the blocks as a \[G, N, K\] weight"):
        OPS["block_diagonal_linear"](torch.randn(3, 32), Weight.dense(torch.randn(16, 32)))
