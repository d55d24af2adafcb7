"""Throughput of the reference platform's compiled fixed-point GEMM (platforms/reference/native/fixed_gemm.c).

Times `native.gemm` on SmolLM2-135M's decode shapes (16 rows by default), min over rounds, in
multiply-adds per second: process CPU time with one thread (steadier on a busy host), wall time
with more; checks each
result against numerics' torch form bit for bit. The tile the build uses (256-bit, or 512-bit
where the compiler targets AVX-512) follows from the host: the first line says which.

    python benchmarks/native_gemm.py [--rows 16] [--rounds 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # (N, K) of SmolLM2-135M


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def has_avx512() -> bool:
    try:
        return " avx512f" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from shuili.platforms.reference import native

    if not native.enabled("gemm"):
        raise SystemExit(f"the compiled GEMM is not in use: {native.status()}")
    print(f"{cpu_model()}, avx512f: {has_avx512()}, torch {torch.__version__}, threads {a.threads}")
    g = torch.Generator().manual_seed(0)
    print(f"{'shape':8} {'N x K':>12} {'ms/call':>8} {'GMAC/s':>7}  bits")
    for name, (n, k) in SHAPES.items():
        qa = torch.randint(-2**21, 2**21, (a.rows, k), generator=g).double()
        q = torch.randint(-2**21, 2**21, (n, k), generator=g).double()
        sa = torch.rand(a.rows, 1, dtype=torch.float64, generator=g)
        sb = torch.rand(1, n, dtype=torch.float64, generator=g)
        panels = native.pack(q)
        out = native.gemm(qa, sa, panels, sb, n)
        want = (((qa @ q.T) + 0.0) * sa * sb).to(torch.float32)
        same = torch.equal(out.view(torch.int32), want.view(torch.int32))
        best = float("inf")
        clock = time.process_time if a.threads == 1 else time.perf_counter
        for _ in range(a.rounds):
            t = clock()
            native.gemm(qa, sa, panels, sb, n)
            best = min(best, clock() - t)
        print(f"{name:8} {f'{n} x {k}':>12} {best * 1e3:8.2f} {a.rows * n * k / best / 1e9:7.1f}  "
              f"{'same' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
