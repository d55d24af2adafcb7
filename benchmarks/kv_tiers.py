"""TTFT of a long shared prefix: cold vs device hit vs host hit vs disk hit in a fresh process.

One prompt (a --prefix-len token prefix plus a short suffix) is answered four times, same run:
  cold     a fresh engine computes everything (its blocks are written through to the store)
  device   again on that engine: the prefix cache on the device
  host     after `evict_device_cache` moved every cached device block to the host pool
  disk     a NEW process (this script with --child) on the same store directory, host tier off
Each phase reports TTFT (arrival to first token; engine construction excluded), the KV bytes it
moved between tiers, and whether its tokens and logprob bits equal the cold answer. A warm-up
request with other tokens runs first in each process (of the same length on cuda, where kernels
compile per shape, so compilation stays out of the numbers; short on the CPU, which compiles
nothing).

    python benchmarks/kv_tiers.py --model smollm2-135m --prefix-len 2048 --threads 1     # CPU
    python benchmarks/kv_tiers.py --device cuda --model mid-v4 --batch-invariant          # H200
    python benchmarks/kv_tiers.py --model tiny-v4 --prefix-len 256                        # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_kwargs(args) -> dict:
    from shuili.hal import PlatformConfig

    P = args.tokens_per_block or block_size(args.model)
    total = args.prefix_len + args.suffix_len + args.output_len
    max_len = -(-(total + 1) // P) * P
    return dict(model=args.model, platform=PlatformConfig(platform=args.platform, batch_invariant=args.batch_invariant),
                dtype=args.dtype, tokens_per_block=P, max_model_len=max_len, max_num_seqs=2,
                num_blocks=2 * (max_len // P) + 4, max_num_batched_tokens=args.budget)


def block_size(model: str) -> int:
    from shuili.core.models import V4_NAMES

    if model in V4_NAMES:
        from shuili.core.models.deepseek_v4_config import named

        cfg = named(model)
        return max(16, cfg.csa_ratio, cfg.hca_ratio)
    return 16


def prompt(vocab: int, n: int, salt: int) -> list[int]:
    # fixed token ids in the ordinary vocabulary; `salt` makes the warm-up prompt differ everywhere
    return [100 + (j * 131 + salt * 977) % min(vocab - 100, 20000) for j in range(n)]


def answer(llm, ids: list[int], output_len: int) -> tuple[float, list]:
    from shuili import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0, logprobs=1, ignore_eos=True)
    out = llm.generate([ids], sp)[0]
    m = out.metrics
    llm.engine.scheduler.check()
    return m["first_token"] - m["arrival"], [list(out.token_ids), [struct.pack("<f", x).hex() for x in out.logprobs]]


def moved(before: dict, after: dict) -> dict:
    keys = ("kv_bytes_device_to_host", "kv_bytes_host_to_device", "kv_bytes_disk_to_device",
            "kv_bytes_device_to_disk", "kv_store_bytes_read", "kv_store_bytes_written")
    return {k.removeprefix("kv_"): after.get(k, 0) - before.get(k, 0) for k in keys}


def hits(before: dict, after: dict) -> dict:
    return {t: after[f"kv_hit_tokens_{t}"] - before[f"kv_hit_tokens_{t}"] for t in ("device", "host", "disk")}


def build(args, **tiers):
    import torch

    from shuili import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args), **tiers)
    return llm, time.perf_counter() - t0


def phase(llm, ids, args, name: str) -> dict:
    t = llm.engine.kv_tiers
    t.flush()
    s0 = t.stats()
    c0 = time.process_time()
    ttft, bits = answer(llm, ids, args.output_len)
    cpu = time.process_time() - c0  # the whole request, all threads: steadier than wall time on a busy host
    t.flush()
    s1 = t.stats()
    return {"phase": name, "ttft_s": ttft, "cpu_s": cpu, "hit_tokens": hits(s0, s1), "bytes": moved(s0, s1),
            "bits": bits}


def child(args) -> dict:
    llm, load_s = build(args, kv_store=args.child)
    vocab = llm.engine.model.vocab_size
    n = args.prefix_len + args.suffix_len
    answer(llm, prompt(vocab, args.warmup_len or n, salt=7), 1)  # warm-up: other tokens
    out = phase(llm, prompt(vocab, n, salt=0), args, "disk (new process)")
    out["load_s"] = load_s
    return out


def main(args) -> dict:
    store = args.store or tempfile.mkdtemp(prefix="shuili-kv-bench-")
    if os.path.isdir(store) and os.listdir(store):
        raise SystemExit(f"--store {store} is not empty: the cold phase would find blocks there; give an "
                         "empty or new directory")
    llm, load_s = build(args, kv_host_bytes=args.host_bytes, kv_store=store)
    eng = llm.engine
    vocab = eng.model.vocab_size
    n = args.prefix_len + args.suffix_len
    ids = prompt(vocab, n, salt=0)
    answer(llm, prompt(vocab, args.warmup_len or n, salt=7), 1)  # warm-up: other tokens
    eng.kv_tiers.evict_device_cache(eng.kv, keep=False)  # the warm-up's blocks: not this benchmark's
    rows = [phase(llm, ids, args, "cold")]
    rows.append(phase(llm, ids, args, "device hit"))
    t0 = time.perf_counter()
    s0 = eng.kv_tiers.stats()
    eng.kv_tiers.evict_device_cache(eng.kv)
    offload = {"s": time.perf_counter() - t0, "bytes": moved(s0, eng.kv_tiers.stats())["bytes_device_to_host"]}
    rows.append(phase(llm, ids, args, "host hit"))
    eng.kv_tiers.flush()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", store] + args.passthrough
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"the fresh process failed:\n{r.stderr[-4000:]}")
    rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    cold_bits = rows[0]["bits"]
    for row in rows:
        row["bit_identical_to_cold"] = row.pop("bits") == cold_bits
    if not args.store:
        shutil.rmtree(store, ignore_errors=True)
    return {"model": args.model, "platform": eng.platform.name, "device": eng.device, "dtype": args.dtype,
            "batch_invariant": args.batch_invariant, "prefix_len": args.prefix_len,
            "prompt_len": n, "tokens_per_block": eng.kv.P, "load_s": load_s, "offload_to_host": offload,
            "phases": rows, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "torch": __import__("torch").__version__}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: the reference platform; cuda: the nvidia platform")
    ap.add_argument("--platform", default=None, help="override the platform the device picks")
    ap.add_argument("--dtype", default=None, help="unset: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--batch-invariant", action="store_true", help="the platform's batch-invariant mode")
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--tokens-per-block", type=int, default=None, help="unset: 16, or the V4 model's largest ratio")
    ap.add_argument("--warmup-len", type=int, default=None,
                    help="tokens of the warm-up prompt (unset: the benchmark prompt's length on cuda, where "
                         "kernels compile per shape; 32 on cpu)")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--host-bytes", default="16G")
    ap.add_argument("--store", default=None, help="store directory (unset: a temporary one, removed after)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.platform = args.platform or ("nvidia" if args.device == "cuda" else "reference")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.warmup_len is None and args.device == "cpu":
        args.warmup_len = 32
    argv = list(sys.argv[1:] if argv is None else argv)
    args.passthrough = [a for a in argv if a != "--json"]
    return args


def report(res: dict) -> None:
    print(f"{res['model']} on {res['platform']} ({res['device']}, {res['dtype']}), prompt {res['prompt_len']} "
          f"tokens, P={res['tokens_per_block']}, {res['date_utc']} UTC, torch {res['torch']}")
    print(f"{'phase':<20} {'TTFT s':>9} {'CPU s':>8} {'hit tokens (dev/host/disk)':>28} {'bytes in':>12} {'bits = cold':>12}")
    for r in res["phases"]:
        h, b = r["hit_tokens"], r["bytes"]
        into = b["bytes_host_to_device"] + b["bytes_disk_to_device"]
        print(f"{r['phase']:<20} {r['ttft_s']:>9.3f} {r.get('cpu_s', float('nan')):>8.2f} {h['device']:>10}/{h['host']}/{h['disk']:<10} "
              f"{into:>12} {str(r['bit_identical_to_cold']):>12}")
    o = res["offload_to_host"]
    cold = res["phases"][0]["bytes"]
    print(f"offload of the cached device blocks to host: {o['bytes']} bytes in {o['s']:.3f} s; "
          f"cold write-through to the store: {cold['store_bytes_written']} bytes")


if __name__ == "__main__":
    a = parse()
    if a.child:
        print(json.dumps(child(a)))
    else:
        res = main(a)
        print(json.dumps(res)) if a.json else report(res)
