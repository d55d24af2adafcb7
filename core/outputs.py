"""RequestOutput: what generate() returns and stream() yields (re-exported by shuili.core.api)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestOutput(BaseModel):
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[float] = Field(default_factory=list, description="float32 logprob of each sampled token")
    prompt_logprobs: list[float | None] | None = Field(None, description="logprob of prompt tokens 1..n-1")
    seed: int | None = Field(None, description="replay this answer with SamplingParams(seed=seed)")
    finish_reason: FinishReason | None = None
    error: str | None = None
    finished: bool = False
    num_preemptions: int = 0
    metrics: dict[str, float] = Field(default_factory=dict, description="arrival, first_token, finish (s)")
