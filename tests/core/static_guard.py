"""Device-free stand-ins for decode-graph tests: `ReplayByRerun` records by running the function
once on all-padding inputs (which must write no cache) and replays by re-running it; `guarded()`
adds a guard that fails on any host read of a tensor in model code during replays (the ops, which
on the reference platform are not the capture-safe ones, run unguarded) and records every op call's
tensor shapes per captured graph (they must depend on the bucket only)."""
from __future__ import annotations

import contextlib

import torch

_HOST_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class HostRead(AssertionError):
    pass


class _Guard:
    """While `on`, a host read of any tensor raises HostRead (patched on torch.Tensor)."""

    def __init__(self):
        self.on = False
        self.caught: list[str] = []  # the engine turns a failed step into failed requests: keep a record

    @contextlib.contextmanager
    def active(self):
        saved = {n: getattr(torch.Tensor, n) for n in _HOST_READS}

        def make(name, orig):
            def f(t, *a, **k):
                if self.on:
                    self.caught.append(name)
                    raise HostRead(f"host read of a tensor ({name}) in the static decode path")
                return orig(t, *a, **k)
            return f

        for n, orig in saved.items():
            setattr(torch.Tensor, n, make(n, orig))
        self.on = True
        try:
            yield
        finally:
            self.on = False
            for n, orig in saved.items():
                setattr(torch.Tensor, n, orig)


class _Ops:
    """The model's DispatchTable, recording each op call's tensor shapes; ops run unguarded."""

    def __init__(self, ops, guard: _Guard):
        self._ops, self._guard, self.calls = ops, guard, None

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def call(*a, **k):
            on, self._guard.on = self._guard.on, False
            try:
                out = fn(*a, **k)
            finally:
                self._guard.on = on
            if self.calls is not None:
                self.calls.append((name, _shapes(a), _shapes(tuple(k.values())), _shapes(out)))
            return out
        return call


def _shapes(x):
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype
    if isinstance(x, (tuple, list)):
        return tuple(_shapes(v) for v in x)
    return type(x).__name__


class ReplayByRerun:
    """capture(fn) -> replay, device-free. The warm-up run on all-padding inputs must write nothing;
    replays run under the host-read guard and record op shapes per capture (one signature each)."""

    def __init__(self, guard: _Guard | None = None, ops: _Ops | None = None, fail: bool = False):
        self.caches = None
        self.captured = 0
        self.guard, self.ops = guard, ops
        self.fail = fail  # stand in for a capture the device refuses
        self.signatures: dict[int, set] = {}

    def __call__(self, fn):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        before = {n: [t.clone() for t in ts] for n, ts in self.caches.items()}
        fn()
        for n, ts in self.caches.items():
            for a, b in zip(before[n], ts):
                assert a.equal(b), f"a padding-only step wrote cache group {n}"
        self.captured += 1
        if self.guard is None:
            return fn
        key = self.captured
        self.signatures[key] = set()

        def replay():
            self.ops.calls = []
            with self.guard.active():
                out = fn()
            self.signatures[key].add(tuple(self.ops.calls))
            self.ops.calls = None
            return out
        return replay


def guarded() -> ReplayByRerun:
    g = _Guard()
    return ReplayByRerun(g, _Ops(None, g))


def install(capture: ReplayByRerun, engine) -> None:
    """Route the engine model's op calls (and its Engram service's) through the recorder."""
    if capture.ops is not None:
        capture.ops._ops = engine.model.ops
        engine.model.ops = capture.ops
        if getattr(engine.model, "engram", None) is not None:
            engine.model.engram.ops = capture.ops
