"""Would float32 storage of the reference GEMM's weight grids pay? CPU time per decode GEMM.

The reference platform's `linear` multiplies integer-valued float64 grids (hal/numerics.py `dot`:
22 + 21 bits at K = 576) with a float64 matmul; the weight grid is cached as float64. Its values
fit in float32 exactly (|q| <= 2**21), which would halve its memory, but no float64 GEMM reads
float32 (torch.matmul refuses mixed dtypes; BLAS dgemm takes doubles), so every call would first
widen the weight. This times, for SmolLM2-135M's decode shapes (16 rows), one thread, process CPU
time (min over rounds, the rounds interleaved):
  f64      the float64 grid matmul (today)
  f32+wide a float32-stored grid widened per call, then the same matmul (same exact result)
  f32 BLAS a plain float32 GEMM of the same operands (what transformers runs; not exact)
and checks that f64 and f32+wide give the same bits.

    python benchmarks/fixed_gemm_storage.py [--rows 16] [--rounds 7]
"""
from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # (N, K) of SmolLM2-135M


def cpu_per_call(fn, n: int) -> float:
    c = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - c) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from shuili.hal import numerics
    from shuili.platforms.reference.malloc import keep_freed_blocks

    keep_freed_blocks()  # as the reference platform runs
    g = torch.Generator().manual_seed(0)
    step = {"f64": 0.0, "f32+wide": 0.0, "f32 BLAS": 0.0}  # 30 layers' four GEMMs + the lm_head
    print(f"{a.rows} rows, 1 thread, torch {torch.__version__}; ms per call (min of {a.rounds} rounds)")
    for name, (n, k) in SHAPES.items():
        pa, pb = numerics.dot_bits(k)
        qa = torch.randint(-2 ** pa, 2 ** pa + 1, (a.rows, k), generator=g).double()
        q64 = torch.randint(-2 ** pb, 2 ** pb + 1, (n, k), generator=g).double()
        q32 = q64.float()
        assert torch.equal(q32.double(), q64), "the grid must fit float32 exactly"
        fns = {"f64": lambda: torch.matmul(qa, q64.t()),
               "f32+wide": lambda: torch.matmul(qa, q32.to(torch.float64).t()),
               "f32 BLAS": lambda: torch.matmul(qa.float(), q32.t())}
        same = torch.equal(fns["f64"]().view(torch.int64), fns["f32+wide"]().view(torch.int64))
        reps = max(2, int(2e8 / (n * k * a.rows)))
        best = {m: cpu_per_call(f, reps) for m, f in fns.items()}
        for _ in range(a.rounds - 1):
            for m, f in fns.items():
                best[m] = min(best[m], cpu_per_call(f, reps))
        for m in step:
            step[m] += best[m] * (1 if name == "lm_head" else 30)
        print(f"{name:8s} [{a.rows}x{k}] x [{k}x{n}]: " + ", ".join(f"{m} {best[m] * 1e3:.2f}" for m in best)
              + f"; f64 == f32+wide bitwise: {same}")
    print("one decode step's GEMMs (30 layers + lm_head): "
          + ", ".join(f"{m} {v * 1e3:.0f} ms" for m, v in step.items()))


if __name__ == "__main__":
    main()
