"""CPU time of shuili's reference platform on SmolLM2 greedy generation (a busy host's benchmark).

Wall time says little on a machine shared with other jobs; CPU time of this process (time.process_time,
user + system, all threads) says more, so before/after comparisons of the reference platform's ops
are taken here, one thread by default, the same batch as benchmarks/cpu_vs_transformers.py (16 fixed
32-token prompts, greedy, every request generating exactly --output-len tokens). Prints load and
generation CPU and wall seconds, tokens per CPU second, and digests of the token ids and of the
sampled tokens' float32 logprob bits, so that runs of two versions can be checked to agree bit for bit.
Run it against another commit with PYTHONPATH pointing at a worktree of it.

    python benchmarks/reference_cpu_time.py [--batch 16] [--input-len 32] [--output-len 64]
        [--threads 1] [--json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import struct
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from shuili import LLM, SamplingParams

    from cpu_vs_transformers import prompts

    ps = prompts(a.batch, a.input_len)
    c0, w0 = time.process_time(), time.perf_counter()
    llm = LLM(model="smollm2-135m", platform="reference", max_num_seqs=a.batch)
    load = (time.process_time() - c0, time.perf_counter() - w0)
    llm.generate([ps[0]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    c0, w0 = time.process_time(), time.perf_counter()
    outs = llm.generate(ps, sp)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    comps = [o.outputs[0] if hasattr(o, "outputs") else o for o in outs]  # older commits: no .outputs
    ids = [list(c.token_ids) for c in comps]
    n = sum(len(t) for t in ids)
    res = {"batch": a.batch, "input_len": a.input_len, "output_len": a.output_len, "threads": a.threads,
           "torch": torch.__version__, "load_cpu_s": load[0], "load_wall_s": load[1], "gen_cpu_s": cpu,
           "gen_wall_s": wall, "tokens": n, "tok_per_cpu_s": n / cpu,
           "ids_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}
    d = hashlib.sha256()
    for c in comps:
        d.update(struct.pack(f"<{len(c.logprobs)}f", *c.logprobs))
    res["logprobs_sha256"] = d.hexdigest()[:16]
    if a.json:
        print(json.dumps(res))
        return
    print(f"batch {a.batch} x {a.output_len} new tokens, {a.threads} thread(s), torch {torch.__version__}")
    print(f"load {load[0]:.2f} s CPU ({load[1]:.2f} s wall); generate {cpu:.2f} s CPU ({wall:.2f} s wall), "
          f"{n / cpu:.1f} tokens per CPU second; ids {res['ids_sha256']}, logprobs {res['logprobs_sha256']}")


if __name__ == "__main__":
    main()
