"""The GGUF tokenizer and chat template against transformers' own GGUF tokenizer loading."""
from __future__ import annotations

import os

import pytest

from shuili.core.models.gguf_loader import read_gguf
from shuili.core.models.gguf_tokenizer import GGUFTokenizer, build_tokenizer

TEXTS = [
    "What is the capital of France?",
    "  leading spaces\tand\ttabs\n\nnew lines   trailing  ",
    "abc123def 4567 8.9e10 -42 3,141,592",
    "Ünïcödé ☃ 日本語のテキスト emoji 🤖👍🏽 café naïve",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm we'll they've She'S",
    "def f(x):\n    return x ** 2  # square\n",
    "x" * 80,
    "",
    " ",
]


@pytest.fixture(scope="module")
def gguf_path():
    from shuili.core.models.llama import resolve_named

    try:
        return resolve_named("smollm2-135m")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def meta(gguf_path):
    return read_gguf(gguf_path).metadata


@pytest.fixture(scope="module")
def ours(meta):
    return GGUFTokenizer(meta)


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                                      gguf_file=os.path.basename(gguf_path))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens_stay_whole_and_are_dropped_by_decode(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    start, end = ours.backend.token_to_id("<|im_start|>"), ours.backend.token_to_id("<|im_end|>")
    assert ids[0] == start and ids[-1] == end
    assert ours.decode(ids) == "user\nhi"
    assert end in ours.eos_token_ids


def test_chat_template_matches_transformers(ours, hf):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template("What is the capital of France?") == want
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert ours.apply_chat_template(convo) == hf.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(convo, add_generation_prompt=False) == hf.apply_chat_template(
        convo, tokenize=False, add_generation_prompt=False)


def test_metadata_flags(ours, meta):
    assert ours.vocab_size == len(meta["tokenizer.ggml.tokens"]) == ours.backend.get_vocab_size()
    assert ours.add_bos == meta["tokenizer.ggml.add_bos_token"]
    assert ours.eos_token_ids[0] == meta["tokenizer.ggml.eos_token_id"]


def tiny_meta(**over):
    tokens = ["<s>", "a", "b", "ab", "Ġ", "Ġab"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 1, 1, 1, 1, 1], "tokenizer.ggml.merges": ["a b", "Ġ ab"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0,
            "tokenizer.ggml.add_bos_token": True}
    meta.update(over)
    return meta


def test_tiny_vocabulary_merges_and_bos():
    tok = GGUFTokenizer(tiny_meta())
    assert tok.encode("ab ab") == [0, 3, 5]
    assert tok.decode([0, 3, 5]) == "ab ab"


def test_unsupported_tokenizers_are_clear_errors():
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery' is not supported"):
        build_tokenizer(tiny_meta(**{"tokenizer.ggml.pre": "mystery"}))
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
        build_tokenizer(tiny_meta(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="no tokenizer.ggml.merges"):
        build_tokenizer(tiny_meta(**{"tokenizer.ggml.merges": []}))
    with pytest.raises(ValueError, match="no tokenizer.chat_template"):
        GGUFTokenizer(tiny_meta()).apply_chat_template("hi")
