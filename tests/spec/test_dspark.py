"""DSpark (DeepSeek-V4.1's draft layers, core/spec/dspark.py) on tiny-v41: greedy and seeded
temperature-0.8 requests (one with penalties) give the token ids and float32 logprob bits of plain
decoding, alone and batched, with chunked prefill, overlap and preemption, the KV manager checked
after every step; the draft lengths follow the confidence and the budget; negative controls (another
acceptance rule; draft context written into the target's own window cache) are caught; the draft
weights round-trip through both checkpoint namings.
"""
from __future__ import annotations

import os
import struct

import pytest
import torch

from shuili import LLM, SamplingParams

pytestmark = pytest.mark.slow
PLATFORM = os.environ.get("SHUILI_TEST_PLATFORM", "reference")

PROMPTS = ["the cat sat on the mat. the cat sat on", "abc abc abc abc", "one two three one two", "zq"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.8, seed=12, max_tokens=8, ignore_eos=True, logprobs=1,
                         repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1),
          SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=1)]
DSPARK = {"method": "dspark", "num_speculative_tokens": 6, "min_confidence": 0.0}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bits(out) -> tuple:
    return (tuple(out.token_ids), tuple(struct.pack("<f", x) for x in out.logprobs), out.finish_reason)


def v41(**kw):
    base = dict(model="tiny-v41", platform=PLATFORM, tokens_per_block=16, max_num_seqs=8,
                max_num_batched_tokens=256)
    base.update(kw)
    return LLM(**base)


def drive(llm, prompts, params, preempt_at=(), per_step=None):
    eng = llm.engine
    reqs = [eng.add_request(p, s) for p, s in zip(prompts, params)]
    step = 0
    while eng.has_unfinished():
        eng.step_requests()
        step += 1
        if per_step is not None:
            per_step(eng)
        if step in preempt_at and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.running[0].request_id)
        eng.scheduler.check()  # kv.check_integrity included
    eng.kv.check_integrity()
    return [bits(eng.output(r)) for r in reqs], reqs


@pytest.fixture(scope="module")
def ref():
    llm = v41(enable_prefix_caching=False)
    return [bits(llm.generate([p], [s])[0]) for p, s in zip(PROMPTS, PARAMS)]


def test_dspark_alone_and_batched(ref):
    llm = v41(speculative=DSPARK)
    for i in (0, 1):  # alone
        got, _ = drive(llm, [PROMPTS[i]], [PARAMS[i]])
        assert got == [ref[i]]
    got, reqs = drive(llm, PROMPTS, PARAMS)  # batched, prefix cache now hot
    assert got == ref
    assert sum(r.num_draft_proposed for r in reqs) > 0
    # random weights: sampled drafts share the target's noise, so some are accepted
    assert sum(r.num_draft_accepted for r in reqs) > 0


def test_dspark_chunked_prefill_overlap_preemption(ref):
    got, _ = drive(v41(speculative=DSPARK, max_num_batched_tokens=7), PROMPTS, PARAMS)
    assert got == ref
    got, reqs = drive(v41(speculative=DSPARK, overlap=True), PROMPTS, PARAMS)
    assert got == ref
    assert sum(r.num_draft_proposed for r in reqs) > 0, "overlap mode drafted nothing"
    got, reqs = drive(v41(speculative=DSPARK), PROMPTS, PARAMS, preempt_at=(3, 5, 8))
    assert sum(r.num_preemptions for r in reqs) >= 2
    assert got == ref


def test_dspark_lengths_follow_budget_and_confidence(ref):
    """At most num_speculative_tokens drafts per step in total and block_size per request; with a
    confidence floor no draft can reach (survival < 1), no request gets drafts."""
    llm = v41(speculative={**DSPARK, "num_speculative_tokens": 3})
    b = llm.engine.model.cfg.dspark_block_size
    seen = []

    def per_step(eng):
        drafts = [len(r.draft_token_ids) for r in eng.scheduler.running]
        assert sum(drafts) <= 3 and max(drafts, default=0) <= b
        seen.append(sum(drafts))

    got, reqs = drive(llm, PROMPTS, PARAMS, per_step=per_step)
    assert got == ref and max(seen) > 0
    got, reqs = drive(v41(speculative={**DSPARK, "min_confidence": 1.0}), PROMPTS, PARAMS)
    assert got == ref and sum(r.num_draft_proposed for r in reqs) == 0


def test_negative_control_other_rule_is_caught(ref, monkeypatch):
    """Accepting every draft (verification by another rule) must change the outputs."""
    import shuili.core.scheduler as sched

    monkeypatch.setattr(sched, "num_accepted", lambda drafts, targets: len(drafts))
    got, _ = drive(v41(speculative=DSPARK), PROMPTS, PARAMS)
    assert got != ref


def test_negative_control_context_in_target_cache_is_caught(ref):
    """Draft context KV written over the target's own window layers (not its draft layers) must
    change the outputs: the identity above is not blind to the drafter's cache writes."""
    llm = v41(speculative=DSPARK)
    llm.engine.model.dspark.layer0 = 0
    got, _ = drive(llm, PROMPTS, PARAMS)
    assert got != ref


def test_dspark_errors():
    from shuili.core.models.deepseek_v41 import DeepseekV41Model, build
    from shuili.core.models.deepseek_v41_loader import random_params

    with pytest.raises(ValueError, match=r"'dspark' cannot serve this model: the model has no DSpark draft "
                                         r"layers.*fit it: ngram"):
        LLM(model="smollm2-135m", platform=PLATFORM, speculative={"method": "dspark", "num_speculative_tokens": 2})

    def no_drafts(ops, device, dtype, seed):
        return build("tiny-v41", ops, device=device, dtype=dtype, seed=seed)

    with pytest.raises(ValueError, match=r"built without its DSpark draft layers.*fit it: ngram"):
        v41(model=no_drafts, speculative={"method": "dspark", "num_speculative_tokens": 2})
    m = v41().engine.model
    with pytest.raises(ValueError, match="DSpark draft layers need .* more tensors"):
        DeepseekV41Model(m.cfg, m.ops, random_params(m.cfg), engram=m.engram, with_dspark=True)


