"""Helpers for the core engine tests: the toy-model engine, workloads and bitwise comparison.
(A uniquely named module, since the tests import it by name under --import-mode=importlib.)"""
from __future__ import annotations

import os
import random
import struct

from core_toy_model import factory

from shuili import LLM, SamplingParams

# SHUILI_TEST_PLATFORM=nvidia runs the same engine checks on another platform's ops
PLATFORM = os.environ.get("SHUILI_TEST_PLATFORM", "reference")


def make_llm(model_kw=None, **engine_kw) -> LLM:
    kw = dict(tokens_per_block=4, num_blocks=256, max_num_batched_tokens=64, max_num_seqs=32)
    kw.update(engine_kw)
    return LLM(model=factory(**(model_kw or {})), platform=PLATFORM, **kw)


def make_model_llm(model, **engine_kw) -> LLM:
    """A real model (a NAMED config such as tiny-v4 / tiny-v41, or a factory) with the engine settings
    the model invariance tests share."""
    kw = dict(model=model, platform=PLATFORM, tokens_per_block=16, max_num_seqs=8, max_num_batched_tokens=256)
    kw.update(engine_kw)
    return LLM(**kw)


def solo_bits(llm: LLM, prompts, params) -> list[tuple]:
    """Each request generated alone on `llm`, one after another: the reference answers."""
    return [bits(llm.generate([p], [s])[0]) for p, s in zip(prompts, params)]


def run_preempting_first(eng, prompts, params, at=(2, 3)) -> list:
    """Add every request and step until all finish, preempting the first running request after each
    step in `at` and checking the scheduler after every step; returns the requests."""
    reqs = [eng.add_request(p, s) for p, s in zip(prompts, params)]
    step = 0
    while eng.has_unfinished():
        eng.step()
        step += 1
        if step in at and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.running[0].request_id)
        eng.scheduler.check()
    return reqs


def bits(out) -> tuple:
    """A request's result as comparable bits: token ids and the raw float32 logprob bytes."""
    return (tuple(out.token_ids), tuple(struct.pack("<f", x) for x in out.logprobs), out.finish_reason)


def workload(n: int, seed: int = 0, shared_prefix: str = "") -> tuple[list[str], list[SamplingParams]]:
    """n prompts of ragged lengths; a mix of greedy, plain and filtered sampling."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        body = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, 30)))
        prompts.append(shared_prefix + body)
        kind = i % 4
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=rng.randint(3, 10), ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=rng.randint(3, 10), ignore_eos=True)
        elif kind == 2:
            p = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=2000 + i,
                               max_tokens=rng.randint(3, 10), ignore_eos=True)
        else:
            p = SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3,
                               frequency_penalty=0.2, seed=3000 + i, max_tokens=rng.randint(3, 10),
                               ignore_eos=True)
        params.append(p)
    return prompts, params
