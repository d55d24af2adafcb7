"""Tokenizer path: byte-level fallback for random models, HF tokenizer.json when a checkpoint has one,
and the registry entry points (`load_model`) for named configs and checkpoint directories."""
from __future__ import annotations

import json

import pytest

from shuili.core.models import load_model
from shuili.core.models.deepseek_v4_config import named
from shuili.core.models.deepseek_v4_loader import random_params, released_tensors, save_checkpoint
from shuili.core.models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from shuili.hal.config import PlatformConfig
from shuili.hal.registry import resolve_platform


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer(1024)
    text = "héllo, 水力 🌊\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and min(ids) >= 3 and max(ids) < 259
    assert tok.decode(ids) == text
    assert tok.decode([0, *ids, 1, 900]) == text  # specials and out-of-range ids are dropped
    assert tok.decode(ids[:-2] + [0xF0 + 3]) .endswith("\ufffd")  # broken UTF-8 is replaced
    assert tok.eos_token_ids == (1,)
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(200)


def _write_tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<bos>": 0, "<eos>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<bos>", "<eos>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


def test_hf_tokenizer_json(tmp_path):
    _write_tokenizer_json(tmp_path)
    tok = load_tokenizer(str(tmp_path), vocab_size=1024, eos_token_ids=())
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world nope") == [2, 3, 4]
    assert tok.decode([0, 2, 3, 1]) == "hello world"
    assert tok.eos_token_ids == (1,) and tok.vocab_size == 1024
    assert isinstance(load_tokenizer(None, 1024), ByteTokenizer)


def test_registry_builds_and_loads(tmp_path):
    ops = resolve_platform(PlatformConfig(platform="reference")).ops
    m = load_model("tiny-v4", ops, seed=5)
    assert m.vocab_size == 1024 and isinstance(m.tokenizer, ByteTokenizer)
    assert [g.name for g in m.cache_groups()] == ["swa_kv", "csa_kv", "csa_idx", "csa_state", "hca_kv",
                                                  "hca_state"]
    cfg = named("tiny-v4")
    save_checkpoint(str(tmp_path), cfg, released_tensors(cfg, random_params(cfg, seed=5)))
    _write_tokenizer_json(tmp_path)
    c = load_model(str(tmp_path), ops)
    assert isinstance(c.tokenizer, HFTokenizer)
    assert c.blocks[0].ffn.tid2eid.equal(m.blocks[0].ffn.tid2eid)  # same seed, same weights
    assert c.apply_chat_template("hi") == "hi"
