"""The position-independent primitives: accuracy against math, and bits independent of the batch."""
import math
import struct

import pytest
import torch

from shuili.hal import numerics as N


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


def _exact_dot_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`N.dot` recomputed with Python integers (no BLAS): the exact sum of the fixed-point products."""
    pa, pb = N.dot_bits(a.shape[-1])
    qa, ea = N.to_fixed(a, pa)
    qb, eb = N.to_fixed(b, pb)
    out = torch.empty(a.shape[0], b.shape[0], dtype=torch.float64)
    for i in range(a.shape[0]):
        for j in range(b.shape[0]):
            s = sum(int(x) * int(y) for x, y in zip(qa[i].tolist(), qb[j].tolist()))
            out[i, j] = math.ldexp(s, int(ea[i]) - pa + int(eb[j]) - pb)
    return out.to(torch.float32)


@pytest.mark.parametrize("k", [1, 7, 64, 577])
def test_dot_is_the_exact_sum_of_its_fixed_point_products(gen, k):
    a = torch.randn(5, k, generator=gen) * torch.logspace(-3, 3, k)
    b = torch.randn(4, k, generator=gen)
    a[1, 0] = 1e4  # an outlier sets its row's grid
    assert torch.equal(N.dot(a, b), _exact_dot_bits(a, b))
    assert N.dot(a, b).sub(a.double() @ b.double().t()).abs().max() < 1e-5 * (a.abs() @ b.abs().t()).max()


@pytest.mark.parametrize("bits,exact", [(None, True), ((30, 30), False)])
def test_blas_sum_of_fixed_point_products_is_exact(gen, bits, exact):
    # with dot_bits the float64 BLAS sum equals the integer sum; with more bits than float64
    # holds (negative control) it does not
    a, b = torch.randn(3, 577, generator=gen), torch.randn(3, 577, generator=gen)
    pa, pb = bits or N.dot_bits(577)
    qa, qb = N.to_fixed(a, pa)[0], N.to_fixed(b, pb)[0]
    blas = torch.matmul(qa, qb.t())
    ints = [[sum(int(x) * int(y) for x, y in zip(r.tolist(), c.tolist())) for c in qb] for r in qa]
    assert all(int(blas[i, j]) == ints[i][j] for i in range(3) for j in range(3)) == exact


def test_dot_rows_independent_of_batch_and_threads(gen):
    w = torch.randn(33, 200, generator=gen)
    row = torch.randn(200, generator=gen)
    alone = N.dot(row[None], w)[0]
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for m in (2, 17, 300):
                x = torch.randn(m, 200, generator=gen) * 100
                x[m // 2] = row
                assert torch.equal(N.dot(x, w)[m // 2], alone)
    finally:
        torch.set_num_threads(threads)


def test_dot_pv_ignores_masked_keys_and_signed_zeros(gen):
    p = torch.softmax(torch.randn(3, 6, generator=gen), -1)
    v = torch.randn(6, 8, generator=gen)
    v[:, 2] = -0.0
    alone = N.dot_pv(p, v)
    # 10 appended keys with weight 0 (their values anything finite) change no bit, nor the zero's sign
    wide = N.dot_pv(torch.cat([p, torch.zeros(3, 10)], 1), torch.cat([v, torch.randn(10, 8, generator=gen)]))
    assert torch.equal(wide, alone) and not torch.signbit(wide[:, 2]).any()
    torch.testing.assert_close(alone.double(), p.double() @ v.double(), rtol=1e-6, atol=1e-7)


def test_sincos_and_pow_accuracy():
    x = torch.linspace(-3e5, 3e5, 100_001, dtype=torch.float32)
    s, c = N.sincos64(x)
    assert (s - torch.sin(x.double())).abs().max() < 1e-14 and (c - torch.cos(x.double())).abs().max() < 1e-14
    y = torch.arange(0, 64, 2).float() / 64
    want = torch.tensor([_f32(10000.0 ** float(v)) for v in y])
    assert (N.pow_f32(10000.0, y) - want).abs().div(want).max() <= 2 ** -23


def _ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    # numpy's sqrt is the hardware's IEEE instruction (correctly rounded), unlike torch.sqrt on MKL
    # builds (MKL VML, whose last bit depends on the CPU)
    import numpy as np

    with np.errstate(invalid="ignore"):
        return torch.from_numpy(np.sqrt(x.numpy()))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    it = torch.int64 if a.dtype == torch.float64 else torch.int32
    return bool(((a.view(it) == b.view(it)) | (torch.isnan(a) & torch.isnan(b))).all())


def test_sqrt_is_correctly_rounded(gen):
    # every 3rd float32 of [1, 4) (both exponent parities: all significands), then a spread of
    # float32 and float64 magnitudes, subnormals and special values
    xf = ((torch.arange(0, 1 << 24, 3, dtype=torch.int64) + (127 << 23)).to(torch.int32)).view(torch.float32)
    assert _same_bits(N.sqrt(xf), _ieee_sqrt(xf))
    specials = [0.0, -0.0, math.inf, -math.inf, -1.0, math.nan, 1.0, 2.0, 0.25]
    x32 = torch.cat([(torch.rand(100_000, generator=gen, dtype=torch.float64) * 280 - 150).exp2().float(),
                     torch.tensor(specials + [1e-45, 1.1754942e-38, 3.4028235e38])])
    got = N.sqrt(x32)
    assert got.dtype == torch.float32 and _same_bits(got, _ieee_sqrt(x32))
    x64 = torch.cat([(torch.rand(100_000, generator=gen, dtype=torch.float64) * 2100 - 1075).exp2(),
                     torch.tensor(specials + [5e-324, 2.2250738585072014e-308, 1.7976931348623157e308],
                                  dtype=torch.float64)])
    assert _same_bits(N.sqrt64(x64), _ieee_sqrt(x64))
    assert _same_bits(N.rsqrt(x32[:1000]), 1.0 / _ieee_sqrt(x32[:1000]))


@pytest.mark.parametrize("ulps", [-8, -1, 1, 8])
def test_sqrt_bits_do_not_depend_on_torch_sqrt(gen, monkeypatch, ulps):
    # torch.sqrt is only a first guess: a library whose sqrt is off by a few ulps (MKL VML on
    # another CPU) must give the same bits
    x = (torch.rand(20_000, generator=gen, dtype=torch.float64) * 400 - 200).exp2()
    x32 = (x * 2.0 ** -100).float()
    want, want32 = N.sqrt64(x), N.sqrt(x32)
    real = torch.sqrt
    monkeypatch.setattr(torch, "sqrt", lambda t: (real(t).view(torch.int64) + ulps).view(torch.float64))
    assert _same_bits(N.sqrt64(x), want)
    assert _same_bits(N.sqrt(x32), want32)
    # negative control: the comparison sees a one-ulp change
    assert not _same_bits(torch.sqrt(x), want)


def test_ceil_log2_is_exact():
    n = torch.cat([torch.arange(1, 70_000), torch.tensor([2 ** 40, 2 ** 40 + 1, 2 ** 53])])
    want = torch.tensor([(int(v) - 1).bit_length() for v in n])
    assert torch.equal(N.ceil_log2(n), want)
