"""Property-based: random arrivals (random priorities), aborts and forced preemptions on a small
cache, under both policies and both step modes. After every step the KV integrity invariant
holds; at the end no block leaks, and every request that was not aborted produced exactly its
solo answer, bit for bit."""
from __future__ import annotations

import pytest
from core_helpers import bits, make_llm, workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROMPTS, PARAMS = workload(10, seed=11, shared_prefix="common head ")

events = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 29)),  # workload index + 10 * priority
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("preempt"), st.integers(0, 30)),
    ),
    min_size=1, max_size=25)


@pytest.fixture(scope="module")
def solo(solo_results):
    return solo_results(PROMPTS, PARAMS)


@pytest.mark.parametrize("overlap", [False, True])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=events, budget=st.sampled_from([3, 8, 32]), num_blocks=st.sampled_from([12, 20, 64]),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_traffic(solo, overlap, events, budget, num_blocks, policy):
    llm = make_llm(num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=4, overlap=overlap,
                   policy=policy)
    eng = llm.engine
    live = []  # (request, workload index)
    aborted = set()

    def step():
        eng.step()
        eng.scheduler.check()

    for kind, arg in events:
        if kind == "add":
            i = arg % 10
            live.append((eng.add_request(PROMPTS[i], PARAMS[i], priority=arg // 10), i))
        elif kind == "step":
            for _ in range(arg):
                step()
        elif kind == "abort" and live:
            req = live[arg % len(live)][0]
            if not req.finished:
                eng.abort(req.request_id)
                aborted.add(req.request_id)
        elif kind == "preempt" and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.running[arg % len(eng.scheduler.running)].request_id)
    while eng.has_unfinished():
        step()
    assert all(u["used"] == 0 for u in eng.kv.usage().values()), "blocks leaked"
    for req, i in live:
        if req.request_id not in aborted:
            assert bits(eng.output(req)) == solo[i], f"request {i} diverged"
        else:
            assert req.finish_reason in ("abort", "length", "stop")
