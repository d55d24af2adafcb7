"""Batch invariance, bitwise: a request's token ids and float32 logprob bits do not depend on its
batch (size 2..32, any position), chunked-prefill budget, prefix-cache state, preemption or overlap
mode. Each is compared with the request run alone on a cold engine. The negative control swaps the
HAL GEMM for torch's (not batch-invariant) matmul and must see a difference.
"""
from __future__ import annotations

import random

import pytest
from core_helpers import bits, make_llm, workload

PROMPTS, PARAMS = workload(32, seed=1)


def run(idx, llm=None, **engine_kw):
    llm = llm or make_llm(**engine_kw)
    outs = llm.generate([PROMPTS[i] for i in idx], [PARAMS[i] for i in idx])
    llm.engine.scheduler.check()
    return [bits(o) for o in outs], llm


@pytest.fixture(scope="module")
def solo(solo_results):
    return solo_results(PROMPTS, PARAMS)


@pytest.mark.parametrize("size", [2, 3, 8, 17, 32])
def test_batch_size_and_position(solo, size):
    rng = random.Random(size)
    idx = rng.sample(range(32), size)  # a random subset in a random order: every position occurs
    got, _ = run(idx)
    assert got == [solo[i] for i in idx]


def test_needle_at_every_position(solo):
    fillers = [i for i in range(32) if i != 5][:7]
    for pos in (0, 3, 7):
        idx = fillers[:pos] + [5] + fillers[pos:]
        got, _ = run(idx)
        assert got[pos] == solo[5], f"needle at position {pos} diverged"


@pytest.mark.parametrize("budget", [1, 3, 7, 16, 1000])
def test_chunked_prefill_budgets(solo, budget):
    idx = list(range(0, 32, 3))
    got, _ = run(idx, max_num_batched_tokens=budget)
    assert got == [solo[i] for i in idx]


def test_prefix_cache_cold_and_hot(solo_results):
    prompts, params = workload(12, seed=7, shared_prefix="the shared system prompt, 37 chars..")
    ref = solo_results(prompts, params)
    llm = make_llm()
    cold = [bits(o) for o in llm.generate(prompts, params)]
    cached = llm.engine.kv.usage()["full"]["cached"]
    assert cached > 0, "nothing was published to the prefix cache"
    hits_before = _hit_tokens(llm, prompts[0])
    hot = [bits(o) for o in llm.generate(prompts, params)]
    llm.engine.scheduler.check()
    assert hits_before > 0, "the hot run found no cached prefix"
    assert cold == ref and hot == ref


def _hit_tokens(llm, prompt):
    from shuili.core.request import Request
    from shuili import SamplingParams

    req = Request("probe", llm.engine.tokenize(prompt), SamplingParams(), 0, 0)
    return llm.engine.kv.find_cached(req)[0]


def test_forced_preemption(solo):
    llm = make_llm()
    eng = llm.engine
    idx = list(range(12))
    reqs = [eng.add_request(PROMPTS[i], PARAMS[i]) for i in idx]
    step = 0
    while eng.has_unfinished():
        eng.step()
        step += 1
        running = [r for r in eng.scheduler.running]
        if step in (2, 4, 5) and running:
            for r in running[:: 2]:
                eng.scheduler.preempt(r.request_id)
        eng.scheduler.check()
    assert sum(r.num_preemptions for r in reqs) >= 3
    assert [bits(eng.output(r)) for r in reqs] == [solo[i] for i in idx]


def test_preemption_when_blocks_run_out(solo):
    idx = list(range(16))
    llm = make_llm(num_blocks=14, max_num_batched_tokens=32)
    outs = llm.generate([PROMPTS[i] for i in idx], [PARAMS[i] for i in idx])
    llm.engine.scheduler.check()
    assert sum(o.num_preemptions for o in outs) > 0, "the small cache never forced a preemption"
    assert [bits(o) for o in outs] == [solo[i] for i in idx]


@pytest.mark.parametrize("budget", [5, 64])
def test_overlap_mode(solo, budget):
    idx = list(range(0, 32, 2))
    got, _ = run(idx, overlap=True, max_num_batched_tokens=budget)
    assert got == [solo[i] for i in idx]


def test_priority_policy_does_not_change_results(solo):
    llm = make_llm(policy="priority", num_blocks=16)
    idx = list(range(10))
    outs = llm.generate([PROMPTS[i] for i in idx], [PARAMS[i] for i in idx], priority=[i % 3 for i in idx])
    assert [bits(o) for o in outs] == [solo[i] for i in idx]


def test_negative_control_detects_non_invariance(solo_results):
    """Same comparison, with torch matmul in the model: some request must differ, else the tests are blind."""
    kw = {"naive_linear": True}
    ref = solo_results(PROMPTS[:16], PARAMS[:16], kw)
    llm = make_llm(kw)
    got = [bits(o) for o in llm.generate(PROMPTS[:16], PARAMS[:16])]
    assert got != ref


class _SlotKeyedSampling:
    """Sampling noise keyed by batch slot instead of the request seed: the classic bug."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, positions, **hints):
        import torch

        slots = torch.arange(seeds.shape[0], dtype=seeds.dtype)
        return self._ops.sample(logits, temperature, top_k, top_p, min_p, slots, positions, **hints)


def test_negative_control_slot_keyed_noise(solo):
    llm = make_llm()
    llm.engine.runner.sampler.ops = _SlotKeyedSampling(llm.engine.runner.sampler.ops)
    idx = list(range(16))
    got, _ = run(idx, llm)
    assert got != [solo[i] for i in idx]
