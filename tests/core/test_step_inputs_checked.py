"""The runner range-checks the token ids and block tables it builds on the host: a captured decode
graph's ops do not check them on the device (platforms/nvidia/common.check)."""
from __future__ import annotations

import pytest
from core_helpers import make_llm

from shuili import SamplingParams
from shuili.hal.checks import inputs_are_checked


@pytest.fixture
def engine():
    return make_llm().engine


def test_out_of_range_token_id_is_stopped_on_the_host(engine):
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    req.prompt_token_ids[1] = engine.model.vocab_size + 3  # a bug past admission (admission refuses it)
    with pytest.raises(ValueError, match=r"token id 263 is outside the vocabulary \[0, 260\)"):
        engine.runner.host_inputs(engine.scheduler.schedule())


def test_out_of_range_block_is_stopped_before_its_slots_are_written(engine):
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    out = engine.scheduler.schedule()
    pool = engine.runner.pool_blocks["full"]
    req.block_ids["full"][0] = pool  # its slots would be pool * P + offset, past the cache
    with pytest.raises(ValueError, match=rf"block id {pool} of cache group 'full' is outside the pool \[0, {pool}\)"):
        engine.runner.host_inputs(out)


def test_a_failed_check_fails_only_that_step(engine):
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    req.prompt_token_ids[0] = 999
    engine.step()
    assert req.finished and "token id 999 is outside the vocabulary" in (req.error or "")
    ok = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert ok.error is None and len(ok.output_token_ids) == 2


def test_tokenizer_ids_outside_the_vocabulary_are_refused(engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text: [1, 300])
    with pytest.raises(ValueError, match=r"tokenizer produced ids \[300\] outside the model's vocabulary"):
        engine.add_request("hi")


def test_the_model_runs_with_checked_inputs_only_inside_a_step(engine, monkeypatch):
    """The ops may leave their device checks out during a step's forward (hal/checks.py), since
    the runner checked the ids above; a forward called outside a step keeps them."""
    seen = []
    forward = engine.model.forward

    def spy(*a, **k):
        seen.append(inputs_are_checked())
        return forward(*a, **k)

    monkeypatch.setattr(engine.model, "forward", spy)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert seen and all(seen)
    assert not inputs_are_checked()
