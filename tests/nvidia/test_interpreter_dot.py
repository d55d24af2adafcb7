"""The interpreter's tl.dot as the conftest replaces it: the bitwise batch-invariance tests are
only as good as this dot. It must give a row the same bits wherever the row sits in its tile (else
those tests check the host's BLAS) and must still see how a kernel cuts K (else they check nothing)."""
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from tests_nvidia_dot import fixed_order_dot

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="checks the TRITON_INTERPRET dot; a GPU uses its MMA")


@triton.jit
def _tile_kernel(a_ptr, b_ptr, y_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                 CUTS: tl.constexpr):
    rows = tl.arange(0, M)
    cols = tl.arange(0, N)
    acc = tl.zeros([M, N], tl.float32)
    for c in tl.static_range(CUTS):
        kk = c * (K // CUTS) + tl.arange(0, K // CUTS)
        a = tl.load(a_ptr + rows[:, None] * K + kk[None, :])
        b = tl.load(b_ptr + kk[:, None] * N + cols[None, :])
        acc += tl.dot(a, b, input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc)


def tile(a, b, cuts=1):
    y = torch.empty(a.shape[0], b.shape[1])
    _tile_kernel[(1,)](a, b, y, M=a.shape[0], N=b.shape[1], K=a.shape[1], CUTS=cuts)
    return y


def test_row_bits_do_not_depend_on_its_place_in_the_tile():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 128, generator=gen), torch.randn(128, 32, generator=gen)
    want = tile(a[:1].expand(16, -1).contiguous(), b)[0]
    for at in (0, 1, 7, 31, 63):
        rows = torch.randn(64, 128, generator=gen)
        rows[at] = a[0]
        assert torch.equal(tile(rows, b)[at], want), at
    # and it is the fixed-order sum itself, never a BLAS call
    ref = fixed_order_dot(a.numpy(), b.numpy(), np.zeros((64, 32), np.float32))
    assert np.array_equal(tile(a, b).numpy().view(np.uint32), ref.view(np.uint32))


def test_cutting_k_still_changes_bits():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(16, 128, generator=gen), torch.randn(128, 16, generator=gen)
    one, two = tile(a, b, cuts=1), tile(a, b, cuts=2)
    assert not torch.equal(one, two)
    assert torch.allclose(one, two, rtol=1e-5, atol=1e-5)
