"""tiny-v4 through the real engine: tokens and logprob bits do not depend on the token budget
(chunking), batch composition or prefix-cache hits (the compressor state lives in sliding groups)."""
from __future__ import annotations

import torch

from shuili.core.api import LLM, SamplingParams


def _prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 1024, (37,), generator=g).tolist()  # crosses 2 HCA entries, 9 CSA entries
    return [shared + torch.randint(3, 1024, (n,), generator=g).tolist() for n in (5, 22)]


def _run(prompts, together: bool, hits: list | None = None, **cfg):
    llm = LLM(model="tiny-v4", platform="reference", tokens_per_block=16, seed=2, num_blocks=64, **cfg)
    kv = llm.engine.kv
    find = kv.find_cached

    def record(req):
        n, blocks = find(req)
        if hits is not None:
            hits.append(n)
        return n, blocks

    kv.find_cached = record
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=4, ignore_eos=True)
    if together:
        outs = llm.generate(prompts, params)
    else:
        outs = [llm.generate([p], params)[0] for p in prompts]
    return [(o.token_ids, o.logprobs) for o in outs]


def test_engine_outputs_do_not_depend_on_chunking_batching_or_prefix_hits():
    prompts = _prompts()
    base = _run(prompts, together=True, max_num_batched_tokens=512, enable_prefix_caching=False)
    assert all(len(t) == 4 for t, _ in base)
    # small budget: chunked prefill mixed with decodes; sequential: the second prompt hits the
    # cached 32-token prefix (two 16-token blocks, incl. the sliding groups' window blocks)
    assert _run(prompts, together=True, max_num_batched_tokens=12, enable_prefix_caching=False) == base
    hits = []
    assert _run(prompts, together=False, hits=hits, max_num_batched_tokens=512, enable_prefix_caching=True) == base
    assert hits[-1] == 32


def test_direct_perplexity_runs_any_model_and_matches_the_engine():
    """The one engine-free CacheDriver handles V4's sliding and compressed groups (the old llama-only
    driver refused them); one forward of the whole text equals the engine's chunked prompt logprobs."""
    from shuili.core import perplexity

    samples = [perplexity.TextSample(id="short", text="the quick brown fox jumps over the lazy dog, twice")]
    llm = LLM(model="tiny-v4", platform="reference", tokens_per_block=16, seed=2, num_blocks=64,
              max_num_batched_tokens=16)
    engine = perplexity.engine_perplexity(llm, samples)
    direct = perplexity.direct_perplexity(llm.engine.model, llm.engine.ops, samples)
    assert engine[0].num_tokens > 16 and engine[0].logprobs == direct[0].logprobs
