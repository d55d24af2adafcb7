"""The `example` platform: what a vendor's first plugin looks like.

It runs on the CPU, overrides three ops and declares the rest as reference fallbacks. Its claims
are deliberately mixed so that the conformance suite has something to find:
- rms_norm: float64 internally; honestly declared `run_to_run` (passes at tolerance);
- swiglu: the reference formula, so bit-identical; declared `portable_bitwise` (passes);
- linear: one plain torch.matmul, which on the CPU is NOT batch-invariant (a row's bits depend on
  the row count), yet declared `batch_invariant`: the naive-vendor mistake conformance must catch.
"""
from __future__ import annotations

import torch

from shuili.hal import (
    HAL_API_VERSION, Availability, DeterminismLevel, DtypeSupport, OpCapability,
    PlatformCapabilities, PlatformInfo, Weight,
)
from shuili.hal.hookspecs import hookimpl
from shuili.hal.ops import OP_NAMES

NAME = "example"
OVERRIDDEN = ("rms_norm", "swiglu", "linear")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    return y.to(x.dtype)


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    from shuili.platforms.reference.public import OPS

    # a vendor kernel would go here; delegating keeps the example bit-identical by construction
    return OPS["swiglu"](gate_up, limit)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    from shuili.platforms.reference.public import dequantize_weight

    wf = w.data.float() if w.format == "dense" else dequantize_weight(w)
    y = x.float() @ wf.t()  # M-dependent kernel choice: not batch-invariant on the CPU
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@hookimpl
def shuili_platform_info():
    return PlatformInfo(name=NAME, vendor="Example Corp", priority=-10,
                        hal_api_version=HAL_API_VERSION, plugin_version="0.1.0",
                        description="example out-of-tree backend (CPU)")


@hookimpl
def shuili_platform_probe(platform):
    if platform != NAME:
        return None
    return Availability.yes("runs on the CPU; always available")


@hookimpl
def shuili_platform_capabilities(platform, config):
    if platform != NAME:
        return None
    f32 = (DtypeSupport(name="float32"),)
    return PlatformCapabilities(
        ops={
            "rms_norm": OpCapability(dtypes=f32, determinism=DeterminismLevel.run_to_run,
                                     notes="float64 internally: close to, not equal to, the reference"),
            "swiglu": OpCapability(dtypes=f32, determinism=DeterminismLevel.portable_bitwise),
            "linear": OpCapability(
                dtypes=f32, determinism=DeterminismLevel.batch_invariant,
                formats=(DtypeSupport(name="dense"), DtypeSupport(name="fp8_block128", support="emulated"),
                         DtypeSupport(name="mxfp4", support="emulated")),
                notes="deliberately over-claimed: plain matmul is not batch-invariant on the CPU"),
        },
        compute_dtypes=("float32",), device_type="cpu",
        fallback_ops=tuple(n for n in OP_NAMES if n not in OVERRIDDEN))


@hookimpl
def shuili_platform_ops(platform, config):
    if platform != NAME:
        return None
    return {"rms_norm": rms_norm, "swiglu": swiglu, "linear": linear}
