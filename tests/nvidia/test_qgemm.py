"""The decode-tuned quantized GEMMs (platforms/nvidia/qgemm.py) against the reference: plain and split K,
run-to-run and batch-invariant bits, and the fused MoE pipeline (GPU, or TRITON_INTERPRET on CPU)."""
import pytest
import torch

from shuili.platforms.nvidia import gemm, qgemm
from shuili.platforms.reference.ops import OPS as REF

from test_kernels import DTYPES, TOL, g, on, rel, rnd, weight

FMTS = ["fp8_block128", "mxfp4"]


@pytest.fixture(autouse=True)
def _qgemm_on(monkeypatch):
    # on by default; SHUILI_NVIDIA_QGEMM=0 in the environment must not skip these tests
    monkeypatch.setattr(gemm, "USE_QGEMM", True)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("bi", [False, True])
@pytest.mark.parametrize("m", [1, 20])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qlinear(device, fmt, bi, m, dtype):
    assert gemm.USE_QGEMM and qgemm.supports(weight(fmt, (8, 64), seed=0))
    w = weight(fmt, (72, 320), seed=30 + m)  # K=320: a partial 128-block (fp8) and a partial BK step
    x, bias = rnd(m, 320, seed=31).to(dtype), rnd(72, seed=32).to(dtype)
    want = REF["linear"](x.float(), on(w, "cpu", torch.float32), bias.float())
    got = gemm.linear(x.to(device), on(w, device, dtype), bias.to(device), batch_invariant=bi)
    assert got.dtype == dtype and rel(got, want) < TOL[dtype]


@pytest.mark.parametrize("fmt", FMTS)
def test_qlinear_split_k_default_mode(device, fmt, monkeypatch):
    """Default mode cuts K (fixed chunks, partials added in chunk order): within tolerance, and the
    same bits run to run."""
    monkeypatch.setattr(qgemm, "MIN_KC", 128)
    assert qgemm.split_for(2, 640, 128, 264) == (5, 128) and qgemm.split_for(300, 640, 128, 264) == (1, 640)
    w = weight(fmt, (40, 640), seed=33)
    x, bias = rnd(9, 640, seed=34), rnd(40, seed=35)
    want = REF["linear"](x, on(w, "cpu", torch.float32), bias)
    wd = on(w, device, torch.float32)
    got = gemm.linear(x.to(device), wd, bias.to(device))
    assert rel(got, want) < TOL[torch.float32]
    assert torch.equal(got, gemm.linear(x.to(device), wd, bias.to(device)))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qlinear_batch_invariant_rows(device, fmt, dtype, monkeypatch):
    """Batch-invariant mode: a row's bits do not depend on M or its position, with K split (the
    split comes from the weight's shape alone)."""
    # chunks of 3 and 2 BK steps: chunks of one step would add the same partials in the same order
    # as no split, so a row that skipped the split would go unnoticed
    monkeypatch.setattr(qgemm, "MIN_KC", 256)
    monkeypatch.setattr(qgemm, "BI_MIN_PROGRAMS", 64)
    assert qgemm.bi_split(40, 640) == (2, 384)
    w = on(weight(fmt, (40, 640), seed=36), device, dtype)
    x = rnd(70, 640, seed=37).to(device, dtype)
    bias = rnd(40, seed=38).to(device, dtype)
    full = gemm.linear(x, w, bias, batch_invariant=True)
    want = REF["linear"](x.float().cpu(), on(w, "cpu", torch.float32), bias.float().cpu())
    assert rel(full, want) < TOL[dtype]
    for lo, hi in ((0, 1), (33, 34), (69, 70), (5, 40)):
        assert torch.equal(gemm.linear(x[lo:hi], w, bias, batch_invariant=True), full[lo:hi])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("bi", [False, True])
def test_qmoe(device, fmt, bi):
    """Fused MoE (gathered GEMM1 + SwiGLU epilogue, weighted scatter GEMM2, ordered combine)
    against the reference; in batch-invariant mode a token alone gets the bits it gets in the batch."""
    t, e, k, d, inter = 21, 6, 3, 64, 96
    ids = torch.stack([torch.randperm(e, generator=g(200 + i))[:k] for i in range(t)])
    wts = torch.softmax(rnd(t, k, seed=40), -1)
    w13, w2 = weight(fmt, (e, 2 * inter, d), seed=41), weight(fmt, (e, d, inter), seed=42)
    x = rnd(t, d, seed=43)
    want = REF["moe_experts"](x, ids, wts, w13, w2, 1.5)  # a small limit: the clamps bite
    w13d, w2d = on(w13, device, torch.float32), on(w2, device, torch.float32)
    args = (ids.to(device), wts.to(device), w13d, w2d, 1.5)
    got = gemm.moe_experts(x.to(device), *args, batch_invariant=bi)
    assert rel(got, want) < 1e-4
    nolim = gemm.moe_experts(x.to(device), *args[:-1], None, batch_invariant=bi)
    assert rel(nolim, REF["moe_experts"](x, ids, wts, w13, w2, None)) < 1e-4
    assert not torch.equal(nolim, got)  # negative control: the limit is applied
    if bi:
        for i in (0, 13):
            one = gemm.moe_experts(x[i:i + 1].to(device), ids[i:i + 1].to(device), wts[i:i + 1].to(device),
                                   w13d, w2d, 1.5, batch_invariant=True)
            assert torch.equal(one, got[i:i + 1])


@pytest.mark.parametrize("fmt", FMTS)
def test_qgrouped(device, fmt):
    sizes = torch.tensor([3, 0, 17, 1, 9])
    w = weight(fmt, (5, 64, 256), seed=44)
    x = rnd(int(sizes.sum()), 256, seed=45)
    for bi in (False, True):
        got = gemm.grouped_linear(x.to(device), on(w, device, torch.float32), sizes.to(device), batch_invariant=bi)
        assert rel(got, REF["grouped_linear"](x, w, sizes)) < TOL[torch.float32]
