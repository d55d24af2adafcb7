"""Per-kernel time of the NVIDIA ops against the measured roofline, on one GPU.

Ceilings are measured first (device-to-device copy: bytes read + written per second; an
8192^3 bf16 torch.matmul: FLOP/s). For each kernel the floor is max(bytes / copy rate,
FLOPs / matmul rate) with bytes = each input read once + each output written once; the table
gives measured median time, floor and floor / measured. A quick correctness check against a
float32 torch oracle runs on each benchmarked shape first (rel. error printed).

    python benchmarks/nvidia_kernels.py --json out.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing as tt

from shuili.hal.types import Weight
from shuili.platforms.nvidia import attention, gemm, indexer, misc, norm_rope, quant, sampling

DEV = "cuda"
BF = torch.bfloat16


def bench(fn, ms=200):
    return tt.do_bench(fn, warmup=50, rep=ms, return_mode="median") * 1e-3


def graph_bench(fn, reps=10):
    """Seconds per call of fn replayed from a CUDA graph (reps calls a graph): device time alone."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return bench(g.replay) / reps


def ceilings():
    n = 1 << 30  # 2 GiB of bf16
    a = torch.randn(n, device=DEV, dtype=BF)
    b = torch.empty_like(a)
    copy_s = bench(lambda: b.copy_(a))
    bw = 2 * a.numel() * a.element_size() / copy_s
    del a, b
    x = torch.randn(8192, 8192, device=DEV, dtype=BF)
    y = torch.randn(8192, 8192, device=DEV, dtype=BF)
    mm_s = bench(lambda: x @ y, ms=500)
    return bw, 2 * 8192 ** 3 / mm_s


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def paged_case(b, ctx, h, kvh, d, bs=64, q_len=1):
    nblk = ctx // bs
    table = torch.randperm(b * nblk, device=DEV).view(b, nblk).to(torch.int32)
    k = torch.randn(b * nblk, bs, kvh, d, device=DEV, dtype=BF)
    v = torch.randn_like(k)
    q = torch.randn(b * q_len, h, d, device=DEV, dtype=BF)
    seq = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
    qsl = (torch.arange(b + 1, device=DEV) * q_len).to(torch.int32)
    return dict(q=q, k_cache=k, v_cache=v, block_tables=table, seq_lens=seq, query_start_loc=qsl,
                scale=d ** -0.5)


def paged_oracle(kw, rows=2):
    """float32 torch attention for the first `rows` sequences (decode rows)."""
    q, k, v, bt = kw["q"], kw["k_cache"], kw["v_cache"], kw["block_tables"]
    outs = []
    for b in range(rows):
        ks = k[bt[b].long()].flatten(0, 1).float()  # [ctx, kvh, d]
        vs = v[bt[b].long()].flatten(0, 1).float()
        g = q.shape[1] // k.shape[2]
        qq = q[b].float().view(k.shape[2], g, -1)
        s = torch.einsum("hgd,nhd->hgn", qq, ks) * kw["scale"]
        outs.append(torch.einsum("hgn,nhd->hgd", s.softmax(-1), vs).reshape(q.shape[1], -1))
    return torch.stack(outs)


