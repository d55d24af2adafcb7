"""The V4.1 loader: both namings (transformers' and the released one, sharded with an index) give the
same model; malformed checkpoints raise errors that name the tensor, what was expected and found."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from shuili.core.models import deepseek_v41 as V
from shuili.core.models.deepseek_v41_config import named
from shuili.core.models.deepseek_v41_loader import (CheckpointError, random_params, save_checkpoint,
                                                   tensors_for)
from shuili.hal.config import PlatformConfig
from shuili.hal.registry import resolve_platform

CFG = named("tiny-v41", engram_layer_ids=(), engram_num_embeddings=())


@pytest.fixture(scope="module")
def ops():
    return resolve_platform(PlatformConfig(platform="reference")).ops


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=11)


def _logits(model):
    drv = model.driver(max_seqs=1, max_len=64)
    return model.forward(drv.batch([(0, list(range(5, 30)))], logits="all"))


@pytest.mark.parametrize("naming, shards, nested", [("transformers", 1, False), ("released", 2, True)])
def test_both_namings_load_the_same_model(tmp_path, ops, params, naming, shards, nested):
    save_checkpoint(str(tmp_path), CFG, tensors_for(CFG, params, naming), shards=shards, nested=nested)
    if shards > 1:
        assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    got = V.load_checkpoint(str(tmp_path), ops, progress=False)
    assert got.cfg == CFG
    want = V.DeepseekV41Model(CFG, ops, params)
    assert torch.equal(_logits(got), _logits(want))


def _released(tmp_path, params):
    save_checkpoint(str(tmp_path), CFG, tensors_for(CFG, params, "released"), shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    return index["weight_map"]


def _rewrite(tmp_path, wm, name, fn):
    f = tmp_path / wm[name]
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


def test_missing_tensor_is_named(tmp_path, ops, params):
    wm = _released(tmp_path, params)
    name = "layers.4.attn.indexer.wk.weight"
    _rewrite(tmp_path, wm, name, lambda t: t.pop(name))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.4\.attn\.indexer\.wk\.weight'"):
        V.load_checkpoint(str(tmp_path), ops, progress=False)


def test_wrong_shape_and_dtype_are_named(tmp_path, ops, params):
    wm = _released(tmp_path, params)
    name = "layers.2.attn.compressor.wgate.weight"
    _rewrite(tmp_path, wm, name, lambda t: t.__setitem__(name, torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=r"'layers\.2\.attn\.compressor\.wgate\.weight' has shape \[3, 3\], "
                                              r"expected \[64, 32\]"):
        V.load_checkpoint(str(tmp_path), ops, progress=False)
    _rewrite(tmp_path, wm, name, lambda t: t.__setitem__(name, torch.zeros(64, 32, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=r"wgate\.weight' has dtype int32"):
        V.load_checkpoint(str(tmp_path), ops, progress=False)


def test_unknown_tensor_and_missing_shard_are_named(tmp_path, ops, params):
    wm = _released(tmp_path, params)
    _rewrite(tmp_path, wm, "embed.weight", lambda t: t.__setitem__("layers.3.attn.compressor.wkv.weight",
                                                                    torch.zeros(64, 32)))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.3.attn.compressor.wkv.weight"] = wm["embed.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'layers\.3\.attn\.compressor\.wkv\.weight' is neither"):
        V.load_checkpoint(str(tmp_path), ops, progress=False)
    index["weight_map"]["layers.3.attn.compressor.wkv.weight"] = "model-00009-of-00009.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"to shard .model-00009-of-00009\.safetensors., but .* has no such file"):
        V.load_checkpoint(str(tmp_path), ops, progress=False)


def test_bad_config_is_named(tmp_path, ops, params):
    save_checkpoint(str(tmp_path), CFG, tensors_for(CFG, params, "transformers"), nested=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["text_config"]["index_source_layer_ids"] = [1]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="index_source_layer_ids"):
        V.load_checkpoint(str(tmp_path), ops, progress=False)
