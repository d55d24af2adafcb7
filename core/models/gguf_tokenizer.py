"""A byte-level BPE tokenizer and chat template built from a GGUF file's `tokenizer.*` metadata.

The vocabulary, merges and token types become a `tokenizers.Tokenizer`: tokens typed CONTROL are
special added tokens (matched whole, dropped by `decode`), USER_DEFINED ones plain added tokens.
The pre-tokenizer follows llama.cpp's `tokenizer.ggml.pre` name; "smollm" (and the other
StarCoder-family names) isolates every digit before the GPT-2 split, as SmolLM2's own
tokenizer.json does. The chat template (`tokenizer.chat_template`) is rendered with jinja2 the way
transformers renders it (sandboxed, trim_blocks, lstrip_blocks).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de")
_DIGIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx", "pixtral")
SUPPORTED_PRE = _GPT2_PRE + _DIGIT_PRE + _LLAMA3_PRE


def _pre_tokenizer(pre: str):
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; shuili knows {', '.join(SUPPORTED_PRE)}. "
                     "Add its split regex to shuili/core/models/gguf_tokenizer.py")


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _spell(token: str, alphabet: set[str]) -> str:
    """A vocabulary entry in the byte alphabet (files write a few, e.g. control tokens, in raw UTF-8)."""
    if set(token) <= alphabet:
        return token
    table = _byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported; shuili reads byte-level BPE "
                         "('gpt2') vocabularies, as used by SmolLM2, Llama 3 and Qwen GGUF files")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError("GGUF file has no tokenizer.ggml.merges; a byte-level BPE vocabulary needs them")
    if len(types) != len(tokens):
        raise ValueError(f"GGUF tokenizer: {len(tokens)} tokens but {len(types)} token types")
    alphabet = set(_byte_alphabet().values())
    vocab = {_spell(t, alphabet): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    # a control token written outside the byte alphabet would be a second id for its text
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                if ty == CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
            if ty == USER_DEFINED and t in vocab]
    tok.add_special_tokens(specials)
    tok.add_tokens(user)
    if tok.get_vocab_size() != len(tokens):
        raise ValueError(f"GGUF tokenizer: built {tok.get_vocab_size()} ids from {len(tokens)} tokens "
                         "(duplicate entries in tokenizer.ggml.tokens?)")
    return tok


class GGUFTokenizer:
    """The engine's `Tokenizer` (core/model_api.py) plus the file's chat template."""

    def __init__(self, meta: dict[str, Any]):
        self.backend = build_tokenizer(meta)
        tokens = meta["tokenizer.ggml.tokens"]
        self.vocab_size = len(tokens)
        self.bos_token_id = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id = meta.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and self.bos_token_id is not None
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and self.eos_token_id is not None
        eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"),
               *(meta.get("tokenizer.ggml.eog_token_ids") or [])]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))
        self.bos_token = tokens[self.bos_token_id] if self.bos_token_id is not None else ""
        self.eos_token = tokens[self.eos_token_id] if self.eos_token_id is not None else ""
        self.chat_template: str | None = meta.get("tokenizer.chat_template")

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if self.add_bos else []) + ids + ([self.eos_token_id] if self.add_eos else [])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: str | list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the file's template; a plain string is one user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not self.chat_template:
            raise ValueError("this GGUF file has no tokenizer.chat_template; pass raw prompts instead "
                             "(e.g. `shuili generate --no-chat-template`)")
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token)


@lru_cache(maxsize=8)
def _compile(source: str):
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise ValueError("rendering the GGUF chat template needs jinja2: pip install jinja2") from exc
    import json

    def raise_exception(message: str):
        raise ValueError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
