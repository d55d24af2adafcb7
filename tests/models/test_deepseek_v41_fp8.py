"""V4.1's FP8 32x32 linears stay as stored (the contract's fp8_block32) when the platform declares
the format, and are decoded at load when it does not. The released parity fixture, rewritten with
its linears in FP8 e4m3 + ue8m0 32x32 blocks as the release stores them, gives the same logits bit
for bit either way on the reference (which dequantizes exactly); malformed FP8 tensors are named."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shuili.core.models import deepseek_v41 as V
from shuili.core.models.deepseek_v41_loader import (CheckpointError, fp8_format, gemm_weight_formats, read_config,
                                                   released_name, schema)
from shuili.hal.config import PlatformConfig
from shuili.hal.registry import resolve_platform
from shuili.hal.types import Weight
from shuili.platforms.reference.quant import dequantize_weight, quantize_weight_fp8_block32

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepseek_v41_tiny")
RELEASED = os.path.join(FIXTURE, "released")
if not os.path.isfile(os.path.join(RELEASED, "config.json")):
    pytest.skip("the deepseek_v41_tiny fixture is not in this checkout", allow_module_level=True)
sys.path.insert(0, FIXTURE)
import v41_goldens as G  # noqa: E402

WITHOUT_FP8_BLOCK32 = ("dense", "fp8_block128", "mxfp4")


@pytest.fixture(scope="module")
def ops():
    return resolve_platform(PlatformConfig(platform="reference")).ops


def _fp8_names(cfg) -> set[str]:
    return {released_name(n) for n, sp in schema(cfg).items() if sp.kind in ("linear", "grouped")}


def write_fp8_copy(dst: str, mutate=None) -> str:
    """The released fixture with every linear (incl. wo_a) as e4m3 data + e8m0 `.scale` [N/32, K/32],
    same shards, index updated, quantization_config added. mutate(tensors) may break a shard."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(RELEASED):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(RELEASED, f), dst)
    raw = json.load(open(os.path.join(RELEASED, "config.json")))
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "weight_block_size": [32, 32], "expert_dtype": "bf16"}
    json.dump(raw, open(os.path.join(dst, "config.json"), "w"))
    fp8 = _fp8_names(read_config(RELEASED))
    index = json.load(open(os.path.join(RELEASED, "model.safetensors.index.json")))
    wm = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(RELEASED, shard), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for k in [k for k in tensors if k in fp8]:
            q = quantize_weight_fp8_block32(tensors[k])
            tensors[k] = q.data
            tensors[k[: -len("weight")] + "scale"] = (torch.log2(q.scale).to(torch.int32) + 127).to(
                torch.uint8).view(torch.float8_e8m0fnu)
        if mutate:
            mutate(tensors)
        save_file(tensors, os.path.join(dst, shard))
        wm.update({k: shard for k in tensors})
    json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
    return dst


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_fp8_copy(str(tmp_path_factory.mktemp("v41_fp8")))


def _logits(model, case):
    drv = model.driver(max_seqs=1, max_len=128)
    ids = case.prompt.tolist()
    full = model.forward(drv.batch([(0, ids)], logits="all"))
    drv2 = model.driver(max_seqs=1, max_len=128)
    parts, start = [], 0
    for n in case.chunk_sizes:
        parts.append(model.forward(drv2.batch([(0, ids[start:start + n])], logits="all")))
        start += n
    return full, torch.cat(parts)