def run(args):
    bw, mmf = ceilings()
    rows = []

    def record(name, secs, nbytes=0.0, flops=0.0, err=None, **extra):
        floor = max(nbytes / bw, flops / mmf)
        rows.append(dict(kernel=name, us=secs * 1e6, floor_us=floor * 1e6, pct_roofline=100 * floor / secs,
                         bound="memory" if nbytes / bw >= flops / mmf else "compute",
                         gbps=nbytes / secs / 1e9, tflops=flops / secs / 1e12, rel_err=err, **extra))

    def _sec0():  # decode attention, long context (GQA and MQA/V4-width heads)
        for (b, ctx, h, kvh, d) in [(32, 16384, 32, 8, 128), (64, 8192, 16, 1, 512)]:
            kw = paged_case(b, ctx, h, kvh, d)
            nbytes = 2 * b * ctx * kvh * d * 2 + 2 * kw["q"].numel() * 2
            err = rel(attention.paged_attention(**kw)[:2].float(), paged_oracle(kw))
            for bi in (False, True):
                t = bench(lambda: attention.paged_attention(**kw, batch_invariant=bi))
                record(f"paged_decode B{b} ctx{ctx} H{h}/{kvh} D{d}" + (" [BI]" if bi else ""), t, nbytes,
                       4 * b * h * ctx * d, err)
            del kw
    def _sec1():  # prefill attention, one 4096-token sequence
        kw = paged_case(1, 4096, 32, 8, 128, q_len=4096)
        for bi in (False, True):
            t = bench(lambda: attention.paged_attention(**kw, batch_invariant=bi))
            record("paged_prefill T4096 H32/8 D128" + (" [BI]" if bi else ""), t,
                   3 * 4096 * 8 * 128 * 2 + 2 * kw["q"].numel() * 2, 2 * 2 * 4096 * 4096 * 32 * 128 / 2)
        del kw
    def _sec2():  # sparse attention (mid-v4 decode: 16 heads x 512, 128 window + 512 selected entries)
        t_, h, d = 64, 16, 512
        for fmt in ("none", "mxfp8"):
            rows_ = torch.randn(t_ * 1024, d, device=DEV)
            cache = rows_.to(BF) if fmt == "none" else quant.kv_quantize(rows_, fmt)
            win = torch.randint(0, t_ * 1024, (t_, 128), device=DEV, dtype=torch.int32)
            sel = torch.randint(0, t_ * 1024, (t_, 512), device=DEV, dtype=torch.int32)
            q = torch.randn(t_, h, d, device=DEV, dtype=BF)
            sinks = torch.randn(h, device=DEV)
            rb = cache.shape[1] * cache.element_size()
            f = lambda: attention.sparse_attention(q, [cache, cache], [win, sel], d ** -0.5, sinks, [fmt, fmt])  # noqa: E731
            record(f"sparse_attn T64 H16 D512 L640 {fmt}", bench(f), t_ * 640 * rb + 2 * q.numel() * 2,
                   4 * t_ * h * 640 * d)
            # kernel time alone (CUDA-graph replay: no host launch cost); chunk sizes swept on bf16 rows
            default = attention.SPARSE_SPLIT
            sweep = (64, 128, 256) if fmt == "none" else ()
            try:
                for split in (default,) + tuple(x for x in sweep if x != default):
                    attention.SPARSE_SPLIT = split
                    record(f"sparse_attn T64 H16 D512 L640 {fmt} [graph, split {split}]", graph_bench(f),
                           t_ * 640 * rb + 2 * q.numel() * 2, 4 * t_ * h * 640 * d)
            finally:
                attention.SPARSE_SPLIT = default

    def _sec3():  # indexer: 64 decode tokens, each over its sequence's 4096 compressed keys
        b, ents, bs, nh, dk = 64, 4096, 64, 32, 128
        for fmt in ("none", "mxfp4"):
            rows_ = torch.randn(b * ents, dk, device=DEV)
            kc = (rows_.to(BF) if fmt == "none" else quant.kv_quantize(rows_, fmt)).view(b * ents // bs, bs, -1)
            bt = torch.arange(b * ents // bs, device=DEV, dtype=torch.int32).view(b, -1)
            q = torch.randn(b, nh, dk, device=DEV, dtype=BF)
            w = torch.randn(b, nh, device=DEV)
            qsl = torch.arange(b + 1, device=DEV, dtype=torch.int32)
            pos = torch.full((b,), 4 * ents - 1, device=DEV, dtype=torch.int64)
            f = lambda: indexer.indexer_topk(q, w, kc, bt, qsl, pos, 4, 512, fmt)  # noqa: E731
            record(f"indexer_topk B64 E4096 H32 Dk128 {fmt}", bench(f), kc.numel() * kc.element_size(),
                   2 * b * ents * nh * dk)
    def _sec4():  # GEMMs
        for m in (64, 4096):
            n = k = 4096
            x = torch.randn(m, k, device=DEV, dtype=BF)
            wd = torch.randn(n, k, device=DEV, dtype=BF) * k ** -0.5
            w8 = Weight("fp8_block128", wd.float().clamp(-448, 448).to(torch.float8_e4m3fn),
                        torch.ones(n // 128, k // 128, device=DEV), (n, k))
            w4 = Weight("mxfp4", torch.randint(0, 256, (n, k // 2), device=DEV, dtype=torch.uint8),
                        torch.full((n, k // 32), 120, device=DEV, dtype=torch.uint8), (n, k))
            ref = x.float() @ wd.float().t()
            for name, w, wbytes in (("dense", Weight.dense(wd), n * k * 2), ("fp8", w8, n * k),
                                    ("mxfp4", w4, n * k // 2 + n * k // 32)):
                for bi in (False, True):
                    if name == "dense":
                        err = rel(gemm.linear(x, w, batch_invariant=bi).float(), ref)
                    elif name == "fp8":
                        err = rel(gemm.linear(x, w, batch_invariant=bi).float(),
                                  x.float() @ w8.data.float().t())
                    else:
                        err = None
                    t = bench(lambda: gemm.linear(x, w, batch_invariant=bi))
                    record(f"linear M{m} N{n} K{k} {name}" + (" [BI]" if bi else ""), t,
                           wbytes + 2 * m * (n + k), 2 * m * n * k, err)
    def _sec5():  # MoE (mid-v4 dims), 64 decode tokens, top-6 of 32 experts
        t_, e, kk, dd, ii = 64, 32, 6, 2048, 768
        x = torch.randn(t_, dd, device=DEV, dtype=BF)
        ids = torch.stack([torch.randperm(e, device=DEV)[:kk] for _ in range(t_)])
        wts = torch.softmax(torch.randn(t_, kk, device=DEV), -1)
        for name in ("dense", "mxfp4"):
            if name == "dense":
                w13 = Weight.dense(torch.randn(e, 2 * ii, dd, device=DEV, dtype=BF) * dd ** -0.5)
                w2 = Weight.dense(torch.randn(e, dd, ii, device=DEV, dtype=BF) * ii ** -0.5)
                wb = (w13.data.numel() + w2.data.numel()) * 2
            else:
                w13 = Weight("mxfp4", torch.randint(0, 256, (e, 2 * ii, dd // 2), device=DEV, dtype=torch.uint8),
                             torch.full((e, 2 * ii, dd // 32), 120, device=DEV, dtype=torch.uint8), (e, 2 * ii, dd))
                w2 = Weight("mxfp4", torch.randint(0, 256, (e, dd, ii // 2), device=DEV, dtype=torch.uint8),
                            torch.full((e, dd, ii // 32), 120, device=DEV, dtype=torch.uint8), (e, dd, ii))
                wb = (w13.data.numel() + w2.data.numel()) * 17 // 16
            for bi in (False, True):
                t = bench(lambda: gemm.moe_experts(x, ids, wts, w13, w2, 10.0, batch_invariant=bi))
                record(f"moe_experts T64 E32 k6 D2048 I768 {name}" + (" [BI]" if bi else ""), t, wb,
                       2 * t_ * kk * 3 * dd * ii)
    def _sec6():  # row-wise ops
        x = torch.randn(8192, 4096, device=DEV, dtype=BF)
        wn = torch.randn(4096, device=DEV, dtype=BF)
        err = rel(norm_rope.rms_norm(x, wn, 1e-6).float(),
                  x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * wn.float())
        record("rms_norm T8192 D4096", bench(lambda: norm_rope.rms_norm(x, wn, 1e-6)), 2 * x.numel() * 2, 0, err)
        record("add_rms_norm T8192 D4096", bench(lambda: norm_rope.add_rms_norm(x, x, wn, 1e-6)), 4 * x.numel() * 2)
        xr = torch.randn(8192, 16, 512, device=DEV, dtype=BF)
        pos = torch.randint(0, 4096, (8192,), device=DEV)
        cs = torch.randn(4096, 32, device=DEV)
        record("rope T8192 H16 D512 r64", bench(lambda: norm_rope.rope(xr, pos, cs, cs, 64)), 2 * xr.numel() * 2)
        # in place (HAL 1.11's may_overwrite): V4's attention output and the indexer's q, 64 rope channels
        # alone (77 and 154 us on an H100 on 2026-12-08 with pairs loaded a channel at a time: L2-request bound)
        xq = torch.randn(8192, 32, 128, device=DEV, dtype=BF)
        record("rope T8192 H16 D512 r64 in place", graph_bench(
            lambda: norm_rope.rope(xr, pos, cs, cs, 64, may_overwrite=True)), 2 * 8192 * 16 * 64 * 2)
        record("rope T8192 H32 D128 r64 in place", graph_bench(
            lambda: norm_rope.rope(xq, pos, cs, cs, 64, may_overwrite=True)), 2 * 8192 * 32 * 64 * 2)
        # rms_norm_rope at V4's q (SHUILI_NVIDIA_NORM_ROPE_ROWS: rows a program), graph-replayed
        keep = norm_rope.NORM_ROPE_ROWS
        for rb in (1, 4, 16):
            norm_rope.NORM_ROPE_ROWS = rb
            record(f"rms_norm_rope T8192 H16 D512 r64 rows{rb}", graph_bench(
                lambda: norm_rope.rms_norm_rope(xr, None, 1e-6, pos, cs, cs, 64)), 2 * xr.numel() * 2)
        norm_rope.NORM_ROPE_ROWS = keep
        kx = torch.randn(65536, 512, device=DEV)
        for fmt in ("mxfp8", "fp4_e4m3"):
            rb = quant.bytes_per_row(fmt, 512)
            record(f"kv_quantize N65536 D512 {fmt}", bench(lambda: quant.kv_quantize(kx, fmt)),
                   kx.numel() * 4 + 65536 * rb)
            pk = quant.kv_quantize(kx, fmt)
            record(f"kv_dequantize N65536 D512 {fmt}", bench(lambda: quant.kv_dequantize(pk, fmt, 512)),
                   kx.numel() * 4 + 65536 * rb)
        lg = torch.randn(64, 129280, device=DEV) * 3
        err = rel(sampling.log_softmax(lg), torch.log_softmax(lg.double(), -1))
        record("log_softmax B64 V129280", bench(lambda: sampling.log_softmax(lg)), 2 * lg.numel() * 4, 0, err)
        temp = torch.full((64,), 0.8, device=DEV)
        zk = torch.zeros(64, dtype=torch.int32, device=DEV)
        one, zero = torch.ones(64, device=DEV), torch.zeros(64, device=DEV)
        seeds, posi = torch.arange(64, device=DEV), torch.arange(64, device=DEV)
        record("sample B64 V129280 (seeded, no filter)",
               bench(lambda: sampling.sample(lg, temp, zk, one, zero, seeds, posi)), lg.numel() * 4)
        record("sample B64 V129280 (seeded, no filter) [graph]",
               graph_bench(lambda: sampling.sample(lg, temp, zk, one, zero, seeds, posi, all_greedy=False,
                                                   any_filter=False)), lg.numel() * 4)
        record("sample B64 V129280 (greedy)",
               bench(lambda: sampling.sample(lg, zero, zk, one, zero, seeds, posi)), lg.numel() * 4)
        cache = torch.empty(4096, 64, 528, device=DEV, dtype=torch.uint8)
        vals = torch.randint(0, 255, (8192, 528), device=DEV, dtype=torch.uint8)
        slots = torch.randperm(4096 * 64, device=DEV)[:8192]
        record("cache_write N8192 row528B", bench(lambda: misc.cache_write(cache, slots, vals)), 2 * vals.numel())
    secs = (_sec0, _sec1, _sec2, _sec3, _sec4, _sec5, _sec6)
    for sec in [secs[int(i)] for i in args.sections.split(",")] if args.sections else secs:
        try:
            sec()
        except Exception as exc:  # keep timing the other kernels
            import traceback
            traceback.print_exc()
            rows.append(dict(kernel=f'{sec.__name__} FAILED: {type(exc).__name__}: {exc}'[:200], us=0, floor_us=0,
                             pct_roofline=0, bound='-', gbps=0, tflops=0, rel_err=None))
        torch.cuda.empty_cache()
    return {"copy_GBps": bw / 1e9, "bf16_matmul_TFLOPs": mmf / 1e12, "kernels": rows}


def table(res) -> str:
    out = [f"ceilings: copy {res['copy_GBps']:.0f} GB/s (read+write), bf16 matmul {res['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
           f"{'kernel':<52} {'us':>9} {'floor us':>9} {'%roof':>6} {'bound':>7} {'GB/s':>7} {'TFLOP/s':>8} {'rel err':>8}"]
    for r in res["kernels"]:
        e = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        out.append(f"{r['kernel']:<52} {r['us']:9.1f} {r['floor_us']:9.1f} {r['pct_roofline']:6.1f} "
                   f"{r['bound']:>7} {r['gbps']:7.0f} {r['tflops']:8.1f} {e:>8}")
    return "\n".join(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sections", default="", help="comma-separated section numbers (0-6); default all")
    a = ap.parse_args()
    res = run(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))
