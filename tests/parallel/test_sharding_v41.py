"""V4.1 shards without an engine: a rank's shards of the transformers and the released (2-file,
indexed) checkpoint equal slices of the whole model, a split tensor is never read whole, another
rank's experts are never read, and the sizes V4.1 cannot split are named."""
from __future__ import annotations

import os

import pytest
import torch

from shuili.core.config import EngineConfig
from shuili.core.models import deepseek_v41_loader as L
from shuili.core.models.deepseek_v41_config import named
from shuili.core.models.safetensors_index import Checkpoint
from shuili.core.parallel.engine import check_fits
from shuili.core.parallel.eplb import Placement
from shuili.core.parallel.sharding_v41 import ShardPlanV41, _Slices, load_sharded_v41, random_sharded_v41

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepseek_v41_tiny")


def _data(v):
    return v.data if hasattr(v, "format") else v


@pytest.fixture(scope="module", params=["hf", "released"])
def checkpoint(request):
    path = os.path.join(FIX, request.param)
    cfg = L.read_config(path)
    return cfg, path, L.load_params(path, cfg, progress=False)


@pytest.mark.parametrize("tp,rank,ep", [(2, 0, False), (2, 1, False), (1, 1, True), (2, 1, True)])
def test_checkpoint_shards_equal_slices_of_the_whole_model(checkpoint, tp, rank, ep, monkeypatch):
    cfg, path, whole = checkpoint
    world = tp if not ep else 2
    slots = Placement.contiguous(cfg.num_hidden_layers, cfg.n_routed_experts, world).local(rank) if ep else ()
    plan = ShardPlanV41(cfg, tp, rank % tp, ep, slots)
    reads = []
    real_get, real_slice = Checkpoint.get, _Slices.slice
    monkeypatch.setattr(Checkpoint, "get", lambda self, n, *a, **k: reads.append(("whole", n)) or real_get(self, n, *a, **k))
    monkeypatch.setattr(_Slices, "slice", lambda self, n: reads.append(("slice", n)) or real_slice(self, n))
    got = load_sharded_v41(path, plan)
    assert set(got) == set(whole)
    for name, v in whole.items():
        assert torch.equal(_data(got[name]), _data(plan.take(name, v))), name
    hf = "hf" in path
    inv = {} if hf else {L.released_name(n): n for n in whole if L.released_name(n)}
    split = [n for kind, n in reads if kind == "whole" and plan.rule(inv.get(n, n)) is not None]
    assert not split, f"read whole although this rank keeps a slice: {split[:3]}"
    if ep and not hf:  # another rank's experts are never opened
        mine = {e for layer in slots for e in layer}
        foreign = [n for _, n in reads if ".experts." in n and int(n.split(".experts.")[1].split(".")[0]) not in mine]
        assert not foreign, foreign[:3]
    if tp > 1:  # negative control: these really are slices
        a = "model.layers.0.self_attn."
        assert got[a + "q_b_proj.weight"].data.shape[0] == cfg.num_attention_heads * cfg.head_dim // tp
        assert got["model.layers.1.engram.wkv.weight"].data.shape[0] == (cfg.hc_mult + 1) * cfg.hidden_size // tp
        assert not torch.equal(_data(got[a + "sinks"]), _data(ShardPlanV41(cfg, tp, 1 - rank % tp).take(a + "sinks", whole[a + "sinks"])))


def test_random_shards_are_slices_of_the_seeded_model():
    cfg = named("tiny-v41")
    whole = L.random_params(cfg, seed=5)
    plan = ShardPlanV41(cfg, 2, 1)
    got = random_sharded_v41(plan, seed=5)
    for name, v in whole.items():
        assert torch.equal(_data(got[name]), _data(plan.take(name, v))), name


def test_v41_sizes_that_do_not_fit_are_named():
    cfg = named("tiny-v41")  # 2 heads, 2 output groups, 4 experts
    with pytest.raises(ValueError, match=r"does not divide the model's num_attention_heads \(2\)"):
        check_fits(EngineConfig(model="tiny-v41", tensor_parallel_size=4), cfg, None)
    with pytest.raises(ValueError, match=r"divisible by 3; EP sizes that fit: \[1, 2, 4\]"):
        check_fits(EngineConfig(model="tiny-v41", data_parallel_size=3, enable_expert_parallel=True), cfg, None)
    odd = cfg.model_copy(update={"hidden_size": 33})
    with pytest.raises(ValueError, match="Engram wkv width"):
        check_fits(EngineConfig(model="tiny-v41", tensor_parallel_size=2, enable_expert_parallel=True), odd, None)
    check_fits(EngineConfig(model="tiny-v41", tensor_parallel_size=2, enable_expert_parallel=True), cfg, None)


