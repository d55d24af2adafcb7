"""End-to-end mid-v4 on the NVIDIA platform (the `shuili bench` code path, `run_bench`) against
transformers' DeepseekV4ForCausalLM.generate on the same weights and batch, greedy, EOS ignored.

Prefill throughput = B * input_len / wall(output_len=1); decode throughput =
B * (N - 1) / (wall(N) - wall(1)), the same formula for both frameworks. Run for the default and
the batch-invariant platform mode. Also reports the share of prompts whose first greedy token
agrees with transformers (a same-weights sanity check; bf16 near-ties can flip a few).

    python benchmarks/nvidia_e2e.py --json e2e.json [--batch 64 --input-len 128 --output-len 64]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from shuili.core.api import LLM
from shuili.core.cli import run_bench
from shuili.core.config import EngineConfig
from shuili.core.models.deepseek_v4 import DeepseekV4Model
from shuili.core.models.deepseek_v4_config import named
from shuili.core.models.deepseek_v4_loader import random_params, released_tensors, save_checkpoint
from shuili.core.sampling_params import SamplingParams
from shuili.hal import PlatformConfig


# name -> (batch_invariant, enforce_eager, overlap)
VARIANTS = {"default": (False, False, False), "bi": (True, False, False),
            "default_overlap": (False, False, True), "bi_overlap": (True, False, True),
            "default_eager": (False, True, False), "bi_eager": (True, True, False)}


def shuili_engine(cfg, params, variant: str, args):
    bi, eager, overlap = VARIANTS[variant]

    def factory(ops, device, dtype, seed):
        return DeepseekV4Model(cfg, ops, params, device=device, dtype=dtype, max_model_len=args.max_len)

    conf = EngineConfig(model=args.model, platform=PlatformConfig(platform=args.platform, batch_invariant=bi),
                        dtype=args.dtype, max_num_seqs=args.batch, max_num_batched_tokens=args.budget,
                        tokens_per_block=max(16, cfg.hca_ratio), kv_cache_bytes=args.kv_gib << 30, max_model_len=args.max_len,
                        enable_prefix_caching=False, enforce_eager=eager, overlap=overlap)
    return LLM(model=factory, config=conf)


def profile(llm, args):
    """Where a decode step's time goes: top device kernels, and device-busy vs wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    run_bench(llm, args.batch, 8, 2, 0.0, 2)
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t = time.perf_counter()
        r = run_bench(llm, args.batch, 8, 9, 0.0, 3)
        wall = time.perf_counter() - t
    ev = p.key_averages()
    busy = sum(e.self_device_time_total for e in ev) / 1e6
    print(f"profile: 8 decode steps + 1 prefill, wall {wall:.3f}s, device busy {busy:.3f}s, "
          f"launches {sum(e.count for e in ev if e.device_type.name == 'CUDA')}", flush=True)
    print(ev.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60), flush=True)
    del r


