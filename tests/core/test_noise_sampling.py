"""The counter-based noise (golden vectors: the cross-platform spec) and the reference sampling ops."""
from __future__ import annotations

import math

import pytest
import torch

from shuili.hal import noise
from shuili.platforms.reference import sampling as S

# hash32(seed, position, token_id): MurmurHash3_x86_32 of five 32-bit words, hash seed 0x5348554C.
# Any platform's sampler must reproduce these exactly.
GOLDEN = [
    ((0, 0, 0), 1781388583),
    ((42, 7, 123), 2732391580),
]


@pytest.mark.parametrize("args,h", GOLDEN)
def test_golden_vectors(args, h):
    assert noise.hash32(*args) == h
    assert int(noise.hash32_tensor(*args)) == h


def test_seed_and_position_wrap_modulo_2_64():
    # recorded once from the spec implementation; negative seeds / 64-bit positions are mod 2**64
    table = {(1, 1, 1): noise.hash32(1, 1, 1), (-1, 2**40, 129279): noise.hash32(-1, 2**40, 129279)}
    for (s, p, t), h in table.items():
        assert int(noise.hash32_tensor(s, p, t)) == h
    assert noise.hash32(-1, 0, 0) == noise.hash32(2**64 - 1, 0, 0)


def test_tensor_matches_scalar_spec():
    ids = torch.arange(0, 200_000, 37)
    for seed, pos in [(0, 0), (123456789, 5), (2**63 - 1, 2**33 + 3), (-5, 17)]:
        got = noise.hash32_tensor(seed, pos, ids).tolist()
        assert got == [noise.hash32(seed, pos, int(i)) for i in ids]


def test_uniform_strictly_inside_unit_interval():
    lo = (0 + 0.5) / 2**32
    hi = (2**32 - 1 + 0.5) / 2**32
    assert 0.0 < lo and hi < 1.0 and math.isfinite(-math.log(-math.log(hi)))
    u = noise.uniform(7, 3, torch.arange(100_000))
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert torch.isfinite(S.gumbel(7, 3, torch.arange(100_000))).all()


def test_noise_depends_on_each_key():
    ids = torch.arange(1000)
    base = noise.hash32_tensor(1, 2, ids)
    for other in (noise.hash32_tensor(2, 2, ids), noise.hash32_tensor(1, 3, ids)):
        assert (base != other).float().mean() > 0.99
    assert len(set(base.tolist())) > 990


def test_log_softmax_row_invariant_and_accurate():
    x = torch.randn(9, 1000) * 4
    full = S.log_softmax(x)
    for i in range(9):
        assert torch.equal(S.log_softmax(x[i:i + 1])[0], full[i])
    assert torch.allclose(full, torch.log_softmax(x, -1), atol=1e-5)
    assert full.dtype == torch.float32


def _sample(logits, temp=1.0, k=0, p=1.0, mp=0.0, seeds=None, pos=None):
    B = logits.shape[0]
    f = lambda v, dt: torch.full((B,), v, dtype=dt)  # noqa: E731
    return S.sample(logits, f(temp, torch.float32), f(k, torch.int32), f(p, torch.float32),
                    f(mp, torch.float32), seeds if seeds is not None else torch.arange(B),
                    pos if pos is not None else f(0, torch.int64))


def test_greedy_ties_to_lowest_id():
    x = torch.zeros(1, 50)
    x[0, [7, 3, 40]] = 5.0
    assert int(_sample(x, temp=0.0)[0]) == 3


def test_sample_row_invariant():
    x = torch.randn(12, 300)
    seeds = torch.arange(100, 112)
    pos = torch.arange(12) * 3
    for kw in ({}, {"k": 10}, {"p": 0.8}, {"mp": 0.1}, {"temp": 0.0}):
        full = _sample(x, seeds=seeds, pos=pos, **kw)
        for i in (0, 5, 11):
            one = _sample(x[i:i + 1], seeds=seeds[i:i + 1], pos=pos[i:i + 1], **kw)
            assert int(one[0]) == int(full[i])


def test_top_k_top_p_min_p_restrict_the_support():
    x = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    xs = x.expand(200, -1).contiguous()
    draws = lambda **kw: set(_sample(xs, seeds=torch.arange(200), **kw).tolist())  # noqa: E731
    assert draws(k=2) == {0, 1}
    assert draws(p=0.6) == {0, 1}  # 0.5 < 0.6, token 1 crosses and is kept
    assert draws(p=0.45) == {0}  # token 0 alone crosses 0.45
    assert draws(mp=0.35) == {0, 1}  # p >= 0.35 * 0.5
    assert draws() == {0, 1, 2, 3, 4}


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    x = torch.log(probs)[None]
    got = _sample(x.expand(3000, -1).contiguous(), seeds=torch.arange(3000))
    counts = torch.bincount(got, minlength=3).float()
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_seed_and_position_change_the_sample():
    x = torch.zeros(1, 1000)
    xs = x.expand(50, -1).contiguous()
    a = set(_sample(xs, seeds=torch.arange(50), pos=torch.zeros(50, dtype=torch.int64)).tolist())
    b = set(_sample(xs, seeds=torch.zeros(50, dtype=torch.int64), pos=torch.arange(50)).tolist())
    assert len(a) > 40 and len(b) > 40


def test_apply_penalties_formula():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    counts = torch.tensor([[2, 1, 0, 0, 0]], dtype=torch.int32)
    prompt = torch.tensor([[False, False, True, False, False]])
    out = S.apply_penalties(logits, counts, prompt, torch.tensor([2.0]), torch.tensor([0.5]),
                            torch.tensor([0.25]))
    expect = torch.tensor([[2.0 / 2 - 0.5 - 0.5, -2.0 * 2 - 0.25 - 0.5, 1.0 / 2, -1.0, 0.5]])
    assert torch.equal(out, expect)
    neutral = S.apply_penalties(logits, counts, prompt, torch.ones(1), torch.zeros(1), torch.zeros(1))
    assert torch.equal(neutral, logits)
