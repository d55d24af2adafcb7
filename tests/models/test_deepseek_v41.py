"""DeepSeek-V4.1 without the engine: config parsing and errors, the per-source cache layout, and the
bits of the logits under chunking and batching (with a negative control)."""
from __future__ import annotations

import pytest
import torch

from shuili.core.models import deepseek_v41 as V
from shuili.core.models.deepseek_v41_config import V41Config, named
from shuili.hal.config import PlatformConfig
from shuili.hal.registry import resolve_platform


@pytest.fixture(scope="module")
def ops():
    return resolve_platform(PlatformConfig(platform="reference")).ops


@pytest.fixture(scope="module")
def model(ops):
    return V.build("tiny-v41", ops, seed=3)


# ------------------------------------------------------------------------------------------- config
RELEASED = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [32, 32], "activation_scheme": "dynamic", "expert_dtype": "fp4"},
    "text_config": {"vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
                    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], "kv_source_layer_ids": [2, 8, 14, 20],
                    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "candidate_source_layer_id": 20,
                    "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
                    "engram_pad_token_id": 2, "num_nextn_predict_layers": 3, "rms_norm_eps": 1e-20,
                    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                     "beta_fast": 32, "beta_slow": 1}},
    "vision_config": {"hidden_size": 1024},
}


def test_released_config():
    cfg = V41Config.from_hf(RELEASED)
    assert cfg.quantization.weight_block_size == (32, 32) and cfg.quantization.expert_dtype == "fp4"
    assert len(cfg.compress_ratios) == 40 and cfg.engram_layer_ids == (1, 14)
    assert [cfg.role(i) for i in (0, 2, 3, 20, 21, 24)] == ["swa", "full", "reuse", "full", "reuse", "reindex"]
    assert cfg.kv_source_of(23) == 20 and cfg.index_source_of(27) == 24
    assert cfg.yarn.factor == 16


def test_flat_config_round_trip():
    t = named("tiny-v41")
    assert V41Config.from_hf(t.to_hf()) == t
    assert V41Config.from_hf(t.to_hf(nested=True)) == t


@pytest.mark.parametrize("patch, field", [
    ({"num_hidden_layers": "forty"}, "num_hidden_layers"),
    ({"compress_ratios": [0, 2]}, "compress_ratios"),
    ({"kv_source_layer_ids": [0, 8, 14, 20]}, "kv_source_layer_ids"),
    ({"candidate_source_layer_id": 3}, "candidate_source_layer_id"),
    ({"kv_source_layer_ids": [2, 8, 14, 21]}, "compress_ratios[20]"),
])
def test_config_errors_name_the_field(patch, field):
    raw = dict(RELEASED, text_config=dict(RELEASED["text_config"], **patch))
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        V41Config.from_hf(raw)


def test_quantization_errors_name_the_field():
    raw = dict(RELEASED, quantization_config={"weight_block_size": [32]})
    with pytest.raises(ValueError, match=r"quantization_config\.weight_block_size"):
        V41Config.from_hf(raw)
    with pytest.raises(ValueError, match="model_type"):
        V41Config.from_hf({"model_type": "llama"})


def test_mid_v41_size():
    n = named("mid-v41").num_params(with_engram_tables=False)
    assert 2e9 < n < 4e9, n


# -------------------------------------------------------------------------------------------- caches
def test_one_pool_per_source_not_per_layer(model):
    cfg = model.cfg
    groups = {g.name: g for g in model.cache_groups()}
    assert groups["swa_kv"].layers == tuple(range(cfg.num_hidden_layers))
    compressed = [g for g in groups.values() if g.kind == "compressed"]
    assert sorted(g.name for g in compressed) == ["idx_src2", "idx_src4", "kv_src2", "kv_src4"]
    assert all(len(g.layers) == 1 for g in compressed)  # one tensor per source, shared by its group
    assert groups["kv_src2"].ratio == 2 and groups["kv_src4"].ratio == 1
    assert groups["state_src2"].window == 2 and "state_src4" not in groups  # ratio 1: no partial group


# ------------------------------------------------------------------------------------------ the bits
def _prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def test_chunked_prefill_and_decode_are_bitwise_one_shot(model):
    ids = _prompt(37)
    drv = model.driver(max_seqs=3, max_len=64)
    full = model.forward(drv.batch([(0, ids)], logits="all"))
    for cuts in ((7, 8, 9), (1, 2, 30), (5,)):  # odd cuts split ratio-2 groups across calls
        seq = cuts[0] % 3
        drv.lens.pop(seq, None)
        parts, start = [], 0
        for c in list(cuts) + [len(ids)]:
            end = min(start + c, len(ids))
            if end > start:
                parts.append(model.forward(drv.batch([(seq, ids[start:end])], logits="all")))
            start = end
        assert torch.equal(torch.cat(parts), full), cuts


def test_batched_is_bitwise_alone(model):
    a, b = _prompt(29, 1), _prompt(18, 2)
    drv = model.driver(max_seqs=2, max_len=64)
    alone = model.forward(drv.batch([(0, a)], logits="all"))
    drv2 = model.driver(max_seqs=2, max_len=64)
    both = model.forward(drv2.batch([(1, b[:11]), (0, a)], logits="all"))
    assert torch.equal(both[11:], alone)


def test_negative_control_lost_partial_group_changes_the_bits(model):
    """Dropping the carried partial group (the state of source 2) between two chunks must show."""
    ids = _prompt(30, 4)
    drv = model.driver(max_seqs=1, max_len=64)
    full = model.forward(drv.batch([(0, ids)], logits="all"))
    drv = model.driver(max_seqs=1, max_len=64)
    first = model.forward(drv.batch([(0, ids[:9])], logits="all"))  # token 8 starts a ratio-2 group
    for t in model.caches["state_src2"].values():
        t.zero_()
    second = model.forward(drv.batch([(0, ids[9:])], logits="all"))
    assert torch.equal(first, full[:9])
    assert not torch.equal(second, full[9:])
