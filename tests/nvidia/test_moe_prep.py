"""The one-launch MoE routing prep against torch's stable argsort and gemm.group_tiles: the same
permutation, counts and tile map (so the expert GEMMs see the same rows in the same order)."""
import pytest
import torch

from shuili.platforms.nvidia import gemm
from shuili.platforms.nvidia.moe_prep import MAX_ROWS, moe_prep


@pytest.mark.parametrize("n,e,bm", [(1, 32, 16), (6, 8, 64), (384, 32, 16), (384, 32, 64), (512, 256, 16),
                                    (1537, 256, 16), (MAX_ROWS, 32, 64), (100, 3, 16)])
def test_prep_equals_stable_sort_and_group_tiles(device, n, e, bm):
    g = torch.Generator().manual_seed(n + e + bm)
    flat = torch.randint(0, e, (n,), generator=g)
    if n > 10:
        flat[: n // 3] = 1  # one crowded expert, several empty ones for small e
    order, sizes, tiles = moe_prep(flat.to(device), e, bm)
    want_sizes = torch.bincount(flat, minlength=e)
    assert torch.equal(order.cpu(), torch.argsort(flat, stable=True))
    assert torch.equal(sizes.cpu(), want_sizes)
    want = gemm.group_tiles(want_sizes, n, bm)
    assert tiles[3] == want[3]
    for got, exp in zip(tiles[:3], want[:3]):
        assert torch.equal(got.cpu(), exp)


def test_prefill_sizes_take_the_sort(device):
    flat = torch.randint(0, 8, (MAX_ROWS + 1,), generator=torch.Generator().manual_seed(1))
    order, sizes, _ = moe_prep(flat.to(device), 8, 64)
    assert torch.equal(order.cpu(), torch.argsort(flat, stable=True))
