"""Differential mode for the first run on an Ascend box: every torch_npu call is replayed on the
CPU simulation of the same operator and the two results compared.

The simulator encodes readings of the op documentation that could not be checked without hardware
(docs/platforms/ascend.md, "Not verified"). With `SHUILI_ASCEND_DIFFERENTIAL=1` the op factory
wraps the real `NpuApi` so that each call also runs `sim_impls` on host copies of its arguments;
`MISMATCHES` collects (op, what differed) and a warning is logged per mismatch. Integer outputs
(indices, ids) must match exactly; float outputs within `rtol`/`atol` of their dtype. Slow (every
op runs twice, once on the host): for validation runs, not serving.
"""
from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import torch

from shuili.platforms.ascend.sim_impls import IMPLS

ENV = "SHUILI_ASCEND_DIFFERENTIAL"
MISMATCHES: list[tuple[str, str]] = []
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 1e-2), torch.float16: (4e-3, 2e-3)}
log = logging.getLogger("shuili.platforms.ascend.differential")


def _host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_host(v) for v in value)
    return value


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []


def compare(name: str, got: Any, want: Any) -> str:
    """'' when equal within tolerance, else what differed."""
    a, b = _flat(got), _flat(want)
    if len(a) != len(b):
        return f"{len(a)} outputs vs {len(b)} simulated"
    for i, (x, y) in enumerate(zip(a, b)):
        x = x.detach().to("cpu")
        if x.numel() == 1 and y.numel() == 1 and x.dim() <= 1 and y.dim() <= 1:
            continue  # disabled optional outputs come back as placeholders
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"output {i}: {x.dtype}{tuple(x.shape)} vs simulated {y.dtype}{tuple(y.shape)}"
        if not x.is_floating_point():
            if not torch.equal(x, y):
                bad = int((x != y).sum())
                return f"output {i}: {bad} of {x.numel()} integer entries differ"
            continue
        rtol, atol = TOLERANCE.get(x.dtype, (0.0, 0.0))
        xf, yf = x.to(torch.float32), y.to(torch.float32)
        if not torch.allclose(xf, yf, rtol=rtol, atol=atol, equal_nan=True):
            return f"output {i}: max abs diff {(xf - yf).abs().max().item():.3g}"
    return ""


def _wrap(name: str, real_fn):
    sim_fn = IMPLS[name]

    def call(*args, **kwargs):
        host_args, host_kwargs = _host(args), _host(kwargs)
        got = real_fn(*args, **kwargs)
        if name == "npu_scatter_pa_kv_cache":  # in place: compare the caches it wrote
            sim_fn(*host_args, **host_kwargs)
            got, want = (kwargs["key_cache"], kwargs["value_cache"]), (host_kwargs["key_cache"],
                                                                       host_kwargs["value_cache"])
        else:
            try:
                want = sim_fn(*host_args, **host_kwargs)
            except RuntimeError as exc:  # the call is outside what the simulator emulates
                MISMATCHES.append((name, f"simulator refused the call: {exc}"))
                log.warning("%s: simulator refused the call: %s", name, exc)
                return got
        problem = compare(name, got, want)
        if problem:
            MISMATCHES.append((name, problem))
            log.warning("%s differs from its simulation: %s", name, problem)
        return got

    return call


def differential(api):
    """`api` with every simulated operator also run on the simulator and compared."""
    ops = types.SimpleNamespace(**{n: getattr(api.ops, n) for n in IMPLS if hasattr(api.ops, n)})
    for n in list(vars(ops)):
        setattr(ops, n, _wrap(n, getattr(api.ops, n)))
    return dataclasses.replace(api, ops=ops)
