"""Speculative decoding: acceptance, tokens per step and wall speedup against the same workload
without speculation, in the same process, plus a bit-for-bit check of the outputs (token ids and
float32 logprobs must be identical: shuili verifies drafts by exact match, core/spec/verify.py).

    # CPU (reference platform): SmolLM2-135M + ngram on a repeat / edit-a-paragraph workload
    python benchmarks/spec_decode.py
    # H200 (nvidia platform, batch-invariant mode, decode graphs): mid-v4, mtp and ngram
    python benchmarks/spec_decode.py --device cuda --model mid-v4 --json spec_h200.json
    # the cuda mode's code path on the CPU with tiny-v4 (a smoke run of the same code)
    python benchmarks/spec_decode.py --device cpu --model tiny-v4 --max-tokens 12 --num-prompts 3
    # DeepSeek-V4.1's DSpark draft layers (random weights) on the CPU
    python benchmarks/spec_decode.py --model tiny-v41 --max-tokens 16 --num-prompts 4

Tokens per step = generated tokens / the steps that sampled for the request (1.0 without
speculation). On a shared CPU host the process CPU time ratio is the steadier speedup figure.
Random-weight V4 / V4.1 models accept few model drafts: their MTP block / DSpark layers were never
trained (sampled drafts still match sometimes: they share the target's counter-based noise).
"""
from __future__ import annotations

import argparse
import gc
import json
import platform as host
import struct
import time

import torch

from shuili import LLM, SamplingParams
from shuili.core.config import EngineConfig
from shuili.hal import PlatformConfig

PARAGRAPHS = [
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "Farmers moved their animals to the high ground near the old mill, where the road still held.",
    "A cache stores recent results so that repeated work is skipped. When the cache is full, the "
    "least recently used entry is removed to make room for a new one.",
    "She opened the window, listened to the rain on the roof, and decided that the letter could "
    "wait until tomorrow. The lamp on the desk flickered twice and went out.",
    "To bake the bread, mix the flour, water, salt and yeast, let the dough rise for two hours, "
    "shape it into a loaf, and bake it in a hot oven for forty minutes.",
]
TASKS = ["Repeat the following paragraph exactly, word for word:\n\n{p}",
         "Rewrite the following paragraph, changing only its first sentence:\n\n{p}"]


def workload(n: int, max_tokens: int, temperature: float, seed: int):
    prompts, params = [], []
    for i in range(n):
        prompts.append(TASKS[i % 2].format(p=PARAGRAPHS[i % len(PARAGRAPHS)]))
        params.append(SamplingParams(temperature=temperature, seed=seed + i, max_tokens=max_tokens,
                                     ignore_eos=True))
    return prompts, params


def bits(outs):
    return [(tuple(o.token_ids), tuple(struct.pack("<f", x) for x in o.logprobs)) for o in outs]


def engine_config(args, spec: dict | None) -> EngineConfig:
    plat = PlatformConfig(platform="nvidia" if args.device == "cuda" else "reference",
                          batch_invariant=args.device == "cuda" and not args.no_batch_invariant)
    return EngineConfig(model=args.model, platform=plat, dtype=args.dtype, max_num_seqs=max(args.num_prompts, 1),
                        max_num_batched_tokens=args.budget, max_model_len=args.max_model_len,
                        tokens_per_block=args.tokens_per_block, kv_cache_bytes=args.kv_gib << 30,
                        enforce_eager=args.enforce_eager, speculative=spec)


def make_llm(args, spec: dict | None, shared: dict) -> LLM:
    conf = engine_config(args, spec)
    if not args.model.endswith("-v4"):
        return LLM(config=conf)
    # one set of random weights for every run (drawn once; with mtp.*), MTP cache only for mtp
    from shuili.core.models.deepseek_v4 import DeepseekV4Model
    from shuili.core.models.deepseek_v4_config import named
    from shuili.core.models.deepseek_v4_loader import random_params

    cfg = named(args.model)
    if "params" not in shared:
        shared["params"] = random_params(cfg, device=args.device, dtype=args.dtype, seed=0)
    mtp = spec is not None and spec["method"] == "mtp"

    def factory(ops, device, dtype, seed):
        return DeepseekV4Model(cfg, ops, shared["params"], device=device, dtype=dtype,
                               max_model_len=args.max_model_len, with_mtp=mtp)

    factory.name = args.model
    return LLM(model=factory, config=conf)


def sync(args):
    if args.device == "cuda":
        torch.cuda.synchronize()


