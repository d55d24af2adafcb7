"""Quantized GEMMs at decode sizes against the weight-read roofline, on one GPU.

Per shape (mid-v4's linears and experts, M = 1..256 rows): the decode-tuned kernel of
platforms/nvidia/qgemm.py ("new"), the older kernel of gemm.py ("old", gemm.USE_QGEMM = False) and
bf16 cuBLAS on the same logical weight ("bf16"). Times are medians of CUDA-graph replays (no
Python launch cost, as inside the engine's decode graph), rotating over enough weight copies that
the weights do not sit in the 50 MB L2. Floor = bytes read once (weight data + scales of the
weights used, activations) + bytes written, over the measured copy rate; "%4.8" is the same bytes
over the 4.8 TB/s datasheet rate. Each shape is checked against a float32 torch oracle first.

    python benchmarks/nvidia_qgemm.py [--json out.json] [--sweep] [--quick]
    python benchmarks/nvidia_qgemm.py --sweep-moe | --moe-ab    (MoE tile knobs, qgemm.MOE_TILES)
    python benchmarks/nvidia_qgemm.py --sweep-moe-dense 4096    (the dense experts' tiles at many rows)
    python benchmarks/nvidia_qgemm.py --moe-dense-configs 8192  (their row tile with both GEMMs' tiles)
    python benchmarks/nvidia_qgemm.py --asm-ab                  (mxfp4 decode: inline PTX vs float32)
    python benchmarks/nvidia_qgemm.py --scale-ab                (mxfp4 scales: row- vs K-group-major)
    python benchmarks/nvidia_qgemm.py --korder-ab               (mxfp4 bf16 tiles: K order vs even/odd)
    python benchmarks/nvidia_qgemm.py --moe-times               (the mxfp4 MoE alone, T 1 to 256)
    ncu ... python benchmarks/nvidia_qgemm.py --moe-once 64     (one MoE shape, three calls, for a profiler)
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton.testing as tt

from shuili.hal.types import Weight
from shuili.platforms.nvidia import gemm, qgemm

DEV = "cuda"
BF = torch.bfloat16
L2_BYTES = 120 << 20  # rotate over at least this many weight bytes
# mid-v4 decode linears (N, K): wq_a, wq_b, wkv, wo_b, shared w1/w3, shared w2, indexer wq_b; 4096^2
LINEARS = [(512, 2048), (8192, 512), (2048, 2048), (768, 2048), (2048, 768), (4096, 512), (4096, 4096)]
MOE = (32, 6, 2048, 768)  # mid-v4 routed experts: E, top-k, D, I


def bench(fn, ms=100):
    return tt.do_bench(fn, warmup=25, rep=ms, return_mode="median") * 1e-3


def graph_time(calls, ms=100):
    """Seconds per call of the list `calls`, replayed from one CUDA graph (median over ms)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return bench(g.replay, ms) / len(calls)


