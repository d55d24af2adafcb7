"""mid-v4 decode step time vs context on the NVIDIA platform: the captured decode graph (what the
engine replays each step), with caches that hold `ctx` tokens per sequence, no prefill needed.

Weights are random and drawn on the GPU (timing only; their bits do not matter here): bf16, or the
released formats (FP8 128x128 linears, MXFP4 experts, and mxfp8 window / fp4_e4m3 compressed /
mxfp4 indexer KV). Cache contents are random rows (packed formats: rows quantized by the platform's
own kv_quantize). Block layout as the engine's KV manager leaves it: full and compressed groups hold
every block of a sequence, sliding groups only the last blocks their window reaches (-1 before).

Roofline: bytes one step must read, counted from the tensors: every weight once (all experts: at
batch 8+ with top-6 of 32 nearly all are hit), and per sequence and layer the KV rows attention
reads (window 128, 512 CSA top-k rows or ctx/128 HCA rows) plus the indexer's keys (ctx/4 rows).
Over the measured copy rate.

    python benchmarks/nvidia_decode_ctx.py --json ctx.json [--batches 8,64 --ctx 1024,4096,16384,65536]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import shuili.core.models.deepseek_v4 as V4
from shuili.core.graphs import DecodeGraphs
from shuili.core.model_api import ForwardBatch
from shuili.core.models.deepseek_v4 import DeepseekV4Model
from shuili.core.models.deepseek_v4_config import named
from shuili.core.models.deepseek_v4_loader import _grouped, schema
from shuili.hal import PlatformConfig, resolve_platform
from shuili.hal.formats import bytes_per_row
from shuili.hal.types import Weight

DEV = "cuda"
_ROPE: dict = {}
_rope_tables = V4.rope_tables


def _cached_rope(cfg, compressed, max_len):  # one model's tables serve every model built here
    key = (compressed, max_len, cfg.rope_theta, cfg.compress_rope_theta)
    if key not in _ROPE:
        _ROPE[key] = _rope_tables(cfg, compressed, max_len)
    return _ROPE[key]


V4.rope_tables = _cached_rope
RELEASED_KV = dict(window_kv_format="mxfp8", compressed_kv_format="fp4_e4m3", indexer_k_format="mxfp4")


def fp8_block(t: torch.Tensor) -> Weight:
    """float32 [N, K] -> fp8_block128 (power-of-two scale per 128x128 block), on the GPU."""
    n, k = t.shape
    bn, bk = -(-n // 128), -(-k // 128)
    pad = torch.zeros(bn * 128, bk * 128, device=t.device)
    pad[:n, :k] = t.abs()
    amax = pad.view(bn, 128, bk, 128).amax((1, 3)).clamp_min(448 * 2.0 ** -126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return Weight("fp8_block128", (t / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale, (n, k))


def mxfp4_random(shape: tuple[int, ...]) -> Weight:
    """Random e2m1 codes with e8m0 scale 2^-8 (|w| <= 0.023): timing weights, any valid bytes do."""
    *lead, k = shape
    data = torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8, device=DEV)
    return Weight("mxfp4", data, torch.full((*lead, k // 32), 119, dtype=torch.uint8, device=DEV), tuple(shape))


def gpu_params(cfg, released: bool, dt=torch.bfloat16) -> dict:
    torch.manual_seed(0)
    out = {}
    for name, sp in schema(cfg, False).items():
        if sp.kind == "i64":
            out[name] = torch.rand(sp.shape[0], cfg.n_routed_experts, device=DEV).argsort(-1)[:, :sp.shape[1]]
            continue
        if name.endswith(("norm.weight", "_scale")):
            t = torch.ones(sp.shape, device=DEV)
        elif name.endswith(("_base", "ape", "attn_sink", "gate.bias")):
            t = torch.randn(sp.shape, device=DEV) * 0.1
        elif sp.kind == "experts" and released:
            out[name] = mxfp4_random(sp.shape)
            continue
        else:
            t = torch.randn(sp.shape, device=DEV) * 0.02
        if sp.kind == "f32":
            out[name] = t
        elif sp.kind == "dense":
            out[name] = t.to(dt)
        elif sp.kind == "experts":
            out[name] = Weight.dense(t.to(dt))
        elif sp.kind in ("linear", "grouped"):
            w = fp8_block(t) if released else Weight.dense(t.to(dt))
            out[name] = _grouped(w, cfg, name) if sp.kind == "grouped" else w
    return out


def weight_bytes(params: dict) -> int:
    n = 0
    for v in params.values():
        if isinstance(v, Weight):
            n += v.data.numel() * v.data.element_size()
            n += 0 if v.scale is None else v.scale.numel() * v.scale.element_size()
        elif isinstance(v, torch.Tensor) and v.is_floating_point():
            n += v.numel() * v.element_size()
    return n


def kv_bytes(cfg, B: int, ctx: int, dt_size: int = 2) -> int:
    """KV bytes one decode step reads: window rows every layer, CSA top-k rows + indexer keys, HCA rows."""
    def row(fmt, d):
        return d * dt_size if fmt == "none" else bytes_per_row(fmt, d)

    win = min(cfg.sliding_window, ctx + 1) * row(cfg.window_kv_format, cfg.head_dim)
    csa = min(cfg.index_topk, (ctx + 1) // cfg.csa_ratio) * row(cfg.compressed_kv_format, cfg.head_dim)
    idx = (ctx + 1) // cfg.csa_ratio * row(cfg.indexer_k_format, cfg.index_head_dim)
    hca = (ctx + 1) // cfg.hca_ratio * row(cfg.compressed_kv_format, cfg.head_dim)
    per = cfg.num_hidden_layers * win + len(cfg.layers_of("csa")) * (csa + idx) + len(cfg.layers_of("hca")) * hca
    return B * per


class Caches:
    """The model's caches for B sequences of ctx tokens (+ the decode token), and their tables."""

    def __init__(self, model, ops, B: int, ctx: int, P: int = 128):
        self.P, self.B, self.ctx, self.vocab = P, B, ctx, model.vocab_size
        nb = -(-(ctx + 1) // P)  # logical blocks per sequence
        self.width = nb
        self.tables, caches = {}, {}
        for g in model.cache_groups():
            if g.kind == "sliding":
                live = min(nb, -(-(g.window - 1) // P) + 2)
                tab = torch.full((B, nb), -1, dtype=torch.int32)
                for s in range(B):
                    tab[s, nb - live:] = torch.arange(s * live, (s + 1) * live, dtype=torch.int32)
                n = B * live
            else:
                tab = torch.arange(B * nb, dtype=torch.int32).view(B, nb)
                n = B * nb
            self.tables[g.name] = tab.to(DEV)
            shape = (n, P // g.ratio, *g.entry_shape)
            ts = []
            for _ in g.layers:
                if g.dtype == "uint8":
                    fmt = {"swa_kv": model.cfg.window_kv_format, "csa_kv": model.cfg.compressed_kv_format,
                           "hca_kv": model.cfg.compressed_kv_format, "csa_idx": model.cfg.indexer_k_format}[g.name]
                    dim = model.cfg.index_head_dim if g.name == "csa_idx" else model.cfg.head_dim
                    pool = ops.kv_quantize(torch.randn(4096, dim, device=DEV), fmt).to(DEV)
                    flat = torch.empty(n * (P // g.ratio), pool.shape[1], dtype=torch.uint8, device=DEV)
                    reps = -(-flat.shape[0] // 4096)
                    flat.copy_(pool.repeat(reps, 1)[:flat.shape[0]])
                    ts.append(flat.view(shape))
                else:
                    ts.append((torch.randn(shape, device=DEV) * 0.5).to(getattr(torch, g.dtype)))
            caches[g.name] = ts
        model.bind_caches(caches, P)
        self.caches = caches

    def batch(self, groups) -> ForwardBatch:
        B, ctx, P = self.B, self.ctx, self.P
        i64, i32 = torch.int64, torch.int32
        slots = {}
        for g in groups:
            if g.kind != "compressed":
                blk = self.tables[g.name][:, ctx // P].long()
                slots[g.name] = blk * P + ctx % P
        return ForwardBatch(
            input_ids=torch.randint(0, self.vocab, (B,), device=DEV), positions=torch.full((B,), ctx, dtype=i64, device=DEV),
            query_start_loc=torch.arange(B + 1, dtype=i32, device=DEV),
            seq_lens=torch.full((B,), ctx + 1, dtype=i32, device=DEV),
            context_lens=torch.full((B,), ctx, dtype=i32, device=DEV),
            block_tables=self.tables, slot_mapping=slots,
            logits_indices=torch.arange(B, dtype=i64, device=DEV), tokens_per_block=P,
            query_start_loc_cpu=list(range(B + 1)), seq_lens_cpu=[ctx + 1] * B, context_lens_cpu=[ctx] * B)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def time_graph(replay, iters: int) -> float:
    for _ in range(3):
        replay()
    sync()
    if DEV != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            replay()
        return (time.perf_counter() - t) / iters
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def profile_replay(replay, label: str, rows: int = 12) -> list:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            replay()
        torch.cuda.synchronize()
    ev = sorted((e for e in p.key_averages() if e.self_device_time_total > 0),
                key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in ev) / 3
    out = [(e.key[:70], e.self_device_time_total / 3, e.count // 3) for e in ev[:rows]]
    launches = sum(e.count for e in ev) // 3
    print(f"profile {label}: device busy {total:.0f} us per step, {launches} kernels", flush=True)
    for k, us, n in out:
        print(f"  {us:9.1f} us {n:5d}x  {k}", flush=True)
    # one replay's kernels in launch order: which call of a kernel is slow (e.g. the MoE's qgemm)
    try:
        seq = sorted((e for e in p.events() if e.device_type.name == "CUDA" and e.device_time_total > 0),
                     key=lambda e: e.time_range.start)[:launches]
        trace = [(e.name[:60], e.device_time_total) for e in seq]
    except Exception as exc:  # a profiler without these event fields: keep the averages
        print(f"no launch trace: {exc!r}", flush=True)
        trace = []
    slow = sorted(range(len(trace)), key=lambda i: -trace[i][1])[:25]
    print(f"slowest single launches of {label} (index in the step, us, kernel, previous kernel):", flush=True)
    for i in sorted(slow):
        print(f"  {i:5d} {trace[i][1]:8.1f}  {trace[i][0][:40]:40s} after {trace[i - 1][0][:40] if i else '-'}",
              flush=True)
    return ([{"kernel": k, "us": us, "calls": n} for k, us, n in out] + [{"kernel": "TOTAL", "us": total}]
            + [{"trace": trace}])


def copy_rate() -> float:
    if DEV != "cuda":
        return 1e10
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--ctx", default="1024,4096,16384,65536")
    ap.add_argument("--formats", default="bf16,released")
    ap.add_argument("--bi", default="", help="batch:ctx pairs also timed in batch-invariant mode, e.g. 64:1024")
    ap.add_argument("--profile", default="", help="format:batch:ctx cases to profile, e.g. released:64:65536")
    ap.add_argument("--profile-rows", type=int, default=12)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--model", default="mid-v4")
    ap.add_argument("--platform", default="nvidia")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block", type=int, default=128, help="tokens per KV block")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    bw = copy_rate()
    print(f"copy rate {bw / 1e9:.0f} GB/s; {gpu}; torch {torch.__version__}", flush=True)
    batches = [int(x) for x in args.batches.split(",")]
    ctxs = [int(x) for x in args.ctx.split(",")]
    bi_cases = {tuple(int(v) for v in x.split(":")) for x in args.bi.split(",") if x}
    prof_cases = {x for x in args.profile.split(",") if x}
    rows, keep = [], []
    for fmt in args.formats.split(","):
        released = fmt == "released"
        cfg = named(args.model, **(RELEASED_KV if released else {}))
        t0 = time.perf_counter()
        params = gpu_params(cfg, released, getattr(torch, args.dtype))
        wbytes = weight_bytes(params)
        print(f"{fmt}: weights {wbytes / 1e9:.2f} GB, built in {time.perf_counter() - t0:.1f}s", flush=True)
        for bi in (False, True):
            if bi and not bi_cases:
                continue
            plat = resolve_platform(PlatformConfig(platform=args.platform, batch_invariant=bi))
            model = DeepseekV4Model(cfg, plat.ops, params, device=DEV, dtype=args.dtype,
                                    max_model_len=max(ctxs) + 256)
            for B in batches:
                for ctx in ctxs:
                    if bi and (B, ctx) not in bi_cases:
                        continue
                    try:
                        c = Caches(model, plat.ops, B, ctx, args.block)
                        groups = model.cache_groups()
                        t = time.perf_counter()
                        if plat.capture_graph is None:  # a CPU smoke run: the eager forward
                            g, batch = None, c.batch(groups)
                            graph = type("Eager", (), {"replay": staticmethod(lambda: model.forward(batch))})
                        else:
                            g = DecodeGraphs(model, plat.capture_graph, groups, B, c.width, args.block, DEV)
                            if g.run(c.batch(groups)) is None:
                                raise RuntimeError(g.disabled)
                            graph = next(iter(g.graphs.values()))
                        sync()
                        cap_s = time.perf_counter() - t
                        step = time_graph(graph.replay, args.iters)
                        nbytes = wbytes + kv_bytes(cfg, B, ctx)
                        r = dict(format=fmt, batch_invariant=bi, batch=B, ctx=ctx, step_ms=step * 1e3,
                                 tok_s=B / step, bytes=nbytes, floor_ms=nbytes / bw * 1e3,
                                 pct_roofline=100 * nbytes / bw / step, capture_s=cap_s,
                                 finite=bool(torch.isfinite(graph.replay()[:B]).all()))
                        key = f"{fmt}:{B}:{ctx}" + (":bi" if bi else "")
                        if key in prof_cases and DEV == "cuda":
                            r["profile"] = profile_replay(graph.replay, key, args.profile_rows)
                    except torch.OutOfMemoryError as exc:
                        r = dict(format=fmt, batch_invariant=bi, batch=B, ctx=ctx, error=f"OOM: {exc}"[:200])
                    rows.append(r)
                    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "profile"},
                          flush=True)
                    model.caches = {}
                    # graphs stay alive, as in the engine: they share one memory pool, and capturing into
                    # a pool whose earlier graph was freed (then empty_cache) trips an allocator assert
                    # (seen on the H200, torch 2.11: CUDACachingAllocator.cpp:2799 use_count > 0)
                    keep.append(g)
                    c = g = graph = None
        del params
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_rate": bw, "gpu": gpu, "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    print(f"\n{'format':<9}{'BI':>3}{'B':>4}{'ctx':>7}{'step ms':>9}{'tok/s':>9}{'floor ms':>9}{'roofl':>7}"
          f"{'vs 1k':>7}")
    base = {}
    for r in rows:
        if "error" in r:
            print(f"{r['format']:<9}{int(r['batch_invariant']):>3}{r['batch']:>4}{r['ctx']:>7}  {r['error'][:60]}")
            continue
        k = (r["format"], r["batch_invariant"], r["batch"])
        base.setdefault(k, r["step_ms"])
        print(f"{r['format']:<9}{int(r['batch_invariant']):>3}{r['batch']:>4}{r['ctx']:>7}{r['step_ms']:9.3f}"
              f"{r['tok_s']:9.0f}{r['floor_ms']:9.3f}{r['pct_roofline']:6.0f}%{r['step_ms'] / base[k]:6.2f}x")


if __name__ == "__main__":
    main()
