"""Where `LLM.generate` spends its time on the reference platform, for cpu_vs_transformers.py's run
(batch 16, 32-token prompts, greedy), by cProfile's cumulative time per function; or, with
--attention, the compiled paged attention alone (decode, 16 sequences at 128 tokens, one layer).

    python benchmarks/reference_generate_profile.py [--threads 2] [--output-len 128] [--rows 30]
    python benchmarks/reference_generate_profile.py --attention [--threads 1] [--calls 400]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def profile_generate(output_len: int, rows: int) -> None:
    from cpu_vs_transformers import prompts

    from shuili import LLM, SamplingParams

    ps = prompts(16, 32)
    llm = LLM(model="smollm2-135m", platform="reference", max_num_seqs=16)
    llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    llm.generate(ps, sp)
    pr.disable()
    print(f"generate: 16 x {output_len} tokens in {time.perf_counter() - t0:.2f} s, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    pstats.Stats(pr).sort_stats("cumulative").print_stats(rows)


def time_attention(calls: int) -> None:
    from reference_attention_ab import case

    from shuili.platforms.reference import attention

    q, kc, vc, table, lens, qsl, scale, window = case(torch.Generator().manual_seed(0), 16, 1, 128)
    run = lambda: attention.paged_attention(q, kc, vc, table, lens, qsl, scale, window)  # noqa: E731
    run()
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    print(f"paged_attention, 16 sequences x 128 tokens, decode: {(time.perf_counter() - t0) / calls * 1e3:.3f} ms "
          f"per call, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--calls", type=int, default=400)
    a = ap.parse_args()
    torch.set_num_threads(a.threads or (1 if a.attention else 2))
    time_attention(a.calls) if a.attention else profile_generate(a.output_len, a.rows)
