"""A parallel engine whose worker dies fails fast with a clear error (WorkerDied), never hangs."""
from __future__ import annotations

import os
import signal

import pytest

from shuili.core.config import EngineConfig
from shuili.core.parallel.engine import ParallelEngine
from shuili.core.parallel.world import WorkerDied
from shuili.core.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [100, 200, 300]]
BASE = dict(model="tiny-v4", platform="reference", num_blocks=16, max_num_seqs=4, enable_prefix_caching=False)


def _run(eng, prompts):
    for p in prompts:
        eng.add_request(p, PARAMS)
    while eng.has_unfinished():
        eng.step_requests()


def test_killed_worker_fails_the_engine_with_a_clear_error():
    eng = ParallelEngine(EngineConfig(**BASE, tensor_parallel_size=2, distributed_timeout_s=300))
    try:
        _run(eng, [PROMPTS[1]])
        worker = eng.world.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=60)
        eng.add_request(PROMPTS[0], PARAMS)
        with pytest.raises(WorkerDied, match=r"rank 1 .*exit code -9.*died"):
            while eng.has_unfinished():
                eng.step_requests()
        with pytest.raises(WorkerDied):  # the engine stays failed
            eng.step_requests()
    finally:
        eng.close()


def test_worker_dying_mid_collective_is_reported():
    """The worker dies while rank 0 is inside a collective (no liveness check in between)."""
    eng = ParallelEngine(EngineConfig(**BASE, data_parallel_size=2, enable_expert_parallel=True,
                                      distributed_timeout_s=300))
    try:
        eng.world.check_alive = lambda: None  # only the collective can notice now
        os.kill(eng.world.procs[0].pid, signal.SIGKILL)
        eng.add_request(PROMPTS[0], PARAMS)
        with pytest.raises(WorkerDied, match="collective failed"):
            eng.step_requests()
    finally:
        eng.close()
