"""Scheduler without a model: budgets, chunking, admission, preemption, policies, abort."""
from __future__ import annotations

import pytest

from shuili import SamplingParams
from shuili.core.kv_cache import KVCacheManager
from shuili.core.model_api import CacheGroupSpec
from shuili.core.request import Request, Status, check_stop
from shuili.core.scheduler import SampleRow, Scheduler, StepOutput

P = 4
FULL = CacheGroupSpec(name="full", kind="full", layers=(0,), entry_shape=(1,))


def make(num_blocks=64, budget=16, max_seqs=8, policy="fcfs", max_len=256):
    kv = KVCacheManager([FULL], num_blocks, P)
    return Scheduler(kv, max_seqs, budget, max_len, policy)


def add(s, n_prompt, max_tokens=4, priority=0, rid=None, first=1):
    r = Request(rid or f"r{len(s.requests)}-{s.next_arrival()}", list(range(first, first + n_prompt)),
                SamplingParams(max_tokens=max_tokens), 0, s.next_arrival(), priority)
    s.add(r)
    return r


def finish_step(s, out):
    """Stand-in for the runner: every sample is token 7; the scheduler applies it (and max_tokens)."""
    rows = [SampleRow(c.req, c.end, i, c.epoch) for i, c in enumerate(c for c in out.chunks if c.sample)]
    s.update(out, StepOutput(rows, [7] * len(rows), [0.0] * len(rows), [False] * len(rows)))
    s.check()


def test_budget_and_chunked_prefill():
    s = make(budget=10)
    a, b = add(s, 7), add(s, 9)
    out = s.schedule()
    assert [(c.req, c.num_tokens, c.sample) for c in out.chunks] == [(a, 7, True), (b, 3, False)]
    finish_step(s, out)
    out = s.schedule()  # running first: a decodes, b continues its prompt
    assert [(c.req, c.start, c.num_tokens) for c in out.chunks] == [(a, 7, 1), (b, 3, 6)]
    assert out.num_tokens <= 10
    finish_step(s, out)


def test_max_num_seqs():
    s = make(budget=100, max_seqs=2)
    for _ in range(4):
        add(s, 3)
    out = s.schedule()
    assert len(out.chunks) == 2 and len(s.running) == 2


def test_preemption_and_no_admission_in_that_step():
    s = make(num_blocks=5, budget=64)
    a, b = add(s, 8, max_tokens=8), add(s, 8, max_tokens=8)
    finish_step(s, s.schedule())  # a and b use 2 blocks each (+1 free)
    c = add(s, 2)
    out = s.schedule()  # decode: a needs block 3 -> takes the free one; b needs one -> preempts
    assert out.preempted == [b] and b.status is Status.WAITING and b.num_computed_tokens == 0
    assert c.status is Status.WAITING  # no admission in a step that preempted
    assert [ch.req for ch in out.chunks] == [a]
    finish_step(s, out)


def test_forced_preempt_and_recompute_keeps_outputs():
    s = make()
    a = add(s, 5, max_tokens=6)
    finish_step(s, s.schedule())
    finish_step(s, s.schedule())
    s.preempt(a.request_id)
    out = s.schedule()
    assert out.preempted == [a]
    out = s.schedule()  # readmitted: recompute prompt + the 2 outputs, then sample the third
    (ch,) = out.chunks
    assert ch.start == 4 and ch.end == 7 and ch.sample  # 4 = the prefix-cache hit (one block)
    with pytest.raises(ValueError, match="not running"):
        s.preempt("nope")


def test_priority_policy_order_and_victim():
    s = make(num_blocks=6, budget=64, policy="priority")
    lo = add(s, 8, max_tokens=8, priority=5)
    hi = add(s, 8, max_tokens=8, priority=0)
    out = s.schedule()
    assert [c.req for c in out.chunks] == [hi, lo]  # lower value runs first
    finish_step(s, out)
    finish_step(s, s.schedule())
    add(s, 4, priority=1)
    for _ in range(6):
        out = s.schedule()
        if out.preempted:
            break
        finish_step(s, out)
    assert out.preempted and out.preempted[0] is lo  # the lowest priority is the victim


