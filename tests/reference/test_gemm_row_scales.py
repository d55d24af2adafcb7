"""gemm's host-side row scales (used for a few rows, as in decode) must equal numerics'
tensor path bit for bit: the same power-of-two scales and the same linear output, including
rows of zeros, -0, subnormals, the largest floats, inf and nan."""
import math

import pytest
import torch

from shuili.hal import numerics
from shuili.hal.types import Weight
from shuili.platforms.reference import gemm


def _edge_rows(gen, m, k):
    x = numerics.normal((m, k), gen)
    x[0] = 0.0
    x[1] = -0.0
    x[2, 0] = math.inf
    x[3, 0] = math.nan
    x[4] = 1e-45  # the smallest float32 subnormal
    x[5] = 3e38
    x[6, -1] = -math.inf
    x[7] = x[7] * 1e-40  # subnormal rows of mixed size
    return x


@pytest.mark.parametrize("k", [1, 7, 576, 1536])
def test_row_scales_equal_the_tensor_path(gen, k):
    x = _edge_rows(gen, 12, k)
    pa = numerics.dot_bits(k)[0]
    e = numerics.exponent_bound(x)
    sx, sa = gemm._row_scales(x, pa)
    assert torch.equal(sx, numerics.pow2((pa - e).clamp(-1022, 1023)))
    assert torch.equal(sa, numerics.pow2((e - pa).clamp(-1022, 1023)))
    assert not torch.equal(sx, sa)  # negative control: the two scales are not interchangeable


@pytest.mark.parametrize("rows", [1, 12, gemm._HOST_SCALE_ROWS, gemm._HOST_SCALE_ROWS + 1])
def test_linear_bits_equal_numerics_dot(gen, rows):
    w = numerics.normal((33, 576), gen)
    x = _edge_rows(gen, rows, 576) if rows >= 8 else numerics.normal((rows, 576), gen)
    got = gemm.linear(x, Weight.dense(w))
    want = numerics.dot(x, w)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
