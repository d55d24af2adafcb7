"""Engine snapshots -> OpenAI response bodies and stream chunks (completions and chat)."""
from __future__ import annotations

import json
from functools import lru_cache

from shuili.core.server.engine_loop import Snapshot

# OpenAI's finish reasons, plus shuili's: "abort" (cancelled or shut down) and "error"
FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


class Pieces:
    """Token id -> its text, for logprobs (special tokens shown, not dropped)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, tid: int) -> str:
        try:
            return self.tok.decode([tid], skip_special_tokens=False)
        except TypeError:  # a tokenizer without the keyword
            return self.tok.decode([tid])


class ChoiceStream:
    """What one choice has sent so far; `advance` gives the next delta.

    Text that could still change is held back: a trailing partial UTF-8 character (decoded as
    U+FFFD) and, while stop strings are set, the last (longest stop - 1) characters, which could
    be the start of a stop string the final text will not contain."""

    def __init__(self, stops: list[str]):
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent_chars = 0
        self.sent_tokens = 0

    def advance(self, snap: Snapshot) -> tuple[str, int, int]:
        """(text delta, first new token, end of new tokens)."""
        text = snap.text
        end = len(text)
        if not snap.finished:
            end -= self.hold
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent_chars:end] if end > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, end)
        a, b = self.sent_tokens, len(snap.token_ids) - snap.hidden_tail
        self.sent_tokens = max(a, b)
        return delta, a, max(a, b)


def completion_logprobs(pieces: Pieces, snap: Snapshot, a: int, b: int, k: int, offset: int) -> dict:
    toks = [pieces.text(t) for t in snap.token_ids[a:b]]
    offsets = []
    for t in toks:
        offsets.append(offset)
        offset += len(t)
    tops = None
    if k:
        tops = [{pieces.text(i): lp for i, lp in snap.top[j][:k]} if j < len(snap.top) else {}
                for j in range(a, b)]
    return {"tokens": toks, "token_logprobs": snap.logprobs[a:b], "top_logprobs": tops, "text_offset": offsets}


def _entry(pieces: Pieces, tid: int, lp: float) -> dict:
    s = pieces.text(tid)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(pieces: Pieces, snap: Snapshot, a: int, b: int, k: int) -> dict:
    content = []
    for j in range(a, b):
        e = _entry(pieces, snap.token_ids[j], snap.logprobs[j])
        alts = snap.top[j][:k] if j < len(snap.top) else []
        e["top_logprobs"] = [_entry(pieces, i, lp) for i, lp in alts]
        content.append(e)
    return {"content": content, "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def render_chat(model, messages: list[dict[str, str]]) -> str:
    """The model's chat template over the messages; ValueError when the model has none."""
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages)
    if model.apply_chat_template("x") == "x":
        raise ValueError("this model has no chat template; use /v1/completions with a raw prompt")
    if len(messages) == 1 and messages[0]["role"] == "user":
        return model.apply_chat_template(messages[0]["content"])
    return _deepseek_chat(messages)


def _deepseek_chat(messages: list[dict[str, str]]) -> str:
    # the same markers model.apply_chat_template uses for one user turn, extended to a conversation
    out = ["<｜begin▁of▁sentence｜>"]
    out += [m["content"] for m in messages if m["role"] in ("system", "developer")]
    for m in messages:
        if m["role"] == "user":
            out.append(f"<｜User｜>{m['content']}")
        elif m["role"] == "assistant":
            out.append(f"<｜Assistant｜></think>{m['content']}<｜end▁of▁sentence｜>")
    out.append("<｜Assistant｜></think>")
    return "".join(out)
