"""Checkpoint shards: model.safetensors.index.json is honoured, and a malformed checkpoint (missing tensor,
wrong shape or dtype, index naming a missing shard, truncated file) fails naming the tensor or file, what was
expected and what was found."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from shuili.core.models.safetensors_index import INDEX_FILE, Checkpoint, CheckpointError


def _shards(path, shards: dict[str, dict[str, torch.Tensor]], index: bool = True):
    for fname, tensors in shards.items():
        save_file(tensors, str(path / fname))
    if index:
        wm = {n: f for f, ts in shards.items() for n in ts}
        (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return path


@pytest.fixture
def two(tmp_path):
    return _shards(tmp_path, {
        "model-00001-of-00002.safetensors": {"embed.weight": torch.arange(12.).reshape(3, 4),
                                             "layers.0.attn.wq_a.weight": torch.ones(2, 4)},
        "model-00002-of-00002.safetensors": {"layers.0.ffn.gate.bias": torch.zeros(5),
                                             "head.weight": torch.full((3, 4), 2.0)},
    })


def test_index_maps_tensors_to_shards(two):
    ck = Checkpoint(str(two))
    assert sorted(ck.names()) == ["embed.weight", "head.weight", "layers.0.attn.wq_a.weight",
                                  "layers.0.ffn.gate.bias"]
    assert ck.shard_of("head.weight") == "model-00002-of-00002.safetensors"
    assert ck.info("embed.weight") == (torch.float32, (3, 4))
    assert torch.equal(ck.get("head.weight", (3, 4), (torch.float32,)), torch.full((3, 4), 2.0))
    assert sorted(ck.unread()) == ["embed.weight", "layers.0.attn.wq_a.weight", "layers.0.ffn.gate.bias"]


def test_index_is_authoritative_over_other_files(two):
    # a stale shard the index does not name: never opened (not even a readable file), its tensors are not
    # part of the checkpoint. Globbing the directory would fail on it (negative control below).
    (two / "model-00003-of-00003.safetensors").write_bytes(b"\x00" * 64)
    save_file({"embed.weight": torch.zeros(3, 4), "stale.weight": torch.zeros(1)},
              str(two / "old.safetensors"))
    ck = Checkpoint(str(two))
    assert torch.equal(ck.get("embed.weight"), torch.arange(12.).reshape(3, 4))
    assert "stale.weight" not in ck
    (two / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match="model-00003-of-00003.safetensors"):
        Checkpoint(str(two))


def test_index_naming_a_missing_shard(two):
    (two / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        Checkpoint(str(two))
    msg = str(e.value)
    assert "maps tensor 'layers.0.ffn.gate.bias' and 1 other tensors to shard 'model-00002-of-00002.safetensors'" \
        in msg and "has no such file" in msg and "model-00001-of-00002.safetensors" in msg


def test_index_naming_a_tensor_its_shard_lacks(two):
    idx = json.loads((two / INDEX_FILE).read_text())
    idx["weight_map"]["layers.0.attn.wkv.weight"] = "model-00001-of-00002.safetensors"
    (two / INDEX_FILE).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"maps tensor 'layers.0.attn.wkv.weight' to "
                                              r"model-00001-of-00002.safetensors, but that shard does not hold it"):
        Checkpoint(str(two))


@pytest.mark.parametrize("text, words", [
    ('{"metadata": {}}', "expected {\"weight_map\""),
    ('{"weight_map": {"a": 3}}', "expected {\"weight_map\""),
    ('{"weight_map": {}}', "lists no tensors"),
    ('{"weight_map": {"a": "../x.safetensors"}}', "has no such file"),
    ('{"weight_map": ', "not valid JSON"),
])
def test_malformed_index(two, text, words):
    (two / INDEX_FILE).write_text(text)
    with pytest.raises(ValueError) as e:
        Checkpoint(str(two))
    assert INDEX_FILE in str(e.value) and words in str(e.value)


def test_missing_tensor_says_what_was_expected(two):
    ck = Checkpoint(str(two))
    with pytest.raises(CheckpointError) as e:
        ck.get("layers.0.attn.wq_b.weight", (8, 2), (torch.bfloat16, torch.float8_e4m3fn))
    msg = str(e.value)
    assert "missing tensor 'layers.0.attn.wq_b.weight' (expected shape [8, 2], dtype bfloat16 or " \
           "float8_e4m3fn; model.safetensors.index.json does not list it)" in msg
    assert "'layers.0.attn.wq_a.weight'" in msg          # the near name
    (two / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match="no shard holds it"):
        Checkpoint(str(two)).get("nope")


def test_wrong_shape_or_dtype_names_expected_found_and_shard(two):
    ck = Checkpoint(str(two))
    with pytest.raises(CheckpointError, match=r"tensor 'head.weight' has shape \[3, 4\], expected \[4, 4\] "
                                              r"\(in model-00002-of-00002.safetensors\)"):
        ck.get("head.weight", (4, 4), (torch.float32,))
    with pytest.raises(CheckpointError, match=r"tensor 'head.weight' has dtype torch.float32, expected one of "
                                              r"\['bfloat16'\] \(in model-00002-of-00002.safetensors\)"):
        ck.get("head.weight", (3, 4), (torch.bfloat16,))
    assert "head.weight" in ck.unread()                  # a rejected tensor was never read


def test_same_tensor_in_two_shards_without_index(tmp_path):
    _shards(tmp_path, {"a.safetensors": {"x": torch.zeros(2)}, "b.safetensors": {"x": torch.ones(2)}}, index=False)
    with pytest.raises(CheckpointError, match="tensor 'x' is in both a.safetensors and b.safetensors"):
        Checkpoint(str(tmp_path))


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_truncated_shard_names_the_file(two, cut):
    p = two / "model-00002-of-00002.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(CheckpointError) as e:
        Checkpoint(str(two))
    assert str(e.value).startswith(f"{p} is not a readable safetensors file")


def test_v4_loader_reads_through_the_index(tmp_path):
    """A sharded V4 checkpoint with a stale extra shard loads (the index decides), and the same checkpoint
    with its index pointing at a missing shard fails naming it."""
    from shuili.core.models.deepseek_v4_config import named
    from shuili.core.models.deepseek_v4_loader import load_params, random_params, released_tensors, save_checkpoint

    cfg = named("tiny-v4")
    tensors = released_tensors(cfg, random_params(cfg, seed=3, with_mtp=False))
    save_checkpoint(str(tmp_path), cfg, tensors, shards=2)
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"junk")
    got = load_params(str(tmp_path), cfg, progress=False)
    w = got["layers.2.attn.wq_a.weight"]
    assert torch.equal(w.data, tensors["layers.2.attn.wq_a.weight"])
    (tmp_path / "model-00002-of-00002.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(CheckpointError, match="to shard 'model-00002-of-00002.safetensors', but .* has no such file"):
        load_params(str(tmp_path), cfg, progress=False)
