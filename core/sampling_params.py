"""Per-request sampling parameters, validated with errors that name the field and the fix."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from shuili.core.errors import ReadableErrors

MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; each alternative costs a full-vocabulary sort per step


_RULES = {
    "n": (lambda v: v >= 1, "must be >= 1 (samples per prompt)"),
    "temperature": (lambda v: v >= 0, "must be >= 0 (0 = greedy)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 or -1 turns it off)"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1] (1 turns it off)"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1] (0 turns it off)"),
    "repetition_penalty": (lambda v: v > 0, "must be > 0 (1 turns it off)"),
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2] (0 turns it off)"),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2] (0 turns it off)"),
    "max_tokens": (lambda v: v >= 1, "must be >= 1 (or null for the model length)"),
    "min_tokens": (lambda v: v >= 0, "must be >= 0"),
    "stop": (lambda v: all(v), "must not contain empty strings"),
    "stop_token_ids": (lambda v: all(t >= 0 for t in v), "must be token ids >= 0"),
    "seed": (lambda v: 0 <= v <= MAX_SEED, "must be in [0, 2**63 - 1]"),
    "top_logprobs": (lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"must be in [0, {MAX_TOP_LOGPROBS}]"),
}


class SamplingParams(ReadableErrors, BaseModel):
    # allow_inf_nan: NaN would pass every range check below
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    n: int = Field(1, description="independent samples per prompt; sample i uses seed + i")
    temperature: float = Field(1.0, description="sampling temperature; 0 = greedy")
    top_k: int = Field(0, description="keep the k most likely tokens; 0 or -1 = off")
    top_p: float = Field(1.0, description="nucleus mass in (0, 1]; 1 = off")
    min_p: float = Field(0.0, description="keep tokens with p >= min_p * p_max; 0 = off")
    repetition_penalty: float = Field(1.0, description="penalizes tokens already seen (> 0, vLLM's rule); 1 = off")
    presence_penalty: float = Field(0.0, description="subtracted from seen tokens' logits, in [-2, 2]")
    frequency_penalty: float = Field(0.0, description="times each seen token's count, subtracted, in [-2, 2]")
    max_tokens: int | None = Field(16, description="most tokens to generate; None = up to the model length")
    min_tokens: int = Field(0, description="EOS and stop ids are not honoured before this many tokens")
    stop: list[str] = Field(default_factory=list, description="stop strings (not included in text)")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = Field(None, description="sampler seed; None = a fresh seed, recorded in the output")
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

    @field_validator(*_RULES)
    @classmethod
    def _in_range(cls, v, info: ValidationInfo):
        # per field, so a bad value is reported as "field: rule, got value" (core/errors.py)
        ok, rule = _RULES[info.field_name]
        if v is not None and not ok(v):
            raise ValueError(rule)
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
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
