"""Tokenizers: a byte-level fallback for random-weight models and HF `tokenizer.json` via `tokenizers`.

Both satisfy `shuili.core.model_api.Tokenizer` (encode, decode, eos_token_ids, vocab_size).
"""
from __future__ import annotations

import json
import os


class ByteTokenizer:
    """UTF-8 bytes as ids: byte b -> b + offset; ids below `offset` are specials (bos, eos, pad...).

    Decoding drops specials and ids past the byte range, and replaces invalid UTF-8 with U+FFFD.
    """

    def __init__(self, vocab_size: int, offset: int = 3, bos_token_id: int | None = 0,
                 eos_token_ids: tuple[int, ...] = (1,)):
        if vocab_size < offset + 256:
            raise ValueError(f"a byte-level tokenizer needs vocab_size >= {offset + 256} (offset {offset} + 256 "
                             f"bytes), the model has {vocab_size}; give the model a tokenizer.json instead")
        self.vocab_size, self.offset = vocab_size, offset
        self.bos_token_id, self.eos_token_ids = bos_token_id, tuple(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` (HF tokenizers format). Special tokens are kept out of decoded text."""

    def __init__(self, path: str, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None,
                 vocab_size: int | None = None):
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = vocab_size or self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids, self.bos_token_id = tuple(eos_token_ids), bos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(directory: str | None, vocab_size: int, eos_token_ids: tuple[int, ...] = (1,),
                   bos_token_id: int | None = 0):
    """`directory/tokenizer.json` when present (eos from tokenizer_config.json if it names one), else bytes."""
    path = os.path.join(directory, "tokenizer.json") if directory else None
    if path and os.path.isfile(path):
        tok = HFTokenizer(path, eos_token_ids, bos_token_id, vocab_size)
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                eos = json.load(f).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            eid = tok.token_to_id(eos) if isinstance(eos, str) else None
            if eid is not None and eid not in tok.eos_token_ids:
                tok.eos_token_ids = (*tok.eos_token_ids, eid)
        return tok
    return ByteTokenizer(vocab_size, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids)


def deepseek_chat(tokenizer, prompt: str) -> str:
    """DeepSeek-V4 / V4.1's single-turn chat form, where the tokenizer knows its role tokens (a
    synthetic model's byte tokenizer does not: the prompt goes through as it is)."""
    if hasattr(tokenizer, "token_to_id") and tokenizer.token_to_id("<｜User｜>") is not None:
        return f"<｜begin▁of▁sentence｜><｜User｜>{prompt}<｜Assistant｜></think>"
    return prompt
