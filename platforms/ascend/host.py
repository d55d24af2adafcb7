"""The torch path of last resort: run the reference implementation on the host.

For ops (or argument combinations) no torch_npu operator covers, the backend copies the inputs to
the CPU, runs the reference platform's implementation there and copies the result back. Correct
and portable (the oracle's own code), slow on a real NPU: each such call is a device-host round
trip. `PATHS` counts which path every call took, so tests can assert the NPU operator was used.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable

import torch

from shuili.hal.types import Weight

PATHS: Counter = Counter()


def took(path: str) -> None:
    PATHS[path] += 1


def _to(obj: Any, device: torch.device | str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Weight):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    return obj


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0].device
    return torch.device("cpu")


def reference_op(name: str) -> Callable:
    from shuili.platforms.reference.public import OPS

    if name not in OPS:
        raise KeyError(f"the reference platform has no op {name!r} to fall back on")
    return OPS[name]


def on_device(name: str) -> Callable:
    """The reference op `name` run where its inputs are (its torch code on the NPU), for ops no
    torch_npu operator covers whose reference code has no batch-dependent reduction; same signature
    as the contract. Counted as `name:torch`."""
    fn = reference_op(name)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        took(f"{name}:torch")
        return fn(*args, **kwargs)

    return call


def on_host(name: str) -> Callable:
    """The reference op `name`, wrapped to run on the host; same signature as the contract."""
    fn = reference_op(name)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        took(f"{name}:host")
        device = _device_of(args, kwargs)
        if device.type == "cpu":
            return fn(*args, **kwargs)
        out = fn(*_to(args, "cpu"), **_to(kwargs, "cpu"))
        return _to(out, device)

    return call
