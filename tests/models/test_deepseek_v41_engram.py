"""The Engram tables of a V4.1 model stay in host memory: during a whole forward of tiny-v41 no
torch tensor ever aliases a table's memory (only the step's gathered rows are copied out and
uploaded). Negative control: a gather that wraps the table as a tensor must be caught."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from models_helpers import InlineExecutor, TensorWatch

from shuili.core.models import deepseek_v41 as V
from shuili.core.models.engram import EngramTable
from shuili.hal.config import PlatformConfig
from shuili.hal.registry import resolve_platform


class _Spans(TensorWatch):
    """Address ranges of every tensor an aten op reads or makes."""

    def __init__(self):
        super().__init__()
        self.spans: list[tuple[int, int]] = []

    def saw(self, t):
        if t.device.type != "meta" and t.numel():
            s = t.untyped_storage()
            self.spans.append((s.data_ptr(), s.data_ptr() + s.nbytes()))


class _WrapsTable(EngramTable):
    def gather(self, ids, out):
        rows = torch.from_numpy(np.asarray(self.data))[torch.from_numpy(ids)]  # the table as a tensor
        out[:rows.numel()] = rows.reshape(-1).numpy()


@pytest.mark.parametrize("bad", [False, True], ids=["host_only", "negative_control"])
def test_tables_never_become_model_tensors(bad):
    ops = resolve_platform(PlatformConfig(platform="reference")).ops
    m = V.build("tiny-v41", ops, seed=1)
    eng = m.engram
    assert eng is not None and set(eng.tables) == {1, 4}
    if bad:
        eng.tables = {k: _WrapsTable(t.data, t.scale, t.kind, t.head_dim, t.source) for k, t in eng.tables.items()}
    eng._pool = InlineExecutor()
    tables = [(t.data.__array_interface__["data"][0], t.data.nbytes) for t in eng.tables.values()]
    drv = m.driver(max_seqs=1, max_len=64)
    with _Spans() as log:
        m.forward(drv.batch([(0, list(range(3, 30)))], logits="all"))
        m.forward(drv.batch([(0, [7])]))
    hits = [s for s in log.spans for lo, n in tables if s[0] < lo + n and lo < s[1]]
    assert bool(hits) == bad
    assert len(log.spans) > 100  # the mode saw the forward


def test_engram_rows_change_the_output():
    """Zeroing the Engram value path (wkv) must change the logits: the write is live."""
    ops = resolve_platform(PlatformConfig(platform="reference")).ops
    m = V.build("tiny-v41", ops, seed=1)
    ids = list(range(3, 20))
    a = m.forward(m.driver(max_seqs=1, max_len=32).batch([(0, ids)], logits="all"))
    m.blocks[1].engram.wkv.data.zero_()
    b = m.forward(m.driver(max_seqs=1, max_len=32).batch([(0, ids)], logits="all"))
    assert not torch.equal(a, b)
