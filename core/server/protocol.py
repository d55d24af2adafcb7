"""OpenAI request schemas (pydantic) and the one error shape every failure is answered with.

Requests are validated strictly from the JSON body: "10" is not an integer and true is not a
number, as in OpenAI's API. Unknown fields are ignored as OpenAI does. A field that takes
several shapes (prompt, stop, message content) is typed Any and checked by hand, so its error
names the field once instead of once per union branch.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shuili.core.sampling_params import MAX_SEED, MAX_TOP_LOGPROBS

MAX_N = 128
MAX_STOP = 16


class APIError(Exception):
    """Answered as OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


def _stop_list(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ValueError("must be a string or a list of strings")
    if len(v) > MAX_STOP or any(not s for s in v):
        raise ValueError(f"must hold 1 to {MAX_STOP} non-empty strings")
    return v


class SamplingFields(BaseModel):
    """The sampling fields both endpoints share; ranges are OpenAI's (and vLLM's extras)."""
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop: Any = Field(None, validate_default=True)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, le=MAX_N)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = Field(False, description="add each choice's token ids (vLLM's name)")
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return _stop_list(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if any(t < 0 for t in v):
            raise ValueError("must be token ids >= 0")
        return v

    def check(self) -> None:
        """Rules across fields, raised with the field they are about as `param`."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream: true", "stream_options")
        if self.logit_bias:
            raise APIError("logit_bias is not supported; leave it out", "logit_bias")


def _prompt(v: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of token-id lists -> prompts."""
    def ids(x) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(v, str):
        prompts = [v]
    elif ids(v):
        prompts = [v]
    elif isinstance(v, list) and v and all(isinstance(p, str) or ids(p) for p in v):
        prompts = list(v)
    else:
        raise ValueError("must be a non-empty string, a list of strings, a list of token ids or a list "
                         "of token-id lists")
    if any(p == "" for p in prompts):
        raise ValueError("must not be empty: give at least one character or one token id")
    return prompts


class CompletionRequest(SamplingFields):
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        return _prompt(v)

    def check(self) -> None:
        super().check()
        if self.echo:
            raise APIError("echo is not supported; leave it out or set it to false", "echo")
        if self.suffix:
            raise APIError("suffix is not supported; leave it out", "suffix")
        if self.best_of not in (None, self.n):
            raise APIError("best_of is not supported; leave it out or make it equal to n", "best_of")


def _content(v: Any) -> str:
    """A string, null, or a list of {"type": "text", "text": ...} parts -> the text."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                   and isinstance(p.get("text"), str) for p in v):
        return "".join(p["text"] for p in v)
    raise ValueError('must be a string or a list of {"type": "text", "text": "..."} parts '
                     "(only text content is supported)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, v):
        return _content(v)

    def text(self) -> str:
        return self.content


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.messages[-1].role == "assistant":
            raise APIError("messages: the last message must not be the assistant's; end with a user "
                           "message", "messages")

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ----------------------------------------------------------------------------------- errors
def _bounds(model: type[BaseModel], name: str) -> str:
    info = model.model_fields.get(name)
    if info is None:
        return ""
    parts = []
    for m in info.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{op} {getattr(m, attr)}")
    return f"; allowed: {name} {' and '.join(parts)}" if parts else ""


def _line(model: type[BaseModel], err: dict) -> tuple[str | None, str]:
    loc = [str(x) for x in err["loc"]]
    if err["type"] == "json_invalid":
        return None, f"the body is not valid JSON: {err['ctx']['error']}"
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:
        return None, msg
    field = ".".join(loc)
    if err["type"] == "missing":
        return field, f"{field} is required"
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
    return field, f"{field}: {msg}{shown}{_bounds(model, loc[0]) if len(loc) == 1 else ''}"


def parse(model: type[BaseModel], body: bytes):
    """The validated request, or APIError(400) naming each bad field and its allowed range."""
    if not body.strip():
        raise APIError("the body is empty; send a JSON object", None)
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        lines = [_line(model, e) for e in exc.errors()]
        if any(e["type"] == "model_type" and not e["loc"] for e in exc.errors()):
            raise APIError("the body must be a JSON object", None) from None
        raise APIError("; ".join(dict.fromkeys(m for _, m in lines)), lines[0][0]) from None
    req.check()
    return req
