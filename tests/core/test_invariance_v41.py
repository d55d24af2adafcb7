"""Bitwise batch invariance on the DeepSeek-V4.1 code path (tiny-v41: a window pool per layer,
compressed-KV / indexer-key pools per KV source, ratio-2 compressor state): alone, batched, chunked
at several budgets, cold and hot prefix cache, after preemption; and a negative control whose
batch-dependent op must break it."""
from __future__ import annotations

from functools import partial

import pytest
from core_helpers import bits, make_model_llm, run_preempting_first, solo_bits, workload

from shuili.hal.ops import DispatchTable

pytestmark = pytest.mark.slow

PROMPTS, PARAMS = workload(5, seed=7, shared_prefix="y" * 40)


make = partial(make_model_llm, "tiny-v41")


@pytest.fixture(scope="module")
def solo():
    return solo_bits(make(enable_prefix_caching=False), PROMPTS, PARAMS)


def test_v41_batch_and_hot_prefix(solo):
    llm = make()
    order = [3, 0, 4, 1, 2]
    cold = [bits(o) for o in llm.generate([PROMPTS[i] for i in order], [PARAMS[i] for i in order])]
    assert cold == [solo[i] for i in order]
    hot = [bits(o) for o in llm.generate(PROMPTS, PARAMS)]
    kv = llm.engine.kv
    assert kv.num_hit_tokens > 0  # the shared prefix came from the cache
    llm.engine.scheduler.check()
    assert hot == solo


@pytest.mark.parametrize("budget", [5, 13])
def test_v41_chunked_prefill(solo, budget):
    llm = make(max_num_batched_tokens=budget)
    assert [bits(o) for o in llm.generate(PROMPTS, PARAMS)] == solo
    llm.engine.scheduler.check()


def test_v41_forced_preemption(solo):
    llm = make()
    eng = llm.engine
    reqs = run_preempting_first(eng, PROMPTS, PARAMS)
    assert sum(r.num_preemptions for r in reqs) >= 2
    assert [bits(eng.output(r)) for r in reqs] == solo


def test_v41_negative_control_batch_dependent_op(solo):
    """A linear whose result depends on the number of rows must make batched != alone."""
    from shuili.core.models import load_model

    def factory(ops, device, dtype, seed):
        table = ops.as_dict()
        inner = table["linear"]
        table["linear"] = lambda x, w, bias=None: inner(x, w, bias) * (1.0 + 1e-6 * (x.shape[0] > 1))
        return load_model("tiny-v41", DispatchTable(ops.platform, table, dict(ops.sources)), device, dtype, seed)

    llm = make_model_llm(factory, enable_prefix_caching=False)
    assert [bits(o) for o in llm.generate(PROMPTS, PARAMS)] != solo
