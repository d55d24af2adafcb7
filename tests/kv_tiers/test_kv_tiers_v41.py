"""KV tiers on tiny-v41: its per-KV-source compressed and indexer pools, the window pool and
the compressor state come back from the host and from the store in a new process with the bits
of a full recompute (the Engram look-back is recomputed from token ids, nothing to store)."""
from __future__ import annotations

from tiers_helpers import bits, cold, in_new_process, params, prompts

from shuili import LLM, SamplingParams

MODEL = "tiny-v41"
VOCAB = 256


def test_host_hit_and_disk_hit_in_a_new_process_match_recompute(tmp_path):
    ps = prompts(VOCAB, 70, 2, seed=3)
    pars = params(len(ps))
    want = cold(MODEL, ps, pars, max_num_seqs=4)
    llm = LLM(model=MODEL, platform="reference", kv_host_bytes="64M", kv_store=str(tmp_path / "store"),
              max_num_seqs=4)
    assert [bits(o) for o in llm.generate(ps, [SamplingParams(**q) for q in pars])] == want
    t = llm.engine.kv_tiers
    assert t.evict_device_cache(llm.engine.kv) > 0
    assert [bits(o) for o in llm.generate(ps, [SamplingParams(**q) for q in pars])] == want
    llm.engine.scheduler.check()
    assert t.hit_tokens["host"] >= 64 and t.loaded_blocks["host"] > 0
    t.flush()
    child = in_new_process(MODEL, ps, pars, {"max_num_seqs": 4, "kv_store": str(tmp_path / "store")})
    assert child["bits"] == want and child["stats"]["kv_hit_tokens_disk"] >= 64
