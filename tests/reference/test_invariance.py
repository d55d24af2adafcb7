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


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_grouped_linear_row_invariant(ops, gen, fmt):
    e, n, k = 3, 40, 64
    w = torch.randn(e, n, k, generator=gen)
    weight = Weight.dense(w) if fmt == "dense" else quantize_weight_mxfp4(w)
    row = torch.randn(k, generator=gen)
    alone = ops["grouped_linear"](row[None], weight, torch.tensor([0, 1, 0]))[0]
    for sizes in ([0, 1, 0], [4, 9, 2], [20, 18, 1], [0, 33, 5]):
        m = sum(sizes)
        for pos in sorted({sizes[0], sizes[0] + sizes[1] // 2, sizes[0] + sizes[1] - 1}):
            x = _embed(row, m, pos, gen)
            out = ops["grouped_linear"](x, weight, torch.tensor(sizes))
            assert torch.equal(out[pos], alone), (sizes, pos)


@pytest.mark.parametrize("fmt", ["dense", "fp8_block128"])
def test_moe_experts_row_invariant(ops, gen, fmt):
    e, d, i, k = 6, 128, 128, 2
    w13 = torch.randn(e, 2 * i, d, generator=gen) * 0.1
    w2 = torch.randn(e, d, i, generator=gen) * 0.1
    q = quantize_weight_fp8_block128 if fmt == "fp8_block128" else Weight.dense
    w13w, w2w = q(w13), q(w2)
    row = torch.randn(d, generator=gen)
    rid, rw = torch.tensor([4, 1]), torch.tensor([0.7, 0.3])
    alone = ops["moe_experts"](row[None], rid[None], rw[None], w13w, w2w, 1.0)[0]
    for m in (2, 5, 17, 40):
        for pos in sorted({0, m // 3, m - 1}):
            x = _embed(row, m, pos, gen)
            ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)])
            wts = torch.rand(m, k, generator=gen)
            ids[pos], wts[pos] = rid, rw
            out = ops["moe_experts"](x, ids, wts, w13w, w2w, 1.0)
            assert torch.equal(out[pos], alone), (m, pos)


def test_routing_and_norm_rows_invariant(ops, gen):
    e = 32
    row = torch.randn(e, generator=gen)
    bias = torch.randn(e, generator=gen)
    wa, ia = ops["moe_route_topk"](row[None], bias, 6, "sqrtsoftplus", True, 1.5)
    na = ops["rms_norm"](row[None], bias, 1e-6)
    for m in (3, 50, 300):
        x = _embed(row, m, m // 2, gen)
        w, i = ops["moe_route_topk"](x, bias, 6, "sqrtsoftplus", True, 1.5)
        assert torch.equal(w[m // 2], wa[0]) and torch.equal(i[m // 2], ia[0])
        assert torch.equal(ops["rms_norm"](x, bias, 1e-6)[m // 2], na[0])


@pytest.mark.parametrize("k,n", [(7, 5), (33, 3), (13, 5), (100, 3)])
def test_linear_row_invariant_odd_shapes(ops, gen, k, n):
    # MKL edge kernels made these shapes position-dependent inside a tile before K was padded
    w = Weight.dense(torch.randn(n, k, generator=gen))
    x = torch.randn(32, k, generator=gen)
    full = ops["linear"](x, w)
    for i in range(32):
        assert torch.equal(ops["linear"](x[i:i + 1], w)[0], full[i]), i
