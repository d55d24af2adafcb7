"""Engine configuration (pydantic), loadable from JSON or TOML (`shuili generate --config FILE`)."""
from __future__ import annotations

import json
import os
import tomllib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shuili.core.models import DEFAULT_MODEL
from shuili.hal import PlatformConfig


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(DEFAULT_MODEL, description="a registered name, a checkpoint directory or a .gguf file")
    platform: PlatformConfig = Field(default_factory=lambda: PlatformConfig(platform="auto"))
    dtype: str = Field("float32", description="compute dtype of the model")
    seed: int = Field(0, description="weight seed for synthetic models")
    max_model_len: int | None = Field(None, description="None = the model's limit")
    max_num_seqs: int = Field(64, description="most requests running at once")
    max_num_batched_tokens: int = Field(2048, description="token budget of one step")
    tokens_per_block: int = Field(16, description="P: tokens per KV block (a multiple of every ratio)")
    num_blocks: int | None = Field(None, description="KV blocks per cache group; None = from the budget")
    kv_cache_bytes: int = Field(1 << 30, description="KV memory budget when num_blocks is None")
    enable_prefix_caching: bool = True
    overlap: bool = Field(False, description="prepare step N+1 on the host while step N runs")
    enforce_eager: bool = Field(False, description="never replay decode steps as device graphs (graphs "
                                "are used where the platform and the model support them)")
    policy: Literal["fcfs", "priority"] = "fcfs"

    @field_validator("platform", mode="before")
    @classmethod
    def _platform(cls, v):
        if isinstance(v, str):
            return PlatformConfig(platform=v)
        return v

    @model_validator(mode="after")
    def _check(self):
        problems = []
        for name in ("max_num_seqs", "max_num_batched_tokens", "tokens_per_block", "kv_cache_bytes"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            problems.append(f"num_blocks={self.num_blocks} must be >= 1 (or None for the memory budget)")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append(f"max_model_len={self.max_model_len} must be >= 2")
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))
        return self

    @classmethod
    def from_file(cls, path: str, **overrides) -> "EngineConfig":
        """JSON (.json) or TOML (.toml); keys are EngineConfig fields; `overrides` win."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {path!r} does not exist")
        if path.endswith(".toml"):
            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif path.endswith(".json"):
            with open(path) as f:
                data = json.load(f)
        else:
            raise ValueError(f"config file {path!r}: use a .json or .toml file")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)
