"""Input checks of the NVIDIA ops record nothing into a captured graph, launch nothing inside the
engine's steps (whose inputs are checked on the host) and stay in other eager calls.

A GPU is not needed: a meta tensor takes the device path of `common.check` (it is not a CPU
tensor), and a dispatch log shows every op the check issues."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shuili.hal.checks import inputs_checked
from shuili.platforms.nvidia import common, misc


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _embed_ops(monkeypatch, capturing: bool) -> list[str]:
    monkeypatch.setattr(common, "capturing", lambda: capturing)
    ids = torch.zeros(4, dtype=torch.int64, device="meta")
    table = torch.empty(9, 16, device="meta")
    with OpLog() as log:
        misc.embedding(ids, table)
    return log.ops


def test_captured_check_launches_nothing(monkeypatch):
    assert _embed_ops(monkeypatch, capturing=True) == ["aten.embedding.default"]


def test_eager_check_keeps_the_device_assert(monkeypatch):
    ops = _embed_ops(monkeypatch, capturing=False)
    assert "aten._assert_async.msg" in ops and ops[-1] == "aten.embedding.default"


def test_cpu_tensors_still_raise_while_capturing(monkeypatch):
    monkeypatch.setattr(common, "capturing", lambda: True)
    with pytest.raises(ValueError, match=r"embedding ids must lie in \[0, 9\)"):
        misc.embedding(torch.tensor([9]), torch.zeros(9, 4))


def test_checked_inputs_launch_no_check(monkeypatch):
    monkeypatch.setattr(common, "capturing", lambda: False)
    ids = torch.zeros(4, dtype=torch.int64, device="meta")
    table = torch.empty(9, 16, device="meta")
    with inputs_checked(), OpLog() as inside:
        misc.embedding(ids, table)
    with OpLog() as after:
        misc.embedding(ids, table)
    assert inside.ops == ["aten.embedding.default"]
    assert "aten._assert_async.msg" in after.ops


def test_cpu_tensors_still_raise_when_inputs_are_checked():
    with inputs_checked(), pytest.raises(ValueError, match=r"embedding ids must lie in \[0, 9\)"):
        misc.embedding(torch.tensor([9]), torch.zeros(9, 4))
