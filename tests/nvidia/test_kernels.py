"""NVIDIA kernels against the reference ops, at small shapes (GPU, or TRITON_INTERPRET on CPU)."""
import math

import pytest
import torch

from shuili.hal.types import Weight
from shuili.platforms.reference.ops import OPS as REF
from shuili.platforms.nvidia import (attention, common, compress, gemm, indexer, mhc, misc, moe, norm_rope, quant,
                                     sampling, sparse_group)

DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def g(seed):
    return torch.Generator().manual_seed(seed)


def rnd(*shape, seed=0, std=1.0):
    return torch.randn(*shape, generator=g(seed)) * std


# ------------------------------------------------------------------------------------ quantized KV
@pytest.mark.parametrize("fmt", ["mxfp8", "fp4_e4m3", "mxfp4"])
@pytest.mark.parametrize("d", [32, 128])
def test_kv_quantize_bitwise(device, fmt, d):
    x = rnd(19, d, seed=d) * torch.logspace(-5, 3, 19)[:, None]
    x[1] = 0.0
    x[2, :5] = torch.tensor([0.25, 0.75, -1.25, 5.0, -0.0])  # e2m1 ties
    want = REF["kv_quantize"](x, fmt)
    got = quant.kv_quantize(x.to(device), fmt).cpu()
    assert torch.equal(got, want), f"{fmt}: {(got != want).sum()} bytes differ"
    back = quant.kv_dequantize(want.to(device), fmt, d).cpu()
    assert torch.equal(back.view(torch.int32), REF["kv_dequantize"](want, fmt, d).view(torch.int32))
    for dt in (torch.bfloat16, torch.float16):  # 16-bit rows: read as they are, packed as float32 values
        xs = (x * 1e-2 if dt == torch.float16 else x).to(dt)
        assert torch.equal(quant.kv_quantize(xs.to(device), fmt).cpu(), REF["kv_quantize"](xs.float(), fmt))


# ------------------------------------------------------------------------------ block-table lookups
@pytest.mark.parametrize("shape", ["flat", "window", "empty"])
def test_paged_slots(device, shape):
    """One kernel, the reference's slots bit for bit: entries before 0, past the table and in -1
    blocks, a window broadcast ([T, 1] against [T, W]), a strided table, an empty batch."""
    gen = g(7)
    bt = torch.randint(-1, 90, (6, 9), generator=gen, dtype=torch.int32)
    if shape == "flat":
        seq, pos = torch.randint(0, 6, (200,), generator=gen), torch.randint(-20, 50, (200,), generator=gen)
    elif shape == "window":
        seq = torch.randint(0, 6, (13, 1), generator=gen)
        pos = torch.randint(-20, 50, (13, 128), generator=gen)
    else:
        seq, pos = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    want = REF["paged_slots"](bt, seq, pos, 5)
    wide = torch.stack([bt, bt], 2)[:, :, 0]  # the same table as a strided view
    for table in (bt, wide):
        got = misc.paged_slots(table.to(device), seq.to(device), pos.to(device), 5).cpu()
        assert got.dtype == torch.int64 and got.shape == want.shape and torch.equal(got, want)
    if shape == "flat":
        assert (want == -1).any() and (want >= 0).any()
        with pytest.raises(ValueError, match="seq_idx must lie in"):
            misc.paged_slots(bt, torch.tensor([6]), torch.tensor([0]), 5)


