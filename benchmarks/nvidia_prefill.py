"""mid-v4 prefill on the NVIDIA platform: one forward over B fresh prompts of L tokens (the engine's
prefill step without the scheduler: eager, and with the ops' device range checks left out as in the
engine's steps), against the bf16 compute roofline; and the profile that says where the step's time goes.

Weights are random and drawn on the GPU (timing only), bf16 or the released formats, as in
nvidia_decode_ctx.py. FLOPs per prompt token are counted from the weights and the config by
nvidia_e2e.prefill_flops_per_token (2 per weight a token multiplies, routed experts at top-k / E,
attention and indexer work over the entries each query reads); the ceiling is a bf16 8192^3
torch.matmul timed in the same call.

    python benchmarks/nvidia_prefill.py --formats bf16,released --batch 2 --len 4096 [--profile [--sites]] [--bi]
        [--device-checks]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nvidia_decode_ctx as ctxb  # noqa: E402
from nvidia_e2e import matmul_rate, prefill_flops_per_token  # noqa: E402
from shuili.core.models.deepseek_v4 import DeepseekV4Model
from shuili.core.models.deepseek_v4_config import named
from shuili.hal import PlatformConfig, resolve_platform
from shuili.hal.checks import inputs_checked

GUARD = inputs_checked  # as in the engine's steps (hal/checks.py); --device-checks: contextlib.nullcontext


def build(a, fmt: str, bi: bool):
    cfg = named(a.model, **(ctxb.RELEASED_KV if fmt == "released" else {}))
    ops = resolve_platform(PlatformConfig(platform=a.platform, batch_invariant=bi)).ops
    params = ctxb.gpu_params(cfg, fmt == "released")
    model = DeepseekV4Model(cfg, ops, params, device=a.device, dtype="bfloat16", max_model_len=a.len)
    return cfg, params, model


def step_times(model, driver, prompts, iters: int) -> list[float]:
    """Seconds of each forward; every iteration prefills the same prompts at position 0 again."""
    out = []
    for i in range(iters + 2):
        b = driver.batch([(s, p, 0) for s, p in enumerate(prompts)])
        ctxb.sync()
        t = time.perf_counter()
        with torch.no_grad(), GUARD():
            model.forward(b)
        ctxb.sync()
        if i >= 2:  # the first two compile and autotune
            out.append(time.perf_counter() - t)
    return out


def profiled_forward(model, driver, prompts, cpu: bool = False):
    """torch.profiler over one forward of the prompts, run as the timed ones run; cpu: the host's
    events too, with Python stacks."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    b = driver.batch([(s, p, 0) for s, p in enumerate(prompts)])
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cpu else [ProfilerActivity.CUDA]
    with prof(activities=acts, with_stack=cpu) as p, torch.no_grad(), GUARD():
        model.forward(b)
        torch.cuda.synchronize()
    return p


def profile(model, driver, prompts, rows: int) -> list[dict]:
    p = profiled_forward(model, driver, prompts)
    ev = sorted((e for e in p.key_averages() if e.self_device_time_total > 0),
                key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in ev) / 1e3
    print(f"  profile: device busy {busy:.2f} ms, {sum(e.count for e in ev)} kernels", flush=True)
    out = []
    for e in ev[:rows]:
        print(f"  {e.self_device_time_total / 1e3:9.2f} ms {e.count:5d}x  {e.key[:90]}", flush=True)
        out.append({"kernel": e.key, "ms": e.self_device_time_total / 1e3, "calls": e.count})
    idle_gaps(p, rows // 2)
    return out


def idle_gaps(p, rows: int) -> None:
    """Where the GPU waits: each gap between one kernel's end and the next one's start, summed by
    the kernel that ended it (the launch the host was late with)."""
    from torch.autograd import DeviceType

    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in p.events()
                if e.device_type == DeviceType.CUDA)
    late: dict[str, list[float]] = {}
    for (_, end, _), (start, _, name) in zip(ks, ks[1:]):
        if start > end:
            late.setdefault(name, []).append(start - end)
    idle = sum(sum(v) for v in late.values()) / 1e3
    print(f"  idle: {idle:.2f} ms between {len(ks)} kernels; by the kernel after the gap:", flush=True)
    for name, g in sorted(late.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"  {sum(g) / 1e3:9.2f} ms {len(g):5d}x  {name[:90]}", flush=True)


# CUDA runtime calls that put work on the stream: kernel launches (torch's and Triton's), memsets, copies
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaMemsetAsync", "cudaMemcpyAsync")
OUR_FRAME = re.compile(r"(^|/)(platforms|core|hal)/[\w/]+\.py\(\d+\): \w+")


