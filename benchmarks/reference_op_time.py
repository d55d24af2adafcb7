"""Where a decode step of the reference platform spends its CPU time, per HAL op.

Wraps every op of the reference op table and the runner's step with process-CPU-time counters,
runs SmolLM2 greedy on the batch of benchmarks/cpu_vs_transformers.py (16 fixed 32-token prompts,
--steps new tokens each) and prints, over the decode steps only (every chunk one token; the
prefill is left out), the time per op: process CPU time at one thread (the default), wall time
with --threads above 1 (CPU time would add the threads up). "other" is the runner's time outside
the ops (batch building, the sampler's glue).

    python benchmarks/reference_op_time.py [--steps 16] [--batch 16] [--threads 1] [--prefill]

--prefill times the batch's prefill step instead (16 x 32 prompt tokens in one step).
"""
from __future__ import annotations

import argparse
import collections
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill", action="store_true", help="time the prefill step, not the decode steps")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.threads == 1 else time.perf_counter
    from shuili.platforms.reference import ops as table

    spent: dict[str, float] = collections.defaultdict(float)
    decode = [False]

    def timed(name, fn):
        def run(*args, **kw):
            c = clock()
            try:
                return fn(*args, **kw)
            finally:
                if decode[0]:
                    spent[name] += clock() - c
        return run

    for name in list(table.OPS):
        table.OPS[name] = timed(name, table.OPS[name])
    from shuili import LLM, SamplingParams
    from shuili.core.runner import ModelRunner

    from cpu_vs_transformers import prompts

    execute = ModelRunner.execute

    def step(self, out, prev=None):
        decode[0] = all(c.end - c.start == 1 for c in out.chunks) != a.prefill
        c = clock()
        try:
            return execute(self, out, prev)
        finally:
            if decode[0]:
                spent["step"] += clock() - c
                spent["steps"] += 1
            decode[0] = False

    ModelRunner.execute = step
    ps = prompts(a.batch, 32)
    llm = LLM(model="smollm2-135m", platform="reference", max_num_seqs=a.batch)
    llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    spent.clear()
    llm.generate(ps, SamplingParams(temperature=0, max_tokens=a.steps + 1, ignore_eos=True))
    n, total = int(spent.pop("steps")), spent.pop("step")
    what = "1 thread" if a.threads == 1 else f"{a.threads} threads, wall time"
    kind = "prefill" if a.prefill else "decode"
    print(f"{n} {kind} steps of {a.batch} sequences, {what}, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}: {total:.2f} s, {total / n * 1e3:.0f} ms per step")
    for k in sorted(spent, key=lambda k: -spent[k]):
        if spent[k] * 1e3 / n >= 0.5:
            print(f"  {k:16s} {spent[k] / n * 1e3:7.1f} ms per step  {100 * spent[k] / total:5.1f}%")
    other = total - sum(spent.values())
    print(f"  {'other':16s} {other / n * 1e3:7.1f} ms per step  {100 * other / total:5.1f}%")

if __name__ == "__main__":
    main()
