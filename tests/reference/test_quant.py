"""Quantization formats: hand-computed bytes, RNE ties, saturation, floors, nibble order, sizes."""
import math

import pytest
import torch

from shuili.hal.types import Weight
from shuili.platforms.reference import quant as Q

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1_value(code):
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def _e4m3_value(byte):
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
    mag = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


# ------------------------------------------------------------------------------- element types
def test_e2m1_rne_boundaries_and_saturation():
    x = [0.0, 0.1, 0.25, 0.26, 0.5, 0.74, 0.75, 1.0, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 6.0,
         100.0, -0.25, -0.3, -0.0, -7.0, -3.5]
    want = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 7, 8, 9, 8, 15, 14]
    assert Q.e2m1_encode(torch.tensor(x)).tolist() == want
    assert Q.e2m1_decode(torch.arange(16)).tolist() == [_e2m1_value(c) for c in range(16)]
    with pytest.raises(ValueError, match="NaN"):
        Q.e2m1_encode(torch.tensor([math.nan]))


def test_nibble_order_low_first():
    packed = Q.pack_nibbles(torch.tensor([1, 2, 15, 0, 7, 8], dtype=torch.uint8))
    assert packed.tolist() == [0x21, 0x0F, 0x87]
    assert Q.unpack_nibbles(packed).tolist() == [1, 2, 15, 0, 7, 8]
    assert Q.unpack_nibbles(torch.tensor([-121], dtype=torch.int8)).tolist() == [7, 8]  # 0x87 as I8


def test_e8m0_decode_and_ceil():
    got = Q.e8m0_to_float(torch.tensor([127, 128, 126, 0, 1, 254, 255], dtype=torch.uint8)).tolist()
    assert got[:6] == [1.0, 2.0, 0.5, 2.0 ** -127, 2.0 ** -126, 2.0 ** 127] and math.isnan(got[6])
    x = torch.tensor([1.0, 1.5, 2.0, 0.75, 7 / 448, 1.0000001, 2.0 ** -126, 0.0, 1e-45, 3e38, math.inf])
    assert Q.float_to_e8m0_ceil(x).tolist() == [127, 128, 128, 127, 121, 128, 1, 0, 1, 254, 255]


def test_e4m3_rne_and_saturation():
    x = torch.tensor([1.0, 1.0625, 1.1875, 448.0, 464.0, 500.0, -1e6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11])
    got = Q.e4m3_encode(x).tolist()
    # 1.0625 ties to 1.0 (even mantissa), 1.1875 ties up to 1.25; beyond 448 saturates;
    # 2^-10 ties between 0 and the smallest subnormal 2^-9 -> 0 (even); 1.5 * 2^-10 -> 2^-9
    assert got == [0x38, 0x38, 0x3A, 0x7E, 0x7E, 0x7E, 0xFE, 0x01, 0x00, 0x01]
    assert [_e4m3_value(b) for b in got] == Q.e4m3_decode(torch.tensor(got, dtype=torch.uint8)).tolist()


# ---------------------------------------------------------------------------------- KV formats
def test_sizes():
    assert Q.bytes_per_row("mxfp8", 512) == 528
    assert Q.bytes_per_row("fp4_e4m3", 512) == 288
    assert Q.bytes_per_row("mxfp4", 128) == 68
    for fmt, d, n in (("mxfp8", 512, 528), ("fp4_e4m3", 512, 288), ("mxfp4", 128, 68)):
        assert Q.kv_quantize(torch.randn(3, d), fmt).shape == (3, n)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.bytes_per_row("mxfp8", 48)
    with pytest.raises(ValueError, match="unknown KV format"):
        Q.bytes_per_row("fp8", 64)


def test_mxfp8_known_bytes():
    x = torch.zeros(3, 32)
    x[0, :4] = torch.tensor([1.0, -2.0, 3.5, 0.0])  # amax 3.5 -> 3.5/448 = 2^-7 -> byte 120
    x[1, 0] = 1e-6  # below the 1e-4 amax floor: scale 2^ceil(log2(1e-4/448)) = 2^-22
    x[2, :3] = torch.tensor([448.0, 1.0625, 1.1875])  # scale 1: RNE ties inside e4m3
    p = Q.kv_quantize(x, "mxfp8")
    assert p.shape == (3, 33)
    assert p[0, :4].tolist() == [0x70, 0xF8, 0x7E, 0x00] and p[0, 32] == 120
    assert p[1, 0] == 0x48 and p[1, 32] == 105  # 1e-6 * 2^22 = 4.19 -> 4.0
    assert p[1, 1:32].tolist() == [0] * 31
    assert p[2, :3].tolist() == [0x7E, 0x38, 0x3A] and p[2, 32] == 127
    back = Q.kv_dequantize(p, "mxfp8", 32)
    assert back[0, :4].tolist() == [1.0, -2.0, 3.5, 0.0] and back[1, 0] == 4.0 * 2.0 ** -22


