"""compress_pool on the reference platform: the contract's formula, the overlap layout, skipped entries."""
import pytest
import torch

from shuili.platforms.reference.ops import OPS

pool = OPS["compress_pool"]


def naive(state, src, out, offset, dim, overlap):
    """float64, one entry and one token at a time, straight from the contract's docstring."""
    n, span = src.shape
    y = torch.zeros(n, dim, dtype=torch.float64)
    for i in range(n):
        if out[i] < 0:
            continue
        kvs, gates = [], []
        for j in range(span):
            s = int(src[i, j])
            if s < 0:
                continue
            shift = dim if overlap and j >= span // 2 else 0
            k0 = offset + shift
            g0 = k0 + (2 * dim if overlap else dim)
            kvs.append(state[s, k0:k0 + dim].double())
            gates.append(state[s, g0:g0 + dim].double())
        if kvs:
            w = torch.softmax(torch.stack(gates), dim=0)
            y[i] = (w * torch.stack(kvs)).sum(0)
    return y


@pytest.mark.parametrize("overlap,span", [(True, 8), (False, 4), (False, 128), (True, 2)])
def test_matches_the_contract(overlap, span):
    g = torch.Generator().manual_seed(span)
    dim, off, n = 16, 3, 11
    state = torch.randn(40, off + 4 * dim + 2, generator=g) * 3
    src = torch.randint(0, 40, (n, span), generator=g)
    src[2] = -1
    src[5, :span // 2] = -1
    out = torch.arange(n)
    out[[0, 7]] = -1
    got = pool(state, src, out, off, dim, overlap)
    assert got.dtype == torch.float32 and got.shape == (n, dim)
    assert torch.allclose(got.double(), naive(state, src, out, off, dim, overlap), rtol=1e-5, atol=1e-6)
    assert (got[[0, 2, 7]] == 0).all()


def test_overlap_reads_each_half_of_the_channels():
    dim = 2
    state = torch.zeros(2, 4 * dim)
    state[0, :dim] = 1.0  # token 0 (previous block): kv from the first half
    state[0, dim:2 * dim] = 100.0  # ... never the second
    state[1, dim:2 * dim] = 5.0  # token 1 (this block): kv from the second half
    state[1, :dim] = -100.0
    got = pool(state, torch.tensor([[0, 1]]), torch.tensor([0]), 0, dim, True)
    assert torch.allclose(got, torch.full((1, dim), 3.0))  # equal gates: the mean of 1 and 5


def test_a_token_row_changes_only_its_entry():
    g = torch.Generator().manual_seed(0)
    state = torch.randn(20, 32, generator=g)
    src = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    out = torch.tensor([0, 1])
    a = pool(state, src, out, 0, 16, False)
    state[5] += 1.0
    b = pool(state, src, out, 0, 16, False)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="cannot hold"):
        pool(torch.zeros(4, 10), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0, 4, True)
    with pytest.raises(ValueError, match="even"):
        pool(torch.zeros(4, 16), torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0, 4, True)
