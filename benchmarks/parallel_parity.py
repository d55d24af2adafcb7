"""Parallel configurations against one process: greedy tokens and the largest logprob difference.

    PYTHONPATH=. python benchmarks/parallel_parity.py                       # tiny-v4, every config
    PYTHONPATH=. python benchmarks/parallel_parity.py --configs tp2 tp2-dp2-ep4
    PYTHONPATH=. python benchmarks/parallel_parity.py --model tiny-v41      # DeepSeek-V4.1
Also times how long a SIGKILLed worker takes to fail the engine (--failfast): from the kill to
WorkerDied, with the liveness check and with only the collective noticing.
"""
from __future__ import annotations

import argparse
import os
import signal
import time

import torch

from shuili.core.config import EngineConfig
from shuili.core.engine import Engine
from shuili.core.parallel.engine import ParallelEngine
from shuili.core.parallel.world import WorkerDied
from shuili.core.sampling_params import SamplingParams

CONFIGS = {"tp2": dict(tensor_parallel_size=2), "dp2": dict(data_parallel_size=2),
           "tp2-ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
           "dp2-ep2": dict(data_parallel_size=2, enable_expert_parallel=True),
           "tp2-dp2-ep4": dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)}


def _run(eng, prompts, params):
    reqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step_requests()
    return [(list(r.output_token_ids), torch.tensor(r.logprobs)) for r in reqs]


def failfast(base: dict, collective_only: bool) -> float:
    eng = ParallelEngine(EngineConfig(**base, tensor_parallel_size=2, distributed_timeout_s=600))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    _run(eng, [[1, 2, 3]], params)
    if collective_only:
        eng.world.check_alive = lambda: None
    eng.add_request([4, 5, 6], params)
    t0 = time.perf_counter()
    os.kill(eng.world.procs[0].pid, signal.SIGKILL)
    try:
        while eng.has_unfinished():
            eng.step_requests()
    except WorkerDied as exc:
        dt = time.perf_counter() - t0
        print(f"  WorkerDied after {dt:.2f} s: {str(exc)[:160]}")
    eng.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-v4")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--failfast", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = dict(model=a.model, platform="reference", num_blocks=48, max_num_seqs=4, enable_prefix_caching=False)
    prompts = [list(range(5, 22)), [100, 200, 300], [42] * 9, [7, 700, 70, 7]]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    single = Engine(EngineConfig(**base))
    prompts = [[t % single.model.vocab_size for t in p] for p in prompts]  # tiny-v41 has 256 ids
    one = _run(single, prompts, params)
    for name in a.configs:
        eng = ParallelEngine(EngineConfig(**base, **CONFIGS[name]))
        got = _run(eng, prompts, params)
        eng.close()
        same = all(t == t1 for (t, _), (t1, _) in zip(got, one))
        diff = max(float((lp - lp1).abs().max()) for (_, lp), (_, lp1) in zip(got, one))
        print(f"{name:<12} greedy tokens equal: {same}  max |logprob - one process| = {diff:.3g}")
    if a.failfast:
        print("kill -> WorkerDied, liveness check:")
        failfast(base, False)
        print("kill -> WorkerDied, collective only:")
        failfast(base, True)


if __name__ == "__main__":
    main()
