"""Checkpoint loading: FP8 block-128 linears + MXFP4 experts against the dequantized dense model,
malformed checkpoints fail naming the tensor, config.json parsing (released and HF spellings)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shuili.core.models import deepseek_v4 as V
from shuili.core.models.deepseek_v4_config import V4Config, named
from shuili.core.models.deepseek_v4_loader import (
    CheckpointError, random_params, released_tensors, save_checkpoint, schema,
)
from shuili.hal.config import PlatformConfig
from shuili.hal.registry import resolve_platform
from shuili.hal.types import Weight
from shuili.platforms.reference import quant


@pytest.fixture(scope="module")
def ops():
    return resolve_platform(PlatformConfig(platform="reference")).ops


def _quantized_checkpoint(cfg: V4Config, params: dict):
    """Released layout: linears F8_E4M3 + F8_E8M0 scale per 128x128, experts I8 e2m1 pairs + E8M0 per 32.
    Also returns the params of the dense model holding exactly the dequantized values."""
    kinds = schema(cfg)
    tensors, dense = released_tensors(cfg, params), dict(params)
    out = {}
    for name, t in tensors.items():
        if ".experts." in name:
            w = quant.quantize_weight_mxfp4(t)
            out[name] = w.data.view(torch.int8)
            out[name[: -len("weight")] + "scale"] = w.scale.view(torch.float8_e8m0fnu)
        elif kinds.get(name) is not None and kinds[name].kind in ("linear", "grouped"):
            w = quant.quantize_weight_fp8_block128(t)
            out[name] = w.data
            out[name[: -len("weight")] + "scale"] = quant.float_to_e8m0_ceil(w.scale).view(torch.float8_e8m0fnu)
            deq = quant.dequantize_weight(w)
            dense[name] = Weight.dense(deq.reshape(cfg.o_groups, cfg.o_lora_rank, -1)
                                       if kinds[name].kind == "grouped" else deq)
        else:
            out[name] = t
    for name in [n for n in params if n.endswith(("experts.w13", "experts.w2"))]:
        e = params[name].data
        if name.endswith("w13"):  # w1 and w3 quantize separately; the concat along N is the same rows
            I = cfg.moe_intermediate_size
            deq = torch.cat([quant.dequantize_weight(quant.quantize_weight_mxfp4(e[:, :I])),
                             quant.dequantize_weight(quant.quantize_weight_mxfp4(e[:, I:]))], dim=1)
        else:
            deq = quant.dequantize_weight(quant.quantize_weight_mxfp4(e))
        dense[name] = Weight.dense(deq)
    return out, dense


@pytest.fixture(scope="module")
def tiny():
    cfg = named("tiny-v4")
    return cfg, random_params(cfg, seed=11)


def test_fp8_linears_and_mxfp4_experts_load_like_the_dequantized_model(ops, tiny, tmp_path):
    cfg, params = tiny
    tensors, dense = _quantized_checkpoint(cfg, params)
    save_checkpoint(str(tmp_path), cfg, tensors, shards=3)
    q = V.load_checkpoint(str(tmp_path), ops, progress=False, with_mtp=True)
    assert q.blocks[2].attn.wq_a.format == "fp8_block128"
    assert q.blocks[2].attn.wq_a.scale.dtype == torch.float32
    assert q.blocks[1].ffn.w13.format == "mxfp4" and q.blocks[1].ffn.w13.data.shape == (8, 256, 128)
    assert q.mtp is not None
    ref = V.DeepseekV4Model(cfg, ops, dense)
    ids = torch.randint(3, 1024, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    a = q.forward(q.driver(max_len=64).batch([(0, ids)], logits="all"))
    b = ref.forward(ref.driver(max_len=64).batch([(0, ids)], logits="all"))
    # the reference GEMM dequantizes to float32 exactly, so both models hold the same numbers
    assert torch.allclose(a, b, rtol=0, atol=1e-6 * float(b.abs().max()))
    # and the quantized model is not trivially the float one
    f = V.DeepseekV4Model(cfg, ops, params)
    c = f.forward(f.driver(max_len=64).batch([(0, ids)], logits="all"))
    assert not torch.allclose(a, c, rtol=0, atol=1e-6 * float(c.abs().max()))


@pytest.fixture(scope="module")
def good_ckpt(tiny, tmp_path_factory):
    cfg, params = tiny
    path = tmp_path_factory.mktemp("good")
    save_checkpoint(str(path), cfg, released_tensors(cfg, params))
    return path


def _broken(good_ckpt, tmp_path, edit):
    tensors = load_file(str(good_ckpt / "model.safetensors"))
    edit(tensors)
    (tmp_path / "config.json").write_text((good_ckpt / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("name, edit, words", [
    ("layers.3.attn.wkv.weight", lambda t, n: t.pop(n), "missing tensor 'layers.3.attn.wkv.weight'"),
    ("layers.2.ffn.experts.5.w2.weight", lambda t, n: t.pop(n), "missing tensor 'layers.2.ffn.experts.5.w2.weight'"),
    ("layers.4.attn.compressor.ape", lambda t, n: t.__setitem__(n, t[n][:2]),
     "'layers.4.attn.compressor.ape' has shape [2, 256], expected [4, 256]"),
    ("layers.0.ffn.gate.tid2eid", lambda t, n: t.__setitem__(n, t[n].float()),
     "'layers.0.ffn.gate.tid2eid' has dtype torch.float32"),
    ("embed.weight", lambda t, n: t.__setitem__(n, t[n].to(torch.int32)), "'embed.weight' has dtype torch.int32"),
    ("layers.1.attn.wq_b.weight", lambda t, n: t.__setitem__(n, t[n].to(torch.float8_e4m3fn)),
     "missing tensor 'layers.1.attn.wq_b.scale'"),
])
def test_malformed_checkpoint_names_the_tensor(ops, good_ckpt, tmp_path, name, edit, words):
    path = _broken(good_ckpt, tmp_path, lambda t: edit(t, name))
    with pytest.raises(CheckpointError) as e:
        V.load_checkpoint(path, ops, progress=False)
    assert words in str(e.value)


def test_checkpoint_without_config_or_weights(ops, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        V.load_checkpoint(str(tmp_path), ops)
    (tmp_path / "config.json").write_text(json.dumps(named("tiny-v4").to_hf()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        V.load_checkpoint(str(tmp_path), ops)


RELEASED = {  # deepseek-ai/DeepSeek-V4-Flash config.json (v4_arch.md §1.1)
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "expert_dtype": "fp4", "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
}


def test_released_config_parses():
    c = V4Config.from_hf(RELEASED)
    assert c.num_hidden_layers == 43 and len(c.attn_kinds) == 43
    assert c.attn_kinds[:4] == ("swa", "swa", "csa", "hca") and c.attn_kinds[42] == "csa"
    assert len(c.layers_of("csa")) == 21 and len(c.layers_of("hca")) == 20
    assert c.hca_ratio == 128 and c.csa_ratio == 4
    assert c.mlp_kinds[:4] == ("hash", "hash", "hash", "topk")
    assert c.yarn is not None and c.yarn.factor == 16 and c.yarn.original_max_position_embeddings == 65536
    assert 284.0e9 < c.num_params(with_mtp=False) < 284.6e9  # 284.3B measured on HF's meta model


def test_config_roundtrips_through_hf():
    transformers = pytest.importorskip("transformers")
    for name in ("tiny-v4", "mid-v4"):
        c = named(name)
        assert V4Config.from_hf(json.loads(json.dumps(c.to_hf()))) == c
        hf = transformers.DeepseekV4Config(**c.to_hf())
        assert V4Config.from_hf(hf.to_dict()) == c
    assert 2.4e9 < named("mid-v4").num_params() < 3.0e9
    assert named("tiny-v4").num_params() < 50e6


def test_bad_config_is_explained():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        V4Config.from_hf({**RELEASED, "num_hidden_layers": 50})
    with pytest.raises(ValueError, match="model_type"):
        V4Config.from_hf({**RELEASED, "model_type": "llama"})
    with pytest.raises(ValueError, match="unknown V4 config"):
        named("huge-v4")


@pytest.mark.parametrize("device", ["meta"] + (["cuda"] if torch.cuda.is_available() else []))
def test_random_weights_do_not_depend_on_the_device(tiny, device):
    """A seed is one model on every device: the cross-platform checks score a GPU platform against
    the reference built on the CPU, and a CUDA generator draws other numbers from the same seed."""
    cfg, cpu = tiny
    got = random_params(cfg, device=device, seed=11)
    assert got.keys() == cpu.keys()
    for name, want in cpu.items():
        a, b = (want.data, got[name].data) if isinstance(want, Weight) else (want, got[name])
        assert (b.device.type, b.dtype, b.shape) == (device, a.dtype, a.shape), name
        if device != "meta":  # meta holds no values: it shows only that nothing is drawn there
            assert torch.equal(b.cpu(), a), name


@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(b"\xff" * 1000), "is not a readable safetensors file (header too large)"),
    (lambda p: p.write_bytes(b""), "is empty (0 bytes); expected a safetensors file"),
    (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "file not fully covered"),
])
def test_corrupt_safetensors_names_the_file(ops, good_ckpt, tmp_path, damage, words):
    from shuili.core.models import load_model

    (tmp_path / "config.json").write_text((good_ckpt / "config.json").read_text())
    weights = tmp_path / "model.safetensors"
    weights.write_bytes((good_ckpt / "model.safetensors").read_bytes())
    damage(weights)
    with pytest.raises(CheckpointError) as e:
        load_model(str(tmp_path), ops)
    assert str(e.value).startswith(f"{weights} ") and words in str(e.value)


def test_bad_checkpoint_config_json_names_the_line(ops, tmp_path):
    from shuili.core.models import load_model

    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4",\n "vocab_size": }')
    with pytest.raises(ValueError, match=r"config.json:2:16: not valid JSON"):
        load_model(str(tmp_path), ops)
