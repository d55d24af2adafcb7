"""The float32 GEMMs of few columns (platforms/nvidia/skinny.py) and split-K's fused sum
(platforms/nvidia/splitk.py) at mid-v4's decode shapes, timed by CUDA-graph replay (as in the
engine's decode graph) on one GPU.

- `--sweep`: skinny.TILE candidates (BM, MIN_KC, CHUNKS, warps) on hc_mix (x [T, 4, 2048] bf16,
  fn [24, 8192]: the partials, then the Sinkhorn that adds them), the MoE router (x [T, 2048] float32,
  w [32, 2048]) and the head's mix (w [4, 8192]), with cuBLAS beside the linears. "same bits" says
  whether a candidate gives the current tile's output (only the K chunking changes bits);
- always: mid-v4's split-K linears (fp8_block128 at M = T, default and batch-invariant mode) with
  the fused sum against the standalone sum kernel (splitk.counters forced to None), and whether
  their outputs agree bit for bit.

    python benchmarks/nvidia_skinny.py [--t 64] [--sweep]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from nvidia_qgemm import BF, DEV, LINEARS, graph_time, rand_weight  # noqa: E402

from shuili.hal.types import Weight  # noqa: E402
from shuili.platforms.nvidia import gemm, mhc, qgemm, skinny, splitk  # noqa: E402

CANDIDATES = [(16, 128, 32, 4), (16, 64, 128, 4), (16, 64, 128, 2), (32, 64, 128, 4), (64, 64, 128, 4),
              (64, 64, 128, 8), (16, 128, 64, 4), (32, 128, 64, 4), (64, 128, 64, 8), (16, 256, 32, 4)]


def sweep(t: int) -> None:
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
        "router": lambda: skinny.linear(xr, wr, None, torch.empty(t, 32, device=DEV)),
        "head mix": lambda: skinny.linear(xh, wh, None, torch.empty(t, 4, device=DEV)),
    }
    cublas = {"router": lambda: xr @ wr.t(), "head mix": lambda: xh @ wh.t()}
    print(f"{'case':<10} {'tile (BM, MIN_KC, CHUNKS, warps)':<34} {'chunks':>6} {'us':>8}  same bits")
    base_tile = skinny.TILE
    for name, run in cases.items():
        ref = run().clone()
        for tile in CANDIDATES:
            skinny.TILE = tile
            try:
                k = 8192 if name != "router" else 2048
                sec = graph_time([run])
                same = torch.equal(run(), ref)
                print(f"{name:<10} {str(tile):<34} {k // skinny.chunk(k, tile):>6} {sec * 1e6:8.2f}  {same}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 (a tile that fails to compile or run: say so, go on)
                print(f"{name:<10} {str(tile):<34} failed: {type(e).__name__}: {e}"[:160], flush=True)
            finally:
                skinny.TILE = base_tile
        if name in cublas:
            print(f"{name:<10} {'cuBLAS':<34} {'':>6} {graph_time([cublas[name]]) * 1e6:8.2f}", flush=True)


def fused_sum(t: int) -> None:
    print(f"\nsplit-K linears, fp8_block128, M = {t}: fused sum vs the standalone sum kernel")
    print(f"{'N x K':<12} {'mode':<5} {'split':>5} {'fused us':>9} {'unfused us':>11}  same bits")
    real = splitk.counters
    for n, k in LINEARS:
        w = rand_weight("fp8_block128", (n, k))
        x = torch.randn(t, k, device=DEV).to(BF)
        for bi in (False, True):
            run = lambda: gemm.linear(x, w, batch_invariant=bi)  # noqa: E731
            bm, bn, bk = qgemm.tiles_for(t, w.format, bi)
            split = (qgemm.bi_split(n, k) if bi else
                     qgemm.split_for(-(-n // bn) * -(-t // bm), k, bk, qgemm.MIN_PROGRAMS))[0]
            a = run()
            fused = graph_time([run])
            splitk.counters = lambda *_: None
            try:
                b = run()
                plain = graph_time([run])
            finally:
                splitk.counters = real
            print(f"{f'{n}x{k}':<12} {'BI' if bi else 'def':<5} {split:>5} {fused * 1e6:9.2f} {plain * 1e6:11.2f}  "
                  f"{torch.equal(a, b)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=64)
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    if a.sweep:
        sweep(a.t)
    fused_sum(a.t)


if __name__ == "__main__":
    main()
