"""The float32 GEMMs of few columns (platforms/nvidia/skinny.py) at mid-v4's decode shapes, timed
by CUDA-graph replay (as in the engine's decode graph) on one GPU: skinny.TILE candidates (BM,
MIN_KC, CHUNKS, warps) on hc_mix (x [T, 4, 2048] bf16, fn [24, 8192]: the partials, then the
Sinkhorn that adds them), the MoE router (x [T, 2048] float32, w [32, 2048]) and the head's mix
(w [4, 8192]), with cuBLAS beside the linears. "same bits" says whether a candidate gives the
current tile's output (only the K chunking changes bits).

(At commit bccd30d this script also timed a split-K sum fused into the GEMMs against the
standalone one; splitk.py's docstring has the figures and why the fused sum was dropped.)

    python benchmarks/nvidia_skinny.py [--t 64] [--reps 20]

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph: a graph of one call times "
                    "its replay overhead (several us) with it")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    sweep(a.t, a.reps)


if __name__ == "__main__":
    main()