def _our_frame(names: list[str]) -> str:
    for name in names:
        m = OUR_FRAME.search(name)
        if m:
            return name[m.start():].lstrip("/")
    return "?"


def launch_sites(model, driver, prompts, rows: int) -> list[dict]:
    """Who launches: every CUDA runtime launch, memset and copy of one forward, counted by the
    innermost shuili function above it (a Python frame, "file(line of its def): name", from the
    profiler's Python events above the launch or an ancestor op's recorded stack; "?" where it
    links none) and the torch op that made it ("-": a Triton kernel). On an H100 (2026-12-07) the
    profiler linked no Python frame to any launch, only the ops. Profiled with Python stacks, so
    its own timings mean nothing; the counts are the forward's."""
    sites = collections.Counter()
    for e in profiled_forward(model, driver, prompts, cpu=True).events():
        if not e.name.startswith(LAUNCH_CALLS):
            continue
        op, frame, q = "-", "?", e.cpu_parent
        while q is not None:
            if op == "-" and q.name.startswith("aten::"):
                op = q.name
            frame = _our_frame([q.name] + list(getattr(q, "stack", None) or []))
            if frame != "?":
                break
            q = q.cpu_parent
        sites[(e.name.split("_")[0], frame, op)] += 1
    print(f"  launch sites: {sum(sites.values())} runtime calls", flush=True)
    out = []
    for (call, frame, op), n in sites.most_common(rows):
        print(f"  {n:5d}  {call:18s} {frame[:70]:70s} {op[:30]}", flush=True)
        out.append({"call": call, "frame": frame, "op": op, "count": n})
    return out


def free_cache(a) -> None:
    if a.device == "cuda":
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="bf16,released")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--bi", action="store_true", help="also time batch-invariant mode")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--sites", action="store_true",
                    help="after the profile: count each format's launches by the shuili function making them")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device-checks", action="store_true",
                    help="keep the ops' device range checks, which the engine's steps leave out")
    ap.add_argument("--model", default="mid-v4")
    ap.add_argument("--platform", default="nvidia")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    ctxb.DEV = a.device
    global GUARD
    GUARD = contextlib.nullcontext if a.device_checks else inputs_checked
    rate = matmul_rate(a.device)
    print(f"bf16 8192^3 matmul: {rate / 1e12:.0f} TFLOP/s", flush=True)
    g = torch.Generator().manual_seed(0)
    results = []
    runs = [(fmt, bi) for fmt in a.formats.split(",") for bi in ([False, True] if a.bi else [False])]
    for fmt, bi in runs:
        cfg, params, model = build(a, fmt, bi)
        prompts = [torch.randint(0, cfg.vocab_size, (a.len,), generator=g).tolist() for _ in range(a.batch)]
        flops = prefill_flops_per_token(cfg, params, a.len) * a.len * a.batch
        driver = model.driver(max_seqs=a.batch, max_len=a.len)
        ts = step_times(model, driver, prompts, a.iters)
        t = statistics.median(ts)
        tag = f"{fmt}{' [BI]' if bi else ''}"
        print(f"prefill {tag:<14} B{a.batch} x {a.len}: {t * 1e3:8.2f} ms  "
              f"{a.batch * a.len / t:9.0f} tok/s  "
              f"{flops / t / 1e12:6.1f} TFLOP/s = {100 * flops / t / rate:5.1f}% of the bf16 roofline "
              f"({flops / 1e12:.2f} TFLOP)", flush=True)
        results.append({"format": fmt, "bi": bi, "device_checks": a.device_checks, "batch": a.batch,
                        "len": a.len, "s": t, "all_s": ts,
                        "flop": flops, "roofline_share": flops / t / rate, "prompts": prompts})
        del model, driver, params
        free_cache(a)
    # profiles only once every run is timed: on an H100 (2026-12-07) a bf16 forward timed in the
    # process after a profile took 81.5 ms against 67.3 without one (the host's launches slowed)
    for r in results:
        prompts = r.pop("prompts")
        if a.profile and a.device == "cuda":
            print(f"profile of {r['format']}{' [BI]' if r['bi'] else ''}:", flush=True)
            _, params, model = build(a, r["format"], r["bi"])
            driver = model.driver(max_seqs=a.batch, max_len=a.len)
            step_times(model, driver, prompts, 0)  # compile and autotune
            r["profile"] = profile(model, driver, prompts, a.profile_rows)
            if a.sites:
                r["sites"] = launch_sites(model, driver, prompts, 2 * a.profile_rows)
            del model, driver, params
            free_cache(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"matmul_flop_s": rate, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
