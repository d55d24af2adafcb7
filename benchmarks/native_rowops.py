"""One-thread CPU time of the reference platform's swiglu and log_softmax at SmolLM2 decode shapes.

16 rows: swiglu over [16, 2 x 1536], log_softmax over [16, 49152]; process CPU time per call, the
min of 5 rounds of 20 calls. The first line says whether the compiled row ops are in use
(SHUILI_REFERENCE_NATIVE=0 times the torch forms, which give the same bits).

    python benchmarks/native_rowops.py
"""
from __future__ import annotations

import time

import torch


def per_call_ms(fn, n: int = 20, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        c = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - c) / n)
    return best * 1e3


def main() -> None:
    torch.set_num_threads(1)
    from shuili.platforms.reference import elementwise, native, sampling

    print(native.status())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2 * 1536, generator=g) * 4
    logits = torch.randn(16, 49152, generator=g) * 8
    print(f"swiglu {per_call_ms(lambda: elementwise.swiglu(x, None)):.3f} ms, "
          f"log_softmax {per_call_ms(lambda: sampling.log_softmax(logits)):.3f} ms")


if __name__ == "__main__":
    main()
