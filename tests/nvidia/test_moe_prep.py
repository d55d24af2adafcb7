"""The one-launch MoE routing prep (three launches over chunks at prefill sizes) against torch's
stable argsort and the torch tile map: the same permutation, counts and tile map (so the expert
GEMMs see the same rows in the same order); and the one-launch tile map of grouped_linear against
the same torch tile map."""
import pytest
import torch

from shuili.hal.types import Weight
from shuili.platforms.nvidia import gemm
from shuili.platforms.nvidia import moe_prep as mp
from shuili.platforms.nvidia.moe_prep import (CHUNK_ROWS, MAX_GROUPS, MAX_ROWS, _group_tiles_torch, group_tiles,
                                              moe_prep)


@pytest.mark.parametrize("n,e,bm", [(1, 32, 16), (6, 8, 64), (384, 32, 16), (384, 32, 64), (512, 256, 16),
                                    (1537, 256, 16), (MAX_ROWS, 32, 64), (100, 3, 16)])
def test_prep_equals_stable_sort_and_group_tiles(device, n, e, bm):
    g = torch.Generator().manual_seed(n + e + bm)
    flat = torch.randint(0, e, (n,), generator=g)
    if n > 10:
        flat[: n // 3] = 1  # one crowded expert, several empty ones for small e
    _assert_sorted_like_torch(flat, e, bm, *moe_prep(flat.to(device), e, bm))


def _assert_sorted_like_torch(flat, e, bm, order, sizes, tiles):
    """moe_prep's outputs equal the stable argsort, the counts and the torch tile map of flat."""
    want_sizes = torch.bincount(flat, minlength=e)
    assert torch.equal(order.cpu(), torch.argsort(flat, stable=True))
    assert torch.equal(sizes.cpu(), want_sizes)
    want = _group_tiles_torch(want_sizes, flat.numel(), bm)
    assert tiles[3] == want[3]
    for got, exp in zip(tiles[:3], want[:3]):
        assert torch.equal(got.cpu(), exp)


@pytest.mark.parametrize("n,e,bm", [(MAX_ROWS + 1, 8, 64), (3 * CHUNK_ROWS, 32, 64), (8192 * 6, 32, 64),
                                    (5000, 256, 16), (2 * CHUNK_ROWS + 7, 3, 16)])
def test_prefill_sizes_take_the_chunks(device, monkeypatch, n, e, bm):
    """Past MAX_ROWS the three chunked launches give the stable sort's permutation, the counts and
    the tile map, with no sort: mid-v4's 4k prefill (2 x 4,096 tokens, 6 experts each), a last
    chunk of 7 rows, an expert owning a third of the rows, empty experts."""
    g = torch.Generator().manual_seed(n + e)
    flat = torch.randint(0, e, (n,), generator=g)
    flat[n // 3: 2 * n // 3] = 1
    monkeypatch.setattr(torch, "argsort", lambda *a, **k: pytest.fail("torch's sort used"))
    got = moe_prep(flat.to(device), e, bm)
    monkeypatch.undo()
    _assert_sorted_like_torch(flat, e, bm, *got)


@pytest.mark.parametrize("sizes,bm", [([64, 64, 64, 64], 16), ([3], 64), ([0, 5, 0, 17, 1, 0], 16),
                                      ([0, 0, 0], 16), ([129, 0, 64, 63, 65], 64), ("random", 16),
                                      ("max", 64)])
def test_group_tiles_kernel_equals_torch(device, sizes, bm):
    """grouped_linear's tile map (one launch) equals the torch one: uniform groups (mid-v4's wo_a:
    4 groups of the batch's rows), empty groups, tiles that end mid-group, up to MAX_GROUPS."""
    g = torch.Generator().manual_seed(7)
    if sizes == "random":
        gs = torch.randint(0, 40, (300,), generator=g)
    elif sizes == "max":
        gs = torch.randint(0, 3, (MAX_GROUPS,), generator=g)
    else:
        gs = torch.tensor(sizes)
    m = int(gs.sum())
    got = group_tiles(gs.to(device), m, bm)
    want = _group_tiles_torch(gs, m, bm)
    assert got[3] == want[3]
    for a, b in zip(got[:3], want[:3]):
        assert a.dtype == torch.int64 and torch.equal(a.cpu(), b)


def test_grouped_linear_takes_one_launch_for_its_tile_map(device, monkeypatch):
    """Only _tiles_kernel builds the tile map (the torch path is not called) on a Triton device."""
    monkeypatch.setattr(gemm, "USE_QGEMM", False)
    monkeypatch.setattr(mp, "_group_tiles_torch", lambda *a: pytest.fail("torch tile map used"))
    w = torch.randn(4, 32, 64)
    x = torch.randn(4 * 5, 64)
    y = gemm.grouped_linear(x.to(device), Weight.dense(w.to(device)), torch.full((4,), 5).to(device))
    want = torch.einsum("gtk,gnk->gtn", x.view(4, 5, 64).double(), w.double()).reshape(20, 32)
    assert torch.allclose(y.cpu().double(), want, rtol=1e-4, atol=1e-4)