def test_zero_rows_use_the_floors():
    z = torch.zeros(1, 32)
    assert Q.kv_quantize(z, "mxfp8")[0, 32] == 105
    assert Q.kv_quantize(z, "mxfp4")[0, 16] == 1  # 6 * 2^-126 / 6 = 2^-126
    assert Q.kv_quantize(z, "fp4_e4m3")[0, 16:].tolist() == [0x01, 0x01]  # e4m3(2^-9)
    for fmt in ("mxfp8", "mxfp4", "fp4_e4m3"):
        assert torch.equal(Q.kv_dequantize(Q.kv_quantize(z, fmt), fmt, 32), z)


def test_mxfp4_known_bytes():
    x = torch.zeros(2, 32)
    x[0, :4] = torch.tensor([7.0, 5.0, 0.5, -1.5])  # amax 7 -> 7/6 -> ceil 2 (byte 128)
    x[1, :2] = torch.tensor([6.0 * 2.0 ** -100, -3.0 * 2.0 ** -100])  # scale 2^-100 exactly
    p = Q.kv_quantize(x, "mxfp4")
    # 3.5 ties up to 4 (code 6), 2.5 ties down to 2 (code 4), 0.25 ties to 0, -0.75 ties to -1 (10)
    assert p[0, :2].tolist() == [0x46, 0xA0] and p[0, 16] == 128
    assert p[1, 0] == (0x8 | 5) << 4 | 7 and p[1, 16] == 27
    assert Q.kv_dequantize(p, "mxfp4", 32)[0, :4].tolist() == [8.0, 4.0, 0.0, -2.0]


def test_fp4_e4m3_known_bytes():
    x = torch.zeros(2, 32)
    x[0, :7] = torch.tensor([6.0, -0.75, 0.25, 1.75, 2.5, 3.5, 5.0])  # amax 6: scale e4m3(1) = 0x38
    x[0, 16:18] = torch.tensor([7.0, -3.0])  # amax 7: 7/6 -> e4m3 1.125 (0x39); 7/1.125 saturates
    x[1, 0] = 1e-9  # scale floor 2^-9 (0x01)
    p = Q.kv_quantize(x, "fp4_e4m3")
    assert p.shape == (2, 18)
    assert p[0, :4].tolist() == [0xA7, 0x40, 0x64, 0x06] and p[0, 4:8].tolist() == [0] * 4
    assert p[0, 8] == (13 << 4) | 7 and p[0, 16:].tolist() == [0x38, 0x39]
    assert p[1, :16].tolist() == [0] * 16 and p[1, 16:].tolist() == [0x01, 0x01]
    back = Q.kv_dequantize(p, "fp4_e4m3", 32)
    assert back[0, 16:18].tolist() == [6.0 * 1.125, -3.0 * 1.125]


@pytest.mark.parametrize("fmt,d", [("mxfp8", 512), ("fp4_e4m3", 512), ("mxfp4", 128)])
def test_round_trip_error_bounds(gen, fmt, d):
    x = torch.randn(20, d, generator=gen) * torch.logspace(-3, 2.5, 20)[:, None]
    back = Q.kv_dequantize(Q.kv_quantize(x, fmt), fmt, d)
    block = 16 if fmt == "fp4_e4m3" else 32
    xb, bb = x.reshape(20, -1, block).double(), back.reshape(20, -1, block).double()
    amax = xb.abs().amax(-1, keepdim=True)
    if fmt == "mxfp8":  # 3 mantissa bits: relative error <= 2^-4 above the subnormal range
        assert ((xb - bb).abs() <= xb.abs() * 2.0 ** -4 + amax * 2.0 ** -13).all()
    else:  # e2m1 worst gap 2 (between 4 and 6): error <= one scale unit <= amax / 3
        floor = 2.0 ** -9 if fmt == "fp4_e4m3" else 2.0 ** -126
        assert ((xb - bb).abs() <= (amax / 3 * 1.0001).clamp_min(floor)).all()


