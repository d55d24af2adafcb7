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


def _spy(monkeypatch, name, seen):
    kernel = getattr(skinny, name)

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(name) or kernel[grid](*a, **kw)

    monkeypatch.setattr(skinny, name, Spy())


def test_split3_partials_are_float32_accurate(device):
    """The three bf16 pieces of w add up to w exactly, so the tensor-core partials are as accurate as
    a float32 sum (conformance's bound: 2e-6 * sum |x w|), where w's bf16 rounding alone is not; a
    row's partials do not depend on the other rows; the last chunk may be short (K = 320)."""
    x = rnd(70, 320, seed=50).to(torch.bfloat16)
    w = rnd(24, 320, seed=51) * torch.logspace(-2, 2, 320)  # full float32 significands, many scales
    tile = (64, 128, 4, 3)
    p = skinny.split3_partials(x.to(device), w.to(device), sumsq=True, tile=tile).cpu()
    assert p.shape == (3, 70, 25)
    want = x.double() @ w.double().t()
    bound = 2e-6 * (x.double().abs() @ w.double().abs().t())
    assert ((p[:, :, :24].double().sum(0) - want).abs() <= bound).all()
    assert ((x.double() @ w.bfloat16().double().t() - want).abs() > bound).any()  # one piece is not enough
    ss = (x.double() ** 2).sum(1)
    assert ((p[:, :, 24].double().sum(0) - ss).abs() <= 2e-6 * ss).all()
    for i in (0, 69):
        one = skinny.split3_partials(x[i:i + 1].to(device), w.to(device), sumsq=True, tile=tile).cpu()
        assert torch.equal(one[:, 0], p[:, i])


def test_split3_partials_checks_arguments(device):
    w = rnd(24, 256, seed=52).to(device)
    with pytest.raises(ValueError, match="bf16 x"):
        skinny.split3_partials(rnd(4, 256, seed=53).to(device), w)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        skinny.split3_partials(rnd(4, 256, seed=53).to(device).bfloat16(), w, tile=(64, 96, 4, 3))


@pytest.mark.parametrize("t,bi,kernel", [(40, False, "_split3_kernel"), (39, False, "_partials_kernel"),
                                         (40, True, "_partials_kernel")])
def test_hc_mix_takes_tensor_cores_only_at_many_rows_in_default_mode(device, monkeypatch, t, bi, kernel):
    """Default mode runs the tensor-core partials from SPLIT3_MIN_ROWS rows of bf16 streams (40
    here, to keep the interpreter quick); fewer rows and batch-invariant mode keep the FMA kernel and
    its bits. Both agree with the reference as float32 sums do."""
    from shuili.hal.types import Weight
    from shuili.platforms.nvidia import mhc
    from shuili.platforms.reference.public import OPS as REF

    monkeypatch.setattr(skinny, "SPLIT3_MIN_ROWS", 40)
    monkeypatch.setattr(skinny, "SPLIT3_TILE", (64, 128, 4, 3))
    seen = []
    for name in ("_split3_kernel", "_partials_kernel"):
        _spy(monkeypatch, name, seen)
    x = (rnd(t, 4, 64, seed=54) * torch.logspace(-1, 1, 4)[:, None]).to(torch.bfloat16)
    fn = Weight.dense(rnd(24, 256, seed=55) / 16)
    scale, base = torch.tensor([0.5, 1.0, 2.0]), rnd(24, seed=56) * 0.5
    on = lambda *a: [v.to(device) for v in a]  # noqa: E731
    got = mhc.hc_mix(*on(x, fn, scale, base), 20, 1e-6, 1e-6, batch_invariant=bi)
    assert seen == [kernel]
    want = REF["hc_mix"](x.float(), fn, scale, base, 20, 1e-6, 1e-6)
    for a, b in zip(got, want):
        assert float((a.cpu().double() - b.double()).norm() / b.double().norm()) < 2e-5
