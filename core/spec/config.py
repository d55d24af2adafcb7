"""`EngineConfig.speculative`: which drafter and how many draft tokens a step may verify."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

METHODS = ("ngram", "mtp", "dspark")


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "mtp", "dspark"] = Field(
        description="ngram: prompt lookup in the request's own tokens; mtp: the model's MTP block; "
                    "dspark: V4.1's draft layers")
    num_speculative_tokens: int = Field(
        ge=1, description="draft tokens one step verifies in total, over all its requests (also the "
                          "most one request gets)")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest suffix matched")
    prompt_lookup_min: int = Field(1, ge=1, description="ngram: shortest suffix matched")
    min_confidence: float = Field(
        0.1, ge=0.0, le=1.0, description="model drafts: a draft is verified only while the product of "
                                         "the drafter's confidences up to it is at least this")

    @model_validator(mode="after")
    def _lookup(self):
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self
