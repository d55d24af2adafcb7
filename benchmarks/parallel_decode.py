"""Decode tokens/s: the plain engine vs the parallel (sharded) code path at TP = 1, one process.

The parallel path at world size 1 runs `ParallelV4Model` (vocab/head gathers, all_reduce and
all_to_all are one-rank no-ops) and `ParallelEngine` (host arrays -> device_step, no graphs).
This measures what that path costs a single device. Modes:
  plain        Engine, decode graphs where the platform captures them
  plain-eager  Engine with enforce_eager (the fair comparison: the parallel path is eager)
  tp1          ParallelEngine, experts TP-split (= whole at TP 1)
  tp1-ep       ParallelEngine, experts through the EP dispatch/combine (all_to_all on one rank)

    PYTHONPATH=. python benchmarks/parallel_decode.py --platform reference --model tiny-v4
    PYTHONPATH=. python benchmarks/parallel_decode.py --platform nvidia --model mid-v4 --batch 32 --output-len 64
Each mode runs in this process one after the other (warm-up request first); decode tok/s counts
the tokens after each request's first, over the wall time of the steps that made them.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from shuili.core.config import EngineConfig
from shuili.core.sampling_params import SamplingParams

MODES = ("plain", "plain-eager", "tp1", "tp1-ep")


def _engine(mode: str, base: dict):
    if mode.startswith("plain"):
        from shuili.core.engine import Engine

        return Engine(EngineConfig(**base, enforce_eager=mode == "plain-eager"))
    from shuili.core.parallel.engine import ParallelEngine

    return ParallelEngine(EngineConfig(**base, enable_expert_parallel=mode == "tp1-ep"))


def measure(mode: str, base: dict, batch: int, input_len: int, output_len: int) -> dict:
    eng = _engine(mode, base)
    g = torch.Generator().manual_seed(0)
    V = eng.model.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    eng.add_request(torch.randint(0, V, (input_len,), generator=g).tolist(), SamplingParams(max_tokens=2))
    while eng.has_unfinished():  # warm-up
        eng.step_requests()
    reqs = [eng.add_request(torch.randint(0, V, (input_len,), generator=g).tolist(), params) for _ in range(batch)]
    decode_s, decode_tokens = 0.0, 0
    while eng.has_unfinished():
        prefilling = any(not r.output_token_ids for r in reqs)
        before = sum(len(r.output_token_ids) for r in reqs)
        t0 = time.perf_counter()
        eng.step_requests()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if not prefilling:
            decode_s += dt
            decode_tokens += sum(len(r.output_token_ids) for r in reqs) - before
    out = {"mode": mode, "decode_tokens": decode_tokens, "decode_s": round(decode_s, 4),
           "decode_tok_s": round(decode_tokens / decode_s, 2) if decode_s else None,
           "tokens": [list(r.output_token_ids) for r in reqs[:2]]}
    if hasattr(eng, "close"):
        eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", default="reference")
    ap.add_argument("--model", default="tiny-v4")
    ap.add_argument("--dtype", default=None, help="unset: float32 on reference, bfloat16 otherwise")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = a.dtype or ("float32" if a.platform == "reference" else "bfloat16")
    base = dict(model=a.model, platform=a.platform, dtype=dtype, max_num_seqs=max(a.batch, 1),
                num_blocks=max(a.batch, 1) * (-(-(a.input_len + a.output_len) // 16) + 1) + 4,
                enable_prefix_caching=False)
    rows = [measure(m, base, a.batch, a.input_len, a.output_len) for m in a.modes]
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    if a.json:
        print(json.dumps({"rows": rows, "same_tokens": same}, indent=1))
        return
    for r in rows:
        print(f"{r['mode']:<12} decode {r['decode_tok_s']} tok/s ({r['decode_tokens']} tokens in {r['decode_s']} s)")
    print("same greedy tokens in every mode:", same)


if __name__ == "__main__":
    main()