@pytest.mark.parametrize("fmt,d", [("mxfp8", 64), ("fp4_e4m3", 64), ("mxfp4", 64)])
def test_dequantize_matches_independent_decode(gen, fmt, d):
    p = Q.kv_quantize(torch.randn(4, d, generator=gen) * 3, fmt)
    got = Q.kv_dequantize(p, fmt, d)
    for r in range(4):
        for i in range(d):
            if fmt == "mxfp8":
                v = _e4m3_value(int(p[r, i])) * 2.0 ** (int(p[r, d + i // 32]) - 127)
            else:
                byte = int(p[r, i // 2])
                code = byte & 0xF if i % 2 == 0 else byte >> 4
                sc = (2.0 ** (int(p[r, d // 2 + i // 32]) - 127) if fmt == "mxfp4"
                      else _e4m3_value(int(p[r, d // 2 + i // 16])))
                v = _e2m1_value(code) * sc
            assert float(got[r, i]) == v


# ------------------------------------------------------------------------------------- weights
def test_fp8_block128_weight(gen):
    w = torch.randn(130, 260, generator=gen)
    w[0, 0] = 448.0 * 4  # block (0, 0): amax 1792 -> scale 4
    w[129, 259] = 0.0
    qw = Q.quantize_weight_fp8_block128(w)
    assert qw.format == "fp8_block128" and qw.shape == (130, 260)
    assert qw.data.dtype == torch.float8_e4m3fn and qw.scale.shape == (2, 3)
    assert qw.scale[0, 0] == 4.0 and qw.data[0, 0].view(torch.uint8) == 0x7E
    assert all(math.log2(s).is_integer() for s in qw.scale.flatten().tolist())
    deq = Q.dequantize_weight(qw)
    want = torch.empty(130, 260, dtype=torch.float64)
    for n in range(130):
        for kb in range(3):
            seg = qw.data[n, kb * 128:(kb + 1) * 128].view(torch.uint8).tolist()
            want[n, kb * 128:kb * 128 + len(seg)] = torch.tensor(
                [_e4m3_value(b) for b in seg], dtype=torch.float64) * float(qw.scale[n // 128, kb])
    assert torch.equal(deq.double(), want)
    unit = qw.scale.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :260]
    assert ((deq - w).abs() <= w.abs() * 2.0 ** -4 + unit * 2.0 ** -10).all()  # subnormal e4m3 step 2^-9
    zero = Q.quantize_weight_fp8_block128(torch.zeros(2, 3, 5))
    assert zero.scale.shape == (2, 1, 1) and torch.equal(Q.dequantize_weight(zero), torch.zeros(2, 3, 5))


def test_fp8_block32_weight(gen):
    w = torch.randn(70, 96, generator=gen)
    w[0, 0] = 448.0 * 4  # block (0, 0): amax 1792 -> scale 4; block (0, 1) keeps its own scale
    w[40, 33] = -448.0 / 8  # block (1, 1): amax 56 -> scale 1/8
    qw = Q.quantize_weight_fp8_block32(w)
    assert qw.format == "fp8_block32" and qw.shape == (70, 96)
    assert qw.data.dtype == torch.float8_e4m3fn and qw.scale.shape == (3, 3)  # rows' edge block partial
    assert qw.scale.dtype == torch.float32 and qw.scale[0, 0] == 4.0 and qw.scale[1, 1] == 0.125
    assert qw.scale[0, 1] < 1.0 and all(math.log2(s).is_integer() for s in qw.scale.flatten().tolist())
    deq = Q.dequantize_weight(qw)
    want = torch.empty(70, 96, dtype=torch.float64)
    for n in range(70):
        for kb in range(3):
            seg = qw.data[n, kb * 32:(kb + 1) * 32].view(torch.uint8).tolist()
            want[n, kb * 32:(kb + 1) * 32] = torch.tensor(
                [_e4m3_value(b) for b in seg], dtype=torch.float64) * float(qw.scale[n // 32, kb])
    assert torch.equal(deq.double(), want)
    unit = qw.scale.repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)
    assert ((deq - w).abs() <= w.abs() * 2.0 ** -4 + unit * 2.0 ** -10).all()
    # the 32x32 blocks are finer than 128x128: no worse anywhere, here strictly better in total
    d128 = Q.dequantize_weight(Q.quantize_weight_fp8_block128(w))
    assert (deq - w).abs().sum() < (d128 - w).abs().sum()
    q3 = Q.quantize_weight_fp8_block32(torch.randn(2, 40, 64, generator=gen))
    assert q3.scale.shape == (2, 2, 2)


def test_fp8_block32_rejects_bad_shapes(gen):
    from shuili.hal.formats import check_weight, weight_bytes, weight_scale_shape

    with pytest.raises(ValueError, match=r"fp8_block32 weights need K \(in_features\) % 32 == 0, got K=40"):
        Q.quantize_weight_fp8_block32(torch.randn(64, 40, generator=gen))
    qw = Q.quantize_weight_fp8_block32(torch.randn(64, 64, generator=gen))
    bad = Weight("fp8_block32", qw.data, qw.scale[:1], qw.shape)
    with pytest.raises(ValueError, match=r"fp8_block32 scale for logical \(64, 64\) must be \(2, 2\), got \(1, 2\)"):
        Q.dequantize_weight(bad)
    odd_k = Weight("fp8_block32", torch.zeros(64, 48).to(torch.float8_e4m3fn), torch.ones(2, 2), (64, 48))
    with pytest.raises(ValueError, match=r"K \(in_features\) % 32 == 0, got K=48"):
        Q.dequantize_weight(odd_k)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        Q.dequantize_weight(Weight("fp8_block32", qw.data.float(), qw.scale, qw.shape))
    assert weight_scale_shape("fp8_block32", (3, 70, 96)) == (3, 3, 3)
    assert weight_scale_shape("fp8_block128", (70, 96)) == (1, 1)
    assert weight_bytes("fp8_block32", (64, 64)) == 64 * 64 + 4 and weight_bytes("dense", (2, 3)) == 12
    assert weight_bytes("mxfp4", (2, 64)) == 64 + 4
    check_weight("fp8_block32", (64, 64), (2, 2), (64, 64))
    with pytest.raises(ValueError, match=r"data for logical \(64, 64\) must be \(64, 64\)"):
        check_weight("fp8_block32", (64, 32), (2, 2), (64, 64))


def test_mxfp4_weight_layout(gen):
    w = torch.zeros(2, 64)
    w[0, :2] = torch.tensor([1.0, 6.0])
    w[1, 32] = -12.0  # second block of row 1: scale 2
    qw = Q.quantize_weight_mxfp4(w)
    assert qw.data.shape == (2, 32) and qw.scale.shape == (2, 2) and qw.shape == (2, 64)
    assert qw.data[0, 0] == 0x72 and qw.scale[0].tolist() == [127, 1] and qw.scale[1].tolist() == [1, 128]
    assert qw.data[1, 16] == 0xF
    assert torch.equal(Q.dequantize_weight(qw), w)
    w3 = torch.randn(3, 8, 64, generator=gen)
    q3 = Q.quantize_weight_mxfp4(w3)
    as_i8 = Weight("mxfp4", q3.data.view(torch.int8), q3.scale, q3.shape)
    assert torch.equal(Q.dequantize_weight(as_i8), Q.dequantize_weight(q3))


@pytest.mark.parametrize("fmt", ["fp8_block128", "fp8_block32", "mxfp4"])
def test_quantized_gemm_ops_use_the_decoded_weight(ops, gen, fmt):
    quantize = getattr(Q, f"quantize_weight_{fmt}")
    w = torch.randn(48, 64, generator=gen)
    qw = quantize(w)
    deq = Q.dequantize_weight(qw).double()
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(ops["linear"](x, qw).double(), x.double() @ deq.T, rtol=1e-5, atol=1e-5)
    w3 = torch.randn(2, 48, 64, generator=gen)
    q3 = quantize(w3)
    d3 = Q.dequantize_weight(q3).double()
    got = ops["grouped_linear"](x, q3, torch.tensor([2, 3]))
    want = torch.cat([x[:2].double() @ d3[0].T, x[2:].double() @ d3[1].T])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    w13, w2 = quantize(torch.randn(2, 64, 64, generator=gen)), quantize(torch.randn(2, 64, 32, generator=gen))
    ids, wts = torch.tensor([[1, 0]] * 5), torch.full((5, 2), 0.5)
    y = ops["moe_experts"](x, ids, wts, w13, w2, None)
    y_dense = ops["moe_experts"](x, ids, wts, Weight.dense(Q.dequantize_weight(w13)),
                                 Weight.dense(Q.dequantize_weight(w2)), None)
    assert torch.equal(y, y_dense)


def test_fp4_e4m3_scale_saturates():
    x = torch.zeros(1, 16)
    x[0, :2] = torch.tensor([10000.0, -1000.0])  # amax / 6 > 448: scale clamps to 448 (0x7E)
    p = Q.kv_quantize(x, "fp4_e4m3")
    assert p[0, 8] == 0x7E and p[0, 0] == (0x8 | 4) << 4 | 7  # 10000/448 -> 6; -1000/448 = -2.23 -> -2
    assert Q.kv_dequantize(p, "fp4_e4m3", 16)[0, :2].tolist() == [2688.0, -896.0]


@pytest.mark.parametrize("fmt", ["mxfp8", "fp4_e4m3", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_quantize_takes_16_bit_rows_as_float32(fmt, dtype):
    """The op packs 16-bit rows as their (exact) float32 values: the same bytes as the widened rows,
    the floors included (rows far below them, where 16-bit arithmetic would round the floor)."""
    from shuili.platforms.reference.ops import OPS

    x = (torch.randn(6, 64, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    x[1] *= 1e-3
    x[2] *= 1e-6 if dtype == torch.bfloat16 else 1e-4
    x[3] = 0
    assert torch.equal(OPS["kv_quantize"](x, fmt), OPS["kv_quantize"](x.float(), fmt))
