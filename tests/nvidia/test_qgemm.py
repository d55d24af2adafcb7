"""The decode-tuned quantized GEMMs (platforms/nvidia/qgemm.py) against the reference: plain and split K,
run-to-run and batch-invariant bits, and the fused MoE pipeline (GPU, or TRITON_INTERPRET on CPU)."""
import pytest
import torch
import triton
import triton.language as tl

from shuili.hal.types import Weight
from shuili.platforms.nvidia import dequant, gemm, qgemm
from shuili.platforms.nvidia.moe_prep import moe_prep
from shuili.platforms.nvidia.common import interpreting
from shuili.platforms.nvidia.quant import e2m1_bf16_x8, e2m1_x8, e8m0_bf16_pair
from shuili.platforms.reference import quant
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


@triton.jit
def _decode_kernel(w_ptr, s_ptr, f_ptr, b_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    word = tl.load(w_ptr + r[:, None] * 4 + tl.arange(0, 4)[None, :])  # [N, 4] int32: 32 codes a row
    sb = tl.load(s_ptr + r).to(tl.int32)[:, None]
    lo, hi = e2m1_x8(word, sb)
    v = tl.reshape(tl.join(lo, hi), (N, 32))  # K order
    c = tl.arange(0, 32)
    tl.store(f_ptr + r[:, None] * 32 + c[None, :], v)
    tl.store(b_ptr + r[:, None] * 32 + c[None, :], qgemm._to_bf16(v))


def test_mxfp4_decode_every_code_and_scale(device):
    """The dequantized mxfp4 operand is exactly the reference's e2m1 x 2^(s - 127), as float32 and as
    the bf16 the dots take, for all 16 codes at every e8m0 byte: 0 (2^-127, subnormal results),
    1..2 (subnormal code 1), 128..130 (the scale split), 253..254 (overflow to inf), 255 (NaN)."""
    n = 256
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, 2)  # [n, 32]
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [n, 16] bytes, low nibble = even K
    scale = torch.arange(n, dtype=torch.uint8)[:, None]
    want = quant.dequantize_weight(Weight("mxfp4", data, scale, (n, 32)))
    f = torch.empty(n, 32, device=device)
    b = torch.empty(n, 32, dtype=torch.bfloat16, device=device)
    _decode_kernel[(1,)](data.to(device).view(torch.int32), scale.to(device), f, b, N=n)
    f, b = f.cpu(), b.cpu()
    nan = torch.isnan(want)
    assert nan[255].all() and nan.sum() == 32 and torch.isnan(f[255]).all() and torch.isnan(b[255]).all()
    assert torch.equal(f[:255].view(torch.int32), want[:255].view(torch.int32))
    assert torch.equal(b[:255].view(torch.int16), want[:255].to(torch.bfloat16).view(torch.int16))
    assert torch.isinf(want[254]).sum() == 16 and (want[0] != 0).sum() == 28  # the edges are in range


@triton.jit
def _decode_bf16_kernel(w_ptr, s_ptr, b_ptr, N: tl.constexpr, EVEN_ODD: tl.constexpr):
    r = tl.arange(0, N)
    word = tl.load(w_ptr + r[:, None] * 4 + tl.arange(0, 4)[None, :])
    pair = tl.broadcast_to(e8m0_bf16_pair(tl.load(s_ptr + r).to(tl.int32))[:, None], (N, 4))
    lo, hi = e2m1_bf16_x8(word, pair, EVEN_ODD)
    if EVEN_ODD:
        v = tl.reshape(tl.join(tl.reshape(lo, (N, 16)), tl.reshape(hi, (N, 16))), (N, 32))
    else:
        v = tl.reshape(lo, (N, 32))
    tl.store(b_ptr + r[:, None] * 32 + tl.arange(0, 32)[None, :], v)


