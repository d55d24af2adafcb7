"""The position-independent primitives: accuracy against math, and bits independent of the batch."""
import math
import struct

import pytest
import torch

from shuili.platforms.reference import numerics as N


def _f32(v):
    return struct.unpack("<f", struct.pack("<f", v))[0]


def test_tree_sum_order_and_value(gen):
    x = torch.randn(3, 37, generator=gen)
    torch.testing.assert_close(N.tree_sum(x).double(), x.double().sum(-1), rtol=1e-6, atol=1e-6)
    # the tree for n = 3: (x0 + x2) + x1, padded to 4 with a zero
    big, small = 1e8, 1.0
    got = float(N.tree_sum(torch.tensor([big, small, -big])))
    assert got == _f32(_f32(big - big) + small) == 1.0
    assert N.tree_sum(torch.zeros(2, 0)).shape == (2,)
    assert torch.equal(N.tree_sum(x.t(), dim=0), N.tree_sum(x))


@pytest.mark.parametrize("name,fn", [("exp", math.exp), ("sigmoid", lambda v: 1 / (1 + math.exp(-v))),
                                     ("softplus", lambda v: max(v, 0) + math.log1p(math.exp(-abs(v)))),
                                     ("silu", lambda v: v / (1 + math.exp(-v)))])
def test_transcendentals_close_to_correctly_rounded(gen, name, fn):
    x = (torch.randn(4000, generator=gen) * 20).clamp(-80, 80)
    got = getattr(N, name)(x).tolist()
    want = [_f32(fn(float(v))) for v in x.tolist()]
    ulp_off = sum(g != w and abs(g - w) > abs(w) * 2 ** -23 for g, w in zip(got, want))
    assert ulp_off == 0


def test_special_values():
    e = N.exp(torch.tensor([-math.inf, math.inf, 0.0, -200.0, 200.0])).tolist()
    assert e == [0.0, math.inf, 1.0, 0.0, math.inf]
    assert math.isnan(float(N.exp(torch.tensor([math.nan]))))
    lg = N.log64(torch.tensor([0.0, 1.0, math.e, -1.0, math.inf, 5e-324], dtype=torch.float64)).tolist()
    assert lg[0] == -math.inf and lg[1] == 0.0 and abs(lg[2] - 1) < 1e-15 and math.isnan(lg[3])
    assert lg[4] == math.inf and abs(lg[5] - math.log(5e-324)) < 1e-12
    assert N.softplus(torch.tensor([-120.0])).item() == _f32(math.exp(-120.0))


def test_elementwise_bits_do_not_depend_on_tensor_size(gen):
    # torch's own kernels switch between a vectorised body and a scalar tail by position
    row = torch.randn(37, generator=gen) * 5
    for fn in (N.exp, N.sigmoid, N.silu, N.softplus):
        alone = fn(row)
        for m in (1, 3, 129, 1000):
            batch = torch.randn(m, 37, generator=gen) * 5
            batch[m // 2] = row
            assert torch.equal(fn(batch)[m // 2], alone)
            assert torch.equal(fn(batch.flatten())[m // 2 * 37:(m // 2 + 1) * 37], alone)


def test_softmax_with_sink(gen):
    x = torch.randn(4, 9, generator=gen)
    sink = torch.randn(4, generator=gen)
    p = N.softmax_last(x, sink).double()
    x64 = torch.cat([x.double(), sink.double()[:, None]], 1)
    want = torch.softmax(x64, -1)[:, :9]
    torch.testing.assert_close(p, want, rtol=1e-6, atol=1e-7)
    assert N.softmax_last(torch.zeros(2, 0)).shape == (2, 0)
    assert N.softmax_last(torch.zeros(2, 0), torch.zeros(2)).shape == (2, 0)


def test_softmax_ignores_trailing_minus_inf_padding_bitwise(gen):
    # attention pads each query's logits to a shared width; the bits must not move
    for n in (1, 3, 8, 9, 31):
        row = torch.randn(2, n, generator=gen) * 4
        sink = torch.randn(2, generator=gen)
        alone = N.softmax_last(row, sink)
        for width in (n, n + 1, 2 * n + 5, 64):
            padded = torch.full((2, width), float("-inf"))
            padded[:, :n] = row
            got = N.softmax_last(padded, sink)
            assert torch.equal(got[:, :n], alone) and not got[:, n:].any()
