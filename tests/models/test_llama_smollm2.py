"""SmolLM2-135M-Instruct (the shipped Q4_1 GGUF) on the reference platform against transformers'
own GGUF loading of the same file: weights bit for bit, logits to 1e-3 relative error, greedy
tokens over 32 steps; batch / chunk invariance; the engine path; perplexity.

Everything that needs the real model lives in this one module so the two models load once.
"""
from __future__ import annotations

import os

import pytest
import torch

from shuili.core.models import llama
from shuili.core.models.driver import CacheDriver

NEW_TOKENS = 32
RTOL = 1e-3
RAW_PROMPTS = ["The history of the printing press begins", "def fibonacci(n):\n    "]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return llama.resolve_named("smollm2-135m")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def ops():
    from shuili.hal import PlatformConfig
    from shuili.hal.registry import resolve_platform

    return resolve_platform(PlatformConfig(platform="reference")).ops


@pytest.fixture(scope="module")
def model(gguf_path, ops):
    return llama.load_gguf(gguf_path, ops)


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    m = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def prompts(model):
    return [model.tokenizer.encode(model.apply_chat_template(QUESTION))] + [
        model.tokenizer.encode(p) for p in RAW_PROMPTS]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-row max|difference| / max|reference logit|."""
    return float(((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max())


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts):
    """Per prompt: (prefill logits [L, V], [NEW_TOKENS] tokens, [NEW_TOKENS, V] step logits)."""
    runs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf(torch.tensor([ids]), use_cache=True)
            prefill, past = out.logits[0].float(), out.past_key_values
            step, toks, steps = prefill[-1], [], []
            for _ in range(NEW_TOKENS):
                steps.append(step)
                toks.append(int(step.argmax()))
                out = hf(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
                step, past = out.logits[0, -1].float(), out.past_key_values
            runs.append((prefill, toks, torch.stack(steps)))
    return runs


@pytest.fixture(scope="module")
def our_greedy(model, prompts):
    """The same as hf_greedy, with the three prompts prefilled and decoded as ONE batch."""
    cache = CacheDriver(model, len(prompts), max(map(len, prompts)) + NEW_TOKENS + 1)
    logits = model.forward(cache.batch([(b, ids, 0) for b, ids in enumerate(prompts)], logits="all"))
    ends = torch.tensor([len(ids) for ids in prompts]).cumsum(0).tolist()
    prefill = [logits[e - len(ids):e] for e, ids in zip(ends, prompts)]
    step = torch.stack([p[-1] for p in prefill])
    toks, steps = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(NEW_TOKENS):
        nxt = step.argmax(-1).tolist()
        for b, t in enumerate(nxt):
            toks[b].append(t)
            steps[b].append(step[b])
        step = model.forward(cache.batch([(b, [nxt[b]], len(prompts[b]) + len(toks[b]) - 1)
                                          for b in range(len(prompts))]))
    return [(prefill[b], toks[b], torch.stack(steps[b])) for b in range(len(prompts))]


def test_weights_equal_transformers(model, hf):
    sd = hf.state_dict()
    assert torch.equal(model.embed, sd["model.embed_tokens.weight"])
    assert torch.equal(model.final_norm, sd["model.norm.weight"])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(layer.wqkv.data, qkv), i
        assert torch.equal(layer.wo.data, sd[p + "self_attn.o_proj.weight"]), i
        assert torch.equal(layer.w_gate_up.data, torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                            sd[p + "mlp.up_proj.weight"]])), i
        assert torch.equal(layer.w_down.data, sd[p + "mlp.down_proj.weight"]), i
        assert torch.equal(layer.attn_norm, sd[p + "input_layernorm.weight"]), i
        assert torch.equal(layer.ffn_norm, sd[p + "post_attention_layernorm.weight"]), i


def test_prefill_logits_match_transformers(our_greedy, hf_greedy):
    for (ours, _, _), (ref, _, _) in zip(our_greedy, hf_greedy):
        assert ours.shape == ref.shape
        assert rel_err(ours, ref) <= RTOL


def test_greedy_32_tokens_match_transformers(our_greedy, hf_greedy):
    for b, ((_, ours, our_steps), (_, ref, ref_steps)) in enumerate(zip(our_greedy, hf_greedy)):
        first = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), None)
        assert first is None, f"prompt {b}: first divergence at new token {first}: {ours} vs {ref}"
        assert rel_err(our_steps, ref_steps) <= RTOL


def test_chat_answer_is_sensible(model, hf_greedy):
    tokens = hf_greedy[0][1]
    eos = model.tokenizer.eos_token_ids
    answer = model.tokenizer.decode(tokens[:next((i for i, t in enumerate(tokens) if t in eos), len(tokens))])
    assert "Paris" in answer


def test_batch_and_chunking_do_not_change_bits(model, prompts):
    a, b = prompts[1], prompts[2]
    n = len(a)
    alone = CacheDriver(model, 2, 64)
    ref_prefill = model.forward(alone.batch([(0, a, 0)]))
    ref_decode = model.forward(alone.batch([(0, [7], n)]))
    mixed = CacheDriver(model, 2, 64, tokens_per_block=4)
    # A in chunks of 3 and n-3 tokens, beside B (its own chunks), block size 4
    model.forward(mixed.batch([(1, b[:5], 0), (0, a[:3], 0)]))
    got_prefill = model.forward(mixed.batch([(0, a[3:], 3), (1, b[5:], 5)]))[0]
    got_decode = model.forward(mixed.batch([(1, [9], len(b)), (0, [7], n)]))[1]
    assert torch.equal(got_prefill, ref_prefill[0])
    assert torch.equal(got_decode, ref_decode[0])


def test_cli_generate_by_name_matches_transformers_greedy(model, hf_greedy, capsys):
    """`shuili generate` -> registry name -> engine -> chat template (the model is instruct)."""
    import json

    from shuili.cli import main

    rc = main(["generate", "--model", "smollm2-135m", "--platform", "reference", "--temperature", "0",
               "--max-tokens", str(NEW_TOKENS), "--num-blocks", "64", "--json", "--prompt", QUESTION])
    assert rc == 0
    (rec,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    (out,) = rec["outputs"]
    ref = hf_greedy[0][1]
    eos = model.tokenizer.eos_token_ids
    assert out["error"] is None
    assert out["token_ids"] == ref[:next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]
    assert "Paris" in out["text"]


def test_perplexity_engine_equals_direct_and_transformers(model, ops, hf):
    from shuili.core import perplexity
    from shuili.core.api import LLM

    samples = perplexity.load_texts()[:1]
    llm = LLM(model=model, platform="reference", num_blocks=64)
    engine = perplexity.engine_perplexity(llm, samples)
    direct = perplexity.direct_perplexity(model, ops, samples)
    for e, d in zip(engine, direct):
        assert e.token_ids == d.token_ids and e.num_tokens == len(e.token_ids) - 1
        assert e.logprobs == d.logprobs  # bitwise: the engine's batching changes nothing
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([e.token_ids])).logits[0, :-1].double(), -1)
        nll = -float(lp.gather(1, torch.tensor(e.token_ids[1:])[:, None]).sum())
        assert abs(e.nll - nll) / nll <= RTOL


def test_api_chat_answers_as_the_cli(model, hf_greedy):
    """llm.chat() renders the same template as `shuili generate` (checked above against the same
    transformers greedy run), so the API and the CLI give the same answer."""
    from shuili import LLM, SamplingParams

    llm = LLM(model=model, platform="reference", num_blocks=64)
    (out,) = llm.chat([{"role": "user", "content": QUESTION}],
                      SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    ref = hf_greedy[0][1]
    eos = model.tokenizer.eos_token_ids
    assert out.outputs[0].token_ids == ref[:next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]
    assert "Paris" in out.outputs[0].text