def _fp8_32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight as the V4.1 release stores it: e4m3 values, one e8m0 scale per 32x32 block."""
    from shuili.platforms.reference import quant

    N, K = w.shape
    blocks = w.float().reshape(N // 32, 32, K // 32, 32).abs().amax(dim=(1, 3))
    s8 = quant.float_to_e8m0_ceil(blocks.clamp(min=1e-30) / 448.0)
    s = quant.e8m0_to_float(s8)
    full = s.repeat_interleave(32, 0).repeat_interleave(32, 1)
    return (w.float() / full).to(torch.float8_e4m3fn), s8.view(torch.float8_e8m0fnu)


def test_quantized_released_checkpoint_shards(tmp_path):
    """FP8 (32x32 blocks) head-split linears and MXFP4 experts: a TP2+EP rank's shards equal the
    slices of the whole loaded model; a split through a scale block is refused, naming the fix."""
    from shuili.platforms.reference import quant

    src = os.path.join(FIX, "released")
    cfg = L.read_config(src)
    tensors = L.tensors_for(cfg, L.load_params(src, cfg, progress=False), "released")
    out = {}
    for name, t in tensors.items():
        if ".experts." in name:
            w = quant.quantize_weight_mxfp4(t)
            out[name], out[name[: -len("weight")] + "scale"] = w.data.view(torch.int8), w.scale.view(torch.float8_e8m0fnu)
        elif name.endswith(("attn.wq_b.weight", "attn.wo_a.weight", "attn.wo_b.weight", "attn.wq_a.weight")):
            out[name], out[name[: -len("weight")] + "scale"] = _fp8_32(t)
        else:
            out[name] = t
    L.save_checkpoint(str(tmp_path), cfg, out, shards=2, nested=True)
    # the sharded loader decodes FP8 linears at load (it does not keep fp8_block32 yet): the whole
    # model to slice is read the same way, as for a platform that declares no FP8 format
    whole = L.load_params(str(tmp_path), cfg, progress=False, weight_formats=("dense", "mxfp4"))
    slots = Placement.contiguous(cfg.num_hidden_layers, cfg.n_routed_experts, 2).local(1)
    plan = ShardPlanV41(cfg, 2, 1, True, slots)
    got = load_sharded_v41(str(tmp_path), plan)
    for name, v in whole.items():
        if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name:
            ids = plan.expert_ids(int(name.split(".")[2]))
            assert v.format == got[name].format == "mxfp4"
            assert torch.equal(got[name].data, v.data[ids]) and torch.equal(got[name].scale, v.scale[ids]), name
        else:
            assert torch.equal(_data(got[name]), _data(plan.take(name, v))), name
    a = "model.layers.3.self_attn."
    assert got[a + "q_b_proj.weight"].data.shape[0] == cfg.num_attention_heads * cfg.head_dim // 2
    assert not torch.equal(whole[a + "q_b_proj.weight"].data, tensors["layers.3.attn.wq_b.weight"])  # really fp8
    with pytest.raises(ValueError, match="splits a 32-wide scale block"):  # EP off: w2's I/2 = 16 columns
        load_sharded_v41(str(tmp_path), ShardPlanV41(cfg, 2, 1))


@pytest.mark.parametrize("name, cut, words", [
    ("model.layers.3.self_attn.q_b_proj.weight", lambda t: t[:, :16],
     r"q_b_proj.weight' has shape \[64, 16\], expected \[64, 32\]"),
    ("model.layers.2.mlp.experts.down_proj", lambda t: t[:3],
     r"experts.down_proj' has shape \[3, 32, 32\], expected \[4, 32, 32\]"),
])
def test_a_wrong_sized_tensor_is_named(tmp_path, name, cut, words):
    from safetensors.torch import load_file, save_file

    src = os.path.join(FIX, "hf")
    cfg = L.read_config(src)
    t = load_file(os.path.join(src, "model.safetensors"))
    t[name] = cut(t[name]).contiguous()
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    with pytest.raises(L.CheckpointError, match=words):
        load_sharded_v41(str(tmp_path), ShardPlanV41(cfg, 2, 0))
