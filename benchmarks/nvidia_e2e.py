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


def matmul_rate(device: str, n: int = 8192) -> float:
    """FLOP/s of one bf16 n^3 torch.matmul (the compute ceiling prefill is held to)."""
    if device != "cuda":
        return 1e12
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return 2 * n ** 3 * 10 / (time.perf_counter() - t)


def prefill_flops_per_token(cfg, params, prompt_len: int) -> float:
    """FLOPs a prompt token costs in prefill, counted from the weights and the config: 2 per weight
    it multiplies (routed experts at top-k / E; embedding and head left out: the head runs for the
    last token only), plus attention's QK and PV over the entries each query reads (window, CSA
    top-k, HCA) and the indexer's scores, averaged over the prompt's positions."""
    linear = 0.0
    for name, v in params.items():
        if name.startswith(("embed.", "head.")) or not hasattr(v, "shape") or len(v.shape) < 2:
            continue
        if getattr(v, "dtype", None) in (torch.int64, torch.int32):
            continue
        n = float(torch.Size(v.shape).numel())
        linear += n * cfg.num_experts_per_tok / cfg.n_routed_experts if ".experts." in name else n
    pos = torch.arange(1, prompt_len + 1, dtype=torch.float64)  # visible tokens per query
    per_entry = 4 * cfg.num_attention_heads * cfg.head_dim
    attn = 0.0
    for kind in cfg.attn_kinds:
        ent = pos.clamp(max=cfg.sliding_window)
        if kind == "csa":
            keys = torch.div(pos, cfg.csa_ratio, rounding_mode="floor")  # the indexer scores them all
            ent = ent + keys.clamp(max=cfg.index_topk)
            attn += float(keys.mean()) * 2 * cfg.index_n_heads * cfg.index_head_dim
        elif kind == "hca":
            ent = ent + torch.div(pos, cfg.hca_ratio, rounding_mode="floor")
        attn += float(ent.mean()) * per_entry
    return 2 * linear + attn


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
    res["prefill_flops_per_token"] = prefill_flops_per_token(cfg, params, args.input_len)
    res["matmul_flop_s"] = matmul_rate(args.device)
    print(f"prefill: {res['prefill_flops_per_token'] / 1e9:.3f} GFLOP per token at prompt {args.input_len}; "
          f"bf16 matmul {res['matmul_flop_s'] / 1e12:.0f} TFLOP/s", flush=True)
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
    for k in [f"shuili_{v}" for v in firsts] + ["transformers"]:
        if k in res:  # prefill against the compute ceiling: FLOPs counted above over the matmul rate
            res[k]["prefill_pct_of_compute"] = (100 * res[k]["prefill_tok_s"] * res["prefill_flops_per_token"]
                                                / res["matmul_flop_s"])
            print(f"{k}: prefill {res[k]['prefill_pct_of_compute']:.1f}% of the bf16 compute roofline")
    for k, x in res.items():
        if k.endswith(("_pct", "_vs_hf")):
            print(f"{k}: {x:.3f}")


if __name__ == "__main__":
    main()
