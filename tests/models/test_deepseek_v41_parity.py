"""DeepSeek-V4.1 against transformers' `deepseek_v41` oracle through shuili's loader (float32, CPU):
the fixture in tests/fixtures/deepseek_v41_tiny (both namings: transformers' save_pretrained and the
released names in 2 shards with an index) gives one-shot prefill logits, chunked-prefill logits
through the cache, greedy tokens and per-step decode logits; shuili must match them to
max|diff| / max|ref| <= 1e-4 with equal tokens."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from shuili.core.models import deepseek_v41 as V
from shuili.hal.config import PlatformConfig
from shuili.hal.registry import resolve_platform

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepseek_v41_tiny")
if not os.path.isfile(os.path.join(FIXTURE, "goldens.safetensors")):
    pytest.skip("the deepseek_v41_tiny fixture is not in this checkout", allow_module_level=True)
sys.path.insert(0, FIXTURE)
import v41_goldens as G  # noqa: E402

CASES = G.cases()


@pytest.fixture(scope="module", params=["hf", "released"])
def model(request):
    ops = resolve_platform(PlatformConfig(platform="reference")).ops
    return V.load_checkpoint(os.path.join(FIXTURE, request.param), ops, progress=False)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"prompt{c.index}")
def test_prefill(model, case):
    drv = model.driver(max_seqs=1, max_len=128)
    got = model.forward(drv.batch([(0, case.prompt.tolist())], logits="all"))
    G.assert_close(got, case.prefill_logits, "prefill logits")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"prompt{c.index}")
def test_chunked_prefill_and_greedy_decode(model, case):
    ids = case.prompt.tolist()
    drv = model.driver(max_seqs=1, max_len=128)
    parts, start = [], 0
    for n in case.chunk_sizes:
        parts.append(model.forward(drv.batch([(0, ids[start:start + n])], logits="all")))
        start += n
    G.assert_close(torch.cat(parts), case.chunked_logits, "chunked-prefill logits")
    toks, steps = [int(parts[-1][-1].argmax())], []
    for _ in range(len(case.greedy_tokens) - 1):
        steps.append(model.forward(drv.batch([(0, [toks[-1]])]))[0])
        toks.append(int(steps[-1].argmax()))
    assert toks == case.greedy_tokens
    steps.append(model.forward(drv.batch([(0, [toks[-1]])]))[0])
    G.assert_close(torch.stack(steps), case.decode_logits, "decode logits")


def test_the_check_can_fail(model):
    """Negative control: a one-ulp change in one norm weight must not pass the 1e-4 rule unnoticed
    at the logits of a perturbed model (the tolerance is not vacuous)."""
    case = CASES[1]
    drv = model.driver(max_seqs=1, max_len=128)
    w = model.norm
    saved = w.clone()
    try:
        w.mul_(1.01)
        got = model.forward(drv.batch([(0, case.prompt.tolist())], logits="all"))
    finally:
        w.copy_(saved)
    with pytest.raises(AssertionError):
        G.assert_close(got, case.prefill_logits)
