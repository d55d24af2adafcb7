"""Public data types crossing the HAL boundary."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

WeightFormat = Literal["dense", "fp8_block128", "fp8_block32", "mxfp4"]


class PlatformInfo(BaseModel):
    """What a plugin registers: returned by the `shuili_platform_info` hook."""

    model_config = ConfigDict(frozen=True)
    name: str
    vendor: str
    priority: int = 0  # `platform: auto` picks the highest-priority available platform
    hal_api_version: str
    description: str = ""
    plugin_version: str = "0"


class Availability(BaseModel):
    model_config = ConfigDict(frozen=True)
    available: bool
    reason: str = ""  # human readable; required when unavailable
    details: dict[str, Any] = {}

    @classmethod
    def yes(cls, reason: str = "", **details: Any) -> "Availability":
        return cls(available=True, reason=reason, details=details)

    @classmethod
    def no(cls, reason: str, **details: Any) -> "Availability":
        return cls(available=False, reason=reason, details=details)


@dataclass(frozen=True, eq=False)
class Weight:
    """A linear layer's weight in one of the checkpoint formats.

    dense        data [N, K] (or [E, N, K]) in the compute dtype; scale None
    fp8_block128 data float8_e4m3fn [N, K]; scale float32 [ceil(N/128), ceil(K/128)]
                 (decoded from the checkpoint's e8m0 bytes, so every scale is a power of two)
    fp8_block32  the same with 32x32 blocks (DeepSeek-V4.1's dense linears): data float8_e4m3fn
                 [N, K] with K % 32 == 0; scale float32 powers of two [ceil(N/32), K/32]
    mxfp4        data uint8 [N, K/2], element 2i in the low nibble (e2m1 codes); scale uint8 e8m0
                 [N, K/32], value 2**(byte-127)
    Grouped (MoE) weights put the expert dimension first: data [E, N, ...], scale [E, ...].
    `shape` is the logical (dequantized) shape.
    """

    format: WeightFormat
    data: torch.Tensor
    scale: torch.Tensor | None = None
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.shape:
            object.__setattr__(self, "shape", tuple(self.data.shape))
        if self.format != "dense" and self.scale is None:
            raise ValueError(f"weight format {self.format} needs a scale tensor")

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    def to(self, device) -> "Weight":
        """The same weight with data and scale on `device`."""
        scale = None if self.scale is None else self.scale.to(device)
        return Weight(self.format, self.data.to(device), scale, self.shape)

    @classmethod
    def dense(cls, t: torch.Tensor) -> "Weight":
        return cls("dense", t, None, tuple(t.shape))

    @classmethod
    def join_rows(cls, parts: "list[Weight]") -> "Weight | None":
        """One weight whose output rows are the parts' rows in order (same format, same K), so one
        linear does the parts' work: the same products, each output column its own sum. None when
        an fp8 part's rows end inside a scale block (the joined blocks would mix two parts)."""
        from shuili.hal.formats import FP8_WEIGHT_BLOCKS

        fmt, k = parts[0].format, parts[0].in_features
        if any(p.format != fmt or p.in_features != k or len(p.shape) != 2 for p in parts):
            raise ValueError("join_rows: the parts must be 2-D weights of one format and one K, got "
                             f"{[(p.format, p.shape) for p in parts]}")
        block = FP8_WEIGHT_BLOCKS.get(fmt, 1)
        if any(p.out_features % block for p in parts[:-1]):
            return None
        data = torch.cat([p.data for p in parts])
        scale = None if fmt == "dense" else torch.cat([p.scale for p in parts])
        return cls(fmt, data, scale, (sum(p.out_features for p in parts), k))
