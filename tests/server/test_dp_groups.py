"""The server's admission, abort and state read every data-parallel group's scheduler, not only
the first (core/parallel/engine.py runs one scheduler per DP group). A second group is made here
in one process, the way ParallelEngine holds them, so no worker processes are needed."""
from __future__ import annotations

from shuili.core.api import LLM
from shuili.core.kv_cache import KVCacheManager
from shuili.core.sampling_params import SamplingParams
from shuili.core.scheduler import Scheduler
from shuili.core.server.app import Server


def test_waiting_abort_and_state_cover_every_dp_group():
    eng = LLM("tiny-v4", platform="reference", max_num_seqs=1, num_blocks=64).engine
    kv2 = KVCacheManager(eng.kv.groups, eng.pool_blocks, eng.P, True)
    second = Scheduler(kv2, 1, eng.config.max_num_batched_tokens, eng.max_model_len, eng.config.policy,
                       eng.eos, eng.tokenizer.decode)
    eng.schedulers = [eng.scheduler, second]
    srv = Server(eng, "tiny-v4")
    p = SamplingParams(max_tokens=2)
    first = eng.add_request("abc", p)
    eng.scheduler = second  # as ParallelEngine.add_request places a request on the emptier group
    other = eng.add_request("def", p)
    eng.scheduler = eng.schedulers[0]
    assert srv.loop.num_waiting() == 2  # nothing scheduled yet: one waiting in each group
    # one free running slot per group: two arrivals wait for nothing beyond the two queued
    assert srv.loop.would_wait(2) == 2
    state = srv.state(integrity=True)
    assert state["waiting"] == 2 and state["integrity"] == "ok"
    assert all(v["total"] == 2 * eng.kv.pools[g].num_blocks for g, v in state["kv"].items())
    srv.loop._abort(other.request_id)  # found in the second group's scheduler
    assert other.finished and not first.finished and srv.loop.num_waiting() == 1
