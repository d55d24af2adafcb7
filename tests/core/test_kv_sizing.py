"""Pool sizes from a byte budget: sliding groups get what their window can hold, the groups that
grow with context get the rest (core/kv_sizing.py), and generation is unchanged by it."""
from __future__ import annotations

import pytest
from core_helpers import PLATFORM, bits, workload

from shuili import LLM
from shuili.core.kv_sizing import pool_sizes, sliding_blocks
from shuili.core.models.deepseek_v4_cache import cache_groups
from shuili.core.models.deepseek_v4_config import named


def test_mid_v4_budget_holds_eight_16k_sequences():
    groups = cache_groups(named("mid-v4"), "bfloat16")
    P, S, budget = 128, 8, 8 << 30
    sizes = pool_sizes(groups, P, budget, S, 8192, 16384 + 128)
    need = S * -(-(16384 + 1) // P)  # every block of 8 sequences of 16k + 1 tokens
    full = [g for g in groups if g.kind != "sliding"]
    assert all(sizes[g.name] >= need for g in full)
    for g in groups:
        if g.kind == "sliding":
            assert sizes[g.name] == sliding_blocks(g, P, S, 8192) < need
    used = sum(sizes[g.name] * g.bytes_per_block(P) for g in groups)
    assert used <= budget
    # the old rule (every pool alike) fits fewer blocks than 8 such sequences need
    assert budget // sum(g.bytes_per_block(P) for g in groups) < need


def test_budget_too_small_is_a_clear_error():
    groups = cache_groups(named("mid-v4"), "bfloat16")
    with pytest.raises(ValueError, match="holds no KV block"):
        pool_sizes(groups, 128, 1 << 20, 8, 8192, 4096)


@pytest.mark.slow
def test_budget_sized_pools_generate_the_same_bits():
    prompts, params = workload(4, seed=9, shared_prefix="y" * 50)
    kw = dict(model="tiny-v4", platform=PLATFORM, tokens_per_block=16, max_num_seqs=4,
              max_num_batched_tokens=32, enable_prefix_caching=False)
    alike = LLM(num_blocks=64, **kw)
    sized = LLM(kv_cache_bytes=4 << 20, **kw)
    kv = sized.engine.kv
    slide = [g.name for g in kv.groups if g.kind == "sliding"]
    assert all(kv.pools[n].num_blocks < kv.num_blocks for n in slide)
    assert [bits(o) for o in sized.generate(prompts, params)] == [bits(o) for o in alike.generate(prompts, params)]
    sized.engine.scheduler.check()
    kv.check_integrity()


def test_default_budget_bounds_sliding_state_instead_of_failing(caplog):
    # mid-v4 with EngineConfig's defaults (1 GiB, 64 sequences, 2048-token steps): the windows of 64
    # sequences alone would take ~3.4 GB, so the engine could not start at all
    groups = cache_groups(named("mid-v4"), "bfloat16")
    P, budget = 128, 1 << 30
    sizes = pool_sizes(groups, P, budget, 64, 2048, 4096)
    sliding = [g for g in groups if g.kind == "sliding"]
    assert sum(sizes[g.name] * g.bytes_per_block(P) for g in sliding) <= budget // 2
    assert all(sizes[g.name] >= sliding_blocks(g, P, 1, 2048) for g in sliding)
    assert all(sizes[g.name] >= 1 for g in groups)
    assert sum(sizes[g.name] * g.bytes_per_block(P) for g in groups) <= budget
    assert "sliding-window state of" in caplog.text and "max_num_seqs=64" in caplog.text
    # a budget that holds every window keeps the full reservation
    big = pool_sizes(groups, P, 64 << 30, 64, 2048, 4096)
    assert all(big[g.name] == sliding_blocks(g, P, 64, 2048) for g in sliding)