# ------------------------------------------------------------------------------ KV compression
@pytest.mark.parametrize("overlap,span,dim", [(True, 8, 64), (False, 128, 32), (False, 2, 128), (True, 2, 16)])
def test_compress_pool(device, overlap, span, dim):
    n, off = 37, 5
    gen = g(span + dim)
    state = torch.randn(300, off + (4 if overlap else 2) * dim + 3, generator=gen) * 2
    src = torch.randint(0, 300, (n, span), generator=gen)
    src[3, :] = -1  # no token at all: zeros
    src[4, : span // 2] = -1  # tokens before the sequence
    out = torch.arange(n) * 7
    out[[1, 6, 30]] = -1  # not completed: zeros, nothing read
    want = REF["compress_pool"](state, src, out, off, dim, overlap)
    got = compress.compress_pool(state.to(device), src.to(device), out.to(device), off, dim, overlap).cpu()
    assert rel(got, want) < 1e-5
    assert (got[[1, 3, 6, 30]] == 0).all() and (got[4] != 0).any()
    for i in (0, 4, n - 1):  # each entry alone gives its row of the batch, bit for bit
        one = compress.compress_pool(state.to(device), src[i:i + 1].to(device), out[i:i + 1].to(device), off, dim,
                                     overlap).cpu()
        assert torch.equal(one, got[i:i + 1])


# ------------------------------------------------------------------------------ norms and rotary
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms(device, dtype):
    x, r, w = rnd(7, 96, seed=1), rnd(7, 96, seed=2, std=4), rnd(96, seed=3, std=0.2) + 1
    xs = [t.to(dtype) for t in (x, r, w)]
    got = norm_rope.rms_norm(xs[0].to(device), xs[2].to(device), 1e-6)
    assert rel(got, REF["rms_norm"](xs[0].float(), xs[2].float(), 1e-6)) < TOL[dtype]
    y, s = norm_rope.add_rms_norm(xs[0].to(device), xs[1].to(device), None, 1e-6)
    ry, rs = REF["add_rms_norm"](xs[0].float(), xs[1].float(), None, 1e-6)
    assert rel(y, ry) < TOL[dtype] and rel(s, rs) < TOL[dtype]
    assert norm_rope.rms_norm(xs[0].view(7, 3, 32).to(device), None, 1e-5).shape == (7, 3, 32)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("rope_dim,d", [(16, 48), (54, 54)])
def test_rope(device, interleaved, inverse, rope_dim, d):
    half = rope_dim // 2
    ang = torch.arange(64, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(half) * 2 / rope_dim)
    args = (rnd(5, 3, d, seed=4), torch.tensor([0, 3, 63, 7, 7]), ang.cos().float(), ang.sin().float())
    got = norm_rope.rope(*[a.to(device) for a in args], rope_dim, interleaved, inverse)
    want = REF["rope"](*args, rope_dim, interleaved, inverse)
    assert rel(got, want) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_may_overwrite(device, dtype):
    """The hint rotates x in place and returns it, with the copy's bits; without it x is left alone,
    and a strided x is rotated in the contiguous copy the op makes anyway."""
    half, d = 32, 512
    ang = torch.arange(64, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(half) * 2 / 64)
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    pos = torch.tensor([0, 3, 63, 7, 7]).to(device)
    x = rnd(5, 16, d, seed=4).to(device=device, dtype=dtype)
    keep = x.clone()
    want = norm_rope.rope(x, pos, cos, sin, 64, True, True)
    assert torch.equal(x, keep)
    got = norm_rope.rope(x, pos, cos, sin, 64, True, True, may_overwrite=True)
    assert got.data_ptr() == x.data_ptr() and torch.equal(got, want)
    wide = torch.cat([keep, keep], dim=2)
    strided = norm_rope.rope(wide[:, :, :d], pos, cos, sin, 64, True, True)
    assert torch.equal(strided, want) and torch.equal(wide[:, :, :d], keep)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("h,d,rope_dim,weighted",
                         [(16, 512, 64, False), (1, 512, 64, True), (3, 96, 96, True)])
@pytest.mark.parametrize("rows", [1, 3])
def test_rms_norm_rope(device, dtype, interleaved, h, d, rope_dim, weighted, rows, monkeypatch):
    """The bits of rms_norm then rope on this platform (one launch for 16-bit rows, `rows` rows a
    program: 5 tokens of h heads, so 3 leaves a ragged last program at h = 1 and 16); the
    reference's values."""
    monkeypatch.setattr(norm_rope, "NORM_ROPE_ROWS", rows)
    monkeypatch.setattr(norm_rope, "NORM_ROPE_MIN_ROWS", 1)
    half = rope_dim // 2
    ang = torch.arange(64, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(half) * 2 / rope_dim)
    cos, sin = ang.cos().float(), ang.sin().float()
    x = (rnd(5, h, d, seed=d) * torch.logspace(-2, 2, 5)[:, None, None]).to(dtype)
    w = rnd(d, seed=1, std=0.3) + 1 if weighted else None
    pos = torch.tensor([0, 3, 63, 7, 7])
    on = lambda *a: [v.to(device) if v is not None else None for v in a]  # noqa: E731
    got = norm_rope.rms_norm_rope(*on(x, w), 1e-6, *on(pos, cos, sin), rope_dim, interleaved)
    xd, wd, pd, cd, sd = on(x, w, pos, cos, sin)
    two = norm_rope.rope(norm_rope.rms_norm(xd, wd, 1e-6), pd, cd, sd, rope_dim, interleaved)
    assert got.dtype == dtype and got.shape == x.shape and torch.equal(got, two)
    want = REF["rms_norm_rope"](x.float(), w, 1e-6, pos, cos, sin, rope_dim, interleaved)
    assert rel(got, want) < TOL[dtype]
    if common.interpreting():  # the one-launch kernel (16-bit rows on the GPU) on float32 rows: its logic
        one = norm_rope._fused(xd, wd, 1e-6, pd, cd, sd, rope_dim, interleaved)
        assert torch.equal(one, two)


# --------------------------------------------------------------------------------------- GEMMs
def weight(fmt, shape, seed):
    *lead, n, k = shape
    if fmt == "dense":
        return Weight.dense(rnd(*shape, seed=seed, std=k ** -0.5))
    if fmt in ("fp8_block128", "fp8_block32"):
        b = 128 if fmt == "fp8_block128" else 32
        data = rnd(*shape, seed=seed, std=2.0).clamp(-448, 448).to(torch.float8_e4m3fn)
        exps = torch.randint(-8, 1, (*lead, math.ceil(n / b), math.ceil(k / b)), generator=g(seed))
        return Weight(fmt, data, torch.pow(2.0, exps.float()), tuple(shape))
    data = torch.randint(0, 256, (*lead, n, k // 2), generator=g(seed)).to(torch.uint8)
    scale = torch.randint(118, 126, (*lead, n, k // 32), generator=g(seed + 1)).to(torch.uint8)
    return Weight("mxfp4", data, scale, tuple(shape))


def on(w: Weight, device, dtype):
    data = w.data.to(device)
    if w.format == "dense":
        data = data.to(dtype)
    return Weight(w.format, data, None if w.scale is None else w.scale.to(device), w.shape)


@pytest.mark.parametrize("fmt", ["dense", "fp8_block128", "fp8_block32", "mxfp4"])
@pytest.mark.parametrize("bi", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear(device, fmt, bi, dtype):
    w = weight(fmt, (200, 160), seed=5)
    x, bias = rnd(37, 160, seed=6).to(dtype), rnd(200, seed=7).to(dtype)
    want = REF["linear"](x.float(), on(w, "cpu", torch.float32), bias.float())
    got = gemm.linear(x.to(device), on(w, device, dtype), bias.to(device), batch_invariant=bi)
    assert got.dtype == dtype and rel(got, want) < TOL[dtype]


@pytest.mark.parametrize("fmt", ["dense", "fp8_block32", "mxfp4"])
def test_linear_batch_invariant(device, fmt):
    w = on(weight(fmt, (96, 128), seed=8), device, DTYPES[-1])
    x = rnd(70, 128, seed=9).to(device, DTYPES[-1])
    full = gemm.linear(x, w, batch_invariant=True)
    for i in (0, 33, 69):
        assert torch.equal(gemm.linear(x[i:i + 1], w, batch_invariant=True), full[i:i + 1])


@pytest.mark.parametrize("fmt", ["dense", "fp8_block128", "fp8_block32", "mxfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_batch_invariant_split_k(device, fmt, dtype, monkeypatch):
    # small thresholds so K=320 is cut at these small shapes, into chunks of 3 and 2 BK steps: a
    # chunk of one BK step would add the same f32 partials in the same order as no split at all,
    # so a single row that skipped the split would go unnoticed wherever dot and add do not fuse
    monkeypatch.setattr(gemm, "USE_QGEMM", False)  # this file's kernel; test_qgemm.py covers qgemm's split
    monkeypatch.setattr(gemm, "BI_MIN_KC", 128)
    monkeypatch.setattr(gemm, "BI_MIN_PROGRAMS", 64)
    t = (64, 64, 64)  # the split rule at one tile; the linears below run the tiles in use
    assert gemm.bi_split(40, 320, tile=t) == (2, 192) and gemm.bi_split(64 * 64, 320, tile=t) == (1, 320)
    w = weight(fmt, (40, 320), seed=15)
    x, bias = rnd(37, 320, seed=16).to(dtype), rnd(40, seed=17).to(dtype)
    want = REF["linear"](x.float(), on(w, "cpu", torch.float32), bias.float())
    wd = on(w, device, dtype)
    full = gemm.linear(x.to(device), wd, bias.to(device), batch_invariant=True)
    assert full.dtype == dtype and rel(full, want) < TOL[dtype]
    for i in (0, 20, 36):
        one = gemm.linear(x[i:i + 1].to(device), wd, bias.to(device), batch_invariant=True)
        assert torch.equal(one, full[i:i + 1])


@pytest.mark.parametrize("tile", [None, (16, 32, 32, 2), (32, 64, 32, 4), (16, 16, 64, 2)])
def test_linear_batch_invariant_f32_tiles(device, tile, monkeypatch):
    """Float32 activations in batch-invariant mode take gemm.BI_TILE_F32 (None: the one in use; the
    others: tiles benchmarks/nvidia_bi_linear.py may pick) at mid-v4's mHC mixing shape (N = 24,
    K = 8192, split K): each row alone gives the bits it gives in a batch of 37, within float32
    tolerance of the reference."""
    if tile is not None:
        monkeypatch.setattr(gemm, "BI_TILE_F32", tile)
    w = weight("dense", (24, 8192), seed=30)
    x = rnd(37, 8192, seed=31)
    want = REF["linear"](x, w, None)
    wd = on(w, device, torch.float32)
    full = gemm.linear(x.to(device), wd, batch_invariant=True)
    assert rel(full, want) < TOL[torch.float32]
    for i in (0, 36):
        assert torch.equal(gemm.linear(x[i:i + 1].to(device), wd, batch_invariant=True), full[i:i + 1])


@pytest.mark.parametrize("fmt", ["dense", "fp8_block128", "fp8_block32", "mxfp4"])
@pytest.mark.parametrize("bi", [False, True])
@pytest.mark.parametrize("use_qgemm", [True, False])
def test_grouped_and_moe(device, fmt, bi, use_qgemm, monkeypatch):
    if fmt == "dense" and not use_qgemm:
        pytest.skip("dense weights never reach qgemm")
    monkeypatch.setattr(gemm, "USE_QGEMM", use_qgemm)
    sizes = torch.tensor([3, 0, 17, 1, 9])
    w = weight(fmt, (5, 64, 96), seed=10)
    x = rnd(int(sizes.sum()), 96, seed=11)
    want = REF["grouped_linear"](x, w, sizes)
    got = gemm.grouped_linear(x.to(device), on(w, device, torch.float32), sizes.to(device),
                              batch_invariant=bi)
    assert rel(got, want) < TOL[torch.float32]
    t, e, k = 13, 5, 2
    ids = torch.stack([torch.randperm(e, generator=g(i))[:k] for i in range(t)])
    wts = torch.softmax(rnd(t, k, seed=12), -1)
    w13, w2 = weight(fmt, (e, 64, 64), seed=13), weight(fmt, (e, 64, 32), seed=14)
    xm = rnd(t, 64, seed=15)
    want = REF["moe_experts"](xm, ids, wts, w13, w2, 7.0)
    got = gemm.moe_experts(xm.to(device), ids.to(device), wts.to(device),
                           on(w13, device, torch.float32), on(w2, device, torch.float32), 7.0,
                           batch_invariant=bi)
    assert rel(got, want) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 needs the GPU (the interpreter's bf16 is wrong)")
@pytest.mark.parametrize("fmt", ["dense", "fp8_block128", "fp8_block32", "mxfp4"])
@pytest.mark.parametrize("bi", [False, True])
def test_moe_bf16_keeps_float32_intermediates(fmt, bi):
    """The contract keeps g, u, silu(g) * u and expert outputs in float32. With bf16 inputs the GPU
    may differ from the reference fed the same inputs by the final rounding (one bf16 ulp) plus the
    hi/lo split of the SwiGLU product (16 of its 24 bits: 2^-16 of sum_j w_j |a_j| |W2|). Rounding
    that product to bf16 (2^-9 of the same sum) fails by far: the conformance case that found it
    was bf16, mxfp4, T=3 E=7 k=1 D=I=96."""
    from shuili.platforms.reference.gemm import weight_f32
    t, e, k, d, inter = 40, 7, 2, 96, 96
    ids = torch.stack([torch.randperm(e, generator=g(100 + i))[:k] for i in range(t)])
    wts = torch.softmax(rnd(t, k, seed=20), -1)
    w13, w2 = weight(fmt, (e, 2 * inter, d), seed=21), weight(fmt, (e, d, inter), seed=22)
    if fmt == "dense":
        w13, w2 = (Weight.dense(w.data.bfloat16().float()) for w in (w13, w2))
    x = rnd(t, d, seed=23).bfloat16()
    want = REF["moe_experts"](x.float(), ids, wts, w13, w2, 7.0)
    got = gemm.moe_experts(x.cuda(), ids.cuda(), wts.cuda(), on(w13, "cuda", torch.bfloat16),
                           on(w2, "cuda", torch.bfloat16), 7.0, batch_invariant=bi).float().cpu()
    h = torch.einsum("td,tjnd->tjn", x.float(), weight_f32(w13)[ids])
    a = torch.nn.functional.silu(h[..., :inter].clamp(max=7.0)) * h[..., inter:].clamp(-7.0, 7.0)
    mag = torch.einsum("tj,tji,tjdi->td", wts, a.abs(), weight_f32(w2)[ids].abs())
    ulp = torch.pow(2.0, torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    bad = (got - want).abs() > ulp + 2.0 ** -15 * mag
    assert not bad.any(), f"{int(bad.sum())}/{bad.numel()} beyond the bound, max {(got - want).abs().max()}"


@pytest.mark.parametrize("fmt", ["dense", "fp8_block128", "fp8_block32", "mxfp4"])
def test_grouped_batch_invariant_split_k(device, fmt, monkeypatch):
    monkeypatch.setattr(gemm, "USE_QGEMM", False)
    monkeypatch.setattr(gemm, "BI_MIN_KC", 64)
    monkeypatch.setattr(gemm, "BI_MIN_PROGRAMS", 64)
    assert gemm.bi_split(64, 256, 5, tile=(64, 64, 64)) == (4, 64)
    sizes = torch.tensor([3, 0, 17, 1, 9])
    w = weight(fmt, (5, 64, 256), seed=18)
    x = rnd(int(sizes.sum()), 256, seed=19)
    wd = on(w, device, torch.float32)
    got = gemm.grouped_linear(x.to(device), wd, sizes.to(device), batch_invariant=True)
    assert rel(got, REF["grouped_linear"](x, w, sizes)) < TOL[torch.float32]
    # group 2's rows alone give the same bits as inside the full batch
    alone = gemm.grouped_linear(x[3:20].to(device), wd, torch.tensor([0, 0, 17, 0, 0]).to(device),
                                batch_invariant=True)
    assert torch.equal(alone, got[3:20])


def test_fp8_block32_scale_per_32_columns_is_read(device):
    """Negative control for the 32x32 path: scales that differ inside one 128-column span must each
    reach their own 32 columns (a kernel reading the 128x128 scale index would pass a uniform-scale
    test), and K % 32 != 0 is refused with the rule named."""
    data = torch.ones(40, 128).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0, 4.0, 8.0], [16.0, 0.5, 0.25, 1.0]])
    w = Weight("fp8_block32", data, scale, (40, 128))
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 33], x[0, 127] = 1.0, 1.0, 1.0  # columns in blocks 0, 1 and 3
    got = gemm.linear(x.to(device), on(w, device, torch.float32)).cpu()
    assert got[0, :32].tolist() == [1.0 + 2.0 + 8.0] * 32 and got[0, 32:].tolist() == [16.0 + 0.5 + 1.0] * 8
    assert torch.equal(got, REF["linear"](x, w))
    bad = Weight("fp8_block32", torch.ones(8, 48).to(torch.float8_e4m3fn), torch.ones(1, 2), (8, 48))
    with pytest.raises(ValueError, match=r"fp8_block32 weights need K % 32 == 0, got K=48"):
        gemm.linear(torch.zeros(1, 48).to(device), on(bad, device, torch.float32))


# ----------------------------------------------------------------------------------- attention
def paged_case(seed, b=4, bs=16, kvh=2, grp=4, d=32, max_len=90):
    gen = g(seed)
    seq = [int(torch.randint(1, max_len, (1,), generator=gen)) for _ in range(b)]
    ql = [1 if i % 2 else int(torch.randint(1, s + 1, (1,), generator=gen)) for i, s in enumerate(seq)]
    blocks = [math.ceil(s / bs) for s in seq]
    pool = sum(blocks) + 2
    phys = torch.randperm(pool, generator=gen)
    table = torch.full((b, max(blocks) + 1), -1, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = phys[at:at + nb].to(torch.int32)
        at += nb
    qsl = torch.tensor([0] + ql).cumsum(0).to(torch.int32)
    t = int(qsl[-1])
    return dict(q=rnd(t, kvh * grp, d, seed=seed + 1), k_cache=rnd(pool, bs, kvh, d, seed=seed + 2),
                v_cache=rnd(pool, bs, kvh, d, seed=seed + 3), block_tables=table,
                seq_lens=torch.tensor(seq, dtype=torch.int32), query_start_loc=qsl, scale=d ** -0.5)


def to(kw, device, dtype=None):
    out = {}
    for k, v in kw.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device)
            if dtype is not None and v.is_floating_point() and k in ("q", "k_cache", "v_cache"):
                v = v.to(dtype)
        out[k] = v
    return out


@pytest.mark.parametrize("window,sinks", [(0, False), (16, True), (5, False)])
@pytest.mark.parametrize("bi", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention(device, window, sinks, bi, dtype):
    kw = paged_case(20 + window)
    kw["window"] = window
    kw["sinks"] = rnd(8, seed=3) if sinks else None
    ref_in = to(kw, "cpu", dtype)
    want = REF["paged_attention"](**to(ref_in, "cpu", torch.float32))
    got = attention.paged_attention(**to(kw, device, dtype), batch_invariant=bi)
    assert rel(got, want) < TOL[dtype]


def test_paged_attention_invariant_mode(device, monkeypatch):
    """Batch-invariant mode: a sequence alone == its rows of the batch, and a token decoded ==
    the same token as the last row of a prefill chunk (bitwise). Small splits: several per query."""
    monkeypatch.setattr(attention, "BI_SPLIT", 64 if device == "cuda" else 32)
    kw = to(paged_case(31, max_len=300 if device == "cuda" else 90, bs=16, d=64), device, DTYPES[-1])
    full = attention.paged_attention(**kw, batch_invariant=True)
    qsl = kw["query_start_loc"].tolist()
    for b in range(len(qsl) - 1):
        one = dict(kw, q=kw["q"][qsl[b]:qsl[b + 1]], block_tables=kw["block_tables"][b:b + 1],
                   seq_lens=kw["seq_lens"][b:b + 1],
                   query_start_loc=torch.tensor([0, qsl[b + 1] - qsl[b]], dtype=torch.int32, device=device))
        assert torch.equal(attention.paged_attention(**one, batch_invariant=True), full[qsl[b]:qsl[b + 1]])
        dec = dict(one, q=one["q"][-1:], query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device))
        assert torch.equal(attention.paged_attention(**dec, batch_invariant=True), full[qsl[b + 1] - 1:qsl[b + 1]])


@pytest.mark.parametrize("fmts", [("none",), ("mxfp8", "fp4_e4m3"), ("none", "mxfp4")])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("d", [64, 128])  # packed rows: 66/36/34 bytes (bytes and words), 132/72/68 (words)
def test_sparse_attention(device, fmts, sinks, d):
    t, h = 9, 8
    kv, idx = [], []
    for i, f in enumerate(fmts):
        rows = rnd(3 * 16, d, seed=40 + i)
        kv.append(rows.view(3, 16, d) if f == "none" else REF["kv_quantize"](rows, f).view(3, 16, -1))
        ind = torch.randint(0, 48, (t, 7 + i), generator=g(i)).to(torch.int32)
        ind[torch.rand(t, 7 + i, generator=g(i + 9)) < 0.3] = -1
        ind[0] = -1
        idx.append(ind)
    q = rnd(t, h, d, seed=50)
    s = rnd(h, seed=51) if sinks else None
    want = REF["sparse_attention"](q, kv, idx, d ** -0.5, s, list(fmts))
    got = attention.sparse_attention(q.to(device), [c.to(device) for c in kv], [i.to(device) for i in idx],
                                     d ** -0.5, None if s is None else s.to(device), list(fmts))
    assert rel(got, want) < 1e-5


def bits(x):
    return x.contiguous().view(torch.uint8)


def sparse_case(t, h, d, fmts, widths, seed=0, hole=0.3, slots=96):
    """Caches of `slots` rows per format and [t, widths[i]] index tensors with ~hole -1s."""
    kv, idx = [], []
    for i, (f, w) in enumerate(zip(fmts, widths)):
        rows = rnd(slots, d, seed=seed + 40 + i)
        kv.append(rows.view(-1, 16, d) if f == "none"
                  else REF["kv_quantize"](rows, f).view(slots // 16, 16, -1))
        ind = torch.randint(0, slots, (t, w), generator=g(seed + i)).to(torch.int32)
        ind[torch.rand(t, w, generator=g(seed + i + 9)) < hole] = -1
        idx.append(ind)
    return rnd(t, h, d, seed=seed + 50), kv, idx, rnd(h, seed=seed + 51)


def sparse_run(device, q, kv, idx, sinks, fmts, dtype=torch.float32, **kw):
    """Runs the nvidia op (q and unpacked caches in dtype), returns the output on the CPU."""
    kv = [c if f != "none" else c.to(dtype) for c, f in zip(kv, fmts)]
    return attention.sparse_attention(q.to(device, dtype), [c.to(device) for c in kv],
                                      [i.to(device) for i in idx], q.shape[-1] ** -0.5,
                                      None if sinks is None else sinks.to(device), list(fmts), **kw).cpu()


SMALL_SPLIT = 32  # the sparse kernel's column chunk in these tests: small L crosses chunk boundaries


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmts", [("none", "none"), ("none", "mxfp8")])  # unpacked / packed tiles
def test_sparse_attention_padding_invariant(device, monkeypatch, fmts, dtype):
    """Extra trailing -1 columns (batch-wide padding, CUDA-graph padding) leave every bit unchanged,
    also where they add whole empty chunks between two caches' chunks."""
    monkeypatch.setattr(attention, "SPARSE_SPLIT", SMALL_SPLIT)
    q, kv, idx, s = sparse_case(5, 4, 64, fmts, (45, 70), seed=1)
    idx[0][2, 40:] = -1  # a row whose last valid column sits mid-chunk
    base = sparse_run(device, q, kv, idx, s, fmts, dtype)
    for extra in (0, 37, 300):
        for which in (0, 1):
            pad = [torch.cat([i, torch.full((i.shape[0], extra), -1, dtype=torch.int32)], 1)
                   if c == which else i for c, i in enumerate(idx)]
            got = sparse_run(device, q, kv, pad, s, fmts, dtype)
            assert torch.equal(bits(got), bits(base)), (extra, which)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmts", [("none", "none"), ("none", "fp4_e4m3")])
def test_sparse_attention_batch_invariant(device, monkeypatch, fmts, dtype):
    """A token's output alone equals its row of a 7-token batch, bit for bit."""
    monkeypatch.setattr(attention, "SPARSE_SPLIT", SMALL_SPLIT)
    q, kv, idx, s = sparse_case(7, 4, 64, fmts, (40, 90), seed=2)
    full = sparse_run(device, q, kv, idx, s, fmts, dtype)
    for i in range(7):
        one = sparse_run(device, q[i:i + 1], kv, [x[i:i + 1] for x in idx], s, fmts, dtype)
        assert torch.equal(bits(one), bits(full[i:i + 1])), i


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmts", [("none", "none"), ("mxfp8", "fp4_e4m3"), ("none", "mxfp8", "none")])
def test_sparse_attention_direct(device, monkeypatch, fmts, dtype):
    """Default mode from DIRECT_WAVES x num_sms (token, head block) programs: one program folds all
    of a token's chunks and writes the output, with no partials and no combine. It agrees with the
    reference (sinks and none; a token with no entries too), trailing -1 columns still leave every
    bit unchanged, and fewer tokens or batch-invariant mode keep the split path and its combine."""
    monkeypatch.setattr(attention, "SPARSE_SPLIT", SMALL_SPLIT)
    monkeypatch.setattr(attention, "DIRECT_WAVES", 1)
    combines, combine = [], attention._combine
    monkeypatch.setattr(attention, "_combine", lambda *a: combines.append(1) or combine(*a))
    many = attention.num_sms(device)  # one head block here: this many tokens take the direct path
    q, kv, idx, s = sparse_case(many + 3, 4, 64, fmts, (40, 90, 33)[:len(fmts)], seed=5)
    for i in idx:
        i[1] = -1  # a token with no entry: zeros, or the sink alone
    pad = [torch.cat([i, torch.full((i.shape[0], 45), -1, dtype=torch.int32)], 1) for i in idx]
    for sinks in (s, None):
        got = sparse_run(device, q, kv, idx, sinks, fmts, dtype)
        want = REF["sparse_attention"](q, kv, idx, 64 ** -0.5, sinks, list(fmts))
        assert rel(got, want) < TOL[dtype]
        assert torch.equal(bits(sparse_run(device, q, kv, pad, sinks, fmts, dtype)), bits(got))
    assert combines == []
    sparse_run(device, q, kv, idx, s, fmts, dtype, batch_invariant=True)
    sparse_run(device, q[:many - 1], kv, [i[:many - 1] for i in idx], s, fmts, dtype)
    assert combines == [1, 1]


def grouped_case(t, d, ncache, seed=7, slots=256):
    """Index rows as a prefill makes them: a window of 10 consecutive slots a token (the first two
    tokens' partly -1), 12 picks a token from 24 shared slots (token 5 lists one twice; token 9's
    spread over the pool, so its group takes the rows one after the other), and as a third cache 3
    entries every token from the fourth sees; token 13 has no entry in any cache."""
    win = torch.arange(10)[None, :] + torch.arange(t)[:, None]
    win[:2, :3] = -1
    sel = torch.randint(0, 24, (t, 12), generator=g(seed))
    sel[torch.rand(t, 12, generator=g(seed + 1)) < 0.2] = -1
    sel[5, :2] = 7
    sel[9] = torch.randint(0, slots, (12,), generator=g(seed + 2))
    third = torch.arange(3)[None, :].repeat(t, 1)
    third[:3] = -1
    idx = [win, sel, third][:ncache]
    for i in idx:
        i[13] = -1
    kv = [rnd(slots, d, seed=seed + 3 + c).view(-1, 16, d) for c in range(ncache)]
    return rnd(t, 4, d, seed=seed + 9), kv, [i.to(torch.int32) for i in idx], rnd(4, seed=seed + 10)


@pytest.mark.parametrize("tokens", [4, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ncache", [2, 3])
def test_sparse_attention_groups(device, monkeypatch, dtype, ncache, tokens):
    """Default mode at direct sizes from sparse_group.MIN_TOKENS tokens: TOKENS tokens a program over
    the columns their rows share (dense slot ranges, or the rows one after the other where a group's
    slots spread), within tolerance of the reference, with sinks and without. A slot a row lists
    twice counts twice; a token with no entry gives zeros or the sink alone; trailing -1 columns and
    a second run leave every bit unchanged; batch-invariant mode and fewer tokens keep the kernel
    before it."""
    monkeypatch.setattr(attention, "DIRECT_WAVES", 1)
    monkeypatch.setattr(sparse_group, "TOKENS", tokens)
    monkeypatch.setattr(sparse_group, "DTYPES", (dtype,))  # float32: the interpreter has no bf16
    calls, run = [], sparse_group.sparse_attention
    monkeypatch.setattr(sparse_group, "sparse_attention", lambda *a: calls.append(1) or run(*a))
    t = max(23, attention.num_sms(device) + 3)  # one head block: the direct path's sizes, a ragged group
    monkeypatch.setattr(sparse_group, "MIN_TOKENS", t)
    q, kv, idx, s = grouped_case(t, 64, ncache)
    fmts = ["none"] * ncache
    pad = [torch.cat([i, torch.full((t, 45), -1, dtype=torch.int32)], 1) for i in idx]
    for sinks in (s, None):
        got = sparse_run(device, q, kv, idx, sinks, fmts, dtype)
        want = REF["sparse_attention"](q, kv, idx, 64 ** -0.5, sinks, fmts)
        assert rel(got, want) < TOL[dtype]
        assert torch.equal(bits(sparse_run(device, q, kv, pad, sinks, fmts, dtype)), bits(got))
        assert torch.equal(bits(sparse_run(device, q, kv, idx, sinks, fmts, dtype)), bits(got))
    assert len(calls) == 6
    sparse_run(device, q, kv, idx, s, fmts, dtype, batch_invariant=True)
    sparse_run(device, q[:t - 1], kv, [i[:t - 1] for i in idx], s, fmts, dtype)
    assert len(calls) == 6


def test_sparse_group_applies(monkeypatch):
    """sparse_group's host-side gate: on only with MIN_TOKENS set and reached, on the direct path, with
    q in DTYPES, unpacked rows, at most three caches, none empty or wider than MAX_COLUMNS a group."""
    q = torch.zeros(8, 2, 4, dtype=torch.bfloat16)
    idx = lambda *ls: [torch.zeros(8, n, dtype=torch.int32) for n in ls]  # noqa: E731
    none = lambda n: ["none"] * n  # noqa: E731
    monkeypatch.setattr(sparse_group, "MIN_TOKENS", 0)
    assert not sparse_group.applies(8, q, idx(128, 512), none(2), True)
    monkeypatch.setattr(sparse_group, "MIN_TOKENS", 8)
    assert sparse_group.applies(8, q, idx(128, 512), none(2), True)
    assert sparse_group.applies(8, q, idx(128, 300, 3), none(3), True)
    for t, qq, ix, fm, direct in ((7, q, idx(128), none(1), True), (8, q, idx(128), none(1), False),
                                  (8, q.float(), idx(128), none(1), True), (8, q, idx(128, 513), none(2), True),
                                  (8, q, idx(128, 0), none(2), True), (8, q, idx(1, 1, 1, 1), none(4), True),
                                  (8, q, idx(128, 512), ["none", "mxfp8"], True)):
        assert not sparse_group.applies(t, qq, ix, fm, direct), (t, qq.dtype, [i.shape for i in ix], fm, direct)


def test_sparse_group_columns(device):
    """_columns_kernel's columns and counts: a dense slot range with each token's count of each slot
    (a slot listed twice counts 2), and a group whose slots spread wider than its entries, or whose
    counts would overflow a uint8, taking its rows one after the other, each token counting its own
    valid columns once."""
    idx = torch.tensor([[4, 5, 6, -1], [5, 6, 7, 7], [6, 7, 8, -1], [-1, -1, -1, -1],
                        [0, 90, -1, -1], [3, -1, -1, -1]], dtype=torch.int32, device=device)
    tok, lp = sparse_group.TOKENS, 4
    w = tok * lp
    cols = torch.empty(2, w, dtype=torch.int32, device=device)
    cnt = torch.empty(6, w, dtype=torch.uint8, device=device)
    ncols = torch.empty(2, dtype=torch.int32, device=device)
    sparse_group._columns_kernel[(2,)](idx, cols, cnt, ncols, 6, 4, TOK=tok, LP=lp)
    assert ncols.tolist() == [5, lp + 1]
    assert cols[0, :5].tolist() == [4, 5, 6, 7, 8] and (cols[0, 5:] == -1).all()
    assert cnt[:4, :5].tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 2, 0], [0, 0, 1, 1, 1], [0] * 5]
    assert (cnt[:4, 5:] == 0).all()
    assert cols[1, :lp].tolist() == [0, 90, -1, -1] and cols[1, lp:2 * lp].tolist() == [3, -1, -1, -1]
    own = torch.zeros(2, w, dtype=torch.uint8)
    own[0, :2] = own[1, lp] = 1
    assert torch.equal(cnt[4:].cpu(), own)
    # a slot listed 256 times by one row would overflow its uint8 count: the rows one after the other
    idx = torch.full((1, 260), 5, dtype=torch.int32, device=device)
    cols = torch.empty(1, tok * 512, dtype=torch.int32, device=device)
    cnt = torch.empty(1, tok * 512, dtype=torch.uint8, device=device)
    sparse_group._columns_kernel[(1,)](idx, cols, cnt, ncols, 1, 260, TOK=tok, LP=512)
    assert ncols[0] == 260 and (cols[0, :260] == 5).all() and (cnt[0, :260] == 1).all() and cnt[0, 260:].sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmts", [("mxfp8", "fp4_e4m3"), ("none", "mxfp4")])
def test_sparse_attention_decodes_packed_caches_once(device, monkeypatch, fmts, dtype):
    """Default mode, from DECODE_MIN_ROWS queries (12 here) reading each packed row DECODE_READS
    times on average: the packed caches are decoded once into rows of q's dtype, and the output
    has the bits of those rows given unpacked (the decode is exact). Fewer queries, fewer reads,
    batch-invariant mode and copies past dequant.MAX_BYTES keep the packed rows."""
    from shuili.platforms.nvidia import dequant

    monkeypatch.setattr(attention, "SPARSE_SPLIT", SMALL_SPLIT)
    monkeypatch.setattr(attention, "DECODE_MIN_ROWS", 12)
    calls, decode = [], quant.dequantize_rows
    monkeypatch.setattr(quant, "dequantize_rows", lambda *a: calls.append(a[1]) or decode(*a))
    q, kv, idx, s = sparse_case(12, 4, 64, fmts, (40, 90), seed=4)  # 12 x 130 reads of 192 packed rows
    got = sparse_run(device, q, kv, idx, s, fmts, dtype)
    assert calls == [f for f in fmts if f != "none"]
    rows = [c if f == "none" else REF["kv_dequantize"](c.reshape(96, -1), f, 64) for c, f in zip(kv, fmts)]
    assert torch.equal(bits(got), bits(sparse_run(device, q, rows, idx, s, ["none"] * 2, dtype)))
    want = REF["sparse_attention"](q, kv, idx, 64 ** -0.5, s, list(fmts))
    assert rel(got, want) < TOL[dtype]
    calls.clear()
    packed = sparse_run(device, q, kv, idx, s, fmts, dtype, batch_invariant=True)
    assert rel(packed, want) < TOL[dtype]
    sparse_run(device, q[:11], kv, [i[:11] for i in idx], s, fmts, dtype)
    monkeypatch.setattr(attention, "DECODE_READS", 100)
    sparse_run(device, q, kv, idx, s, fmts, dtype)
    monkeypatch.setattr(attention, "DECODE_READS", 1)
    monkeypatch.setattr(dequant, "MAX_BYTES", 96 * 64 * 2 - 1)  # below each copy here, bf16 or float32
    sparse_run(device, q, kv, idx, s, fmts, dtype)
    assert calls == []


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("fmts", [("none", "none", "none"), ("none", "mxfp8", "none", "mxfp4")])
def test_sparse_attention_chunks_with_holes(device, monkeypatch, sinks, fmts):
    """L spans several chunks with -1 holes and whole -1 chunks in the middle; 3 caches (one
    launch) and 4 (two launches), unpacked and packed tiles; against the reference."""
    monkeypatch.setattr(attention, "SPARSE_SPLIT", SMALL_SPLIT)
    q, kv, idx, s = sparse_case(6, 8, 64, fmts, (100, 75, 33, 64)[:len(fmts)], seed=3)
    idx[0][:, 32:64] = -1  # a whole empty chunk between valid ones
    idx[0][1, :90] = -1  # only the last chunk valid
    idx[1][2] = -1  # one cache empty for one row
    idx[2][:, 5:30] = -1
    want = REF["sparse_attention"](q, kv, idx, 64 ** -0.5, s if sinks else None, list(fmts))
    got = sparse_run(device, q, kv, idx, s if sinks else None, fmts)
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("fmts", [("none", "none"), ("none", "mxfp4")])
def test_sparse_attention_empty_rows(device, monkeypatch, sinks, fmts):
    """Rows with no valid entry in any cache (several all -1 chunks): zeros, with or without sinks,
    as the reference."""
    monkeypatch.setattr(attention, "SPARSE_SPLIT", SMALL_SPLIT)
    q, kv, idx, s = sparse_case(4, 4, 64, fmts, (70, 40), seed=4)
    for i in idx:
        i[1] = -1
        i[3] = -1
    want = REF["sparse_attention"](q, kv, idx, 64 ** -0.5, s if sinks else None, list(fmts))
    got = sparse_run(device, q, kv, idx, s if sinks else None, fmts)
    assert not got[1].any() and not got[3].any()
    assert torch.isfinite(got).all()
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("group", [False, True])
@pytest.mark.parametrize("dk", [64, 128])  # mxfp4 rows of 34 and 68 bytes
@pytest.mark.parametrize("fmt", ["none", "mxfp4"])
def test_indexer_topk_exact(device, monkeypatch, fmt, dk, group):
    """Exact against the reference. group: indexer.GROUP_TOKENS tokens a score program (default mode
    from GROUP_MIN_TOKENS tokens): the first group spans two sequences (each token scored alone),
    the others share one sequence's keys, the last is ragged."""
    if group:
        monkeypatch.setattr(indexer, "GROUP_MIN_TOKENS", 1)
    gen = g(60)
    b, bs, ratio, h, topk = 3, 8, 4, 4, 6
    toks = [70, 9, 33]
    ql = [3, 1, 33]
    ents = [max(1, n // ratio) for n in toks]
    blocks = [math.ceil(e / bs) for e in ents]
    pool = sum(blocks) + 1
    phys = torch.randperm(pool, generator=gen)
    table = torch.full((b, max(blocks)), -1, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = phys[at:at + nb].to(torch.int32)
        at += nb
    qsl = torch.tensor([0] + ql).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n - q, n) for n, q in zip(toks, ql)])
    # small integers: exact scores, many ties, so the tie order is exercised exactly
    rows = torch.randint(-2, 3, (pool * bs, dk), generator=gen).float()
    k_cache = rows.view(pool, bs, dk) if fmt == "none" else REF["kv_quantize"](rows, fmt).view(pool, bs, -1)
    t = int(qsl[-1])
    q = torch.randint(-2, 3, (t, h, dk), generator=gen).float()
    w = torch.randint(-2, 3, (t, h), generator=gen).float()
    args = (q, w, k_cache, table, qsl, pos, ratio, topk, fmt)
    want = REF["indexer_topk"](*args)
    got = indexer.indexer_topk(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args])
    assert torch.equal(got.cpu(), want)


def _top_want(scores, k, width):
    """The exact top-k the kernel replaces: torch.topk on common.desc_key, -1 for no score."""
    t, n = scores.shape
    out = torch.full((t, width), -1, dtype=torch.int32)
    k = min(k, n)
    top = torch.topk(common.desc_key(scores, torch.arange(n).expand(t, n)), k, dim=1).values
    out[:, :k] = torch.where((top >> 32) > indexer._NO_SCORE, common.key_ids(top), -1).to(torch.int32)
    return out


@pytest.mark.parametrize("n,k,sort_max", [(5, 8, 2048), (300, 64, 2048), (40, 6, 8), (700, 64, 128),
                                          (1500, 512, 256)])
def test_indexer_top_kernel_exact(device, n, k, sort_max, monkeypatch):
    """_topk_kernel against torch.topk on (score desc, id asc) keys: whole-row sorts and (sort_max
    below n) the radix select, with ties of every size (small integers), rows of -inf with a few
    scores, +-0, +-inf and NaN of both signs; the same ids in the same order."""
    monkeypatch.setattr(indexer, "SORT_MAX", sort_max)
    gen = g(62)
    s = torch.randint(-3, 4, (6, n), generator=gen).float()
    s[1] = float("-inf")
    s[1, :: max(1, n // 4)] = 2.0  # a few scores among no-scores: fewer than k where k > 4
    s[2] = torch.randn(n, generator=gen)  # distinct
    s[3, 0], s[3, -1] = 0.0, -0.0
    s[4, 1], s[4, 2], s[4, 3] = float("inf"), float("-inf"), float("nan")
    s[4, 4 % n] = -float("nan")
    s[5] = 1.0  # one tie across the whole row
    got = indexer._top(s.to(device), k, k).cpu()
    assert torch.equal(got, _top_want(s, k, k))


# ------------------------------------------------------------------------------ small ops, sampling
@pytest.mark.parametrize("e,k,renorm", [(32, 6, True), (256, 8, True), (300, 16, False), (8, 1, True), (5, 5, True)])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_routing_kernel_equals_the_torch_path(device, e, k, renorm, scoring, monkeypatch):
    """_route_kernel (one launch) against the torch path it replaces, on the same device: on a GPU
    the same bits (same float64 libdevice functions, one rounding, IEEE sqrt and division, the
    same keys and tree); under the interpreter (no libdevice) the same experts and weights within
    1e-6. Ties in the scores pick the lower expert id, as the key says."""
    logits, bias = rnd(37, e, seed=90, std=3), rnd(e, seed=91, std=0.1)
    logits[3] = 0.25  # a row of ties
    tid = torch.stack([torch.randperm(e, generator=g(300 + i))[:k] for i in range(40)])
    toks = torch.randint(0, 40, (37,), generator=g(92))
    cases = [("topk", lambda: moe.moe_route_topk(logits.to(device), bias.to(device), k, scoring, renorm, 2.5)),
             ("topk, no bias", lambda: moe.moe_route_topk(logits.to(device), None, k, scoring, renorm, 1.0)),
             ("hash", lambda: moe.moe_route_hash(logits.to(device), toks.to(device), tid.to(device), scoring,
                                                 renorm, 1.5))]
    for name, run in cases:
        w, ids = run()
        with monkeypatch.context() as mp:
            mp.setattr(moe, "FUSED", {})
            tw, tids = run()
        assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (37, k), name
        assert torch.equal(ids, tids), name
        if name == "topk, no bias":
            assert ids[3].tolist() == list(range(k)), name  # tied scores: ascending ids
        if device == "cuda":
            assert torch.equal(w, tw), name
        else:
            assert rel(w, tw) < 1e-6, name


def test_hash_routing_checks_its_inputs():
    """Eager calls on CPU tensors check token ids and the tid2eid rows they pick (a captured step
    skips both; core/runner.py and the loaders check them before)."""
    logits, tid = rnd(3, 8, seed=93), torch.tensor([[0, 1], [2, 9], [4, 5]])
    with pytest.raises(ValueError, match="token ids must lie in"):
        moe.moe_route_hash(logits, torch.tensor([0, 3, 1]), tid, "sigmoid", True, 1.0)
    with pytest.raises(ValueError, match="tid2eid holds expert ids outside"):
        moe.moe_route_hash(logits, torch.tensor([0, 1, 2]), tid, "sigmoid", True, 1.0)
    w, ids = moe.moe_route_hash(logits, torch.tensor([0, 2, 2]), tid, "sigmoid", True, 1.0)
    assert ids.tolist() == [[0, 1], [4, 5], [4, 5]]


def test_routing_and_sinkhorn(device):
    logits, bias = rnd(21, 16, seed=70, std=2), rnd(16, seed=71, std=0.1)
    for scoring in ("sqrtsoftplus", "softmax", "sigmoid"):
        w, ids = moe.moe_route_topk(logits.to(device), bias.to(device), 4, scoring, True, 1.5)
        rw, rids = REF["moe_route_topk"](logits, bias, 4, scoring, True, 1.5)
        assert torch.equal(ids.cpu(), rids) and rel(w, rw) < 1e-6
    tid = torch.stack([torch.randperm(16, generator=g(i))[:3] for i in range(50)])
    toks = torch.randint(0, 50, (21,), generator=g(72))
    w, ids = moe.moe_route_hash(logits.to(device), toks.to(device), tid.to(device), "sigmoid", True, 1.0)
    rw, rids = REF["moe_route_hash"](logits, toks, tid, "sigmoid", True, 1.0)
    assert torch.equal(ids.cpu(), rids) and rel(w, rw) < 1e-6
    mix, scale, base = rnd(11, 24, seed=73), torch.tensor([0.5, 1.0, 2.0]), rnd(24, seed=74, std=0.5)
    got = mhc.hc_split_sinkhorn(mix.to(device), scale.to(device), base.to(device), 4, 20, 1e-6)
    for a, b in zip(got, REF["hc_split_sinkhorn"](mix, scale, base, 4, 20, 1e-6)):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("fmt,d", [("mxfp8", 512), ("fp4_e4m3", 64), ("mxfp4", 128), ("none", 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write(device, fmt, d, dtype):
    """One launch packs each row at its slot: the reference's bytes (kv_quantize then cache_write),
    skipped rows untouched; the rows may be a strided view (a step's rows inside a wider tensor)."""
    rows = (rnd(9, 2 * d, seed=d) * torch.logspace(-4, 3, 9)[:, None]).to(dtype)[:, :d]
    slots = torch.tensor([5, -1, 0, 31, -1, 12, 7, 30, 2])
    rb = misc.quant.bytes_per_row(fmt, d) if fmt != "none" else d
    cdt = torch.uint8 if fmt != "none" else dtype
    stale = torch.randint(0, 256, (2, 16, rb), generator=g(3)).to(cdt)
    want = stale.clone()
    REF["kv_write"](want, slots, rows.float() if dtype == torch.float32 else rows, fmt)
    got = stale.clone().to(device)
    misc.kv_write(got, slots.to(device), rows.to(device), fmt)
    assert torch.equal(got.cpu(), want)


def test_kv_write_checks_the_cache(device):
    rows = rnd(2, 64).to(device)
    with pytest.raises(ValueError, match=r"kv_write: a mxfp8 cache of 64-wide rows is contiguous uint8"):
        misc.kv_write(torch.zeros(1, 4, 64, dtype=torch.uint8, device=device),
                      torch.tensor([0, 1], device=device), rows, "mxfp8")


# ---------------------------------------------------- float32 linears of few columns (skinny.py)
@pytest.mark.parametrize("bi", [False, True])
@pytest.mark.parametrize("t,k,n,bias", [(64, 8192, 24, False), (7, 2048, 32, True), (5, 96, 3, False),
                                        (33, 4000, 64, True)])
def test_skinny_float32_linear(device, bi, t, k, n, bias):
    """Float32 linears of at most 64 columns take the split-K kernel in both modes: the reference's
    values, and rows alone bit for bit."""
    x, w = rnd(t, k, seed=k), Weight.dense(rnd(n, k, seed=n))
    b = rnd(n, seed=3) if bias else None
    want = REF["linear"](x, w, b)
    on = lambda v: v.to(device) if v is not None else None  # noqa: E731
    got = gemm.linear(on(x), w.to(device), on(b), batch_invariant=bi).cpu()
    assert got.shape == (t, n) and rel(got, want) < 1e-5  # float32 over up to 8192 terms
    for i in (0, t - 1):
        one = gemm.linear(on(x[i:i + 1]), w.to(device), on(b), batch_invariant=bi).cpu()
        assert torch.equal(one, got[i:i + 1])
    assert gemm.linear(on(x[:0]), w.to(device), on(b), batch_invariant=bi).shape == (0, n)


@pytest.mark.parametrize("bi", [False, True])
def test_skinny_float32_linear_at_many_rows(device, monkeypatch, bi):
    """From DENSE_MIN_ROWS rows default mode runs the float32 linear on cuBLAS (run-to-run, as its
    other dense linears); batch-invariant mode keeps the split-K kernel. Both are float32 sums."""
    from shuili.platforms.nvidia import skinny

    calls, kernel = [], skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a: calls.append(1) or kernel(*a))
    t = gemm.DENSE_MIN_ROWS
    x, w, b = rnd(t, 256, seed=60), Weight.dense(rnd(32, 256, seed=61)), rnd(32, seed=62)
    got = gemm.linear(x.to(device), w.to(device), b.to(device), batch_invariant=bi).cpu()
    assert len(calls) == int(bi) and got.dtype == torch.float32
    assert rel(got, REF["linear"](x, w, b)) < 1e-5
    gemm.linear(x[:t - 1].to(device), w.to(device), b.to(device), batch_invariant=bi)
    assert len(calls) == int(bi) + 1  # one row fewer: the split-K kernel in both modes


# ------------------------------------------------------------------------- mHC mixing (hc_mix)
def mix_inputs(t, m, d, dtype, seed=0):
    gen = g(seed + 10 * m + d)
    x = (torch.randn(t, m, d, generator=gen) * torch.logspace(-1, 1, m)[:, None]).to(dtype)
    fn = Weight.dense(torch.randn(m * (m + 2), m * d, generator=gen) / (m * d) ** 0.5)
    return x, fn, torch.tensor([0.5, 1.0, 2.0]), torch.randn(m * (m + 2), generator=gen) * 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d", [(4, 256), (4, 1000), (2, 64), (1, 8), (8, 16)])
def test_hc_mix(device, dtype, m, d):
    """Against the reference (its norm, linear and Sinkhorn), rows alone bit for bit (the K chunks,
    the last one partial at D = 1000, and the partial sums never depend on the batch); m = 8 has 80
    mixing columns, past one program's MAX_N: the composed path."""
    t = 19
    x, fn, scale, base = mix_inputs(t, m, d, dtype)
    want = REF["hc_mix"](x.float(), fn, scale, base, 20, 1e-6, 1e-6)
    on = lambda *a: [v.to(device) for v in a]  # noqa: E731
    got = [v.cpu() for v in mhc.hc_mix(*on(x, fn, scale, base), 20, 1e-6, 1e-6)]
    assert [v.shape for v in got] == [(t, m), (t, m), (t, m, m)]
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and rel(a, b) < 2e-5
    for i in (0, 7, t - 1):
        one = mhc.hc_mix(*on(x[i:i + 1], fn, scale, base), 20, 1e-6, 1e-6)
        assert all(torch.equal(a[i:i + 1], b.cpu()) for a, b in zip(got, one))
    empty = mhc.hc_mix(*on(x[:0], fn, scale, base), 20, 1e-6, 1e-6)
    assert [v.shape for v in empty] == [(0, m), (0, m), (0, m, m)]


def test_hc_mix_norm_is_folded_in(device):
    """Scaling a token's streams leaves its mix (a norm's output times fn) unchanged: the sums of
    squares are applied. Without them the pre coefficients move by far more than rounding."""
    x, fn, scale, base = mix_inputs(4, 4, 64, torch.float32, seed=5)
    a = mhc.hc_mix(x.to(device), fn.to(device), scale.to(device), base.to(device), 5, 1e-6, 1e-6)
    b = mhc.hc_mix((x * 64).to(device), fn.to(device), scale.to(device), base.to(device), 5, 1e-6, 1e-6)
    assert rel(b[0], a[0]) < 1e-6 and rel(b[2], a[2]) < 1e-6


def test_hc_mix_checks_fn(device):
    x, fn, scale, base = mix_inputs(3, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=r"hc_mix: fn must be a dense weight \[m\(m\+2\), m\*D\]"):
        mhc.hc_mix(x.to(device), Weight.dense(fn.data[:, :16]).to(device), scale, base, 1, 1e-6, 1e-6)
    with pytest.raises(ValueError, match=r"hc_mix: x must be the streams"):
        mhc.hc_mix(x[:, 0].to(device), fn.to(device), scale, base, 1, 1e-6, 1e-6)


# ------------------------------------------------------------------------------ mHC streams
def hc_inputs(t, m, d, dtype):
    gen = g(100 * m + d)
    x = (torch.randn(t, m, d, generator=gen) * torch.logspace(-1, 1, m)[:, None]).to(dtype)
    f = torch.randn(t, d, generator=gen).to(dtype)
    post = 2 * torch.rand(t, m, generator=gen)
    return f, x, torch.rand(t, m, generator=gen), post, torch.rand(t, m, m, generator=gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d", [(4, 256), (1, 64), (3, 40), (8, 8), (2, 3000)])
def test_hc_collapse_expand(device, dtype, m, d):
    t = 13
    f, x, pre, post, comb = hc_inputs(t, m, d, dtype)
    want_c = REF["hc_collapse"](x.float(), pre)  # the same (dtype-rounded) values, float32 out
    want_e = REF["hc_expand"](f.float(), x.float(), post, comb)
    on = lambda *a: [v.to(device) for v in a]  # noqa: E731
    got_c = mhc.hc_collapse(*on(x, pre)).cpu()
    got_e = mhc.hc_expand(*on(f, x, post, comb)).cpu()
    assert got_c.dtype == dtype and got_c.shape == (t, d) and got_e.dtype == dtype and got_e.shape == (t, m, d)
    assert rel(got_c, want_c) < TOL[dtype] and rel(got_e, want_e) < TOL[dtype]
    if device == "cpu":  # the interpreter runs the reference's order with no FMA: its bits
        assert torch.equal(got_c, want_c) and torch.equal(got_e, want_e)
    for i in (0, 6, t - 1):  # each token alone gives its row of the batch, bit for bit
        r = slice(i, i + 1)
        assert torch.equal(mhc.hc_collapse(*on(x[r], pre[r])).cpu(), got_c[r])
        assert torch.equal(mhc.hc_expand(*on(f[r], x[r], post[r], comb[r])).cpu(), got_e[r])


def test_hc_shapes_are_checked(device):
    f, x, pre, post, comb = (v.to(device) for v in hc_inputs(3, 4, 8, torch.float32))
    assert mhc.hc_collapse(x[:0], pre[:0]).shape == (0, 8)
    assert mhc.hc_expand(f[:0], x[:0], post[:0], comb[:0]).shape == (0, 4, 8)
    with pytest.raises(ValueError, match="pre must be"):
        mhc.hc_collapse(x, pre[:, :3])
    with pytest.raises(ValueError, match="comb must be"):
        mhc.hc_expand(f, x, post, comb[:2])
    with pytest.raises(ValueError, match="x must be"):
        mhc.hc_expand(f, x[:, 0], post, comb)


@pytest.mark.parametrize("shape,limit", [((5, 64), 1.0), ((3, 2, 3000), None), ((7, 3000), 7.0), ((0, 8), 1.0)])
def test_swiglu_one_launch(device, shape, limit):
    """The fused swiglu against the reference: two column blocks (I = 1500), leading dims, a
    strided input, no limit, an empty batch; NaN stays NaN under the clamp."""
    gu = rnd(*shape, seed=84, std=3)
    if gu.numel():
        gu.view(-1, shape[-1])[0, 0] = float("nan")
    want = REF["swiglu"](gu.reshape(-1, shape[-1]), limit).reshape(*shape[:-1], shape[-1] // 2)
    for x in (gu.to(device), torch.cat([gu, gu], -1).to(device)[..., :shape[-1]]):  # contiguous, strided
        got = misc.swiglu(x, limit)
        assert got.shape == want.shape and got.dtype == gu.dtype
        if gu.numel():
            assert torch.isnan(got.view(-1, shape[-1] // 2)[0, 0])
            ok = ~torch.isnan(want)
            assert rel(got.cpu()[ok], want[ok]) < 1e-6
    with pytest.raises(ValueError, match="must be even"):
        misc.swiglu(gu[..., :3].to(device), limit)


def test_small_ops(device):
    ids, table = torch.tensor([3, 0, 7, 3]), rnd(9, 16, seed=80)
    assert torch.equal(misc.embedding(ids.to(device), table.to(device)).cpu(), REF["embedding"](ids, table))
    with pytest.raises(ValueError):
        misc.embedding(torch.tensor([9]), table) if device == "cpu" else (_ for _ in ()).throw(ValueError)
    gu = rnd(5, 64, seed=81, std=3)
    assert rel(misc.swiglu(gu.to(device), 1.0), REF["swiglu"](gu, 1.0)) < 1e-6
    cache, vals = rnd(3, 4, 8, seed=82), rnd(5, 8, seed=83)
    slots = torch.tensor([4, -1, 11, 0, -1])
    mine = cache.clone().to(device)
    misc.cache_write(mine, slots.to(device), vals.to(device))
    REF["cache_write"](cache, slots, vals)
    assert torch.equal(mine.cpu(), cache)


def test_log_softmax_and_sample(device):
    logits = rnd(6, 5000, seed=90, std=3.0)
    assert rel(sampling.log_softmax(logits.to(device)), REF["log_softmax"](logits)) < 1e-6
    # logits offset by thousands: x - (m + log s) would lose log s's low bits (a conformance find)
    big = rnd(2, 4099, seed=89, std=2.0) + 3000.0
    got, want = sampling.log_softmax(big.to(device)).cpu(), REF["log_softmax"](big)
    assert ((got - want).abs() <= 1e-5 + 1e-5 * want.abs()).all()
    b, v = 8, 300
    lg = rnd(b, v, seed=91, std=2.0)
    args = dict(logits=lg, temperature=torch.tensor([0, 0.7, 1.0, 1.3, 0.5, 1.0, 0.9, 0.0]),
                top_k=torch.tensor([0, 0, 5, 0, 50, 0, 3, 4], dtype=torch.int32),
                top_p=torch.tensor([1.0, 1.0, 1.0, 0.5, 0.9, 1.0, 1.0, 1.0]),
                min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0]),
                seeds=torch.arange(b) * 7919 + 3, positions=torch.arange(b) + 100)
    want = REF["sample"](**args)
    got = sampling.sample(**{k: t.to(device) for k, t in args.items()})
    assert torch.equal(got.cpu(), want)
    hinted = sampling.sample(**{k: t.to(device) for k, t in args.items()}, all_greedy=False, any_filter=True)
    assert torch.equal(hinted.cpu(), want)
    plain = dict(args, top_k=torch.zeros(b, dtype=torch.int32), top_p=torch.ones(b), min_p=torch.zeros(b))
    got = sampling.sample(**{k: t.to(device) for k, t in plain.items()}, all_greedy=False, any_filter=False)
    assert torch.equal(got.cpu(), REF["sample"](**plain))
    greedy = dict(plain, temperature=torch.zeros(b))
    got = sampling.sample(**{k: t.to(device) for k, t in greedy.items()}, all_greedy=True, any_filter=False)
    assert torch.equal(got.cpu(), REF["sample"](**greedy))
    pen = dict(logits=lg, token_counts=torch.randint(0, 3, (b, v), generator=g(92)).to(torch.int32),
               prompt_mask=torch.rand(b, v, generator=g(93)) < 0.1, repetition=torch.full((b,), 1.2),
               presence=torch.full((b,), 0.3), frequency=torch.full((b,), 0.1))
    got = sampling.apply_penalties(**{k: t.to(device) for k, t in pen.items()})
    assert rel(got, REF["apply_penalties"](**pen)) < 1e-7


def test_sample_wide_vocab_chunks(device):
    """Vocabularies over several CHUNKs of the noise argmax: the reference's tokens with and without
    a filter, and a filter that keeps everything picks what no filter picks."""
    b, v = 5, 2 * sampling.CHUNK + 77
    lg = rnd(b, v, seed=95, std=4.0)
    lg[1, sampling.CHUNK + 3] = 40.0  # a clear winner in the second chunk
    lg[2] = 0.0  # every id ties on the logits: the noise alone decides
    assert rel(sampling.log_softmax(lg.to(device)), REF["log_softmax"](lg)) < 1e-6
    args = dict(logits=lg, temperature=torch.tensor([0.8, 1.0, 1.0, 0.0, 1.7]),
                top_k=torch.zeros(b, dtype=torch.int32), top_p=torch.ones(b), min_p=torch.zeros(b),
                seeds=torch.arange(b) * 104729 + 11, positions=torch.arange(b) + 7)
    want = REF["sample"](**args)
    fast = sampling.sample(**{k: t.to(device) for k, t in args.items()}, all_greedy=False, any_filter=False)
    assert torch.equal(fast.cpu(), want)
    keep_all = dict(args, top_k=torch.full((b,), v, dtype=torch.int32))
    slow = sampling.sample(**{k: t.to(device) for k, t in keep_all.items()}, all_greedy=False, any_filter=True)
    assert torch.equal(slow.cpu(), fast.cpu())
    # negative control: another seed moves at least one sampled row
    moved = sampling.sample(**{k: t.to(device) for k, t in dict(args, seeds=args["seeds"] + 1).items()},
                            all_greedy=False, any_filter=False)
    assert not torch.equal(moved.cpu(), fast.cpu())


@pytest.mark.parametrize("fmt", ["fp8_block128", "fp8_block32", "mxfp4"])
def test_quantized_decode_split_k(device, fmt, monkeypatch):
    """Default mode cuts K for quantized weights at decode sizes (fill_split); the split result
    stays within tolerance of the reference, plain and grouped, and is the same run to run."""
    monkeypatch.setattr(gemm, "USE_QGEMM", False)
    monkeypatch.setattr(gemm, "Q_MIN_KC", 64)
    monkeypatch.setattr(gemm, "Q_MIN_PROGRAMS", 16)
    assert gemm.fill_split(2, 320, 64) == (5, 64) and gemm.fill_split(16, 320, 64) == (1, 320)
    w = weight(fmt, (40, 320), seed=25)
    x, bias = rnd(9, 320, seed=26), rnd(40, seed=27)
    want = REF["linear"](x, on(w, "cpu", torch.float32), bias)
    wd = on(w, device, torch.float32)
    got = gemm.linear(x.to(device), wd, bias.to(device))
    assert rel(got, want) < TOL[torch.float32]
    assert torch.equal(got, gemm.linear(x.to(device), wd, bias.to(device)))
    sizes = torch.tensor([3, 0, 5, 1])
    wg = weight(fmt, (4, 64, 256), seed=28)
    xg = rnd(9, 256, seed=29)
    got = gemm.grouped_linear(xg.to(device), on(wg, device, torch.float32), sizes.to(device))
    assert rel(got, REF["grouped_linear"](xg, wg, sizes)) < TOL[torch.float32]


@pytest.mark.parametrize("fmt", ["none", "mxfp4"])
def test_indexer_topk_short_rows_of_a_long_table(device, fmt):
    """A short sequence batched with a long one: its programs past its visible keys skip the keys
    (the grid spans the longest table) and it still gets the reference's ids, -1 padded."""
    gen = g(61)
    bs, ratio, h, dk, topk = 16, 4, 4, 64, 8
    toks, ents = [700, 9], [175, 2]
    blocks = [math.ceil(e / bs) for e in ents]
    pool = sum(blocks)
    table = torch.full((2, max(blocks)), -1, dtype=torch.int32)
    table[0, :blocks[0]] = torch.arange(blocks[0], dtype=torch.int32)
    table[1, :blocks[1]] = torch.arange(blocks[0], pool, dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    pos = torch.tensor([698, 699, 8])
    # small integers: exact scores on every device, ties included
    rows = torch.randint(-2, 3, (pool * bs, dk), generator=gen).float()
    k_cache = rows.view(pool, bs, dk) if fmt == "none" else REF["kv_quantize"](rows, fmt).view(pool, bs, -1)
    q = torch.randint(-2, 3, (3, h, dk), generator=gen).float()
    w = torch.randint(0, 3, (3, h), generator=gen).float()
    args = (q, w, k_cache, table, qsl, pos, ratio, topk, fmt)
    got = indexer.indexer_topk(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args]).cpu()
    assert torch.equal(got, REF["indexer_topk"](*args))
    assert (got[2, 2:] == -1).all() and (got[2, :2] >= 0).all()
