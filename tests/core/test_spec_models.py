"""Speculative decoding on real model code: tiny-v4 (ngram and mtp; sliding, compressed and
compressor-state cache groups, its MTP layer) and SmolLM2-135M (ngram, the bundled GGUF). Greedy
and seeded temperature-0.8 requests (one with penalties) must give the token ids and float32
logprob bits of plain decoding, alone and batched, with chunked prefill, overlap, preemption and
(tiny-v4, device-free stand-in) decode graphs; the KV manager is checked after every step.
"""
from __future__ import annotations

import pytest
from core_helpers import PLATFORM, bits

from shuili import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXT = "the cat sat on the mat. the cat sat on the mat. the dog sat on the log. the cat sat on"
PROMPTS = [TEXT, "abc abc abc abc abc abc", "one two three one two three one two", "zq"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.8, seed=12, max_tokens=10, ignore_eos=True, logprobs=1,
                         repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1),
          SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=1)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 6}
MTP = {"method": "mtp", "num_speculative_tokens": 4, "min_confidence": 0.0}


def v4(**kw):
    base = dict(model="tiny-v4", platform=PLATFORM, tokens_per_block=16, max_num_seqs=8,
                max_num_batched_tokens=256)
    base.update(kw)
    return LLM(**base)


def drive(llm, prompts, params, preempt_at=()):
    eng = llm.engine
    reqs = [eng.add_request(p, s) for p, s in zip(prompts, params)]
    step = 0
    while eng.has_unfinished():
        eng.step_requests()
        step += 1
        if step in preempt_at and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.running[0].request_id)
        eng.scheduler.check()  # kv.check_integrity included
    eng.kv.check_integrity()
    return [bits(eng.output(r)) for r in reqs], reqs


@pytest.fixture(scope="module")
def v4_ref():
    llm = v4(enable_prefix_caching=False)
    return [bits(llm.generate([p], [s])[0]) for p, s in zip(PROMPTS, PARAMS)]


@pytest.mark.parametrize("spec", [NGRAM, MTP], ids=["ngram", "mtp"])
def test_v4_alone_and_batched(v4_ref, spec):
    llm = v4(speculative=spec)
    for i in (0, 1):  # alone
        got, _ = drive(llm, [PROMPTS[i]], [PARAMS[i]])
        assert got == [v4_ref[i]]
    got, reqs = drive(llm, PROMPTS, PARAMS)  # batched, prefix cache now hot
    assert got == v4_ref
    assert sum(r.num_draft_proposed for r in reqs) > 0


@pytest.mark.parametrize("spec", [NGRAM, MTP], ids=["ngram", "mtp"])
def test_v4_chunked_prefill_overlap_preemption(v4_ref, spec):
    got, reqs = drive(v4(speculative=spec, max_num_batched_tokens=7), PROMPTS, PARAMS)
    assert got == v4_ref
    got, reqs = drive(v4(speculative=spec, overlap=True), PROMPTS, PARAMS)
    assert got == v4_ref
    assert sum(r.num_draft_proposed for r in reqs) > 0, "overlap mode drafted nothing"
    got, reqs = drive(v4(speculative=spec), PROMPTS, PARAMS, preempt_at=(3, 5, 8))
    assert sum(r.num_preemptions for r in reqs) >= 2
    assert got == v4_ref


def test_v4_mtp_accepts_some_drafts(v4_ref):
    """Random weights: greedy MTP drafts rarely match, but sampled drafts share the target's noise."""
    _, reqs = drive(v4(speculative=MTP), PROMPTS, PARAMS)
    assert sum(r.num_draft_accepted for r in reqs) > 0


@pytest.mark.skipif(PLATFORM != "reference", reason="uses the device-free graph stand-in")
def test_v4_mtp_with_decode_graphs(v4_ref):
    from static_guard import ReplayByRerun

    from shuili.core.graphs import DecodeGraphs

    llm = v4(speculative={**MTP, "min_confidence": 0.9})  # few drafts: most steps are graphed decode
    eng = llm.engine
    cap = ReplayByRerun()
    cap.caches = eng.runner.caches
    eng.runner.graphs = DecodeGraphs(eng.model, cap, eng.runner.groups, eng.config.max_num_seqs,
                                     -(-eng.max_model_len // eng.kv.P), eng.kv.P, eng.device, keep_hidden=True)
    got, _ = drive(llm, PROMPTS, PARAMS)
    assert got == v4_ref
    assert sum(g.replays for g in eng.runner.graphs.graphs.values()) > 0


def test_v4_mtp_unavailable_without_weights():
    with pytest.raises(ValueError, match=r"'dspark' cannot serve this model: the model has no DSpark draft layers"
                                          r".*fit it: ngram"):
        v4(speculative={"method": "dspark", "num_speculative_tokens": 2})


# ------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smol_path():
    from shuili.core.models import llama

    try:
        return llama.resolve_named("smollm2-135m")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


SMOL_PROMPTS = ["Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
                "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"]
SMOL_PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1),
               SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=1)]


def smol(path, **kw):
    base = dict(model=path, platform=PLATFORM, tokens_per_block=16, max_num_seqs=4, max_num_batched_tokens=512)
    base.update(kw)
    return LLM(**base)


def test_smollm2_ngram_identical(smol_path):
    ref_llm = smol(smol_path, enable_prefix_caching=False)
    ref = [bits(ref_llm.generate([p], [s])[0]) for p, s in zip(SMOL_PROMPTS, SMOL_PARAMS)]
    got, _ = drive(smol(smol_path, speculative=NGRAM), SMOL_PROMPTS[:1], SMOL_PARAMS[:1])  # alone
    assert got == ref[:1]
    got, reqs = drive(smol(smol_path, speculative=NGRAM, max_num_batched_tokens=13), SMOL_PROMPTS, SMOL_PARAMS,
                      preempt_at=(4,))  # batched, chunked prefill, one preemption
    assert got == ref
    assert sum(r.num_preemptions for r in reqs) >= 1
    assert sum(r.num_draft_accepted for r in reqs) > 0, "repetitive text should accept some drafts"


def test_smollm2_mtp_is_a_clear_error(smol_path):
    with pytest.raises(ValueError, match=r"'mtp' cannot serve this model.*fit it: ngram"):
        smol(smol_path, speculative=MTP)
