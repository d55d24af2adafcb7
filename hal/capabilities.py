"""The capability model: what a platform claims per op, as data the conformance suite verifies."""
from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DeterminismLevel(enum.IntEnum):
    """A ladder: each level implies every level below it.

    none             results may differ between two identical calls
    run_to_run       identical inputs and shapes give identical bits, call after call
    batch_invariant  a row's bits do not depend on the other rows, the batch size or the row's place
    portable_bitwise bit-identical to the reference platform on the same inputs
    """

    none = 0
    run_to_run = 1
    batch_invariant = 2
    portable_bitwise = 3

    @classmethod
    def parse(cls, value: "str | int | DeterminismLevel") -> "DeterminismLevel":
        if isinstance(value, DeterminismLevel):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[value]
        except KeyError:
            names = ", ".join(m.name for m in cls)
            raise ValueError(f"unknown determinism level {value!r}; use one of: {names}") from None


Support = Literal["native", "emulated"]


class DtypeSupport(BaseModel):
    """One dtype or quant format an op accepts, and whether hardware runs it natively."""

    model_config = ConfigDict(frozen=True)
    name: str  # torch dtype name ("float32", "bfloat16") or a weight/KV format ("fp8_block128", "mxfp4")
    support: Support = "native"


class OpCapability(BaseModel):
    model_config = ConfigDict(frozen=True)
    dtypes: tuple[DtypeSupport, ...] = ()
    formats: tuple[DtypeSupport, ...] = ()
    determinism: DeterminismLevel = DeterminismLevel.none
    # a level that holds only under a setting (e.g. batch-invariant mode) names it here
    determinism_requires: str | None = None
    notes: str = ""

    def supports_dtype(self, name: str) -> bool:
        return any(d.name == name for d in self.dtypes)

    def supports_format(self, name: str) -> bool:
        return any(f.name == name for f in self.formats)


class PlatformCapabilities(BaseModel):
    """Per-op claims plus platform features. `ops` keys are op names from `shuili.hal.ops`."""

    model_config = ConfigDict(frozen=True)
    ops: dict[str, OpCapability] = Field(default_factory=dict)
    compute_dtypes: tuple[str, ...] = ("float32",)
    graph_capture: bool = False
    collectives_backend: str | None = None
    device_type: str = "cpu"
    # ops the platform knowingly leaves to the reference implementation; resolution takes them from
    # the reference only when the config allows it, and logs it. Any other missing op is an error.
    fallback_ops: tuple[str, ...] = ()

    def op(self, name: str) -> OpCapability:
        if name not in self.ops:
            raise KeyError(f"platform declares no capability for op {name!r}")
        return self.ops[name]

    def determinism(self, name: str) -> DeterminismLevel:
        return self.op(name).determinism

    def summary(self) -> dict:
        levels: dict[str, int] = {}
        for cap in self.ops.values():
            levels[cap.determinism.name] = levels.get(cap.determinism.name, 0) + 1
        return {
            "ops": len(self.ops),
            "determinism": levels,
            "compute_dtypes": list(self.compute_dtypes),
            "graph_capture": self.graph_capture,
            "collectives": self.collectives_backend,
            "device_type": self.device_type,
            "fallback_ops": list(self.fallback_ops),
        }
