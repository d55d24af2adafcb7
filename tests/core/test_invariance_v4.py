"""The bitwise batch-invariance checks on the real model code path: tiny-v4 (DeepSeek-V4 with
sliding, compressed and compressor-state cache groups). Smaller workload than the toy-model suite."""
from __future__ import annotations

from functools import partial

import pytest
from core_helpers import bits, make_model_llm, run_preempting_first, solo_bits, workload

pytest.importorskip("shuili.core.models.deepseek_v4")

pytestmark = pytest.mark.slow

PROMPTS, PARAMS = workload(6, seed=5, shared_prefix="x" * 40)

make = partial(make_model_llm, "tiny-v4")


@pytest.fixture(scope="module")
def solo():
    return solo_bits(make(enable_prefix_caching=False), PROMPTS, PARAMS)


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
    reqs = run_preempting_first(eng, PROMPTS, PARAMS)
    assert sum(r.num_preemptions for r in reqs) >= 2
    assert [bits(eng.output(r)) for r in reqs] == solo
