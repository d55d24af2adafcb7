"""The one state object that flows through scheduler, KV-cache manager, runner and sampler.

The scheduling rule (vLLM v1): each step moves `num_computed_tokens` toward `num_tokens`.
Prefill, chunked prefill, prefix-cache hits and recompute after preemption are all that rule.
`num_tokens` counts placeholders: tokens scheduled for sampling whose value is not yet on the
host (overlap mode schedules step N+1 before step N's samples are read back).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from shuili.core.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    priority: int = 0
    prompt: str | None = None

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per output token
    num_computed_tokens: int = 0
    num_placeholders: int = 0
    # bumped on preemption/abort: results computed for an older epoch are dropped
    epoch: int = 0
    num_preemptions: int = 0
    # speculative decoding (core/spec): provisional tokens after the real ones, proposed for the
    # next step; never part of output_token_ids, hashes or num_tokens until verified
    draft_token_ids: list[int] = field(default_factory=list)
    verifying: int = 0  # drafts of a verify step in flight (its next position is not known yet)
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    num_sample_steps: int = 0  # steps that sampled for this request (tokens per step = outputs / this)
    finish_reason: str | None = None
    error: str | None = None
    stop_text_len: int | None = None  # text is cut here when a stop string matched
    t_arrival: float = 0.0
    t_first_token: float = 0.0
    t_finish: float = 0.0

    # KV-cache state, owned by KVCacheManager
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0

    def __post_init__(self):
        if not self.prompt_logprobs and self.params.prompt_logprobs:
            self.prompt_logprobs = [None] * max(len(self.prompt_token_ids) - 1, 0)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_real_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_real_tokens + self.num_placeholders

    @property
    def num_pending_output(self) -> int:
        return len(self.output_token_ids) + self.num_placeholders

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, -1 for placeholders."""
        n = len(self.prompt_token_ids)
        out = self.prompt_token_ids[start:end] + self.output_token_ids[max(start - n, 0):max(end - n, 0)]
        return out + [-1] * (end - start - len(out))

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_limit(self, max_model_len: int) -> int:
        """Prompt + output tokens this request may reach: the one place max_tokens is applied."""
        n = self.num_prompt_tokens
        cap = self.params.max_tokens if self.params.max_tokens is not None else max_model_len
        return min(n + cap, max_model_len)

    def wants_more(self, max_model_len: int) -> bool:
        """Whether scheduling one more sampled token is allowed (counting placeholders)."""
        return self.num_tokens < self.token_limit(max_model_len)

    def may_stop(self, num_before: int) -> bool:
        """Whether a stop token may end the output when `num_before` tokens precede it (min_tokens)."""
        return num_before >= self.params.min_tokens


def stop_ids(params: SamplingParams, eos: tuple[int, ...]) -> tuple[int, ...]:
    """The token ids that end a request: its stop_token_ids, and EOS unless ignore_eos."""
    return tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos))


def check_stop(req: Request, eos: tuple[int, ...], max_model_len: int,
               decode: Callable[[list[int]], str] | None = None) -> tuple[str | None, int | None]:
    """After a token is appended: (finish reason or None, where the text is cut for a stop string)."""
    ids = req.output_token_ids
    if req.may_stop(len(ids) - 1) and ids[-1] in stop_ids(req.params, eos):
        return "stop", None
    if req.params.stop and decode is not None:
        text = decode(ids)
        hits = [k for k in (text.find(s) for s in req.params.stop) if k >= 0]
        if hits:
            return "stop", min(hits)
    if req.num_real_tokens >= req.token_limit(max_model_len):
        return "length", None
    return None, None
