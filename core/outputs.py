"""RequestOutput and CompletionOutput, shaped as vLLM's (re-exported by shuili.core.api).

`LLM.generate` returns one RequestOutput per prompt whose `.outputs` holds its n completions.
The engine itself runs n=1 requests, so its outputs carry one completion; the `text`,
`token_ids`, ... properties read that single completion (and refuse to guess when there are n).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length", "abort", "error"]


class CompletionOutput(BaseModel):
    index: int = 0
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list, description="float32 logprob of each sampled token")
    finish_reason: FinishReason | None = None
    error: str | None = Field(None, description="why the request failed (finish_reason 'error')")
    seed: int | None = Field(None, description="replay this answer with SamplingParams(seed=seed)")
    num_preemptions: int = 0
    metrics: dict[str, float] = Field(default_factory=dict, description="arrival, first_token, finish (s)")

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.logprobs)


class RequestOutput(BaseModel):
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] = Field(default_factory=list)
    prompt_logprobs: list[float | None] | None = Field(None, description="logprob of prompt tokens 1..n-1")
    outputs: list[CompletionOutput] = Field(default_factory=list)
    finished: bool = False

    def _single(self) -> CompletionOutput:
        if len(self.outputs) != 1:
            raise ValueError(f"request {self.request_id} has {len(self.outputs)} completions; "
                             "read .outputs[i]")
        return self.outputs[0]

    @property
    def text(self) -> str:
        return self._single().text

    @property
    def token_ids(self) -> list[int]:
        return self._single().token_ids

    @property
    def logprobs(self) -> list[float]:
        return self._single().logprobs

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._single().finish_reason

    @property
    def error(self) -> str | None:
        return self._single().error

    @property
    def seed(self) -> int | None:
        return self._single().seed

    @property
    def num_preemptions(self) -> int:
        return self._single().num_preemptions

    @property
    def metrics(self) -> dict[str, float]:
        return self._single().metrics