def test_released_fp8_linears_are_kept_and_give_the_decoded_bits(ops, fp8_dir):
    kept = V.load_checkpoint(fp8_dir, ops, progress=False)
    decoded = V.load_checkpoint(fp8_dir, ops, progress=False, weight_formats=WITHOUT_FP8_BLOCK32)
    cfg = kept.cfg
    assert cfg.quantization.weight_block_size == (32, 32)
    a0, d0 = kept.blocks[0].attn, decoded.blocks[0].attn
    assert len(kept.blocks[0].ffn.shared_gate_up) == 1  # gate and up rows joined, 32-row blocks whole
    for w in (a0.q_a, a0.q_b, a0.kv_proj, a0.o_b, kept.blocks[0].ffn.shared_gate_up[0]):
        assert w.format == "fp8_block32" and w.data.dtype == torch.float8_e4m3fn and w.scale.dtype == torch.float32
        assert tuple(w.scale.shape) == (-(-w.shape[0] // 32), w.shape[1] // 32)
    G_, r = cfg.o_groups, cfg.o_lora_rank
    assert a0.o_a.format == "fp8_block32" and a0.o_a.shape == (G_, r, cfg.num_attention_heads * cfg.head_dim // G_)
    assert tuple(a0.o_a.scale.shape) == (G_, r // 32, a0.o_a.shape[2] // 32)
    assert d0.q_a.format == "dense" and d0.o_a.format == "dense"
    assert torch.equal(dequantize_weight(a0.q_b), dequantize_weight(d0.q_b))
    assert torch.equal(dequantize_weight(a0.o_a), dequantize_weight(d0.o_a))
    # every FP8 byte is kept: 1 byte per weight instead of 4 (float32 compute dtype here)
    assert a0.q_b.data.element_size() == 1 and d0.q_b.data.element_size() == 4
    case = G.cases()[1]
    kf, kc = _logits(kept, case)
    df, dc = _logits(decoded, case)
    assert torch.equal(kf, df) and torch.equal(kc, dc)
    # negative control: one scale off by 2x in one 32x32 block moves the logits
    good = a0.q_b
    scale = good.scale.clone()
    scale[0, 0] *= 2
    a0.q_b = Weight("fp8_block32", good.data, scale, good.shape)
    bad, _ = _logits(kept, case)
    a0.q_b = good
    assert not torch.equal(bad, kf)


def test_float_fixture_still_matches_its_goldens(ops):
    """The float released fixture (no quantization_config) loads as before: dense weights, goldens."""
    model = V.load_checkpoint(RELEASED, ops, progress=False)
    assert model.blocks[0].attn.q_a.format == "dense"
    case = G.cases()[0]
    full, chunked = _logits(model, case)
    G.assert_close(full, case.prefill_logits, "prefill logits")
    G.assert_close(chunked, case.chunked_logits, "chunked-prefill logits")


def test_format_choice_follows_the_platform():
    caps = {p: resolve_platform(PlatformConfig(platform=p)).capabilities for p in ("reference",)}
    assert "fp8_block32" in gemm_weight_formats(caps["reference"])
    from shuili.platforms.ascend.capabilities import capabilities as ascend_caps

    asc = ascend_caps(PlatformConfig(platform="reference"))
    assert "fp8_block32" in gemm_weight_formats(asc)
    assert all(f.support == "emulated" for f in asc.op("linear").formats if f.name == "fp8_block32")
    from shuili.platforms.nvidia.plugin import _WEIGHTS as nv

    assert any(f.name == "fp8_block32" for f in nv)
    assert fp8_format((32, 32)) == "fp8_block32" and fp8_format((128, 128)) == "fp8_block128"
    assert fp8_format((32, 32), WITHOUT_FP8_BLOCK32) is None  # a platform without it: decode at load
    assert fp8_format((64, 64)) is None  # no contract format for the block: decode at load


def test_engine_path_passes_the_platform_formats(ops, fp8_dir):
    from shuili.core.models import load_model

    kept = load_model(fp8_dir, ops, weight_formats=("dense", "fp8_block32"))
    dec = load_model(fp8_dir, ops, weight_formats=("dense",))
    assert kept.blocks[1].attn.q_b.format == "fp8_block32" and dec.blocks[1].attn.q_b.format == "dense"


def test_bad_fp8_scale_shape_is_named(ops, tmp_path):
    name = "layers.0.attn.wq_b.scale"

    def mutate(t):
        if name in t:
            t[name] = t[name][:1].contiguous()  # wq_b [128, 32]: 4 row blocks, keep 1

    write_fp8_copy(str(tmp_path), mutate)
    with pytest.raises(CheckpointError, match=r"'layers\.0\.attn\.wq_b\.scale' has shape \[1, 1\], expected \[4, 1\]"):
        V.load_checkpoint(str(tmp_path), ops, progress=False)


def test_missing_fp8_scale_is_named(ops, tmp_path):
    name = "layers.3.attn.wo_b.scale"
    write_fp8_copy(str(tmp_path), lambda t: t.pop(name, None))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"].pop(name, None)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'layers\.3\.attn\.wo_b\.weight' is float8_e4m3fn but the checkpoint "
                                              r"has no layers\.3\.attn\.wo_b\.scale"):
        V.load_checkpoint(str(tmp_path), ops, progress=False)


def test_contract_rejects_k_not_multiple_of_32():
    data = torch.zeros(32, 48).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"fp8_block32 weights need K \(in_features\) % 32 == 0, got K=48"):
        dequantize_weight(Weight("fp8_block32", data, torch.ones(1, 2), (32, 48)))