def copy_rate():
    a = torch.randn(1 << 30, device=DEV, dtype=BF)
    b = torch.empty_like(a)
    s = bench(lambda: b.copy_(a), ms=200)
    del a, b
    return 2 * (1 << 30) * 2 / s


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def rand_weight(fmt, shape):
    *lead, n, k = shape
    if fmt == "fp8_block128":
        data = (torch.randn(*shape, device=DEV) * 2).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.pow(2.0, torch.randint(-12, -6, (*lead, math.ceil(n / 128), math.ceil(k / 128)), device=DEV).float())
        return Weight("fp8_block128", data, s, tuple(shape))
    data = torch.randint(0, 256, (*lead, n, k // 2), device=DEV, dtype=torch.uint8)
    scale = torch.randint(118, 124, (*lead, n, k // 32), device=DEV, dtype=torch.uint8)
    return Weight("mxfp4", data, scale, tuple(shape))


def wbytes(w: Weight):
    return w.data.numel() * w.data.element_size() + (0 if w.scale is None else w.scale.numel() * w.scale.element_size())


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def dequant(w: Weight):
    """float32 W on the GPU (oracle only)."""
    *lead, n, k = w.shape
    if w.format == "fp8_block128":
        s = w.scale.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]
        return w.data.float() * s
    lut = torch.tensor(E2M1 + [-v for v in E2M1], device=DEV)
    b = w.data.to(torch.int64)
    v = torch.stack([lut[b & 15], lut[b >> 4]], -1).reshape(*lead, n, k)
    return v * torch.pow(2.0, w.scale.float() - 127).repeat_interleave(32, -1)


def moe_oracle(x, ids, wts, w13f, w2f, limit):
    t, k = ids.shape
    inter = w13f.shape[1] // 2
    ys = torch.zeros(t, k, w2f.shape[1], device=DEV)
    for e in range(w13f.shape[0]):
        ti, ji = torch.nonzero(ids == e, as_tuple=True)
        h = x.float()[ti] @ w13f[e].t()
        a = torch.nn.functional.silu(h[:, :inter].clamp(max=limit)) * h[:, inter:].clamp(-limit, limit)
        ys[ti, ji] = a @ w2f[e].t()
    out = wts[:, 0, None] * ys[:, 0]
    for j in range(1, k):
        out = out + wts[:, j, None] * ys[:, j]
    return out


def copies(make, nbytes):
    return [make() for _ in range(max(2, min(48, math.ceil(L2_BYTES / max(nbytes, 1)))))]


def linear_rows(bw, ms_list, fmts, bi_list, quick):
    rows = []
    shapes = LINEARS[-2:] if quick else LINEARS
    for n, k in shapes:
        for fmt in fmts:
            ws = copies(lambda: rand_weight(fmt, (n, k)), n * k)
            wf = dequant(ws[0])
            dense = [Weight.dense(torch.randn(n, k, device=DEV, dtype=BF)) for _ in range(max(2, len(ws) // 2))]
            for m in ms_list:
                x = torch.randn(m, k, device=DEV, dtype=BF)
                ref = x.float() @ wf.t()
                t_bf = graph_time([lambda w=w: torch.matmul(x, w.data.t()) for w in dense])
                for bi in bi_list:
                    res = {}
                    for impl in ("new", "old"):
                        gemm.USE_QGEMM = impl == "new"
                        err = rel(gemm.linear(x, ws[0], batch_invariant=bi).float(), ref)
                        t = graph_time([lambda w=w: gemm.linear(x, w, batch_invariant=bi) for w in ws])
                        res[impl] = (t, err)
                    gemm.USE_QGEMM = True
                    nb = wbytes(ws[0]) + 2 * m * (n + k)
                    rows.append(dict(op="linear", shape=f"M{m} N{n} K{k}", fmt=fmt, bi=bi, bytes=nb,
                                     new_us=res["new"][0] * 1e6, old_us=res["old"][0] * 1e6, bf16_us=t_bf * 1e6,
                                     floor_us=nb / bw * 1e6, err=res["new"][1], old_err=res["old"][1]))
            del ws, dense
            torch.cuda.empty_cache()
    return rows


def moe_inputs(t):
    """T tokens of mid-v4's MoE: activations, top-k expert ids (distinct per token), routing weights."""
    e, k, d, _ = MOE
    x = torch.randn(t, d, device=DEV, dtype=BF)
    ids = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(t)])
    return x, ids, torch.softmax(torch.randn(t, k, device=DEV), -1)


def mxfp4_moe_weights():
    """Copies of mid-v4's mxfp4 expert weights (w13, w2), enough to rotate past L2."""
    e, _, d, inter = MOE
    return copies(lambda: (rand_weight("mxfp4", (e, 2 * inter, d)), rand_weight("mxfp4", (e, d, inter))),
                  3 * inter * d * e // 2)


def bf16_moe_weights():
    """Two copies of mid-v4's expert weights (w13, w2) in bf16 (many-row cases: the weights are not
    what the time is spent on)."""
    e, _, d, inter = MOE
    return [(Weight.dense(torch.randn(e, 2 * inter, d, device=DEV, dtype=BF) * 0.02),
             Weight.dense(torch.randn(e, d, inter, device=DEV, dtype=BF) * 0.02)) for _ in range(2)]


def moe_rows(bw, t_list, fmts, bi_list):
    rows = []
    e, k, d, inter = MOE
    for fmt in fmts:
        per = 2 * inter * d + d * inter
        mk = lambda: (rand_weight(fmt, (e, 2 * inter, d)), rand_weight(fmt, (e, d, inter)))  # noqa: E731
        ws = copies(mk, per * e * (1 if fmt == "fp8_block128" else 0.5))
        wd = [(Weight.dense(torch.randn(e, 2 * inter, d, device=DEV, dtype=BF) * d ** -0.5),
               Weight.dense(torch.randn(e, d, inter, device=DEV, dtype=BF) * inter ** -0.5)) for _ in range(2)]
        w13f, w2f = dequant(ws[0][0]), dequant(ws[0][1])
        for t in t_list:
            x, ids, wts = moe_inputs(t)
            w13, w2 = ws[0]
            ref = moe_oracle(x, ids, wts, w13f, w2f, 10.0)
            used = int(torch.unique(ids).numel())
            nb = (wbytes(w13) + wbytes(w2)) * used / e + t * d * 4
            t_bf = graph_time([lambda p=p: gemm.moe_experts(x, ids, wts, p[0], p[1], 10.0) for p in wd])
            for bi in bi_list:
                res = {}
                for impl in ("new", "old"):
                    gemm.USE_QGEMM = impl == "new"
                    err = rel(gemm.moe_experts(x, ids, wts, w13, w2, 10.0, batch_invariant=bi).float(), ref)
                    tm = graph_time([lambda p=p: gemm.moe_experts(x, ids, wts, p[0], p[1], 10.0, batch_invariant=bi)
                                     for p in ws])
                    res[impl] = (tm, err)
                gemm.USE_QGEMM = True
                rows.append(dict(op="moe_experts", shape=f"T{t} E{e} k{k} D{d} I{inter}", fmt=fmt, bi=bi, bytes=nb,
                                 new_us=res["new"][0] * 1e6, old_us=res["old"][0] * 1e6, bf16_us=t_bf * 1e6,
                                 floor_us=nb / bw * 1e6, err=res["new"][1], old_err=res["old"][1]))
        del ws, wd, w13f, w2f
        torch.cuda.empty_cache()
    return rows


def sweep(bw):
    """Default-mode tile knobs of qgemm at M=64 on the 4096^2 linear and the MoE, printed."""
    out = []
    base = (qgemm.BN_DEFAULT, dict(qgemm.BK_OF), qgemm.NUM_WARPS, qgemm.NUM_STAGES)
    n = k = 4096
    for fmt in ("fp8_block128", "mxfp4"):
        ws = copies(lambda: rand_weight(fmt, (n, k)), n * k)
        x = torch.randn(64, k, device=DEV, dtype=BF)
        bks = (128,) if fmt == "fp8_block128" else (128, 256)
        for bn in (32, 64, 128):
            for bk in bks:
                for nw in (None, 8):
                    for st in (None, 4):
                        qgemm.BN_DEFAULT, qgemm.NUM_WARPS, qgemm.NUM_STAGES = bn, nw, st
                        qgemm.BK_OF[fmt] = bk
                        try:
                            t = graph_time([lambda w=w: gemm.linear(x, w) for w in ws])
                        except Exception as exc:  # noqa: BLE001 (out of resources: record and go on)
                            out.append(f"sweep {fmt} BN{bn} BK{bk} w{nw} s{st}: {type(exc).__name__}")
                            continue
                        out.append(f"sweep {fmt} M64 N{n} K{k} BN{bn} BK{bk} w{nw} s{st}: {t * 1e6:7.1f} us "
                                   f"{wbytes(ws[0]) / t / 1e9:6.0f} GB/s")
        qgemm.BN_DEFAULT, qgemm.BK_OF, qgemm.NUM_WARPS, qgemm.NUM_STAGES = base[0], dict(base[1]), base[2], base[3]
        del ws
    return out


MOE_CANDIDATES = [(bn, bk, nw, ns) for bn in (32, 64, 128) for bk in (64, 128, 256)
                  for nw, ns in ((4, 4), (2, 4), (4, 3), (8, 3))]


# the dense experts' tiles at many rows (64-row tiles; qgemm.DENSE_MOE_TILES)
DENSE_MOE_CANDIDATES = [(bn, bk, nw, ns) for bn in (64, 128, 256) for bk in (64, 128)
                        for nw, ns in ((4, 3), (8, 3))]


def sweep_moe(bw, t=64, candidates=None, dense=False):
    """Default-mode MoE at T tokens (16-row tiles), mxfp4: each candidate (BN, BK, warps, stages)
    for one GEMM with the other at the generic tile (MOE_TILES empty), then the best pair and
    qgemm's chosen MOE_TILES; printed as they finish. `candidates` in place of MOE_CANDIDATES: the
    other GEMM then keeps its chosen tile, and the baseline is the chosen pair. dense: bf16 experts
    at T tokens (many rows an expert: the dense pipeline, qgemm.DENSE_MOE_TILES, and
    DENSE_MOE_CANDIDATES)."""
    table = "DENSE_MOE_TILES" if dense else "MOE_TILES"
    chosen = dict(getattr(qgemm, table))
    keep = chosen if candidates else {}
    ws = bf16_moe_weights() if dense else mxfp4_moe_weights()
    x, ids, wts = moe_inputs(t)
    ref = gemm.moe_experts(x, ids, wts, *ws[0], 10.0).float()

    def timed(tiles):
        setattr(qgemm, table, dict(tiles))
        try:
            err = rel(gemm.moe_experts(x, ids, wts, *ws[0], 10.0).float(), ref)
            return graph_time([lambda p=p: gemm.moe_experts(x, ids, wts, p[0], p[1], 10.0) for p in ws]), err
        except Exception as exc:  # noqa: BLE001 (out of resources: record and go on)
            return None, type(exc).__name__
        finally:
            setattr(qgemm, table, dict(chosen))

    base, _ = timed(keep)
    out, best = [f"sweep-moe T{t}{' dense' if dense else ''} {'chosen' if keep else 'default'} tiles: "
                 f"{base * 1e6:7.1f} us ({bw:.0f} B/s copy rate)"], {}
    print(out[0], flush=True)
    for which in ("gemm1", "gemm2"):
        best[which] = (base, None)
        for c in candidates or (DENSE_MOE_CANDIDATES if dense else MOE_CANDIDATES):
            tm, err = timed({**keep, which: c})
            regs = f" r{c[4]}" if len(c) > 4 else ""
            line = f"sweep-moe T{t} {which} BN{c[0]} BK{c[1]} w{c[2]} s{c[3]}{regs}: " + (
                f"{err}" if tm is None else f"{tm * 1e6:7.1f} us, rel err vs default {err:.1e}")
            out.append(line)
            print(line, flush=True)
            if tm is not None and tm < best[which][0]:
                best[which] = (tm, c)
    pick = {**keep, **{w: c for w, (_, c) in best.items() if c is not None}}
    both, _ = timed(pick)
    out.append(f"sweep-moe T{t} best {pick}: {both * 1e6:7.1f} us against {base * 1e6:7.1f} us")
    print(out[-1], flush=True)
    return out


# (row tile, GEMM1 tile, GEMM2 tile) of default mode's MoE on dense bf16 experts: the chosen
# configuration first, then 128-row tiles (qgemm.DENSE_MOE_BM), whose accumulators fit 8 warps at
# up to 256 columns (GEMM1's gate and up tiles count twice)
DENSE_MOE_CONFIGS = [
    (64, (256, 64, 8, 3), (256, 64, 4, 3)),
    (128, (128, 64, 8, 3), (256, 64, 8, 3)),
    (128, (128, 64, 8, 3), (128, 64, 8, 3)),
    (128, (128, 64, 8, 2), (256, 64, 8, 2)),
    (128, (64, 64, 8, 3), (128, 64, 4, 3)),
    (128, (64, 64, 4, 4), (128, 64, 8, 4)),
    (128, (128, 32, 8, 4), (256, 32, 8, 4)),
    (128, (128, 64, 8, 4), (128, 64, 8, 4)),
]


def moe_dense_configs(t, configs=DENSE_MOE_CONFIGS):
    """Default-mode MoE on dense bf16 experts at T tokens under each (BM, GEMM1 tile, GEMM2 tile),
    CUDA-graph replays over two weight copies; outputs against the first configuration's. The first
    and, last, the fastest also run with their weight tiles by TMA (qgemm.DENSE_MOE_TMA), whose
    outputs must equal the same configuration's by pointer loads."""
    keep = (qgemm.DENSE_MOE_BM, dict(qgemm.DENSE_MOE_TILES), qgemm.DENSE_MOE_TMA)
    ws = bf16_moe_weights()
    x, ids, wts = moe_inputs(t)
    e, k, d, inter = MOE
    flops = 2 * t * k * 3 * d * inter  # the contract's: GEMM2's hi/lo second dot not counted
    ref, first, best, outs = None, None, None, {}

    def run(bm, g1, g2, tma):
        nonlocal ref, first, best
        qgemm.DENSE_MOE_BM, qgemm.DENSE_MOE_TILES, qgemm.DENSE_MOE_TMA = bm, {"gemm1": g1, "gemm2": g2}, tma
        try:
            out = gemm.moe_experts(x, ids, wts, *ws[0], 10.0).float()
            tm = graph_time([lambda p=p: gemm.moe_experts(x, ids, wts, p[0], p[1], 10.0) for p in ws])
        except Exception as exc:  # noqa: BLE001 (out of resources: record and go on)
            print(f"moe-dense T{t} BM{bm} {g1} {g2}{' TMA' if tma else ''}: {type(exc).__name__}", flush=True)
            return
        finally:
            qgemm.DENSE_MOE_BM, qgemm.DENSE_MOE_TILES, qgemm.DENSE_MOE_TMA = keep[0], dict(keep[1]), keep[2]
        ref = out if ref is None else ref
        first = tm if first is None else first
        best = (tm, bm, g1, g2, tma) if best is None or tm < best[0] else best
        same = ""
        if tma:
            same = f", {'same bits as' if torch.equal(out, outs[bm, g1, g2]) else 'OTHER BITS than'} pointer loads"
        outs.setdefault((bm, g1, g2), out)
        print(f"moe-dense T{t} BM{bm} gemm1 {g1} gemm2 {g2}{' TMA' if tma else ''}: {tm * 1e6:8.1f} us, "
              f"{flops / tm / 1e12:6.1f} TFLOP/s, {first / tm:5.2f}x, rel err vs first {rel(out, ref):.1e}{same}",
              flush=True)

    def best_env():  # after every run, so a run cut short still names the fastest so far
        if best is not None:  # for benchmarks/run_h200.sh's prefill stage
            print(f"moe-dense best env: SHUILI_NVIDIA_DENSE_MOE_BM={best[1]} SHUILI_NVIDIA_DENSE_MOE_TILES="
                  f"{','.join(map(str, best[2]))};{','.join(map(str, best[3]))} SHUILI_NVIDIA_DENSE_MOE_TMA="
                  f"{int(best[4])}", flush=True)

    # today's configuration with and without TMA first: the comparison a cut-short run must keep
    for c, tma in [(tuple(configs[0]), False), (tuple(configs[0]), True)] + [(tuple(c), False) for c in configs[1:]]:
        if not tma or c in outs:
            run(*c, tma)
            best_env()
    if best is not None and best[1:4] != tuple(configs[0]) and not best[4]:
        run(*best[1:4], True)
        best_env()


# the H200 sweep's best pair at T64 (2026-12-05), timed against the generic tile by --moe-ab
SWEPT_PAIR = {"gemm1": (32, 64, 4, 3), "gemm2": (128, 64, 4, 3)}


def moe_tiles_ab(ts=(1, 16, 64, 256)):
    """Default-mode MoE (mxfp4) with qgemm.MOE_TILES (SWEPT_PAIR while it is empty) against the
    generic tile, alternating, best of two each."""
    keep = dict(qgemm.MOE_TILES)
    chosen = keep or SWEPT_PAIR
    ws = mxfp4_moe_weights()
    for t in ts:
        x, ids, wts = moe_inputs(t)
        res = {"generic": [], "chosen": []}
        for _ in range(2):
            for name, tiles in (("generic", {}), ("chosen", chosen)):
                qgemm.MOE_TILES = dict(tiles)
                res[name].append(graph_time([lambda p=p: gemm.moe_experts(x, ids, wts, p[0], p[1], 10.0) for p in ws]))
        qgemm.MOE_TILES = dict(keep)
        g, c = min(res["generic"]), min(res["chosen"])
        print(f"moe-ab T{t}: generic {g * 1e6:7.1f} us, {chosen} {c * 1e6:7.1f} us, {g / c:5.2f}x", flush=True)


def mxfp4_cases(ts, ms, linear_modes):
    """(name, calls) of mid-v4's mxfp4 MoE at each T in ts (default and batch-invariant mode) and of
    the mxfp4 4096 x 4096 linear at each M in ms (in each batch-invariant mode of linear_modes), bf16
    activations; calls: one per weight copy (graph_time's)."""
    cases = []
    ws = mxfp4_moe_weights()
    for t in ts:
        x, ids, wts = moe_inputs(t)
        for bi in (False, True):
            moe = [lambda p=p, x=x, ids=ids, wts=wts, bi=bi:
                   gemm.moe_experts(x, ids, wts, p[0], p[1], 10.0, batch_invariant=bi) for p in ws]
            cases.append((f"moe T{t}{' BI' if bi else ''}", moe))
    lw = copies(lambda: rand_weight("mxfp4", (4096, 4096)), 4096 * 4096) if ms else []
    for m in ms:
        x = torch.randn(m, 4096, device=DEV, dtype=BF)
        for bi in linear_modes:
            cases.append((f"linear M{m} N4096 K4096{' BI' if bi else ''}",
                          [lambda w=w, x=x, bi=bi: gemm.linear(x, w, batch_invariant=bi) for w in lw]))
    return cases


def flag_runs(call, flag: str) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
    """Two outputs of call with qgemm.<flag> off and on (restored after)."""
    keep, outs = getattr(qgemm, flag), {}
    try:
        for v in (False, True):
            setattr(qgemm, flag, v)
            outs[v] = (call().clone(), call().clone())
    finally:
        setattr(qgemm, flag, keep)
    return outs


def flag_times(calls, flag: str) -> tuple[float, float]:
    """graph_time of calls with qgemm.<flag> off and on, alternating, best of two each."""
    keep, res = getattr(qgemm, flag), {False: [], True: []}
    try:
        for _ in range(2):
            for v in (False, True):
                setattr(qgemm, flag, v)
                res[v].append(graph_time(calls))
    finally:
        setattr(qgemm, flag, keep)
    return min(res[False]), min(res[True])


def asm_ab(ts=(1, 16, 64, 256), ms=(1, 64, 256)):
    """mxfp4 weights with bf16 activations, decoded by quant.e2m1_bf16_x8 (qgemm.ASM_E2M1) against the
    float32 decode: the same bits are required (both give exact bf16 operands), then each is timed,
    alternating, best of two. MoE (default and batch-invariant mode) and the 4096 x 4096 linear."""
    for name, calls in mxfp4_cases(ts, ms, (False, True)):
        outs = flag_runs(calls[0], "ASM_E2M1")
        same = torch.equal(outs[False][0].view(torch.int16), outs[True][0].view(torch.int16))
        f, a = flag_times(calls, "ASM_E2M1")
        print(f"asm-ab {name:<26} float32 decode {f * 1e6:7.1f} us, asm {a * 1e6:7.1f} us, {f / a:5.2f}x, "
              f"same bits: {same}", flush=True)


def korder_ab(ts=(1, 16, 64, 256), ms=(1, 16)):
    """mxfp4 weights against bf16 activations in tiles under 64 rows (qgemm.MXFP4_BF16_EVEN_ODD): the
    tile dotted in K order against the even-K and odd-K halves. The two sum in other orders (other
    bits); each must match itself run to run. Timed alternating, best of two: the MoE (default and
    batch-invariant mode) and the 4096 x 4096 linear."""
    for name, calls in mxfp4_cases(ts, ms, (False,)):
        stable = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                     for a, b in flag_runs(calls[0], "MXFP4_BF16_EVEN_ODD").values())
        k, e = flag_times(calls, "MXFP4_BF16_EVEN_ODD")
        print(f"korder-ab {name:<24} even/odd {e * 1e6:7.1f} us, K order {k * 1e6:7.1f} us, {e / k:5.2f}x, "
              f"run to run: {stable}", flush=True)


def moe_times(ts=(1, 16, 64, 256)):
    """mid-v4's mxfp4 MoE (bf16 activations) at each T, default and batch-invariant mode: graph
    replays, best of three. Run in two checkouts to compare trees."""
    for name, calls in mxfp4_cases(ts, (), ()):
        print(f"moe-times {name:<12} {min(graph_time(calls) for _ in range(3)) * 1e6:7.1f} us", flush=True)


def dense_ab(ts=(128, 256, 512, 1024, 4096), ms=(256, 512, 1024, 2048, 4096)):
    """Default mode at many rows: the per-tile decode against the dense copy (dequant.py) the
    gemm.DENSE_MOE_MIN_ROWS / DENSE_MIN_ROWS thresholds switch to: mid-v4's mxfp4 MoE at T tokens
    and bf16 MoE (the composed path against qgemm's pipeline), and a 4096 x 4096 fp8_block128
    linear at M rows. Graph replays, alternating, best of two; rel = the two outputs' difference."""
    bf = bf16_moe_weights()
    cases = []
    for t in ts:
        x, ids, wts = moe_inputs(t)
        for tag, ws in (("mxfp4", mxfp4_moe_weights()), ("bf16", bf)):
            cases.append((f"moe {tag} T{t}", "DENSE_MOE_MIN_ROWS",
                          [lambda p=p, x=x, ids=ids, wts=wts: gemm.moe_experts(x, ids, wts, p[0], p[1], 10.0)
                           for p in ws]))
    lw = copies(lambda: rand_weight("fp8_block128", (4096, 4096)), 4096 * 4096)
    for m in ms:
        x = torch.randn(m, 4096, device=DEV, dtype=BF)
        cases.append((f"linear fp8 M{m}", "DENSE_MIN_ROWS", [lambda w=w, x=x: gemm.linear(x, w) for w in lw]))
    for name, knob, calls in cases:
        keep, res, outs = getattr(gemm, knob), {}, {}
        try:
            for _ in range(2):
                for dense in (False, True):
                    setattr(gemm, knob, 0 if dense else 1 << 40)
                    outs[dense] = calls[0]().float()
                    res.setdefault(dense, []).append(graph_time(calls))
        finally:
            setattr(gemm, knob, keep)
        t0, t1 = min(res[False]), min(res[True])
        print(f"dense-ab {name:<20} per tile {t0 * 1e6:9.1f} us, dense copy {t1 * 1e6:9.1f} us, "
              f"{t0 / t1:5.2f}x, rel {rel(outs[True], outs[False]):.1e}", flush=True)


def kgroup_major(w: Weight) -> Weight:
    """The same mxfp4 weight with its scales stored K-group-major ([..., K/32, N], seen as
    [..., N, K/32]): a K step's scale bytes of BN rows lie in one run, not a sector per row."""
    return Weight(w.format, w.data, w.scale.transpose(-1, -2).contiguous().transpose(-1, -2), w.shape)


def scale_ab(ts=(1, 16, 64, 256), ms=(1, 64, 256)):
    """mxfp4 with row-major scales (as loaded) against K-group-major scales (kgroup_major): the
    same bits are required, then each is timed, alternating, best of two. MoE (default and
    batch-invariant mode) and the 4096 x 4096 linear."""
    cases = []
    ws = mxfp4_moe_weights()
    wp = [(kgroup_major(a), kgroup_major(b)) for a, b in ws]
    for t in ts:
        x, ids, wts = moe_inputs(t)
        for bi in (False, True):
            cases.append((f"moe T{t}{' BI' if bi else ''}", [
                [lambda p=p, x=x, ids=ids, wts=wts, bi=bi:
                 gemm.moe_experts(x, ids, wts, p[0], p[1], 10.0, batch_invariant=bi) for p in w]
                for w in (ws, wp)]))
    lw = copies(lambda: rand_weight("mxfp4", (4096, 4096)), 4096 * 4096)
    lp = [kgroup_major(w) for w in lw]
    for m in ms:
        x = torch.randn(m, 4096, device=DEV, dtype=BF)
        for bi in (False, True):
            cases.append((f"linear M{m} N4096 K4096{' BI' if bi else ''}", [
                [lambda w=w, x=x, bi=bi: gemm.linear(x, w, batch_invariant=bi) for w in ww]
                for ww in (lw, lp)]))
    for name, (rowm, kgm) in cases:
        same = torch.equal(rowm[0]().view(torch.int16), kgm[0]().view(torch.int16))
        res = {0: [], 1: []}
        for _ in range(2):
            for i, calls in enumerate((rowm, kgm)):
                res[i].append(graph_time(calls))
        r, k = min(res[0]), min(res[1])
        print(f"scale-ab {name:<26} row-major {r * 1e6:7.1f} us, K-group-major {k * 1e6:7.1f} us, "
              f"{r / k:5.2f}x, same bits: {same}", flush=True)


def table(res) -> str:
    out = [f"copy rate {res['copy_GBps']:.0f} GB/s (read+write); graph-replay medians, us",
           f"{'op':<12} {'shape':<26} {'fmt':<6} {'BI':<3} {'new':>7} {'old':>7} {'bf16':>7} {'floor':>6} "
           f"{'%roof':>6} {'%4.8':>5} {'GB/s':>6} {'x old':>6} {'x bf16':>6} {'err':>8}"]
    for r in res["rows"]:
        out.append(f"{r['op']:<12} {r['shape']:<26} {r['fmt'][:5]:<6} {'y' if r['bi'] else 'n':<3} "
                   f"{r['new_us']:7.1f} {r['old_us']:7.1f} {r['bf16_us']:7.1f} {r['floor_us']:6.1f} "
                   f"{100 * r['floor_us'] / r['new_us']:6.1f} {100 * r['bytes'] / 4.8e12 / (r['new_us'] * 1e-6):5.1f} "
                   f"{r['bytes'] / (r['new_us'] * 1e-6) / 1e9:6.0f} {r['old_us'] / r['new_us']:6.2f} "
                   f"{r['bf16_us'] / r['new_us']:6.2f} {r['err']:8.1e}")
    return "\n".join(out)


def prep_sweep():
    """moe_prep's one program (integers: any setting gives the same outputs) against its settings."""
    from shuili.platforms.nvidia import moe_prep as mp
    e, k = MOE[0], MOE[1]
    base = (mp.TILE_VALUES, mp.PREP_WARPS)
    for t in (1, 64, 256):
        flat = torch.randint(0, e, (t * k,), device=DEV)
        want = mp.moe_prep(flat, e, 16)
        for values in (4096, 8192, 16384):
            for warps in (4, 8):
                mp.TILE_VALUES, mp.PREP_WARPS = values, warps
                try:
                    got = mp.moe_prep(flat, e, 16)
                    same = all(torch.equal(a, b)
                               for a, b in zip([*got[:2], *got[2][:3]], [*want[:2], *want[2][:3]]))
                    us = graph_time([lambda: mp.moe_prep(flat, e, 16)]) * 1e6
                    print(f"moe_prep T{t} rows {t * k} values {values} warps {warps}: {us:6.2f} us  "
                          f"same {same}", flush=True)
                finally:
                    mp.TILE_VALUES, mp.PREP_WARPS = base


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also print a sweep of qgemm's default-mode tiles")
    ap.add_argument("--sweep-moe", action="store_true", help="only the MoE tile sweep (qgemm.MOE_TILES candidates)")
    ap.add_argument("--sweep-moe-dense", type=int, default=0, metavar="T", help="only the dense experts' "
                    "tile sweep at T tokens (bf16 experts, many rows an expert: qgemm.DENSE_MOE_TILES)")
    ap.add_argument("--moe-dense-configs", type=int, default=0, metavar="T", help="only the dense "
                    "experts' (row tile, GEMM1 tile, GEMM2 tile) configurations at T tokens (DENSE_MOE_CONFIGS)")
    ap.add_argument("--moe-ab", action="store_true", help="only qgemm.MOE_TILES against the generic tile")
    ap.add_argument("--moe-once", type=int, default=0, metavar="T",
                    help="only three plain calls of the MoE at T tokens (mxfp4, default mode), for a "
                    "profiler: ncu --launch-skip 2 --launch-count 2 takes the second call's two GEMMs")
    ap.add_argument("--moe-candidates", default="", help="with --sweep-moe: "
                    "'BN,BK,warps,stages[,maxnreg];...' in place of the built-in list, each against "
                    "qgemm.MOE_TILES' chosen pair")
    ap.add_argument("--prep-sweep", action="store_true", help="only moe_prep at mid-v4's routing (T64, "
                    "E32, top-6): moe_prep.TILE_VALUES x PREP_WARPS, CUDA-graph replay")
    ap.add_argument("--asm-ab", action="store_true", help="only the mxfp4 decodes: inline PTX vs float32")
    ap.add_argument("--scale-ab", action="store_true", help="only mxfp4 scales: row-major vs K-group-major")
    ap.add_argument("--korder-ab", action="store_true", help="only mxfp4 bf16 tiles: K order or even/odd")
    ap.add_argument("--moe-times", action="store_true", help="only the mxfp4 MoE's times, T 1 to 256")
    ap.add_argument("--dense-ab", action="store_true", help="only default mode at many rows: per-tile "
                    "decode against the dense copy (gemm.DENSE_MOE_MIN_ROWS, DENSE_MIN_ROWS)")
    ap.add_argument("--quick", action="store_true", help="two linear shapes, M in 1, 64, 256")
    ap.add_argument("--no-bi", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.moe_once:
        ws = mxfp4_moe_weights()
        x, ids, wts = moe_inputs(a.moe_once)
        for _ in range(3):
            gemm.moe_experts(x, ids, wts, ws[0][0], ws[0][1], 10.0)
        torch.cuda.synchronize()
        raise SystemExit(0)
    if a.prep_sweep:
        prep_sweep()
        raise SystemExit(0)
    if a.moe_dense_configs:
        moe_dense_configs(a.moe_dense_configs)
        raise SystemExit(0)
    bw = copy_rate()
    # the A/B modes: each runs alone
    for on, run in ((a.asm_ab, asm_ab), (a.scale_ab, scale_ab), (a.korder_ab, korder_ab),
                    (a.moe_times, moe_times), (a.dense_ab, dense_ab)):
        if on:
            run()
            raise SystemExit(0)
    if a.sweep_moe or a.moe_ab or a.sweep_moe_dense:
        cands = [tuple(int(v) for v in c.split(",")) for c in a.moe_candidates.split(";") if c]
        if a.sweep_moe_dense:
            sweep_moe(bw, a.sweep_moe_dense, cands or None, dense=True)
        else:
            sweep_moe(bw, candidates=cands or None) if a.sweep_moe else moe_tiles_ab()
        raise SystemExit(0)
    extra = sweep(bw) if a.sweep else []
    for line in extra:
        print(line, flush=True)
    ms = (1, 64, 256) if a.quick else (1, 16, 64, 256)
    bis = (False,) if a.no_bi else (False, True)
    rows = linear_rows(bw, ms, ("fp8_block128", "mxfp4"), bis, a.quick)
    rows += moe_rows(bw, (1, 16, 64, 256) if not a.quick else (1, 64, 256), ("mxfp4",), bis)
    res = {"copy_GBps": bw / 1e9, "rows": rows, "sweep": extra}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))
