"""Throughput of the reference platform's compiled fixed-point GEMM (platforms/reference/native/fixed_gemm.c).

Times `native.gemm` on SmolLM2-135M's decode shapes (16 rows by default), min over rounds, in
multiply-adds per second: process CPU time with one thread (steadier on a busy host), wall time
with more; checks each
result against numerics' torch form bit for bit. The tile the build uses (256-bit, or 512-bit
where the compiler targets AVX-512) follows from the host: the first line says which.

    python benchmarks/native_gemm.py [--rows 16] [--rounds 5] [--threads 1]
    python benchmarks/native_gemm.py --step [--rows 16] [--rounds 5] [--threads 2]

--step times a decode step's linears instead: 30 layers of distinct weights (qkv, o, gate_up,
down) and the lm_head, streamed from memory in order as a step reads them, each weight packed both
ways (affine codes as a Q4_1 / Q8_0 GGUF weight's grid packs, 4 bits in the layers and 8 in the
lm_head; and float32 panels), the two forms alternating round by round; checks both give the same
bits.
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
    ap.add_argument("--step", action="store_true", help="a decode step's 121 linears, affine and float32 panels")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from shuili.platforms.reference import native

    if a.step:
        return step(a, native)

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


def step(a, native) -> None:
    from shuili.hal import numerics

    print(f"{cpu_model()}, avx512f: {has_avx512()}, torch {torch.__version__}, threads {a.threads}")
    g = torch.Generator().manual_seed(0)
    shapes = [(n, k, 4) for _ in range(30) for name, (n, k) in SHAPES.items() if name != "lm_head"]
    shapes.append((*SHAPES["lm_head"], 8))
    forms: dict[str, list] = {"affine": [], "float32": []}
    for n, k, bits in shapes:
        q = native.affine_grid(g, n, k, bits, numerics.dot_bits(k)[1])
        sb = numerics.pow2(torch.randint(-40, -10, (1, n), generator=g))
        forms["affine"].append((native.pack(q), sb, n, k))
        forms["float32"].append((native.pack(q, affine=False), sb, n, k))
        del q
    xs = {k: torch.randn(a.rows, k, generator=g) for k in {k for _, k, _ in shapes}}
    for name, ws in forms.items():
        mb = sum(p.data.numel() * p.data.element_size() for p, *_ in ws) / 1e6
        print(f"{name:8} panels: {mb:7.1f} MB, bits {sorted({p.bits for p, *_ in ws})}")
    outs = {name: [native.linear(xs[k], numerics.dot_bits(k)[0], p, sb, n) for p, sb, n, k in ws]
            for name, ws in forms.items()}
    same = all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(*outs.values()))
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(a.rounds):
        for name, ws in forms.items():
            t = time.perf_counter()
            for p, sb, n, k in ws:
                native.linear(xs[k], numerics.dot_bits(k)[0], p, sb, n)
            times[name].append(time.perf_counter() - t)
    macs = a.rows * sum(n * k for n, k, _ in shapes)
    for name, ts in times.items():
        print(f"{name:8} step linears: min {min(ts) * 1e3:6.1f} ms, median {sorted(ts)[len(ts) // 2] * 1e3:6.1f} ms, "
              f"{macs / min(ts) / 1e9:5.1f} GMAC/s")
    print(f"bits: {'same' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
