"""Differential mode: real calls replayed on the simulator; disagreements are recorded."""
from __future__ import annotations

import dataclasses
import types

import torch

from shuili.platforms.ascend import differential
from shuili.platforms.ascend.ops import Mode, build_ops
from tests_ascend_cases import indexer_case, paged_case


def test_agreeing_device_records_nothing(api, gen):
    differential.MISMATCHES.clear()
    ops = build_ops(differential.differential(api), Mode())
    q, kc, vc, table, lens, qsl = paged_case(gen, [17, 40], [1, 1], 16)
    ops["paged_attention"](q, kc, vc, table, lens, qsl, 0.125)
    ops["cache_write"](kc, torch.tensor([3, 5]), kc.view(-1, 2, 64)[:2].clone())
    ops["rms_norm"](torch.randn(3, 8, generator=gen), None, 1e-6)
    assert differential.MISMATCHES == []


def test_disagreeing_device_is_reported(api, gen):
    """A 'device' whose indexer pads with 0 instead of -1 (one of the unverified readings)."""
    real = api.ops.npu_lightning_indexer

    def zero_padded(**kw):
        idx, val = real(**kw)
        return idx.clamp_min(0), val

    device = dataclasses.replace(api, ops=types.SimpleNamespace(**{**vars(api.ops),
                                                                   "npu_lightning_indexer": zero_padded}))
    differential.MISMATCHES.clear()
    ops = build_ops(differential.differential(device), Mode())
    q, w, kc, table, qsl, pos = indexer_case(gen, [70, 33], [5, 33], 4)
    ops["indexer_topk"](q, w, kc, table, qsl, pos, 4, 12)
    assert [m[0] for m in differential.MISMATCHES] == ["npu_lightning_indexer"]
    assert "integer entries differ" in differential.MISMATCHES[0][1]
