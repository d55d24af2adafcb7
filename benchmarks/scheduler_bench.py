"""Scheduler micro-benchmark: µs per Scheduler.schedule() with N running decode requests.

Times are thread CPU time (time.thread_time), so a loaded machine inflates them less than wall
time; wall time is printed beside. No model: every sample resolves to a fixed token, through
Scheduler.update as the engine's would. Each request has a 32-token prompt and never finishes within the run, so
every step schedules N decode tokens (budget and max_num_seqs = N; blocks are plentiful).

    python benchmarks/scheduler_bench.py [--sizes 10 100 1000 10000] [--steps 50] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

from shuili.core.kv_cache import KVCacheManager
from shuili.core.model_api import CacheGroupSpec
from shuili.core.request import Request
from shuili.core.sampling_params import SamplingParams
from shuili.core.scheduler import Scheduler, SampleRow, StepOutput

P = 16
PROMPT = 32
GROUPS = [CacheGroupSpec(name="full", kind="full", layers=(0,), entry_shape=(1,)),
          CacheGroupSpec(name="swa", kind="sliding", layers=(1,), entry_shape=(1,), window=64)]


def fake_update(s: Scheduler, out) -> None:
    rows = [SampleRow(c.req, c.end, i, c.epoch) for i, c in enumerate(c for c in out.chunks if c.sample)]
    s.update(out, StepOutput(rows, [7] * len(rows), [0.0] * len(rows), [False] * len(rows)))


def bench(n: int, steps: int) -> dict:
    blocks = n * (-(-(PROMPT + steps + 8) // P)) + 8
    kv = KVCacheManager(GROUPS, blocks, P)
    s = Scheduler(kv, max_num_seqs=n, max_num_batched_tokens=n * PROMPT, max_model_len=4096)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i in range(n):
        s.add(Request(f"r{i}", [(i * 31 + j) % 1000 for j in range(PROMPT)], params, i, s.next_arrival()))
    fake_update(s, s.schedule())  # admission + prefill of every request (not timed)
    s.max_num_batched_tokens = n
    t_sched = t_wall = t_upd = 0.0
    for _ in range(steps):
        w0, t0 = time.perf_counter(), time.thread_time()
        out = s.schedule()
        t1, w1 = time.thread_time(), time.perf_counter()
        fake_update(s, out)
        t_upd += time.thread_time() - t1
        t_sched += t1 - t0
        t_wall += w1 - w0
        assert len(out.chunks) == n
    return {"running": n, "steps": steps, "schedule_us": 1e6 * t_sched / steps,
            "schedule_wall_us": 1e6 * t_wall / steps,
            "schedule_us_per_request": 1e6 * t_sched / steps / n, "update_us": 1e6 * t_upd / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 10000])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [bench(n, args.steps if n < 10000 else max(args.steps // 5, 5)) for n in args.sizes]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'running':>8} {'steps':>6} {'schedule CPU µs':>16} {'wall µs':>10} {'µs/request':>11} "
          f"{'update CPU µs':>14}")
    for r in rows:
        print(f"{r['running']:>8} {r['steps']:>6} {r['schedule_us']:>16.1f} {r['schedule_wall_us']:>10.1f} "
              f"{r['schedule_us_per_request']:>11.2f} {r['update_us']:>14.1f}")


if __name__ == "__main__":
    main()
