"""Per-request sampling parameters, validated with errors that name the field and the fix."""
from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; each alternative costs a full-vocabulary sort per step


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, description="independent samples per prompt; sample i uses seed + i")
    temperature: float = Field(1.0, description="0 = greedy")
    top_k: int = Field(0, description="0 or -1 = off")
    top_p: float = Field(1.0, description="nucleus mass in (0, 1]; 1 = off")
    min_p: float = Field(0.0, description="keep tokens with p >= min_p * p_max; 0 = off")
    repetition_penalty: float = Field(1.0, description="> 0; 1 = off")
    presence_penalty: float = Field(0.0, description="in [-2, 2]")
    frequency_penalty: float = Field(0.0, description="in [-2, 2]")
    max_tokens: int | None = Field(16, description="None = up to the model length")
    min_tokens: int = Field(0, description="EOS and stop ids are not honoured before this many tokens")
    stop: list[str] = Field(default_factory=list, description="stop strings (not included in text)")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = Field(None, description="None = a fresh seed, recorded in the output")
    logprobs: bool = Field(True, description="return the sampled tokens' float32 logprobs")
    prompt_logprobs: bool = Field(False, description="logprob of every prompt token after the first")
    top_logprobs: int = Field(0, description="also return this many most likely tokens per position, "
                              "float32, ties by lowest token id")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, v):
        return 0 if v == -1 else v

    @model_validator(mode="after")
    def _check(self):
        problems = []
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)} must be a finite number")
        if self.n < 1:
            problems.append(f"n={self.n}: ask for at least 1 sample")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 or -1 turns it off)")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p} must be in (0, 1] (1 turns it off)")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p={self.min_p} must be in [0, 1] (0 turns it off)")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 turns it off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                problems.append(f"{name}={getattr(self, name)} must be in [-2, 2] (0 turns it off)")
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens} must be >= 1 (or None for the model length)")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            problems.append(f"min_tokens={self.min_tokens} must be in [0, max_tokens]")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids {self.stop_token_ids} must be token ids >= 0")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            problems.append(f"top_logprobs={self.top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            problems.append(f"seed={self.seed} must be in [0, 2**63 - 1]")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