def test_abort_anywhere_frees_blocks():
    s = make(budget=6)
    a, b, c = add(s, 10), add(s, 10), add(s, 10)
    out = s.schedule()
    s.abort(a.request_id)  # running, mid-prefill, with a step in flight
    s.abort(c.request_id)  # still waiting
    finish_step(s, out)
    assert not out.chunks[0].current
    while s.has_unfinished():
        finish_step(s, s.schedule())
    assert a.finish_reason == "abort" and c.finish_reason == "abort" and b.finish_reason == "length"
    assert all(u["used"] == 0 for u in s.kv.usage().values())


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs"):
        make(policy="lifo")


def test_duplicate_request_id_is_refused():
    s = make()
    add(s, 3, rid="x")
    with pytest.raises(ValueError, match="already in use"):
        add(s, 3, rid="x")


def test_priority_victim_already_scheduled_is_withdrawn():
    s = make(num_blocks=5, budget=64, policy="priority")
    lo = add(s, 8, max_tokens=8, priority=5)
    finish_step(s, s.schedule())  # lo: 8 prompt tokens, 2 blocks
    hi = add(s, 8, max_tokens=8, priority=0, first=100)  # no shared prefix
    finish_step(s, s.schedule())  # lo grows to 3 blocks, hi admitted with the last 2
    out = s.schedule()  # lo (scheduled first) fits; hi needs a block: lo is the victim
    assert out.preempted == [lo] and [c.req for c in out.chunks] == [hi]
    assert out.num_tokens == 1 and lo.status is Status.WAITING
    finish_step(s, out)


def test_overlap_never_computes_a_last_token():
    """With a sample in flight (overlap), a request whose pending outputs reach max_tokens gets no
    chunk: the token is its last, and its KV would never be read. It once got a non-sampling
    one-token chunk, a wasted forward at the end of every request (a whole extra step for 1-token
    generations)."""
    s = make(budget=64)
    a, b = add(s, 5, max_tokens=1), add(s, 6, max_tokens=2)
    out = s.schedule()
    assert [(c.req, c.sample) for c in out.chunks] == [(a, True), (b, True)]
    nxt = s.schedule()  # step 1 still in flight: a's token is its last, b may sample once more
    assert [(c.req, c.start, c.sample) for c in nxt.chunks] == [(b, 6, True)]
    finish_step(s, out)
    assert a.finished and not b.finished
    finish_step(s, nxt)
    assert b.finished and not s.schedule().chunks


def _req(prompt, output, **kw):
    r = Request("s", list(prompt), SamplingParams(**kw), 0, 0)
    r.output_token_ids = list(output)
    return r


def test_check_stop_is_the_one_stop_rule():
    eos = (9,)
    # EOS ends the output only once min_tokens tokens precede it (the rule the sampler masks by)
    assert check_stop(_req([1], [5, 9], min_tokens=1), eos, 64) == ("stop", None)
    assert check_stop(_req([1], [5, 9], min_tokens=2), eos, 64) == (None, None)
    assert check_stop(_req([1], [5, 9], ignore_eos=True), eos, 64) == (None, None)
    assert check_stop(_req([1], [5, 3], stop_token_ids=[3]), eos, 64) == ("stop", None)
    # max_tokens and max_model_len are one limit: Request.token_limit
    assert check_stop(_req([1, 2], [5, 6], max_tokens=2), eos, 64) == ("length", None)
    assert check_stop(_req([1, 2], [5], max_tokens=None), eos, 3) == ("length", None)
    assert _req([1, 2], [], max_tokens=None).token_limit(10) == 10
    assert _req([1, 2], [], max_tokens=4).token_limit(10) == 6
    # a stop string cuts the text where it starts
    text = {(5, 6): "xyab"}
    got = check_stop(_req([1], [5, 6], stop=["ab"]), eos, 64, lambda ids: text[tuple(ids)])
    assert got == ("stop", 2)
