"""Decode ops captured in a CUDA graph replay to the eager bits (GPU only)."""
import pytest
import torch

from shuili.platforms.nvidia import attention, gemm, graphs, sampling
from shuili.hal.types import Weight

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("bi", [False, True])
def test_decode_step_graph_matches_eager(bi):
    b, h, kvh, d, bs, nblk, v = 8, 8, 2, 64, 16, 8, 1000
    dev = "cuda"
    k = torch.randn(b * nblk, bs, kvh, d, device=dev, dtype=torch.bfloat16)
    vv = torch.randn_like(k)
    table = torch.randperm(b * nblk, device=dev).view(b, nblk).to(torch.int32)
    w = Weight.dense(torch.randn(v, h * d, device=dev, dtype=torch.bfloat16) * 0.05)
    params = [torch.full((b,), 0.8, device=dev), torch.zeros(b, dtype=torch.int32, device=dev),
              torch.full((b,), 0.9, device=dev), torch.zeros(b, device=dev)]

    def step(q, seq_lens, seeds, positions):
        o = attention.paged_attention(q, k, vv, table, seq_lens,
                                      torch.arange(b + 1, device=dev, dtype=torch.int32), d ** -0.5,
                                      batch_invariant=bi)
        logits = gemm.linear(o.reshape(b, -1), w, batch_invariant=bi).float()
        return sampling.sample(logits, *params, seeds, positions), logits

    inputs = (torch.randn(b, h, d, device=dev, dtype=torch.bfloat16),
              torch.randint(1, nblk * bs, (b,), device=dev, dtype=torch.int32),
              torch.arange(b, device=dev), torch.arange(b, device=dev) + 5)
    static = tuple(t.clone() for t in inputs)
    g = graphs.GraphedStep(lambda: step(*static))
    for trial in range(2):
        fresh = (torch.randn_like(inputs[0]), torch.randint(1, nblk * bs, (b,), device=dev, dtype=torch.int32),
                 inputs[2] + trial, inputs[3])
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        tok_g, lg_g = g()
        tok_e, lg_e = step(*fresh)
        assert torch.equal(lg_g, lg_e) and torch.equal(tok_g, tok_e)


def _engine_bits(bi: bool, eager: bool, overlap: bool = False):
    import struct

    from shuili import LLM, SamplingParams
    from shuili.hal import PlatformConfig

    llm = LLM(model="tiny-v4", platform=PlatformConfig(platform="nvidia", batch_invariant=bi),
              tokens_per_block=16, max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=eager,
              overlap=overlap)
    lens = [1, 3, 15, 16, 17, 33, 47]
    prompts = [[(7 * i + 3 * j) % 1000 + 2 for j in range(n)] for i, n in enumerate(lens)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=100 + i, max_tokens=6 + 3 * i,
                             ignore_eos=True, logprobs=1) for i in range(len(lens))]
    outs = llm.generate(prompts, params)
    g = llm.engine.runner.graphs
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(o.token_ids, [struct.pack("<f", x) for x in o.logprobs]) for o in outs], g


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_decode_graphs_match_eager_bits_in_batch_invariant_mode(overlap):
    eager, g0 = _engine_bits(True, True)
    graphed, g = _engine_bits(True, False, overlap)
    assert g0 is None and g is not None and g.disabled is None, getattr(g, "disabled", None)
    assert sum(x.replays for x in g.graphs.values()) >= 10 and len(g.graphs) >= 3
    assert graphed == eager


def test_engine_decode_graphs_default_mode_close_to_eager():
    import struct

    eager, _ = _engine_bits(False, True)
    graphed, g = _engine_bits(False, False)
    assert g.disabled is None and g.graphs
    for (te, le), (tg, lg) in zip(eager, graphed):
        a = [struct.unpack("<f", x)[0] for x in le]
        b = [struct.unpack("<f", x)[0] for x in lg]
        n = next((i for i, (x, y) in enumerate(zip(te, tg)) if x != y), len(te))  # up to a near-tie flip
        assert n > 0 and all(abs(x - y) <= 1e-3 * (1 + abs(x)) for x, y in zip(a[:n], b[:n]))


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 1.0), (0.8, 0.9)])
def test_overlap_decode_launch_never_syncs(temperature, top_p):
    """Overlap mode only overlaps if launching a decode step never waits for the device: the
    inputs go up in one pinned async copy and the sampler's host hints replace `.any()` reads.
    torch's sync debug mode turns any synchronizing call inside a decode launch into an error."""
    from shuili import LLM, SamplingParams
    from shuili.hal import PlatformConfig

    llm = LLM(model="tiny-v4", platform=PlatformConfig(platform="nvidia"), tokens_per_block=16,
              max_num_seqs=8, max_num_batched_tokens=64, overlap=True)
    prompts = [[(5 * i + j) % 900 + 2 for j in range(9 + i)] for i in range(6)]
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=3, max_tokens=12, ignore_eos=True)
    llm.generate(prompts, params)  # captures the graphs (capture itself synchronizes)
    runner, checked = llm.engine.runner, []
    execute = runner.execute

    def strict(out, prev=None):
        decode = all(c.num_tokens == 1 for c in out.chunks) and prev is not None
        if not decode:
            return execute(out, prev)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(out, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(len(out.chunks))

    runner.execute = strict
    outs = llm.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert len(checked) >= 8


def _v41_bits(eager: bool, overlap: bool = False):
    import struct

    from shuili import LLM, SamplingParams
    from shuili.hal import PlatformConfig

    llm = LLM(model="tiny-v41", platform=PlatformConfig(platform="nvidia", batch_invariant=True),
              tokens_per_block=16, max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=eager,
              overlap=overlap)
    lens = [1, 2, 7, 16, 17, 33, 46]
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=100 + i, max_tokens=6 + 3 * i,
                             ignore_eos=True, logprobs=1) for i in range(len(lens))]
    outs = llm.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    bits = [(o.token_ids, [struct.pack("<f", x) for x in o.logprobs]) for o in outs]
    return bits, llm.engine.runner.graphs, llm.engine.model.engram


@pytest.mark.parametrize("overlap", [False, True])
def test_v41_decode_graphs_match_eager_bits_in_batch_invariant_mode(overlap):
    """tiny-v41 (CED reuse, two-level indexer, Engram read from registered host pages inside the
    graph): replayed decode steps give the eager bits. Not yet run on a GPU (written device-free)."""
    eager, g0, _ = _v41_bits(True)
    graphed, g, engram = _v41_bits(False, overlap)
    assert g0 is None and g is not None and g.disabled is None, getattr(g, "disabled", None)
    assert sum(x.replays for x in g.graphs.values()) >= 10 and len(g.graphs) >= 3
    assert engram.stats.get("static_gathers", 0) > 0  # the captured Engram path (counted at record time)
    assert graphed == eager
