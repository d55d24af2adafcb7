"""The Triton decode of e8m0 scale bytes (platforms/nvidia/quant.py), shared by the KV row codecs and
gemm.py's quantized loads, against the reference's, at every byte; and the even/odd row decode
(split_rows) of sparse attention against the reference's kv_dequantize."""
import pytest
import torch
import triton
import triton.language as tl

from shuili.hal.formats import bytes_per_row
from shuili.platforms.nvidia.quant import FORMAT_ID, e8m0_to_f32, split_rows
from shuili.platforms.reference import quant


@triton.jit
def _e8m0_kernel(s_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(out_ptr + r, e8m0_to_f32(tl.load(s_ptr + r)))


def test_e8m0_every_byte_as_the_reference(device):
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = torch.empty(256, device=device)
    _e8m0_kernel[(1,)](s.to(device), got, N=256)
    got, want = got.cpu(), quant.e8m0_to_float(s)
    assert torch.isnan(got[255]) and torch.isnan(want[255])
    assert torch.equal(got[:255].view(torch.int32), want[:255].view(torch.int32))
    assert got[0] == 2.0 ** -127 and got[254] == 2.0 ** 127  # the edges: subnormal, largest finite


@triton.jit
def _split_kernel(p_ptr, ev_ptr, od_ptr, ROW, R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  FMT: tl.constexpr, WORDS: tl.constexpr, NATIVE: tl.constexpr):
    r = tl.arange(0, R)
    ev, od = split_rows(p_ptr + r.to(tl.int64) * ROW, r % 3 != 1, D, DP, FMT, WORDS, NATIVE)
    at = r[:, None] * (DP // 2) + tl.arange(0, DP // 2)[None, :]
    tl.store(ev_ptr + at, ev)
    tl.store(od_ptr + at, od)


def _split_cases():
    for fmt in ("mxfp8", "fp4_e4m3", "mxfp4"):
        for d in (32, 64, 96, 128, 512):
            for words in (False, True):
                if not words or bytes_per_row(fmt, d) % 4 == 0:
                    yield fmt, d, words


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("fmt,d,words", list(_split_cases()))
def test_split_rows_as_the_reference(device, fmt, d, words, native):
    """quant.split_rows on packed rows of random bytes (every code, every scale byte but the e4m3
    NaN codes 0x7F / 0xFF, which the hardware conversion reads as NaN and the bit decode does not):
    the reference's kv_dequantize values, bit for bit (NaN as NaN), even and odd elements apart;
    every third row masked reads 0, and so do the padded elements past D."""
    if native and device == "cpu":
        pytest.skip("the hardware e4m3 conversion needs a GPU (the interpreter takes the bit decode)")
    r, row = 16, bytes_per_row(fmt, d)
    gen = torch.Generator().manual_seed(d + len(fmt))
    packed = torch.randint(0, 256, (r, row), generator=gen, dtype=torch.int32).to(torch.uint8)
    e4m3 = slice(0, d) if fmt == "mxfp8" else slice(d // 2, row) if fmt == "fp4_e4m3" else slice(0, 0)
    packed[:, e4m3] = torch.where((packed[:, e4m3] & 127) == 127, packed[:, e4m3] ^ 1, packed[:, e4m3])
    dp = triton.next_power_of_2(d)
    want = torch.zeros(r, dp)
    want[:, :d] = quant.kv_dequantize(packed, fmt, d)
    want[1::3] = 0
    ev = torch.empty(r, dp // 2, device=device)
    od = torch.empty(r, dp // 2, device=device)
    _split_kernel[(1,)](packed.to(device), ev, od, row, R=r, D=d, DP=dp, FMT=FORMAT_ID[fmt], WORDS=words,
                        NATIVE=native)
    for got, w in ((ev.cpu(), want[:, 0::2]), (od.cpu(), want[:, 1::2])):
        assert torch.equal(torch.isnan(got), torch.isnan(w))
        bits = [torch.where(torch.isnan(x), 0, x).view(torch.int32) for x in (w, got)]
        same = bits[0] == bits[1]
        assert same.all(), (fmt, d, words, (~same).nonzero()[:4].tolist())
