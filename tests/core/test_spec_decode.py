"""Speculative decoding changes no bit (core/spec): on the toy model, a drafter that replays the
reference answer with planted mistakes makes verify steps accept 0..k drafts and reject at every
offset; token ids and float32 logprob bits must equal plain decoding, batched, with chunked prefill,
forced preemption, overlap mode and a hot prefix cache, with the KV manager's integrity checked
after every step. The negative control verifies by a different rule and must be caught.
"""
from __future__ import annotations

import random

import pytest
from core_helpers import bits, make_llm, workload

from shuili.core.spec.base import Drafter, draftable
from shuili.core.spec.config import SpeculativeConfig
from shuili.core.spec.ngram import lookup

PROMPTS, PARAMS = workload(16, seed=11)
K = 6


class ReplayDrafter(Drafter):
    """Proposes the reference continuation, with a wrong token at a seeded random offset (or none)."""
    name = "replay"

    def __init__(self, answers: dict[tuple, list[int]], k: int, seed: int = 0):
        super().__init__(SpeculativeConfig(method="ngram", num_speculative_tokens=k), None, 10**9)
        self.answers, self.rng, self.proposed = answers, random.Random(seed), []

    def propose(self, requests):
        budget, n = self.config.num_speculative_tokens, 0
        for req in requests:
            if not draftable(req, req.token_limit(10**9)) or budget <= 0:
                continue
            ref = self.answers[tuple(req.prompt_token_ids)]
            done = len(req.output_token_ids) + req.num_placeholders  # overlap: one may be in flight
            d = list(ref[done:][:self.rng.randint(0, min(budget, 4))])
            if d and self.rng.random() < 0.5:
                j = self.rng.randrange(len(d))
                d[j] = (d[j] + 1) % 256
            req.draft_token_ids = d
            budget -= len(d)
            n += len(d)
        self.proposed.append(n)


@pytest.fixture(scope="module")
def solo(solo_results):
    return solo_results(PROMPTS, PARAMS)


def run(idx, solo, llm=None, preempt_at=(), **kw):
    llm = llm or make_llm(**kw)
    eng = llm.engine
    answers = {tuple(eng.tokenize(PROMPTS[i])): list(solo[i][0]) for i in idx}
    eng.drafter = ReplayDrafter(answers, K, seed=len(idx))
    reqs = [eng.add_request(PROMPTS[i], PARAMS[i]) for i in idx]
    step = 0
    while eng.has_unfinished():
        eng.step()
        step += 1
        if step in preempt_at and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.running[-1].request_id)
        eng.scheduler.check()  # includes kv.check_integrity
    assert max(eng.drafter.proposed) <= K
    eng.kv.check_integrity()
    assert all(not r.block_ids for r in reqs), "a finished request kept KV blocks"
    return [bits(eng.output(r)) for r in reqs], reqs


def accepted(reqs):
    return sum(r.num_draft_accepted for r in reqs), sum(r.num_draft_proposed for r in reqs)


@pytest.mark.parametrize("size", [1, 5, 16])
def test_batched_identical(solo, size):
    idx = random.Random(size).sample(range(16), size)
    got, reqs = run(idx, solo)
    assert got == [solo[i] for i in idx]
    acc, prop = accepted(reqs)
    assert size == 1 or 0 < acc < prop, (acc, prop)  # both accepted and rejected drafts occurred


@pytest.mark.parametrize("budget", [2, 5])
def test_chunked_prefill(solo, budget):
    idx = list(range(0, 16, 2))
    got, reqs = run(idx, solo, max_num_batched_tokens=budget)
    assert got == [solo[i] for i in idx]
    assert accepted(reqs)[0] > 0


def test_forced_preemption(solo):
    idx = list(range(10))
    got, reqs = run(idx, solo, preempt_at=(3, 4, 6, 9))
    assert sum(r.num_preemptions for r in reqs) >= 3
    assert got == [solo[i] for i in idx]


def test_kv_pressure_preemption(solo):
    idx = list(range(12))
    got, reqs = run(idx, solo, num_blocks=12)  # 4 tokens per block: growing requests preempt others
    assert sum(r.num_preemptions for r in reqs) > 0
    assert got == [solo[i] for i in idx]


