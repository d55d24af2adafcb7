"""Row-chunked linear and log_softmax (memory bounds) give the unchunked bits exactly."""
import torch

from shuili.hal import numerics
from shuili.hal.types import Weight
from shuili.platforms.reference import gemm, sampling


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_linear_row_chunks_are_bit_identical(monkeypatch):
    g = torch.Generator().manual_seed(3)
    w = Weight.dense(numerics.normal((300, 64), g))
    x = numerics.normal((50, 64), g) * torch.tensor([2.0 ** (i % 9 - 4) for i in range(64)])
    whole = gemm.linear(x, w)
    monkeypatch.setattr(gemm, "_CHUNK_ELEMENTS", 7 * 300)  # 7 rows per chunk, the last one short
    chunked = gemm.linear(x, w)
    assert torch.equal(_bits(whole), _bits(chunked))
    # negative control: a chunk of other rows does change a row's bits only through its own row
    assert not torch.equal(_bits(gemm.linear(x[:7] * 1.0000001, w)), _bits(chunked[:7]))


def test_log_softmax_row_chunks_are_bit_identical(monkeypatch):
    g = torch.Generator().manual_seed(4)
    logits = numerics.normal((20, 1000), g) * 6.0
    logits[3] = float("-inf")
    logits[3, 5] = 1.0
    whole = sampling.log_softmax(logits)
    monkeypatch.setattr(sampling, "_CHUNK_ELEMENTS", 3 * 1000)
    assert torch.equal(_bits(whole), _bits(sampling.log_softmax(logits)))