def timed(args, spec, shared, prompts, params, chat: bool) -> dict:
    llm = make_llm(args, spec, shared)
    eng = llm.engine
    llm.generate(prompts[:2], [p.model_copy(update={"max_tokens": 4}) for p in params[:2]],
                 apply_chat_template=chat)  # warm-up: graph capture, allocator, caches
    eng.kv.reset_prefix_cache()
    steps0 = eng.num_steps
    sync(args)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, apply_chat_template=chat)
    sync(args)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n_out = sum(len(o.token_ids) for o in outs)
    prop = sum(o.metrics["draft_tokens_proposed"] for o in outs)
    acc = sum(o.metrics["draft_tokens_accepted"] for o in outs)
    samp = sum(o.metrics["sample_steps"] for o in outs)
    graphs = eng.runner.graphs
    res = {"wall_s": wall, "cpu_s": cpu, "output_tokens": n_out, "output_tokens_per_s": n_out / wall,
           "engine_steps": eng.num_steps - steps0, "draft_tokens_proposed": prop, "draft_tokens_accepted": acc,
           "acceptance_rate": acc / prop if prop else 0.0, "tokens_per_step": n_out / samp if samp else 0.0,
           "graph_replays": sum(g.replays for g in graphs.graphs.values()) if graphs else 0,
           "_bits": bits(outs)}
    del llm, eng
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--methods", default=None, help="comma list; mtp:C / dspark:C set min_confidence (mtp:0 "
                    "drafts whatever the confidence), ngram:N sets prompt_lookup_min; default: ngram, "
                    "ngram,mtp,mtp:0 for V4 models, ngram,dspark,dspark:0 for V4.1 models")
    ap.add_argument("--num-speculative-tokens", type=int, default=8, help="per step, over all requests")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--tokens-per-block", type=int, default=None, help="default: 16 (128 for V4 models)")
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true", help="no decode graphs (cuda)")
    ap.add_argument("--no-batch-invariant", action="store_true", help="cuda: the default (fast) kernel mode")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    v4 = args.model.endswith("-v4")
    v41 = args.model.endswith("-v41")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.tokens_per_block is None and v4:
        from shuili.core.models.deepseek_v4_config import named

        args.tokens_per_block = max(16, named(args.model).hca_ratio)
    args.tokens_per_block = args.tokens_per_block or 16
    methods = (args.methods or ("ngram,mtp,mtp:0" if v4 else "ngram,dspark,dspark:0" if v41 else "ngram")).split(",")
    chat = not (v4 or v41)  # SmolLM2-Instruct answers through its chat template
    shared: dict = {}
    rows = []
    for temp in (float(t) for t in args.temperatures.split(",")):
        prompts, params = workload(args.num_prompts, args.max_tokens, temp, args.seed)
        base = timed(args, None, shared, prompts, params, chat)
        for method in methods:
            name, _, conf = method.partition(":")
            spec = {"method": name, "num_speculative_tokens": args.num_speculative_tokens}
            if conf and name == "ngram":
                spec.update(prompt_lookup_min=int(conf), prompt_lookup_max=max(int(conf), 4))
            elif conf:
                spec["min_confidence"] = float(conf)
            got = timed(args, spec, shared, prompts, params, chat)
            row = {"method": method, "temperature": temp, "identical": got["_bits"] == base["_bits"],
                   "speedup": base["wall_s"] / got["wall_s"], "baseline_wall_s": base["wall_s"],
                   "cpu_speedup": base["cpu_s"] / got["cpu_s"], "baseline_cpu_s": base["cpu_s"],
                   "baseline_tokens_per_s": base["output_tokens_per_s"],
                   "baseline_graph_replays": base["graph_replays"],
                   **{k: v for k, v in got.items() if not k.startswith("_")}}
            rows.append(row)
            print(f"{method:>6} T={temp:<4} identical={row['identical']} acceptance={row['acceptance_rate']:.3f} "
                  f"tokens/step={row['tokens_per_step']:.2f} wall {base['wall_s']:.2f}s -> {got['wall_s']:.2f}s "
                  f"speedup={row['speedup']:.2f}x (process CPU time {row['cpu_speedup']:.2f}x) tok/s {base['output_tokens_per_s']:.1f} -> "
                  f"{got['output_tokens_per_s']:.1f} graph replays {base['graph_replays']} -> {got['graph_replays']}",
                  flush=True)
    meta = {"model": args.model, "device": args.device, "dtype": args.dtype, "torch": torch.__version__,
            "host": host.processor() or host.machine(), "threads": args.threads,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
            "num_speculative_tokens": args.num_speculative_tokens, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if not all(r["identical"] for r in rows):
        raise SystemExit("speculation changed an output bit: " +
                         ", ".join(f"{r['method']} T={r['temperature']}" for r in rows if not r["identical"]))


if __name__ == "__main__":
    main()
