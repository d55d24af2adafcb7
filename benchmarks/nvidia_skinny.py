"""The float32 GEMMs of few columns (platforms/nvidia/skinny.py) at mid-v4's decode shapes, timed
by CUDA-graph replay (as in the engine's decode graph) on one GPU: skinny.TILE candidates (BM,
MIN_KC, CHUNKS, warps) on hc_mix (x [T, 4, 2048] bf16, fn [24, 8192]: the partials, then the
Sinkhorn that adds them), the MoE router (x [T, 2048] float32, w [32, 2048]) and the head's mix
(w [4, 8192]), with cuBLAS beside the linears. "same bits" says whether a candidate gives the
current tile's output (only the K chunking changes bits).

(At commit bccd30d this script also timed a split-K sum fused into the GEMMs against the
standalone one; splitk.py's docstring has the figures and why the fused sum was dropped.)

    python benchmarks/nvidia_skinny.py [--t 64] [--reps 20]
    python benchmarks/nvidia_skinny.py --many 8192     # prefill rows: FMA vs tensor-core partials

--many T times hc_mix's partials at T rows (a 4k prefill of two sequences has 8192) on the FMA
kernel against skinny.split3_partials' tile candidates (BM, KC, warps, stages), each with its
error against float64 as a multiple of conformance's float32 bound (2e-6 * sum |x w|; under 1
passes), then the whole hc_mix in both modes and the router on its float32 rows.

Each time is per call, from a CUDA graph of --reps calls (the first version replayed a graph of one
call, whose replay overhead hid the kernels). "kernels" lines give each kernel's device time per
call from the profiler.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from nvidia_qgemm import BF, DEV, graph_time  # noqa: E402

from shuili.hal.types import Weight  # noqa: E402
from shuili.platforms.nvidia import mhc, skinny  # noqa: E402

CANDIDATES = [(16, 128, 32, 4), (16, 64, 128, 4), (16, 64, 128, 2), (32, 64, 128, 4), (64, 64, 128, 4),
              (64, 64, 128, 8), (16, 128, 64, 4), (32, 128, 64, 4), (64, 128, 64, 8), (16, 256, 32, 4),
              (16, 128, 32, 2), (16, 128, 32, 1), (16, 64, 128, 1), (16, 128, 32, 4, 1), (16, 128, 32, 4, 2),
              (16, 512, 16, 4), (32, 128, 32, 4), (64, 128, 32, 4), (64, 256, 32, 8), (16, 128, 64, 2)]


def kernel_us(run, reps: int) -> dict[str, tuple[float, int]]:
    """Kernel name -> (device us per call, launches per call) over one replay of a graph of reps calls."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.cuda.CUDAGraph()
    run()
    with torch.cuda.graph(g):
        for _ in range(reps):
            run()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        g.replay()
        torch.cuda.synchronize()
    return {e.key[:40]: (e.self_device_time_total / reps, e.count // reps) for e in p.key_averages()
            if e.self_device_time_total > 0}


def sweep(t: int, reps: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(t, 4, 2048, device=DEV, generator=g).to(BF)
    fn = Weight.dense(torch.randn(24, 8192, device=DEV, generator=g) / 90)
    scale, base = torch.tensor([0.5, 1.0, 2.0], device=DEV), torch.randn(24, device=DEV, generator=g)
    xr = torch.randn(t, 2048, device=DEV, generator=g)
    wr = torch.randn(32, 2048, device=DEV, generator=g)
    xh = x.reshape(t, 8192).float()
    wh = torch.randn(4, 8192, device=DEV, generator=g)
    cases = {
        "hc_mix": lambda: mhc.hc_mix(x, fn, scale, base, 20, 1e-6, 1e-6)[2],
        "hc parts": lambda: skinny.partials(x.reshape(t, 8192), fn.data, sumsq=True),
        "router": lambda: skinny.linear(xr, wr, None, torch.empty(t, 32, device=DEV)),
        "head mix": lambda: skinny.linear(xh, wh, None, torch.empty(t, 4, device=DEV)),
    }
    cublas = {"router": lambda: xr @ wr.t(), "head mix": lambda: xh @ wh.t()}
    for name, run in cases.items():
        ks = ", ".join(f"{k} {us:.2f} us x{n}" for k, (us, n) in kernel_us(run, reps).items())
        print(f"kernels {name:<10} at {skinny.TILE}: {ks}", flush=True)
    print(f"{'case':<10} {'tile (BM, MIN_KC, CHUNKS, warps[, stages])':<34} {'chunks':>6} {'us':>8}  "
          "same bits")
    base_tile = skinny.TILE
    for name, run in cases.items():
        ref = run().clone()
        for tile in CANDIDATES:
            skinny.TILE = tile
            try:
                k = 8192 if name != "router" else 2048
                sec = graph_time([run] * reps)
                same = torch.equal(run(), ref)
                print(f"{name:<10} {str(tile):<34} {k // skinny.chunk(k, tile):>6} {sec * 1e6:8.2f}  {same}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 (a tile that fails to compile or run: say so, go on)
                print(f"{name:<10} {str(tile):<34} failed: {type(e).__name__}: {e}"[:160], flush=True)
            finally:
                skinny.TILE = base_tile
        if name in cublas:
            us = graph_time([cublas[name]] * reps) * 1e6
            print(f"{name:<10} {'cuBLAS':<34} {'':>6} {us:8.2f}", flush=True)


SPLIT3_CANDIDATES = [(64, 1024, 4, 3), (64, 512, 4, 3), (64, 2048, 4, 3), (128, 1024, 4, 3),
                     (128, 1024, 8, 3), (128, 2048, 8, 3), (64, 1024, 4, 4), (64, 1024, 4, 2),
                     (128, 512, 8, 3), (64, 8192, 4, 3)]


def many(t: int, reps: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(t, 4, 2048, device=DEV, generator=g).to(BF)
    fn = Weight.dense(torch.randn(24, 8192, device=DEV, generator=g) / 90)
    scale, base = torch.tensor([0.5, 1.0, 2.0], device=DEV), torch.randn(24, device=DEV, generator=g)
    flat = x.reshape(t, 8192)
    want = flat.double() @ fn.data.double().t()
    bound = 2e-6 * (flat.double().abs() @ fn.data.double().abs().t())

    def err(p):  # worst |sum of partials - float64| over the float32 bound
        return float(((p[:, :, :24].double().sum(0) - want).abs() / bound).max())

    reps = max(1, min(reps, 5))  # one call is already hundreds of us
    fma = lambda: skinny.partials(flat, fn.data, sumsq=True)  # noqa: E731
    print(f"hc parts at T={t}: {'kernel / tile (BM, KC, warps, stages)':<40} {'us':>8} {'err/bound':>10}")

    def row(name, run):
        return f"{'':<20}{name:<40} {graph_time([run] * reps) * 1e6:8.2f} {err(run()):10.3f}"

    print(row(f"FMA {skinny.TILE}", fma))
    for tile in SPLIT3_CANDIDATES:
        run = lambda: skinny.split3_partials(flat, fn.data, sumsq=True, tile=tile)  # noqa: E731
        try:
            print(row(f"split3 {tile}", run), flush=True)
        except Exception as e:  # noqa: BLE001 (a tile that fails to compile or run: say so, go on)
            print(f"{'':<20}{'split3 ' + str(tile):<40} failed: {type(e).__name__}: {e}"[:160], flush=True)
    for bi in (True, False):
        run = lambda: mhc.hc_mix(x, fn, scale, base, 20, 1e-6, 1e-6, batch_invariant=bi)  # noqa: E731
        ks = ", ".join(f"{k} {us:.2f} us" for k, (us, n) in kernel_us(run, reps).items())
        us = graph_time([run] * reps) * 1e6
        print(f"hc_mix T={t} batch_invariant={bi}: {us:.2f} us ({ks})", flush=True)
    xr = torch.randn(t, 2048, device=DEV, generator=g)
    wr = torch.randn(32, 2048, device=DEV, generator=g)
    router = lambda: skinny.linear(xr, wr, None, torch.empty(t, 32, device=DEV))  # noqa: E731
    print(f"router T={t} (float32 rows, FMA): {graph_time([router] * reps) * 1e6:.2f} us; "
          f"cuBLAS {graph_time([lambda: xr @ wr.t()] * reps) * 1e6:.2f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph: a graph of one call times "
                    "its replay overhead (several us) with it")
    ap.add_argument("--many", type=int, default=0, metavar="T",
                    help="time the many-row paths at T rows instead")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    if a.many:
        many(a.many, a.reps)
    else:
        sweep(a.t, a.reps)


if __name__ == "__main__":
    main()