@pytest.mark.parametrize("naming", ["transformers", "released"])
def test_draft_weights_round_trip(tmp_path, naming):
    from shuili.core.models.deepseek_v41_config import named
    from shuili.core.models.deepseek_v41_loader import (dspark_schema, load_params, random_dspark_params,
                                                        random_params, save_checkpoint, tensors_for)
    from shuili.core.models.safetensors_index import CheckpointError
    from shuili.hal.types import Weight

    cfg = named("tiny-v41")
    params = {**random_params(cfg, seed=3), **random_dspark_params(cfg, seed=3)}
    tensors = tensors_for(cfg, params, naming)
    draft = [n for n in tensors if n.startswith(("mtp.", "model.mtp."))]
    if naming == "released":
        assert "mtp.2.markov_head.embed.weight" in draft and "mtp.0.main_proj.weight" in draft
        assert "mtp.1.ffn.experts.3.w2.weight" in draft and "mtp.2.confidence_head.proj.weight" in draft
    save_checkpoint(str(tmp_path), cfg, tensors, shards=2)
    got = load_params(str(tmp_path), cfg, progress=False, with_dspark=True)
    assert set(got) == set(params)
    for n in dspark_schema(cfg):
        a, b = (x.data if isinstance(x, Weight) else x for x in (got[n], params[n]))
        assert torch.equal(a.reshape(b.shape), b), n
    backbone = load_params(str(tmp_path), cfg, progress=False)  # mtp.* skipped unread
    assert not any(n.startswith("model.mtp.") for n in backbone)
    # a draft tensor the schema does not know is an error naming it (only when the drafts are read)
    bad = dict(tensors)
    bad[draft[0].replace(".0.", ".7.", 1) if ".0." in draft[0] else draft[0] + "x"] = torch.zeros(1)
    save_checkpoint(str(tmp_path / "bad"), cfg, bad)
    load_params(str(tmp_path / "bad"), cfg, progress=False)
    with pytest.raises(CheckpointError, match="mtp"):
        load_params(str(tmp_path / "bad"), cfg, progress=False, with_dspark=True)
    # a config without draft layers cannot serve dspark
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers = 0"):
        load_params(str(tmp_path), cfg.model_copy(update={"num_nextn_predict_layers": 0}), progress=False,
                    with_dspark=True)


def test_dspark_up_to_max_model_len():
    """A request that runs into max_model_len: the block's last rows would sit past the model's last
    position; outputs still equal plain decoding and the request stops at the limit."""
    from shuili.core.models.deepseek_v41 import build

    def short(dspark):  # rope tables end at position 23: a block row past it must not index them
        def f(ops, device, dtype, seed):
            return build("tiny-v41", ops, device=device, dtype=dtype, seed=seed, max_model_len=24,
                         with_dspark=dspark)
        return f

    p = [SamplingParams(temperature=0.8, seed=5, max_tokens=64, ignore_eos=True, logprobs=1)]
    ref = [bits(o) for o in v41(model=short(False)).generate(PROMPTS[1:2], p)]
    got, reqs = drive(v41(model=short(True), speculative=DSPARK), PROMPTS[1:2], p)
    assert got == ref and ref[0][2] == "length" and sum(r.num_draft_proposed for r in reqs) > 0


def test_dspark_from_checkpoint_directory(tmp_path):
    """`--model PATH --speculative-method dspark`: a released-name V4.1 checkpoint with its mtp.*
    layers (2 shards + index; no Engram layers so no tables to write) serves dspark with plain
    decoding's bits."""
    from shuili.core.models.deepseek_v41_config import named
    from shuili.core.models.deepseek_v41_loader import (random_dspark_params, random_params, save_checkpoint,
                                                        tensors_for)

    cfg = named("tiny-v41", engram_layer_ids=(), engram_num_embeddings=())
    params = {**random_params(cfg, seed=1), **random_dspark_params(cfg, seed=1)}
    save_checkpoint(str(tmp_path), cfg, tensors_for(cfg, params, "released"), shards=2)
    p, s = PROMPTS[:2], PARAMS[:2]
    ref = [bits(o) for o in v41(model=str(tmp_path)).generate(p, s)]
    got, reqs = drive(v41(model=str(tmp_path), speculative=DSPARK), p, s)
    assert got == ref and sum(r.num_draft_proposed for r in reqs) > 0


def test_dspark_lengths_are_prefix_survival(ref):
    """A confidence head that says sigmoid(0) = 1/2 for every draft: survival 1/2, 1/4, 1/8, ...;
    with min_confidence 0.2 every draftable request gets exactly two drafts (budget permitting)."""
    from shuili.hal.types import Weight

    llm = v41(speculative={**DSPARK, "min_confidence": 0.2, "num_speculative_tokens": 8})
    ds = llm.engine.model.dspark
    ds.w.confidence = Weight.dense(torch.zeros_like(ds.w.confidence.data))
    seen = []

    def per_step(eng):
        seen.extend(len(r.draft_token_ids) for r in eng.scheduler.running if r.draft_token_ids)

    got, _ = drive(llm, PROMPTS, PARAMS, per_step=per_step)
    assert got == ref and seen and set(seen) == {2}
