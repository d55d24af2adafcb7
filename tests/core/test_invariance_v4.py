"""The bitwise batch-invariance checks on the real model code path: tiny-v4 (DeepSeek-V4 with
sliding, compressed and compressor-state cache groups). Smaller workload than the toy-model suite."""
from __future__ import annotations

import pytest
from core_helpers import PLATFORM, bits, workload

from shuili import LLM

pytest.importorskip("shuili.core.models.deepseek_v4")

pytestmark = pytest.mark.slow

PROMPTS, PARAMS = workload(6, seed=5, shared_prefix="x" * 40)


def make(**kw):
    base = dict(model="tiny-v4", platform=PLATFORM, tokens_per_block=16, max_num_seqs=8,
                max_num_batched_tokens=256)
    base.update(kw)
    return LLM(**base)


@pytest.fixture(scope="module")
def solo():
    llm = make(enable_prefix_caching=False)
    return [bits(llm.generate([p], [s])[0]) for p, s in zip(PROMPTS, PARAMS)]


def test_v4_batch_and_hot_prefix(solo):
    llm = make()
    order = [3, 0, 5, 1, 4, 2]
    cold = [bits(o) for o in llm.generate([PROMPTS[i] for i in order], [PARAMS[i] for i in order])]
    assert cold == [solo[i] for i in order]
    hot = [bits(o) for o in llm.generate(PROMPTS, PARAMS)]
    llm.engine.scheduler.check()
    assert hot == solo


def test_v4_chunked_prefill_and_overlap(solo):
    llm = make(max_num_batched_tokens=7, overlap=True)
    assert [bits(o) for o in llm.generate(PROMPTS, PARAMS)] == solo
    llm.engine.scheduler.check()


def test_v4_forced_preemption(solo):
    llm = make()
    eng = llm.engine
    reqs = [eng.add_request(p, s) for p, s in zip(PROMPTS, PARAMS)]
    step = 0
    while eng.has_unfinished():
        eng.step()
        step += 1
        if step in (2, 3) and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.running[0].request_id)
        eng.scheduler.check()
    assert sum(r.num_preemptions for r in reqs) >= 2
    assert [bits(eng.output(r)) for r in reqs] == solo
