"""Top-k logprob alternatives per generated position (what the server's logprobs / top_logprobs return)."""
from __future__ import annotations

import struct

import pytest
from core_helpers import make_llm

from shuili import SamplingParams


def _run(llm, items):
    reqs = [llm.engine.add_request(p, sp) for p, sp in items]
    for _ in range(200):
        if not llm.engine.has_unfinished():
            break
        llm.engine.step_requests()
    return reqs


def _f32(x: float) -> bytes:
    return struct.pack("<f", x)


@pytest.mark.parametrize("overlap", [False, True])
def test_alternatives_are_sorted_float32_and_hold_the_sampled_token(overlap):
    llm = make_llm(overlap=overlap)
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, top_logprobs=4),
              SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, top_logprobs=2),
              SamplingParams(temperature=1.0, seed=4, max_tokens=4, ignore_eos=True)]
    greedy, sampled, plain = _run(llm, zip(["abc def", "hij klm nop", "abc"], params))
    for req, k in ((greedy, 4), (sampled, 2)):
        assert len(req.top_logprobs) == len(req.output_token_ids)
        for alts, tok, lp in zip(req.top_logprobs, req.output_token_ids, req.logprobs):
            assert len(alts) == k
            vals = [v for _, v in alts]
            assert vals == sorted(vals, reverse=True)
            assert all(_f32(v) == _f32(float(v)) for v in vals)  # float32 values
            ties = [(a, b) for a, b in zip(alts, alts[1:]) if a[1] == b[1]]
            assert all(a[0] < b[0] for a, b in ties)  # ties by lowest token id
            listed = dict(alts)
            if tok in listed:
                assert _f32(listed[tok]) == _f32(lp)  # same bits as the sampled token's logprob
    for (tok, _), out in zip((a[0] for a in greedy.top_logprobs), greedy.output_token_ids):
        assert tok == out  # greedy picks the first alternative
    assert plain.top_logprobs == []


def test_asking_for_alternatives_does_not_change_the_sampled_bits():
    base = dict(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    a, = _run(make_llm(), [("abc def", SamplingParams(**base))])
    b, = _run(make_llm(), [("abc def", SamplingParams(**base, top_logprobs=5))])
    assert a.output_token_ids == b.output_token_ids
    assert list(map(_f32, a.logprobs)) == list(map(_f32, b.logprobs))


def test_top_logprobs_range_is_checked():
    with pytest.raises(ValueError, match=r"top_logprobs: must be in \[0, 20\], got 21"):
        SamplingParams(top_logprobs=21)
