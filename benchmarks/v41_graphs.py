"""DeepSeek-V4.1 decode: device graphs (static decode, Engram through mapped table pages) against
eager steps, on the engine path (`run_bench`), with a bitwise check of the outputs.

    # H200 (the lead's run): batch-invariant mode, so graphs must give the eager bits
    PYTHONPATH=. python benchmarks/v41_graphs.py --model mid-v41 --platform nvidia --batch-invariant \\
        --batch 64 --input-len 128 --output-len 64 --json v41_graphs.json
    # CPU check of the script (no capture on the reference platform: replays re-run the function)
    PYTHONPATH=. python benchmarks/v41_graphs.py --model tiny-v41 --platform reference --batch 4 \\
        --input-len 20 --output-len 6 --replay-by-rerun

Decode tokens/s = B * (N - 1) / (wall(N) - wall(1)) per variant (eager, graphs; with --overlap also
both in overlap mode). Reports the graphs' buckets, replays, capture seconds (at engine start-up),
why they were turned off if they were, the Engram service's path counters, and whether every
variant's token ids and logprob bits equal the eager ones. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch


def engine(args, graphs: bool, overlap: bool):
    from shuili import LLM
    from shuili.core.graphs import DecodeGraphs

    from shuili.hal import PlatformConfig

    t = time.perf_counter()
    extra = {"dtype": args.dtype} if args.dtype else {}
    llm = LLM(model=args.model, platform=PlatformConfig(platform=args.platform, batch_invariant=args.batch_invariant),
              max_num_seqs=args.batch, max_num_batched_tokens=args.budget, max_model_len=args.max_len,
              enable_prefix_caching=False, enforce_eager=not graphs or args.replay_by_rerun, overlap=overlap,
              **extra)
    eng = llm.engine
    if graphs and args.replay_by_rerun:  # device-free stand-in: "replay" re-runs the recorded function
        eng.runner.graphs = DecodeGraphs(eng.model, lambda fn: fn, eng.runner.groups, eng.config.max_num_seqs,
                                         -(-eng.max_model_len // eng.kv.P), eng.kv.P, eng.device)
        eng.runner.graphs.capture_all()
    return llm, time.perf_counter() - t


def run(args, graphs: bool, overlap: bool) -> dict:
    from shuili.core.cli import run_bench

    llm, start_s = engine(args, graphs, overlap)
    run_bench(llm, args.batch, args.input_len, 2, 0.0, 1)  # warm-up (kernel compiles, allocator)
    one = run_bench(llm, args.batch, args.input_len, 1, 0.0, 0)
    full = run_bench(llm, args.batch, args.input_len, args.output_len, 0.0, 0)
    g = llm.engine.runner.graphs
    eng = getattr(llm.engine.model, "engram", None)
    return {
        "engine_start_s": start_s,
        "decode_tok_s": args.batch * (args.output_len - 1) / max(full["wall_s"] - one["wall_s"], 1e-9),
        "wall_full_s": full["wall_s"], "wall_one_s": one["wall_s"],
        "graphs": None if g is None else {"captured": len(g.graphs), "disabled": g.disabled,
                                          "replays": sum(x.replays for x in g.graphs.values())},
        "engram_stats": dict(eng.stats) if eng is not None else None,
        "_outputs": full["_outputs"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mid-v41")
    ap.add_argument("--platform", default="nvidia")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--overlap", action="store_true", help="also run both variants in overlap mode")
    ap.add_argument("--replay-by-rerun", action="store_true", help="device-free stand-in for a capture")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = [("eager", False, False), ("graphs", True, False)]
    if args.overlap:
        variants += [("eager_overlap", False, True), ("graphs_overlap", True, True)]
    res = {"config": vars(args), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    outs = {}
    for name, graphs, overlap in variants:
        r = run(args, graphs, overlap)
        outs[name] = r.pop("_outputs")
        res[name] = r
        print(name, {k: v for k, v in r.items() if k != "engram_stats"}, flush=True)
    res["bits_equal_to_eager"] = {n: outs[n] == outs["eager"] for n in outs if n != "eager"}
    failed = [n for n, same in res["bits_equal_to_eager"].items() if not same]
    for n in ("graphs", "graphs_overlap"):
        base = n.replace("graphs", "eager")
        if n in res and base in res:
            g = res[n]["graphs"]
            # a graphs variant that silently ran eagerly must not report a speedup (H200, 2026-12-03)
            res[f"{n}_engaged"] = bool(g) and g["disabled"] is None and g["replays"] > 0
            if res[f"{n}_engaged"]:
                res[f"{n}_decode_speedup"] = res[n]["decode_tok_s"] / res[base]["decode_tok_s"]
            else:
                failed.append(f"{n} (no graph replays: {g})")
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if failed:
        sys.exit(f"FAILED: {', '.join(failed)}")


if __name__ == "__main__":
    main()