def test_overlap_mode(solo):
    idx = list(range(12))
    got, reqs = run(idx, solo, overlap=True)
    assert got == [solo[i] for i in idx]
    assert accepted(reqs)[0] > 0


def test_hot_prefix_cache(solo_results):
    prompts, params = workload(8, seed=7, shared_prefix="a shared prefix that spans blocks...")
    ref = solo_results(prompts, params)
    llm = make_llm()
    eng = llm.engine
    for rnd in range(2):  # cold, then hot: published blocks must hold verified tokens only
        eng.drafter = ReplayDrafter({tuple(eng.tokenize(p)): list(r[0]) for p, r in zip(prompts, ref)}, K, rnd)
        reqs = [eng.add_request(p, s) for p, s in zip(prompts, params)]
        while eng.has_unfinished():
            eng.step()
            eng.scheduler.check()
        assert [bits(eng.output(r)) for r in reqs] == ref
    assert eng.kv.num_hit_tokens > 0


def test_negative_control_other_rule_is_caught(solo, monkeypatch):
    """Accepting every draft (verification by another rule) must change outputs."""
    import shuili.core.scheduler as sched

    monkeypatch.setattr(sched, "num_accepted", lambda drafts, targets: len(drafts))
    idx = list(range(8))
    got, _ = run(idx, solo)
    assert got != [solo[i] for i in idx]


def test_ngram_lookup():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup(toks, 3, 1, 4) == (3, [7, 8, 5, 1])  # the latest earlier occurrence wins
    assert lookup([4, 5, 6], 3, 1, 4) == (0, [])
    assert lookup([5, 6, 5], 2, 1, 3) == (1, [6, 5])


def test_ngram_engine_identical_and_budget(solo_results):
    prompts = ["abcd abcd abcd abcd abcd abc", "xyxyxyxyxyxyxyx", "no repeats here"]
    from shuili import SamplingParams
    params = [SamplingParams(temperature=t, seed=5, max_tokens=12, ignore_eos=True, logprobs=1)
              for t in (0.0, 0.8, 0.8)]
    ref = solo_results(prompts, params)
    llm = make_llm(speculative={"method": "ngram", "num_speculative_tokens": 3})
    eng = llm.engine
    reqs = [eng.add_request(p, s) for p, s in zip(prompts, params)]
    while eng.has_unfinished():
        eng.step_requests()
        eng.scheduler.check()
    assert [bits(eng.output(r)) for r in reqs] == ref
    assert sum(r.num_draft_proposed for r in reqs) > 0
    m = eng.output(reqs[0]).metrics
    assert m["draft_tokens_proposed"] == reqs[0].num_draft_proposed


def test_budget_is_per_step_total():
    llm = make_llm(speculative={"method": "ngram", "num_speculative_tokens": 3})
    eng = llm.engine
    from shuili import SamplingParams
    for _ in range(4):
        eng.add_request("abab abab abab abab", SamplingParams(max_tokens=10, ignore_eos=True))
    while eng.has_unfinished():
        eng.drafter.propose(eng.scheduler.running)
        assert sum(len(r.draft_token_ids) for r in eng.scheduler.running) <= 3
        eng.step_requests()
        eng.scheduler.check()


def test_method_the_model_cannot_serve():
    with pytest.raises(ValueError, match=r"'mtp' cannot serve this model.*fit it: ngram"):
        make_llm(speculative={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"'dspark' cannot serve this model: the model has no DSpark draft layers"):
        make_llm(speculative={"method": "dspark", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_llm(speculative={"method": "ngram", "num_speculative_tokens": 0})


def test_cli_bench_reports_speculation(capsys):
    import json

    from shuili.cli import main

    rc = main(["bench", "--platform", "reference", "--model", "tiny-v4", "--num-prompts", "2", "--input-len", "8",
               "--output-len", "4", "--speculative-method", "ngram", "--num-speculative-tokens", "3", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["identical_outputs"] is True
    assert {"acceptance_rate", "mean_tokens_per_step", "speedup", "draft_tokens_proposed"} <= set(res)
    rc = main(["generate", "--platform", "reference", "--model", "tiny-v4", "--prompt", "x",
               "--speculative-method", "ngram"])
    assert rc != 0 and "--num-speculative-tokens together" in capsys.readouterr().err
