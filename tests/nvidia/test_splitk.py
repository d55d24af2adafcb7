"""Split-K's ordered sum (platforms/nvidia/splitk.py), the one every split-K GEMM of the platform
runs: the partials added in chunk order, then the bias, bit for bit (GPU, or TRITON_INTERPRET)."""
import pytest
import torch

from shuili.platforms.nvidia import skinny, splitk

from test_kernels import rnd


@pytest.mark.parametrize("bias", [False, True])
def test_split_sum_adds_in_chunk_order(device, bias):
    p = rnd(5, 37, 29, seed=1) * torch.logspace(-3, 3, 5)[:, None, None]  # orders of magnitude apart
    b = rnd(29, seed=2) if bias else None
    want = p[0].clone()
    for s in range(1, 5):
        want += p[s]  # float32, one add at a time: the contract of the sum's order
    if bias:
        want += b
    y = torch.empty(37, 40, device=device)[:, :29]  # a strided output (row stride 40)
    got = splitk.split_sum(p.to(device), b.to(device) if bias else None, y)
    assert got is y and torch.equal(got.cpu(), want)
    assert not torch.equal(got.cpu(), p.sum(0) + (b if bias else 0))  # another order gives other bits


def test_skinny_linear_is_its_partials_summed(device):
    x, w = rnd(5, 2048, seed=45).to(device), rnd(32, 2048, seed=46).to(device)
    p = skinny.partials(x, w)
    assert p.shape[0] == 2048 // skinny.chunk(2048)
    y = skinny.linear(x, w, None, torch.empty(5, 32, device=device))
    assert torch.equal(y, splitk.split_sum(p, None, torch.empty(5, 32, device=device)))


def test_skinny_tile_may_name_stages(device, monkeypatch):
    """skinny.TILE's optional 5th element sets the kernel's pipeline stages (benchmarks/nvidia_skinny.py
    sweeps it); the chunking, and so the partials, are the same."""
    x, w = rnd(5, 2048, seed=47).to(device), rnd(24, 2048, seed=48).to(device)
    want = skinny.partials(x, w, sumsq=True)
    seen, kernel = [], skinny._partials_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw.get("num_stages")) or kernel[grid](*a, **kw)

    monkeypatch.setattr(skinny, "_partials_kernel", Spy())
    got = skinny.partials(x, w, sumsq=True, tile=skinny.TILE[:4] + (1,))
    assert seen == [1] and torch.equal(got, want)


def test_skinny_tile_keeps_tiny_v4_chunking():
    """nvidia's locked tiny-v4 baseline was recorded with the tile (16, 128, 32, 4): a TILE that cut
    tiny-v4's skinny K (the mHC mixes' m * D, the router's D) otherwise would change its bits."""
    from shuili.core.models.deepseek_v4_config import named

    cfg = named("tiny-v4")
    for k in (cfg.hc_mult * cfg.hidden_size, cfg.hidden_size):
        assert skinny.chunk(k) == skinny.chunk(k, (16, 128, 32, 4)), k
