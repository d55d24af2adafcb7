"""Platform selection config (the `platform:` section of an engine config)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class PlatformConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    platform: str = Field(
        "auto", description="auto | reference | nvidia | ascend | <plugin name>"
    )
    allow_reference_fallback: bool = Field(
        True,
        description="ops a platform declares as `fallback_ops` run on the reference implementation "
        "(logged); False demands every op natively. An undeclared missing op always fails.",
    )
    batch_invariant: bool = Field(
        False, description="ask for batch-invariant kernels (fixed splits, no split-K)"
    )
    deterministic: bool = Field(
        False, description="apply run-to-run determinism settings (torch, HCCL, cuBLAS)"
    )
    device: str | None = Field(None, description="device string, e.g. cuda:0; None = platform default")
    plugins: list[str] | None = Field(
        None, description="allowlist of plugin entry-point names to load; None loads all"
    )

    @field_validator("platform")
    @classmethod
    def _name(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("platform must be 'auto' or a platform name (see `shuili platforms`)")
        return v