@pytest.mark.skipif(interpreting(), reason="PTX inline assembly: GPU only (the interpreter takes e2m1_x8)")
@pytest.mark.parametrize("even_odd", [False, True])
def test_mxfp4_bf16_decode_every_code_and_scale(device, even_odd):
    """The inline-PTX decode (byte permutes, bf16 multiplies) the mxfp4 GEMMs use with bf16 activations,
    in K order and as even/odd halves: all 16 codes at every e8m0 byte give the reference's value as
    bf16, bit for bit (NaN as NaN): subnormal products at bytes 0..2, inf at 253..254; negative
    codes in every nibble (the signs come from the word's bytes, not from a table)."""
    n = 256
    # row r: codes p + r (mod 16) at positions p, so every code meets every scale and every nibble
    codes = ((torch.arange(32)[None, :] + torch.arange(n)[:, None]) % 16).to(torch.uint8)
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.arange(n, dtype=torch.uint8)[:, None]
    want = quant.dequantize_weight(Weight("mxfp4", data, scale, (n, 32))).to(torch.bfloat16)
    b = torch.empty(n, 32, dtype=torch.bfloat16, device=device)
    _decode_bf16_kernel[(1,)](data.to(device).view(torch.int32), scale.to(device), b, N=n, EVEN_ODD=even_odd)
    b = b.cpu()
    assert torch.isnan(b[255]).all() and not torch.isnan(b[:255]).any()
    assert torch.equal(b[:255].view(torch.int16), want[:255].view(torch.int16))