def shuili_runs(cfg, params, variant, args, prompts):
    llm = shuili_engine(cfg, params, variant, args)
    run_bench(llm, args.batch, args.input_len, 4, 0.0, 1)  # compiles prefill + decode kernels
    one = run_bench(llm, args.batch, args.input_len, 1, 0.0, 0)
    full = run_bench(llm, args.batch, args.input_len, args.output_len, 0.0, 0)
    if args.profile and variant in ("default", "bi", "default_overlap"):
        try:
            profile(llm, args)
        except Exception as exc:  # the profile is a diagnosis, never a reason to lose the numbers
            print(f"profile failed: {type(exc).__name__}: {exc}", flush=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    first = [o.token_ids[0] for o in outs]
    g = llm.engine.runner.graphs
    graphs = None if g is None else {"captured": [list(k) for k in g.graphs], "disabled": g.disabled,
                                     "replays": sum(x.replays for x in g.graphs.values())}
    del llm
    sync()
    return {"prefill_tok_s": args.batch * args.input_len / one["wall_s"],
            "decode_tok_s": args.batch * (args.output_len - 1) / (full["wall_s"] - one["wall_s"]),
            "bench_output_len_1": one, "bench_full": full, "graphs": graphs}, first


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_runs(cfg, params, args, prompts):
    import transformers

    path = tempfile.mkdtemp(prefix="midv4_")
    t0 = time.perf_counter()
    save_checkpoint(path, cfg, {k: v.cpu() for k, v in released_tensors(cfg, params).items()})
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype),
                                                             device_map=args.device).eval()
    load_s = time.perf_counter() - t0
    ids = torch.tensor(prompts, device=args.device)
    mask = torch.ones_like(ids)

    def gen(n):
        sync()
        t = time.perf_counter()
        # the port keeps mHC state in float32 and feeds it to bf16 linears: autocast casts at the linears
        with torch.no_grad(), torch.autocast(args.device, dtype=getattr(torch, args.dtype),
                                             enabled=args.dtype != "float32"):
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)
        sync()
        return time.perf_counter() - t, out

    gen(2)
    w1, out1 = gen(1)
    wn, _ = gen(args.hf_output_len)
    first = out1[:, ids.shape[1]].tolist()
    del hf
    sync()
    return {"prefill_tok_s": args.batch * args.input_len / w1,
            "decode_tok_s": args.batch * (args.hf_output_len - 1) / (wn - w1),
            "wall_output_len_1": w1, "wall_full": wn, "output_len": args.hf_output_len, "load_s": load_s}, first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-output-len", type=int, default=17)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--kv-gib", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--variants", default="default,bi,default_overlap,bi_overlap,default_eager",
                    help=f"comma-separated shuili configurations of {sorted(VARIANTS)}")
    ap.add_argument("--model", default="mid-v4")
    ap.add_argument("--platform", default="nvidia")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cfg = named(args.model)
    params = random_params(cfg, device=args.device, dtype=args.dtype, seed=0, with_mtp=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(args.input_len)] for _ in range(args.batch)]
    res = {"config": vars(args), "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    firsts = {}
    for v in args.variants.split(","):
        res[f"shuili_{v}"], firsts[v] = shuili_runs(cfg, params, v, args, prompts)
        r = res[f"shuili_{v}"]
        print(f"shuili {v}", {k: x for k, x in r.items() if "tok_s" in k}, "graphs", r["graphs"], flush=True)
    if not args.skip_hf:
        res["transformers"], first_h = hf_runs(cfg, params, args, prompts)
        for v, f in firsts.items():
            res[f"first_token_agreement_{v}_vs_hf"] = sum(a == b for a, b in zip(f, first_h)) / len(first_h)
    for base in ("", "_overlap", "_eager"):
        d, b = res.get(f"shuili_default{base}"), res.get(f"shuili_bi{base}")
        if d and b:
            res[f"bi{base}_decode_overhead_pct"] = 100 * (d["decode_tok_s"] / b["decode_tok_s"] - 1)
            res[f"bi{base}_prefill_overhead_pct"] = 100 * (d["prefill_tok_s"] / b["prefill_tok_s"] - 1)
    if "transformers" in res:
        h = res["transformers"]
        for v in firsts:
            res[f"{v}_decode_speedup_vs_hf"] = res[f"shuili_{v}"]["decode_tok_s"] / h["decode_tok_s"]
            res[f"{v}_prefill_speedup_vs_hf"] = res[f"shuili_{v}"]["prefill_tok_s"] / h["prefill_tok_s"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{'':<26}{'prefill tok/s':>14}{'decode tok/s':>14}")
    for k in [f"shuili_{v}" for v in firsts] + ["transformers"]:
        if k in res:
            print(f"{k:<26}{res[k]['prefill_tok_s']:14.0f}{res[k]['decode_tok_s']:14.1f}")
    for k, x in res.items():
        if k.endswith(("_pct", "_vs_hf")):
            print(f"{k}: {x:.3f}")


if __name__ == "__main__":
    main()
