"""Helpers shared by the model tests (a uniquely named module: the tests import it by name under
--import-mode=importlib): watching every tensor aten touches, and an executor that runs inline."""
from __future__ import annotations

from concurrent.futures import Future

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class TensorWatch(TorchDispatchMode):
    """Calls `self.saw(t)` for every tensor an aten op reads or makes (subclasses record what they need)."""

    def saw(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self.saw(t)
        return out


class InlineExecutor:
    """Runs a submitted call in the calling thread, where a (thread-local) dispatch mode sees it."""

    def submit(self, fn, *args):
        f = Future()
        f.set_result(fn(*args))
        return f

    def shutdown(self, wait=True):
        pass
