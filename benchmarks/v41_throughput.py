"""DeepSeek-V4.1 prefill and decode throughput (model + caches, no scheduler), with the Engram gather
timed separately. For the lead's H200 run of mid-v41; runs on the CPU with tiny-v41 to check it.

    # H200, bf16 weights and KV rows / the released storage formats
    PYTHONPATH=. python benchmarks/v41_throughput.py --model mid-v41 --platform nvidia --dtype bfloat16 \\
        --batch 64 --prompt-len 1024 --decode-steps 32 --formats bf16
    PYTHONPATH=. python benchmarks/v41_throughput.py --model mid-v41 --platform nvidia --dtype bfloat16 \\
        --batch 64 --prompt-len 1024 --decode-steps 32 --formats released
    # CPU check
    PYTHONPATH=. python benchmarks/v41_throughput.py --model tiny-v41 --batch 4 --prompt-len 40 --decode-steps 4

"released" formats: KV rows packed (window MXFP8, compressed KV FP4 e2m1/e4m3-16, indexer keys
MXFP4), routed experts MXFP4, the other linears FP8 e4m3 in 32 x 32 blocks as the release stores
them (the contract's fp8_block32 format; the loader keeps released checkpoints in it too).
Prints one JSON object: prefill tokens/s, decode tokens/s at the batch, per-step times, Engram
gather+upload time (host gather of a decode step's rows and of a prefill chunk's, measured apart
from the forward) and the Engram service's path counters, with the device, torch and date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _quantize(params: dict, cfg) -> dict:
    from shuili.core.models.deepseek_v41_loader import schema
    from shuili.platforms.reference.quant import quantize_weight_fp8_block32, quantize_weight_mxfp4

    sch = schema(cfg)
    out = dict(params)
    for name, sp in sch.items():
        w = params[name]
        if sp.kind == "experts":
            out[name] = quantize_weight_mxfp4(w.data.float())
        elif sp.kind in ("linear", "grouped"):  # grouped wo_a [G, r, K]: 32x32 blocks per group
            out[name] = quantize_weight_fp8_block32(w.data.float())
    return out


def build(args, ops, device: str):
    from shuili.core.models.deepseek_v41 import DeepseekV41Model
    from shuili.core.models.deepseek_v41_config import named
    from shuili.core.models.deepseek_v41_loader import random_engram, random_params

    over = {}
    if args.formats == "released":
        over = dict(window_kv_format="mxfp8", compressed_kv_format="fp4_e4m3", indexer_k_format="mxfp4")
    cfg = named(args.model, **over)
    params = random_params(cfg, device=device, dtype=args.dtype, seed=args.seed)
    if args.formats == "released":
        params = _quantize(params, cfg)
    engram = random_engram(cfg, ops, device=device, dtype=args.dtype, seed=args.seed)
    max_len = args.prompt_len + args.decode_steps + 1
    return DeepseekV41Model(cfg, ops, params, device=device, dtype=args.dtype, max_model_len=max_len,
                            engram=engram), max_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-v41", choices=["tiny-v41", "mid-v41"])
    ap.add_argument("--platform", default="reference")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--formats", default="bf16", choices=["bf16", "released"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--prefill-tokens-per-step", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    from shuili.hal import PlatformConfig, resolve_platform

    resolved = resolve_platform(PlatformConfig(platform=args.platform))
    ops = resolved.ops
    device = "cuda" if resolved.name == "nvidia" else "cpu"
    t0 = time.perf_counter()
    model, max_len = build(args, ops, device)
    build_s = time.perf_counter() - t0
    drv = model.driver(max_seqs=args.batch, max_len=max_len, device=device)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, model.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()

    # prefill: whole prompts, as many sequences per forward as the token budget allows
    per_step = max(1, args.prefill_tokens_per_step // args.prompt_len)
    _sync(device)
    t0 = time.perf_counter()
    last = []
    for s in range(0, args.batch, per_step):
        seqs = range(s, min(s + per_step, args.batch))
        last.append(model.forward(drv.batch([(i, prompts[i]) for i in seqs])))
    _sync(device)
    prefill_s = time.perf_counter() - t0
    nxt = torch.cat(last).argmax(-1).tolist()

    # decode: every sequence one token per step
    step_s = []
    for _ in range(args.decode_steps):
        _sync(device)
        t0 = time.perf_counter()
        logits = model.forward(drv.batch([(i, [nxt[i]]) for i in range(args.batch)]))
        nxt = logits.argmax(-1).tolist()  # the host needs the ids (as the sampler would)
        step_s.append(time.perf_counter() - t0)
    decode_s = sum(step_s)

    # the Engram gather + upload alone: one decode step's rows and one prefill chunk's
    eng = {}
    if model.engram is not None:
        from shuili.core.models.engram_hash import engram_history

        lb = model.engram.lookback

        def timed(ids_hist):
            _sync(device)
            t = time.perf_counter()
            for ids, hist in ids_hist:
                model.engram.rows_for(ids, hist)
            _sync(device)
            return time.perf_counter() - t

        dec = [(list(nxt), [x for i in range(args.batch) for x in
                            engram_history(lambda a, b, i=i: prompts[i][a:b], args.prompt_len,
                                           args.prompt_len + 1, lb)])]
        pre = [(prompts[0], engram_history(lambda a, b: prompts[0][a:b], 0, args.prompt_len, lb))]
        eng = {"decode_step_gather_upload_s": timed(dec), "prefill_prompt_gather_upload_s": timed(pre),
               "rows_per_token_per_layer": model.cfg.n_engram_cols, "layers": list(model.cfg.engram_layer_ids),
               "table_rows": list(model.cfg.engram_num_embeddings), "service_counters": dict(model.engram.stats)}

    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(json.dumps({
        "model": args.model, "platform": resolved.name, "dtype": args.dtype, "formats": args.formats,
        "batch": args.batch, "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
        "params_B": round(model.cfg.num_params(with_engram_tables=False) / 1e9, 3),
        "build_s": round(build_s, 2), "prefill_s": round(prefill_s, 4),
        "prefill_tok_per_s": round(args.batch * args.prompt_len / prefill_s, 1),
        "decode_s": round(decode_s, 4), "decode_tok_per_s": round(args.batch * args.decode_steps / decode_s, 1),
        "decode_step_ms": [round(1000 * s, 2) for s in step_s], "engram": eng,
        "device": dev_name, "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }, indent=1))


if __name__ == "__main__":
    main()
