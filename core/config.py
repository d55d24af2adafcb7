"""Engine configuration (pydantic), loadable from JSON or TOML (`shuili generate --config FILE`)."""
from __future__ import annotations

import os
import tomllib
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from shuili.core.errors import ReadableErrors, format_validation_error, read_json
from shuili.core.models import DEFAULT_MODEL
from shuili.core.spec.config import SpeculativeConfig
from shuili.hal import PlatformConfig


_AT_LEAST = {"max_num_seqs": 1, "max_num_batched_tokens": 1, "tokens_per_block": 1, "kv_cache_bytes": 1,
             "num_blocks": 1, "max_model_len": 2, "tensor_parallel_size": 1, "data_parallel_size": 1,
             "num_redundant_experts": 0, "eplb_step_interval": 1}


class EngineConfig(ReadableErrors, BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(DEFAULT_MODEL, description="a registered name, a checkpoint directory or a .gguf file")
    platform: PlatformConfig = Field(default_factory=lambda: PlatformConfig(platform="auto"))
    dtype: str = Field("float32", description="compute dtype of the model")
    seed: int = Field(0, description="weight seed for synthetic models")
    max_model_len: int | None = Field(None, description="None = the model's limit")
    max_num_seqs: int = Field(64, description="most requests running at once")
    max_num_batched_tokens: int = Field(2048, description="token budget of one step")
    tokens_per_block: int | None = Field(None, description="P: tokens per KV block (a multiple of every "
                                         "cache group's ratio); None = the smallest multiple of 16 that is")
    num_blocks: int | None = Field(None, description="KV blocks per cache group; None = from the budget")
    kv_cache_bytes: int = Field(1 << 30, description="KV memory budget when num_blocks is None")
    enable_prefix_caching: bool = True
    overlap: bool = Field(False, description="prepare step N+1 on the host while step N runs")
    enforce_eager: bool = Field(False, description="never replay decode steps as device graphs (graphs "
                                "are used where the platform and the model support them)")
    graph_capture: Literal["startup", "lazy"] = Field(
        "startup", description="when decode graphs are recorded: every (batch, block-table width) "
        "bucket when the engine starts, or each on first use (faster start, stalls while serving)")
    policy: Literal["fcfs", "priority"] = "fcfs"
    speculative: SpeculativeConfig | None = Field(None, description="speculative decoding (core/spec); "
                                                  "None = off. Output bits are the same either way")
    # parallelism (core/parallel/, docs/parallel.md); vLLM's flag names
    tensor_parallel_size: int = Field(1, description="TP: attention heads, output projections and the "
                                      "vocabulary head split over this many ranks")
    data_parallel_size: int = Field(1, description="DP: this many schedulers, each with its own TP group")
    enable_expert_parallel: bool = Field(False, description="EP: routed experts spread over all "
                                         "TP x DP ranks (else split along the intermediate dim by TP)")
    enable_eplb: bool = Field(False, description="rebalance expert placement from routing load (needs EP)")
    num_redundant_experts: int = Field(0, description="EPLB: extra physical expert slots in total")
    eplb_step_interval: int = Field(64, description="EPLB: engine steps between rebalancing")
    distributed_timeout_s: float = Field(60.0, description="a collective that waits longer than this fails "
                                         "the engine (a dead or stuck worker)")
    kv_host_bytes: int = Field(0, description="host-memory KV tier for evicted device blocks, bytes "
                               "(or '8G'); 0 = off (docs/kv-tiers.md)")
    kv_store: str | None = Field(None, description="directory of the shared KV block store (local or a "
                                 "shared file system); None = off")
    kv_store_ttl: float = Field(72 * 3600.0, description="seconds (or '72h') a stored block lives after "
                                "its last use")
    kv_store_bytes: int | None = Field(None, description="size cap of the store directory, bytes (or "
                                       "'500G'); least recently used blocks go first; None = TTL only")

    @field_validator("kv_host_bytes", "kv_store_bytes", mode="before")
    @classmethod
    def _bytes(cls, v):
        from shuili.core.kv_tiers.units import parse_bytes

        if v is None:
            return v
        v = parse_bytes(v)
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("kv_store_ttl", mode="before")
    @classmethod
    def _duration(cls, v):
        from shuili.core.kv_tiers.units import parse_duration

        v = parse_duration(v)
        if v <= 0:
            raise ValueError("must be > 0 (a duration such as 72h)")
        return v

    @field_validator("platform", mode="before")
    @classmethod
    def _platform(cls, v):
        if isinstance(v, str):
            return PlatformConfig(platform=v)
        return v

    @field_validator(*_AT_LEAST)
    @classmethod
    def _at_least(cls, v, info: ValidationInfo):
        # per field, so a bad value is reported as "field: rule, got value" (core/errors.py)
        low = _AT_LEAST[info.field_name]
        if v is not None and v < low:
            raise ValueError(f"must be >= {low}")
        return v

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @model_validator(mode="after")
    def _parallel(self):
        if self.world_size > 1 and self.overlap:
            raise ValueError("overlap with tensor_parallel_size or data_parallel_size > 1 is not supported "
                             "yet: drop --overlap")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel (EPLB places experts over EP ranks)")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("num_redundant_experts needs enable_eplb")
        return self

    @classmethod
    def from_file(cls, path: str, **overrides) -> "EngineConfig":
        """JSON (.json) or TOML (.toml); keys are EngineConfig fields; `overrides` win. Errors name
        the file and the line (syntax) or the field (values)."""
        data = _read_config_file(path)
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(format_validation_error(exc, prefix=path)) from None


def _read_config_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    if not path.endswith((".toml", ".json")):
        raise ValueError(f"config file {path!r}: use a .json or .toml file")
    if path.endswith(".json"):
        data = read_json(path)
    else:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a text file (expected UTF-8 TOML)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of EngineConfig fields, got {type(data).__name__}")
    return data
