"""Decode ops captured in a CUDA graph replay to the eager bits (GPU only)."""
import pytest
import torch

from shuili.platforms.nvidia import attention, gemm, graphs, sampling
from shuili.hal.types import Weight

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_bucket():
    assert graphs.bucket(1) == 1 and graphs.bucket(33) == 48
    with pytest.raises(ValueError):
        graphs.bucket(10 ** 6)


@pytest.mark.parametrize("bi", [False, True])
def test_decode_step_graph_matches_eager(bi):
    b, h, kvh, d, bs, nblk, v = 8, 8, 2, 64, 16, 8, 1000
    dev = "cuda"
    k = torch.randn(b * nblk, bs, kvh, d, device=dev, dtype=torch.bfloat16)
    vv = torch.randn_like(k)
    table = torch.randperm(b * nblk, device=dev).view(b, nblk).to(torch.int32)
    w = Weight.dense(torch.randn(v, h * d, device=dev, dtype=torch.bfloat16) * 0.05)
    params = [torch.full((b,), 0.8, device=dev), torch.zeros(b, dtype=torch.int32, device=dev),
              torch.full((b,), 0.9, device=dev), torch.zeros(b, device=dev)]

    def step(q, seq_lens, seeds, positions):
        o = attention.paged_attention(q, k, vv, table, seq_lens,
                                      torch.arange(b + 1, device=dev, dtype=torch.int32), d ** -0.5,
                                      batch_invariant=bi)
        logits = gemm.linear(o.reshape(b, -1), w, batch_invariant=bi).float()
        return sampling.sample(logits, *params, seeds, positions), logits

    inputs = (torch.randn(b, h, d, device=dev, dtype=torch.bfloat16),
              torch.randint(1, nblk * bs, (b,), device=dev, dtype=torch.int32),
              torch.arange(b, device=dev), torch.arange(b, device=dev) + 5)
    g = graphs.GraphedStep(step, tuple(t.clone() for t in inputs))
    for trial in range(2):
        fresh = (torch.randn_like(inputs[0]), torch.randint(1, nblk * bs, (b,), device=dev, dtype=torch.int32),
                 inputs[2] + trial, inputs[3])
        tok_g, lg_g = g(*fresh)
        tok_e, lg_e = step(*fresh)
        assert torch.equal(lg_g, lg_e) and torch.equal(tok_g, tok_e)