@pytest.mark.parametrize("even_odd", [False, True])
def test_qgemm_mxfp4_decodes_agree(device, even_odd):
    """The GEMMs give the same bits with either mxfp4 decode (bf16 activations), with the tile in K
    order and as even/odd halves (qgemm.MXFP4_BF16_EVEN_ODD): on a GPU the PTX one against the float32
    one, under the interpreter the float32 one twice (the switch is ignored)."""
    w = on(weight("mxfp4", (96, 256), seed=52), device, torch.bfloat16)
    x = rnd(24, 256, seed=53).to(torch.bfloat16).to(device)
    e, k = 8, 2
    w13 = on(weight("mxfp4", (e, 2 * 64, 128), seed=54), device, torch.bfloat16)
    w2 = on(weight("mxfp4", (e, 128, 64), seed=55), device, torch.bfloat16)
    xm = rnd(10, 128, seed=56).to(torch.bfloat16).to(device)
    ids = torch.stack([torch.randperm(e, generator=g(57 + i))[:k] for i in range(10)]).to(device)
    wts = torch.softmax(rnd(10, k, seed=58), -1).to(device)
    outs = {}
    keep = qgemm.ASM_E2M1, qgemm.MXFP4_BF16_EVEN_ODD
    qgemm.MXFP4_BF16_EVEN_ODD = even_odd
    try:
        for asm in (False, True):
            qgemm.ASM_E2M1 = asm
            outs[asm] = [gemm.linear(x, w, None, batch_invariant=bi) for bi in (False, True)]
            outs[asm] += [gemm.moe_experts(xm, ids, wts, w13, w2, 10.0, batch_invariant=bi)
                          for bi in (False, True)]
    finally:
        qgemm.ASM_E2M1, qgemm.MXFP4_BF16_EVEN_ODD = keep
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bi", [False, True])
def test_qlinear_mxfp4_extreme_scales(device, dtype, bi):
    """Columns whose e8m0 scales are 0 and 1 (weights near 2^-127: subnormal products), 129..140 (above
    the 2^127 a single float32 factor holds), 255 (NaN) and ordinary ones, against the reference column
    by column (the whole-matrix norm would hide the tiny columns). The decode before this one read
    scale byte 0 as 0 (not 2^-127) and 255 as inf."""
    n, k = 8, 64
    data = torch.randint(0, 256, (n, k // 2), generator=g(50)).to(torch.uint8)
    scale = torch.tensor([[0, 0], [1, 0], [1, 1], [129, 140], [255, 120], [127, 118], [128, 0], [100, 130]],
                         dtype=torch.uint8)
    w = Weight("mxfp4", data, scale, (n, k))
    x = (rnd(5, k, seed=51) * 2.0 ** 100).to(dtype)  # the 2^-127-sized columns come out near 2^-25
    want = REF["linear"](x.float(), w, None)
    got = gemm.linear(x.to(device), on(w, device, dtype), None, batch_invariant=bi).float().cpu()
    assert torch.isnan(want[:, 4]).all() and torch.isnan(got[:, 4]).all()
    for c in (0, 1, 2, 3, 5, 6, 7):
        assert want[:, c].abs().max() > 0 and rel(got[:, c], want[:, c]) < TOL[dtype], c


def test_qgrouped_batch_invariant_rows(device):
    """Batch-invariant grouped GEMM (the 16-row tiles that take mxfp4 as even/odd dots): a row alone in
    its group gets the bits it gets among the others, whatever the group sizes around it."""
    sizes = torch.tensor([3, 0, 17, 1, 9])
    w = on(weight("mxfp4", (5, 64, 256), seed=46), device, torch.float32)
    x = rnd(int(sizes.sum()), 256, seed=47).to(device)
    full = gemm.grouped_linear(x, w, sizes.to(device), batch_invariant=True)
    starts = torch.cumsum(sizes, 0) - sizes
    for grp, r in ((0, 1), (2, 3), (2, 19), (3, 20), (4, 28)):
        one = torch.zeros_like(sizes)
        one[grp] = 1
        got = gemm.grouped_linear(x[r:r + 1], w, one.to(device), batch_invariant=True)
        assert starts[grp] <= r < starts[grp] + sizes[grp] and torch.equal(got, full[r:r + 1])


def test_qlinear_mxfp4_unaligned_data(device):
    """mxfp4 bytes are read as 4-byte words: data viewed at an odd byte offset is copied first
    (qgemm._weight_args), giving the bits of an aligned copy."""
    w = weight("mxfp4", (40, 256), seed=52)
    buf = torch.zeros(w.data.numel() + 1, dtype=torch.uint8)
    buf[1:] = w.data.reshape(-1)
    odd = Weight("mxfp4", buf.to(device)[1:].view(w.data.shape), w.scale.to(device), w.shape)
    assert odd.data.data_ptr() % 4
    x = rnd(3, 256, seed=53).to(device)
    assert torch.equal(gemm.linear(x, odd, None), gemm.linear(x, on(w, device, torch.float32), None))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("bi", [False, True])
def test_qmoe_bf16_hi_lo_planes(device, fmt, bi):
    """bf16 activations: GEMM1 stores the float32 intermediate as bf16 hi and lo planes, GEMM2 dots
    them. Within tolerance of the reference, and the same bits as GEMM2 splitting a float32
    intermediate itself every K step (the scheme the planes replace)."""
    t, e, k, d, inter = 21, 6, 3, 64, 96
    ids = torch.stack([torch.randperm(e, generator=g(210 + i))[:k] for i in range(t)]).to(device)
    wts = torch.softmax(rnd(t, k, seed=48), -1).to(device)
    w13 = on(weight(fmt, (e, 2 * inter, d), seed=49), device, torch.bfloat16)
    w2 = on(weight(fmt, (e, d, inter), seed=50), device, torch.bfloat16)
    x = rnd(t, d, seed=51).to(device, torch.bfloat16)
    got = gemm.moe_experts(x, ids, wts, w13, w2, 1.5, batch_invariant=bi)
    want = REF["moe_experts"](x.float().cpu(), ids.cpu(), wts.cpu(), on(w13, "cpu", torch.float32),
                              on(w2, "cpu", torch.float32), 1.5)
    assert got.dtype == torch.bfloat16 and rel(got, want) < TOL[torch.bfloat16]
    bm = qgemm.group_bm(t * k, e, bi)
    order, _, tiles = moe_prep(ids.reshape(-1), e, bm)
    a = torch.empty(t * k, inter, device=device)
    qgemm._launch(x, w13, a, tiles=tiles, xi=order, topk=k, swiglu=True, limit=1.5, batch_invariant=bi, bm=bm)
    parts = torch.empty(t * k, d, device=device)
    qgemm._launch(a, w2, parts, tiles=tiles, yi=order, yw=wts.reshape(-1), hilo=True, batch_invariant=bi, bm=bm)
    out = torch.empty_like(got)
    qgemm._combine_kernel[(t, 1)](parts, out, d, TOPK=k, BLOCK=d)
    assert torch.equal(got, out)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("tile", [(32, 64, 2, 4), (128, 256, 8, 3), (32, 32, 4, 8)])
def test_qmoe_tile_overrides(device, fmt, tile, monkeypatch):
    """qgemm.MOE_TILES (the knobs benchmarks/nvidia_qgemm.py --sweep-moe tunes) replace BN, BK, warps
    and stages of both default-mode MoE GEMMs: within tolerance with each, and passed to the launch."""
    t, e, k, d, inter = 21, 6, 3, 64, 320  # I = 320: partial BK steps in GEMM2 and partial BN tiles
    ids = torch.stack([torch.randperm(e, generator=g(220 + i))[:k] for i in range(t)]).to(device)
    wts = torch.softmax(rnd(t, k, seed=52), -1).to(device)
    w13 = on(weight(fmt, (e, 2 * inter, d), seed=53), device, torch.bfloat16)
    w2 = on(weight(fmt, (e, d, inter), seed=54), device, torch.bfloat16)
    x = rnd(t, d, seed=55).to(device, torch.bfloat16)
    want = REF["moe_experts"](x.float().cpu(), ids.cpu(), wts.cpu(), on(w13, "cpu", torch.float32),
                              on(w2, "cpu", torch.float32), 1.5)
    seen, launch = [], qgemm._launch
    monkeypatch.setattr(qgemm, "_launch", lambda *a, **kw: seen.append(kw.get("tile")) or launch(*a, **kw))
    monkeypatch.setattr(qgemm, "MOE_TILES", {"gemm1": tile, "gemm2": tile})
    if fmt == "fp8_block128" and 128 % tile[1]:  # a K step would span two weight scales
        with pytest.raises(ValueError, match="BK dividing 128"):
            gemm.moe_experts(x, ids, wts, w13, w2, 1.5, batch_invariant=False)
        return
    if fmt == "mxfp4" and tile[1] < 64:  # wrong values on the GPU (qgemm._launch says where seen)
        with pytest.raises(ValueError, match="mxfp4 with bf16 operands needs BK >= 64"):
            gemm.moe_experts(x, ids, wts, w13, w2, 1.5, batch_invariant=False)
        return
    got = gemm.moe_experts(x, ids, wts, w13, w2, 1.5, batch_invariant=False)
    assert seen == [tile, tile] and rel(got, want) < TOL[torch.bfloat16]
    seen.clear()
    gemm.moe_experts(x, ids, wts, w13, w2, 1.5, batch_invariant=True)  # fixed tiles in this mode
    assert seen == [None, None]


def _kgroup_major(w: Weight) -> Weight:
    return Weight(w.format, w.data, w.scale.transpose(-1, -2).contiguous().transpose(-1, -2), w.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bi", [False, True])
def test_mxfp4_scales_read_through_their_strides(device, dtype, bi):
    """The kernels read mxfp4 scales through their strides: K-group-major scales ([E, K/32, N]
    seen as [E, N, K/32], the layout benchmarks/nvidia_qgemm.py --scale-ab times) give the same
    bits as the loaded row-major ones, in the MoE and the linear."""
    t, e, k, d, inter = 21, 6, 3, 64, 96
    ids = torch.stack([torch.randperm(e, generator=g(230 + i))[:k] for i in range(t)]).to(device)
    wts = torch.softmax(rnd(t, k, seed=56), -1).to(device)
    w13 = on(weight("mxfp4", (e, 2 * inter, d), seed=57), device, dtype)
    w2 = on(weight("mxfp4", (e, d, inter), seed=58), device, dtype)
    p13, p2 = _kgroup_major(w13), _kgroup_major(w2)
    assert p2.scale.stride() == (inter // 32 * d, 1, d) and torch.equal(p2.scale, w2.scale)
    x = rnd(t, d, seed=59).to(device, dtype)
    want = gemm.moe_experts(x, ids, wts, w13, w2, 1.5, batch_invariant=bi)
    assert torch.equal(gemm.moe_experts(x, ids, wts, p13, p2, 1.5, batch_invariant=bi), want)
    lw = on(weight("mxfp4", (72, 320), seed=60), device, dtype)
    xl = rnd(5, 320, seed=61).to(device, dtype)
    assert torch.equal(gemm.linear(xl, _kgroup_major(lw), None, batch_invariant=bi),
                       gemm.linear(xl, lw, None, batch_invariant=bi))


def _regrouped(x, w, bi):
    t, (g, n, k) = x.shape[0], w.shape
    xg = x.reshape(t, g, k).transpose(0, 1).reshape(g * t, k)
    sizes = torch.full((g,), t, dtype=torch.int64, device=x.device)
    y = gemm.grouped_linear(xg, w, sizes, batch_invariant=bi)
    return y.view(g, t, n).transpose(0, 1).reshape(t, g * n)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("bi", [False, True])
@pytest.mark.parametrize("k", [256, 1024])  # 1024: K split in two (the partials' strided layout)
def test_block_diagonal_is_grouped_linear_bits(device, fmt, bi, k, monkeypatch):
    """block_diagonal_linear runs the grouped launch on the blocks where they lie (no regrouping
    copies, no tile map): grouped_linear's bits on the regrouped rows, in both modes, split or not."""
    g, n, t = 3, 80, 5
    w = on(weight(fmt, (g, n, k), seed=63 + k), device, torch.bfloat16)
    x = rnd(t, g * k, seed=64).to(device, torch.bfloat16)
    want = _regrouped(x, w, bi)
    seen, launch = [], qgemm._launch
    monkeypatch.setattr(qgemm, "_launch", lambda *a, **kw: seen.append(kw.get("diag")) or launch(*a, **kw))
    splits, ssum = [], qgemm.splitk.split_sum
    monkeypatch.setattr(qgemm.splitk, "split_sum", lambda p, *a: splits.append(p.shape[0]) or ssum(p, *a))
    got = gemm.block_diagonal_linear(x, w, batch_invariant=bi)
    assert seen == [True] and splits == ([2] if k == 1024 else [])
    assert got.shape == (t, g * n) and torch.equal(got, want)
    ref = REF["block_diagonal_linear"](x.float().cpu(), on(w, "cpu", torch.float32))
    assert rel(got, ref) < TOL[torch.bfloat16]


def test_block_diagonal_dense_takes_grouped_linear(device):
    w = Weight.dense(rnd(2, 24, 64, seed=65).to(device))
    x = rnd(4, 128, seed=66).to(device)
    for bi in (False, True):
        got = gemm.block_diagonal_linear(x, w, batch_invariant=bi)
        assert torch.equal(got, _regrouped(x, w, bi))
        ref = REF["block_diagonal_linear"](x.cpu(), Weight.dense(w.data.cpu()))
        assert rel(got, ref) < TOL[torch.float32]


# ------------------------------------------------- many rows: the dense copy (dequant.py), default mode
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_block128", "fp8_block32"])
@pytest.mark.parametrize("shape", [(70, 96), (3, 40, 160)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_dense_is_the_reference_decode(device, fmt, shape, dtype):
    """The dense copy holds exactly the reference's decoded weight (bf16 holds every such value), with
    partial tiles on both axes and, for mxfp4, the extreme e8m0 bytes (0 = 2^-127, 255 = NaN)."""
    w = weight(fmt, shape, seed=60)
    if fmt == "mxfp4":
        w.scale.view(-1)[:5] = torch.tensor([0, 1, 255, 254, 140], dtype=torch.uint8)
    got = dequant.dense(on(w, device, torch.float32), dtype)
    want = quant.dequantize_weight(w)
    assert got.format == "dense" and got.data.dtype == dtype and tuple(got.data.shape) == tuple(shape)
    assert torch.equal(got.data.float().cpu().nan_to_num(7.0), want.to(dtype).float().nan_to_num(7.0))
    if fmt == "mxfp4":
        assert torch.isnan(got.data.float()).any()  # negative control: the NaN scale came through


def test_dequant_dense_rejects_bad_input():
    with pytest.raises(ValueError, match="not a quantized format"):
        dequant.dense(weight("dense", (4, 32), seed=1))
    with pytest.raises(ValueError, match="bf16 or float32"):
        dequant.dense(weight("mxfp4", (4, 32), seed=1), torch.float16)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_block128", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_many_rows_takes_the_dense_copy(device, fmt, dtype, monkeypatch):
    """Default mode with at least DENSE_MOE_MIN_ROWS rows per expert: both expert weights go dense
    (dequantized, or bf16 experts as they are) through qgemm's MoE pipeline, within tolerance of the
    reference; batch-invariant mode and copies over dequant.MAX_BYTES keep the per-tile decode (bf16
    experts need no copy: only batch-invariant mode keeps them on the composed path)."""
    t, e, k, d, inter = 21, 6, 3, 64, 96
    ids = torch.stack([torch.randperm(e, generator=g(230 + i))[:k] for i in range(t)]).to(device)
    wts = torch.softmax(rnd(t, k, seed=61), -1).to(device)
    w13 = on(weight(fmt, (e, 2 * inter, d), seed=62), device, dtype)
    w2 = on(weight(fmt, (e, d, inter), seed=63), device, dtype)
    x = rnd(t, d, seed=64).to(device, dtype)
    want = REF["moe_experts"](x.float().cpu(), ids.cpu(), wts.cpu(), on(w13, "cpu", torch.float32),
                              on(w2, "cpu", torch.float32), 1.5)
    seen, launch = [], qgemm._launch
    monkeypatch.setattr(qgemm, "_launch",
                        lambda x_, w, *a, **kw: seen.append(w.format) or launch(x_, w, *a, **kw))
    monkeypatch.setattr(gemm, "DENSE_MOE_MIN_ROWS", 1)
    got = gemm.moe_experts(x, ids, wts, w13, w2, 1.5, batch_invariant=False)
    assert seen == ["dense", "dense"] and rel(got, want) < TOL[dtype]
    monkeypatch.setattr(gemm, "DENSE_MOE_MIN_ROWS", t * k // e + 1)  # one row per expert short of it
    seen.clear()
    gemm.moe_experts(x, ids, wts, w13, w2, 1.5, batch_invariant=False)
    assert "dense" not in seen
    monkeypatch.setattr(gemm, "DENSE_MOE_MIN_ROWS", 1)
    for bi, cap in ((True, dequant.MAX_BYTES), (False, 0)):
        monkeypatch.setattr(dequant, "MAX_BYTES", cap)
        seen.clear()
        gemm.moe_experts(x, ids, wts, w13, w2, 1.5, batch_invariant=bi)
        assert seen == ([] if bi else ["dense"] * 2) if fmt == "dense" else seen == [fmt, fmt], (bi, cap)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_block128", "fp8_block32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_many_rows_takes_the_dense_copy(device, fmt, dtype, monkeypatch):
    """Default mode from DENSE_MIN_ROWS rows: the dense copy and torch.matmul, within tolerance of the
    reference; fewer rows and batch-invariant mode decode per tile (bits unchanged)."""
    w = on(weight(fmt, (200, 160), seed=65), device, dtype)
    x, bias = rnd(37, 160, seed=66).to(device, dtype), rnd(200, seed=67).to(device, dtype)
    want = REF["linear"](x.float().cpu(), on(w, "cpu", torch.float32), bias.float().cpu())
    before = {bi: gemm.linear(x, w, bias, batch_invariant=bi) for bi in (False, True)}
    calls, dense = [], dequant.dense
    monkeypatch.setattr(dequant, "dense", lambda *a: calls.append(1) or dense(*a))
    monkeypatch.setattr(gemm, "DENSE_MIN_ROWS", 37)
    got = gemm.linear(x, w, bias, batch_invariant=False)
    assert calls == [1] and got.shape == (37, 200) and got.dtype == dtype and rel(got, want) < TOL[dtype]
    assert torch.equal(gemm.linear(x, w, bias, batch_invariant=True), before[True]) and calls == [1]
    monkeypatch.setattr(gemm, "DENSE_MIN_ROWS", 38)
    assert torch.equal(gemm.linear(x, w, bias, batch_invariant=False), before[False]) and calls == [1]


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_block128", "fp8_block32", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_diagonal_many_rows_takes_the_dense_copy(device, fmt, dtype, monkeypatch):
    """Default mode from DENSE_MIN_ROWS rows: one batched GEMM over the blocks of the dense copy
    (each block as torch.matmul on it), within tolerance of the reference; fewer rows and
    batch-invariant mode keep their path and bits."""
    g_, n, k, t = 3, 40, 96, 37
    w = on(weight(fmt, (g_, n, k), seed=68), device, dtype)
    x = rnd(t, g_ * k, seed=69).to(device, dtype)
    want = REF["block_diagonal_linear"](x.float().cpu(), on(w, "cpu", torch.float32))
    before = {bi: gemm.block_diagonal_linear(x, w, batch_invariant=bi) for bi in (False, True)}
    monkeypatch.setattr(gemm, "DENSE_MIN_ROWS", t)
    got = gemm.block_diagonal_linear(x, w, batch_invariant=False)
    assert got.shape == (t, g_ * n) and got.dtype == dtype and rel(got, want) < TOL[dtype]
    wd = (w.data if fmt == "dense" else dequant.dense(w, dtype).data).to(dtype)
    for b in range(g_):
        blk = torch.matmul(x[:, b * k:(b + 1) * k], wd[b].t())
        assert rel(got[:, b * n:(b + 1) * n], blk) < TOL[dtype], b
    assert torch.equal(gemm.block_diagonal_linear(x, w, batch_invariant=True), before[True])
    monkeypatch.setattr(gemm, "DENSE_MIN_ROWS", t + 1)
    assert torch.equal(gemm.block_diagonal_linear(x, w, batch_invariant=False), before[False])


def test_dense_moe_tiles_reach_the_dense_launches(device, monkeypatch):
    """qgemm.DENSE_MOE_TILES and DENSE_MOE_BM set the dense experts' launches at many rows (64-row
    tiles, or DENSE_MOE_BM's; bf16), within tolerance of the reference; batch-invariant launches and
    float32 activations never read them."""
    t, e, k, d, inter = 40, 2, 2, 64, 32  # 40 rows an expert: 64-row tiles
    ids = torch.stack([torch.randperm(e, generator=g(240 + i))[:k] for i in range(t)]).to(device)
    wts = torch.softmax(rnd(t, k, seed=71), -1).to(device)
    x = rnd(t, d, seed=72).to(device, torch.bfloat16)
    w13 = on(weight("dense", (e, 2 * inter, d), seed=73), device, torch.bfloat16)
    w2 = on(weight("dense", (e, d, inter), seed=74), device, torch.bfloat16)
    want = REF["moe_experts"](x.float().cpu(), ids.cpu(), wts.cpu(), on(w13, "cpu", torch.float32),
                              on(w2, "cpu", torch.float32), 1.5)
    seen, launch = [], qgemm._launch
    monkeypatch.setattr(qgemm, "_launch",
                        lambda *a, **kw: seen.append((kw["bm"], kw["tile"])) or launch(*a, **kw))
    monkeypatch.setattr(qgemm, "DENSE_MOE_TILES", {"gemm1": (64, 32, 4, 2), "gemm2": (32, 64, 4, 2)})
    got = qgemm.moe_experts(x, ids, wts, w13, w2, 1.5, False)
    assert seen == [(64, (64, 32, 4, 2)), (64, (32, 64, 4, 2))] and rel(got, want) < TOL[torch.bfloat16]
    seen.clear()  # qgemm.DENSE_MOE_BM: the tile map's rows, so both launches'
    monkeypatch.setattr(qgemm, "DENSE_MOE_BM", 128)
    got = qgemm.moe_experts(x, ids, wts, w13, w2, 1.5, False)
    assert [bm for bm, _ in seen] == [128, 128] and rel(got, want) < TOL[torch.bfloat16]
    # qgemm.DENSE_MOE_TMA: the weight tiles by tensor descriptor, the same values into the same dots;
    # GEMM1 at 64-column tiles over 32 gate and 32 up rows an expert: the up tile runs into the next
    # expert's rows or past the weight's end (columns never stored); GEMM2's BK 64 past its K of 32
    descs, tma = [], qgemm._tma_weight
    monkeypatch.setattr(qgemm, "_tma_weight", lambda *a: descs.append(a[1:]) or tma(*a))
    monkeypatch.setattr(qgemm, "DENSE_MOE_TMA", True)
    assert torch.equal(qgemm.moe_experts(x, ids, wts, w13, w2, 1.5, False), got)
    assert descs == [(64, 32), (32, 64)]
    monkeypatch.setattr(qgemm, "DENSE_MOE_TILES", {"gemm1": (64, 32, 4, 2), "gemm2": (64, 32, 4, 2)})
    want64 = qgemm.moe_experts(x, ids, wts, w13, w2, 1.5, False)
    monkeypatch.setattr(qgemm, "DENSE_MOE_TMA", False)
    assert torch.equal(qgemm.moe_experts(x, ids, wts, w13, w2, 1.5, False), want64)
    seen.clear()
    qgemm.moe_experts(x, ids, wts, w13, w2, 1.5, True)
    assert seen == [(qgemm.BI_GROUP_BM, None)] * 2
    seen.clear()  # float32 activations: the tiles were chosen for bf16 (shared memory)
    qgemm.moe_experts(x.float(), ids, wts, on(w13, device, torch.float32), on(w2, device, torch.float32), 1.5,
                      False)
    assert seen == [(64, None)] * 2


def test_dense_moe_tiles_from_the_environment(monkeypatch):
    """SHUILI_NVIDIA_DENSE_MOE_TILES gives both GEMMs' tiles; anything else is an error naming the form."""
    name = "SHUILI_NVIDIA_DENSE_MOE_TILES"
    monkeypatch.delenv(name, raising=False)
    assert qgemm._tiles_env(name) is None
    monkeypatch.setenv(name, "128,64,8,3;256,64,8,3")
    assert qgemm._tiles_env(name) == {"gemm1": (128, 64, 8, 3), "gemm2": (256, 64, 8, 3)}
    for bad in ("128,64,8,3", "128,64,8;256,64,8,3", "a,64,8,3;256,64,8,3", "0,64,8,3;256,64,8,3"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match="BN,BK,warps,stages"):
            qgemm._tiles_env(name)
