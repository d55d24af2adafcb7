"""The Triton decode of e8m0 scale bytes (platforms/nvidia/quant.py), shared by the KV row codecs and
gemm.py's quantized loads, against the reference's, at every byte."""
import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.quant import e8m0_to_f32
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
