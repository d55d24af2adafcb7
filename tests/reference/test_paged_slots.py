"""paged_slots on the reference platform: the contract's formula (entries before 0, past the table
and in freed blocks are -1), broadcasting, and a named error for a sequence outside the table."""
import pytest
import torch

from shuili.platforms.reference.ops import OPS

slots = OPS["paged_slots"]


def test_edges():
    """-1 before 0, past the table and in a -1 block; else block * per_block + offset, int64 from
    an int32 table."""
    bt = torch.tensor([[3, -1, 7], [0, 2, -1]], dtype=torch.int32)
    seq = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1])
    pos = torch.tensor([-1, 0, 5, 4, 9, 13, 4, 8, 12])
    got = slots(bt, seq, pos, 4)
    assert got.dtype == torch.int64
    assert got.tolist() == [-1, 12, -1, -1, 29, -1, 8, -1, -1]


def test_broadcast_is_the_expanded_call():
    """A window: seq [T, 1] against positions [T, W] is the call with seq expanded."""
    g = torch.Generator().manual_seed(0)
    bt = torch.randint(-1, 50, (5, 6), generator=g, dtype=torch.int32)
    seq = torch.tensor([4, 0, 2])
    win = torch.randint(-8, 30, (3, 7), generator=g)
    got = slots(bt, seq[:, None], win, 4)
    assert got.shape == (3, 7) and torch.equal(got, slots(bt, seq[:, None].expand_as(win), win, 4))
    def one(s, p):
        return int(bt[s, p // 4]) * 4 + p % 4 if 0 <= p < 24 and bt[s, p // 4] >= 0 else -1

    want = [[one(s, p) for p in row.tolist()] for s, row in zip(seq.tolist(), win)]
    assert got.tolist() == want


def test_errors_name_the_problem():
    bt = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_idx must lie in \[0, 2\)"):
        slots(bt, torch.tensor([2]), torch.tensor([0]), 4)
    with pytest.raises(ValueError, match="per_block > 0"):
        slots(bt, torch.tensor([0]), torch.tensor([0]), 0)
    no_blocks = torch.zeros(2, 0, dtype=torch.int32)
    assert slots(no_blocks, torch.tensor([0, 1]), torch.tensor([0, 5]), 4).tolist() == [-1, -1]
