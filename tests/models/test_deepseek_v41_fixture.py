"""The tiny DeepSeek-V4.1 parity fixture is whole and self-consistent (no transformers needed).

The parity test against shuili's model lives with the model; these checks guard the fixture itself: both
namings hold the same numbers, the shard index names exactly the tensors of existing shards, and the goldens
are the shapes the parity test reads.
"""
import json
import os
import sys

import pytest
import torch
from safetensors import safe_open

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepseek_v41_tiny")
sys.path.insert(0, FIX)
import make_fixture  # noqa: E402  (imports torch/numpy only; the oracle is imported inside main())
import v41_goldens as G  # noqa: E402


def _read(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_both_namings_hold_the_same_tensors():
    hf, rel = _read(G.HF_DIR), _read(G.RELEASED_DIR)
    cfg = json.load(open(os.path.join(G.HF_DIR, "config.json")))
    want = make_fixture.to_released(hf, cfg["moe_intermediate_size"])
    assert set(want) == set(rel)
    for k in rel:
        assert rel[k].dtype == torch.float32 and torch.equal(rel[k], want[k]), k
    # negative control: the rename table is not the identity, and a perturbed tensor is seen
    assert not set(hf) & set(rel)
    bad = dict(hf)
    bad["model.layers.2.self_attn.compressor.gate_proj.weight"] = hf[
        "model.layers.2.self_attn.compressor.gate_proj.weight"] + 1
    assert not torch.equal(make_fixture.to_released(bad, cfg["moe_intermediate_size"])[
        "layers.2.attn.compressor.wgate.weight"], rel["layers.2.attn.compressor.wgate.weight"])


def test_index_names_exactly_the_shard_contents():
    idx = json.load(open(os.path.join(G.RELEASED_DIR, "model.safetensors.index.json")))
    shards = {f for f in os.listdir(G.RELEASED_DIR) if f.endswith(".safetensors")}
    assert set(idx["weight_map"].values()) == shards and len(shards) == 2
    for f in shards:
        with safe_open(os.path.join(G.RELEASED_DIR, f), "pt") as h:
            assert set(h.keys()) == {k for k, v in idx["weight_map"].items() if v == f}


def test_configs_are_the_two_transformers_shapes():
    flat = json.load(open(os.path.join(G.HF_DIR, "config.json")))
    nested = json.load(open(os.path.join(G.RELEASED_DIR, "config.json")))
    assert flat["model_type"] == "deepseek_v41_text" and "text_config" not in flat
    assert nested["model_type"] == "deepseek_v41" and nested["text_config"]["model_type"] == "deepseek_v41_text"
    for k in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
              "engram_layer_ids", "engram_num_embeddings", "index_n_heads", "index_head_dim"):
        assert flat[k] == nested["text_config"][k], k
    assert flat["architectures"] == nested["architectures"] == ["DeepseekV41ForCausalLM"]


def test_goldens_shapes_and_chunked_agreement():
    cases = G.cases()
    cfg = json.load(open(os.path.join(G.HF_DIR, "config.json")))
    V, L = cfg["vocab_size"], len(cfg["engram_layer_ids"])
    cols = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
    assert len(cases) == 3
    for c in cases:
        S = c.prompt.numel()
        assert c.prefill_logits.shape == c.chunked_logits.shape == (S, V)
        assert sum(c.chunk_sizes) == S and len(c.greedy_tokens) == 16
        assert c.decode_logits.shape == (16, V) and c.engram_hash.shape == (S, L, cols)
        G.assert_close(c.chunked_logits, c.prefill_logits)
        assert c.greedy_tokens[0] == int(c.prefill_logits[-1].argmax())
        assert c.greedy_tokens[1:] == c.decode_logits[:-1].argmax(-1).tolist()
    with pytest.raises(AssertionError):   # negative control: another prompt's logits are far off
        G.assert_close(cases[0].prefill_logits[:20], cases[1].prefill_logits[:20])
