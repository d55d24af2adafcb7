"""The `perturbed` platform: the reference ops with a few outputs moved by one ulp.

It claims `portable_bitwise` for every op, as the reference does. The perturbation is
`torch.nextafter(y, +inf)` on every element of the chosen ops' outputs: elementwise, so each op
stays run-to-run deterministic and batch-invariant, and only the bitwise-vs-reference claim is
false. That is the smallest lie a backend can tell; conformance must catch it at op level (first
divergence with both bit patterns) and at engine level (logprob bits differ from the reference).

`SHUILI_PERTURB_OPS` (comma-separated op names) picks the ops; default rms_norm,log_softmax.
"""
from __future__ import annotations

import functools
import os

import torch

from shuili.hal import HAL_API_VERSION, Availability, PlatformCapabilities, PlatformInfo
from shuili.hal.hookspecs import hookimpl

NAME = "perturbed"
DEFAULT_OPS = ("rms_norm", "log_softmax")


def perturbed_ops() -> tuple[str, ...]:
    raw = os.environ.get("SHUILI_PERTURB_OPS")
    if raw is None:
        return DEFAULT_OPS
    return tuple(n.strip() for n in raw.split(",") if n.strip())


def one_ulp_up(y):
    if isinstance(y, tuple):
        return (one_ulp_up(y[0]),) + y[1:]  # add_rms_norm: only the normed output
    if isinstance(y, torch.Tensor) and y.is_floating_point():
        return torch.nextafter(y, torch.full_like(y, float("inf")))
    return y


def perturb(fn):
    @functools.wraps(fn)  # keeps the contract signature visible to resolve_platform
    def wrapped(*args, **kwargs):
        return one_ulp_up(fn(*args, **kwargs))

    return wrapped


@hookimpl
def shuili_platform_info():
    return PlatformInfo(name=NAME, vendor="shuili tests", priority=-100,
                        hal_api_version=HAL_API_VERSION, plugin_version="0.1.0",
                        description="negative control: reference ops, some outputs +1 ulp")


@hookimpl
def shuili_platform_probe(platform):
    if platform != NAME:
        return None
    return Availability.yes("runs on the CPU; always available")


@hookimpl
def shuili_platform_capabilities(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.reference.public import capabilities

    caps = capabilities(config)
    return PlatformCapabilities.model_validate(caps.model_dump())  # same claims, portable_bitwise


@hookimpl
def shuili_platform_ops(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.reference.public import OPS

    chosen = perturbed_ops()
    unknown = sorted(set(chosen) - set(OPS))
    if unknown:
        raise ValueError(f"SHUILI_PERTURB_OPS names unknown ops {unknown}; use names from {sorted(OPS)}")
    return {name: perturb(fn) if name in chosen else fn for name, fn in OPS.items()}
