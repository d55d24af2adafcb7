"""The reference sampler's greedy pick: the lowest id among a row's maxima, V for a row with NaN."""
import pytest
import torch

from shuili.platforms.reference.sampling import _first_argmax


def slow_first_argmax(row: list[float]) -> int:
    top = max(row) if not any(v != v for v in row) else None
    return len(row) if top is None else next(i for i, v in enumerate(row) if v == top)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_lowest_id_among_maxima(dtype, threads):
    v = 49_152  # SmolLM2's vocabulary: long enough for torch to split the reduction
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, v, generator=g).to(dtype)
    x[0, [40_000, 123, 45_000]] = 9.0  # ties far apart: 123 wins
    x[1, :] = 0.0
    x[1, 7] = -0.0  # -0 == +0: the first of all zeros, id 0
    x[2, :] = float("-inf")  # every element is the max: id 0
    x[3, 30_001] = float("inf")
    x[4, 5] = float("nan")  # no element equals a NaN max: V
    x[5, [v - 1, v - 2]] = 50.0  # the last two ids tie
    x[6, 24_576:] = x[6, :24_576]  # each value twice: the first half wins
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _first_argmax(x)
    finally:
        torch.set_num_threads(old)
    want = [slow_first_argmax(r) for r in x.tolist()]
    assert got.tolist() == want
    assert want[:6] == [123, 0, 0, 30_001, v, v - 2]  # the cases are the ones named above
