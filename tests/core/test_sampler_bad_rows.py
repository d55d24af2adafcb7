"""The sampler's bad-row flags and copies: a row is bad when it holds a NaN or is all -inf (then it
is sampled from zeros), found from the row max; the caller's logits are never written."""
from __future__ import annotations

import types

import torch

from shuili.core.sampler import Sampler, SamplingBatch
from shuili.platforms.reference.ops import OPS

V = 7
NAN, INF = float("nan"), float("inf")


def _batch(s: int, banned: bool) -> SamplingBatch:
    b = SamplingBatch(torch.zeros(s), torch.zeros(s, dtype=torch.int32), torch.ones(s), torch.zeros(s),
                      torch.zeros(s, dtype=torch.int64), torch.zeros(s, dtype=torch.int64), True, False)
    if banned:  # row 0 may not pick its best token
        b.banned_rows, b.banned_ids = torch.tensor([0]), torch.tensor([5])
    return b


def test_bad_rows_are_flagged_and_sampled_from_zeros():
    rows = torch.tensor([
        [0.0, 1.0, 2.0, 3.0, 4.0, 9.0, 1.0],  # fine: picks 5
        [1.0, NAN, 2.0, 3.0, 4.0, 5.0, 6.0],  # a NaN
        [-INF] * V,  # all -inf
        [-INF, -INF, NAN, -INF, -INF, -INF, -INF],  # -inf and a NaN
        [-INF, -INF, -INF, 2.0, -INF, -INF, -INF],  # one finite entry: fine, picks 3
        [INF, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0],  # +inf is a value, not a bad row
    ])
    out = Sampler(types.SimpleNamespace(**OPS), V)(rows.clone(), _batch(rows.shape[0], False))
    assert out.bad.tolist() == [False, True, True, True, False, False]
    assert out.tokens.tolist() == [5, 0, 0, 0, 3, 0]
    uniform = OPS["log_softmax"](torch.zeros(1, V))[0, 0]
    assert all(torch.equal(out.logprobs[i], uniform) for i in (1, 2, 3))
    assert out.logprobs[4].item() == 0.0


def test_the_callers_logits_are_not_written():
    rows = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 9.0, 1.0], [NAN, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    keep = rows.clone()
    out = Sampler(types.SimpleNamespace(**OPS), V)(rows, _batch(2, banned=True))
    assert out.tokens.tolist() == [4, 0]
    assert torch.equal(rows[0], keep[0]) and rows[1, 0].isnan()  # the banned write went to a copy
    # the raw logprob is of the unbanned distribution
    assert torch.equal(out.logprobs[0], OPS["log_softmax"](keep[:1])[0, 4])
