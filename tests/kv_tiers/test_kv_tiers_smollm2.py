"""KV tiers on SmolLM2-135M (one full-attention group, the shipped GGUF): a host hit, a disk hit in
a new engine process and a full recompute give identical token ids and logprob bits."""
from __future__ import annotations

import pytest
from tiers_helpers import bits, cold, in_new_process, params, prompts

from shuili import LLM, SamplingParams

MODEL = "smollm2-135m"
ENGINE = {"max_num_seqs": 2, "num_blocks": 48, "max_model_len": 512}


@pytest.fixture(scope="module", autouse=True)
def _needs_the_model():
    from shuili.core.models.llama import resolve_named

    try:
        resolve_named(MODEL)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_smollm2_host_disk_and_recompute_bits(tmp_path):
    ps = prompts(49152, 50, 1, seed=4)
    pars = params(1)
    want = cold(MODEL, ps, pars, **ENGINE)
    store = str(tmp_path / "store")
    llm = LLM(model=MODEL, platform="reference", kv_host_bytes="256M", kv_store=store, **ENGINE)
    sp = [SamplingParams(**q) for q in pars]
    assert [bits(o) for o in llm.generate(ps, sp)] == want
    t = llm.engine.kv_tiers
    assert t.evict_device_cache(llm.engine.kv) > 0
    assert [bits(o) for o in llm.generate(ps, sp)] == want
    llm.engine.scheduler.check()
    hit = (len(ps[0]) - 1) // 16 * 16  # every full block but the one holding the last prompt token
    assert hit >= 48 and t.hit_tokens["host"] == hit and t.loaded_blocks["host"] == hit // 16
    t.flush()
    child = in_new_process(MODEL, ps, pars, {**ENGINE, "kv_store": store})
    assert child["bits"] == want and child["stats"]["kv_hit_tokens_disk"] == hit
