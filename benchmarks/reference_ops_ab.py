"""A/B of the reference platform's small decode-step ops: another tree's rope, cache_write
and linear against this tree's, in one process, alternating (a busy host's noise
hits both alike), at SmolLM2's decode shapes (16 sequences, 1 thread).

Asserts bit-equal outputs, prints process CPU us per call (min and median of --rounds).

    python benchmarks/reference_ops_ab.py --old /path/to/other/tree [--rounds 6]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time

import torch


def load(root: str, name: str):
    spec = importlib.util.spec_from_file_location(f"old_{name}", os.path.join(root, "platforms", "reference", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cpu_per_call(fn, args, n: int) -> float:
    c = time.process_time()
    for _ in range(n):
        fn(*args)
    return (time.process_time() - c) / n


def cases(g):
    from shuili.core.models.llama import rope_tables
    from shuili.hal import numerics
    from shuili.hal.types import Weight

    cos, sin = rope_tables(64, 10000.0, 8192)
    pos = torch.arange(16) + 70
    q, k = torch.rand(16, 9, 64, generator=g) - 0.5, torch.rand(16, 3, 64, generator=g) - 0.5
    yield "rope q [16, 9, 64]", "rope", "rope", (q, pos, cos, sin, 64, False), 200
    slots = torch.arange(16) * 16 + 5
    yield "cache_write 16 rows", "kvcache", "cache_write", (torch.zeros(64, 16, 3, 64), slots, k), 200
    for n, kk in ((960, 576), (3072, 576), (576, 1536)):
        w = Weight.dense(numerics.normal((n, kk), g) * 0.05)
        yield f"linear [16, {kk}] x [{n}, {kk}]", "gemm", "linear", (numerics.normal((16, kk), g), w), 30


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="root of the other tree (its platforms/reference/*.py)")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import importlib

    from shuili.platforms.reference.malloc import keep_freed_blocks

    keep_freed_blocks()  # as the reference platform runs
    g = torch.Generator().manual_seed(0)
    print(f"1 thread, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}; us per call")
    for name, module, fn, args, n in cases(g):
        old = getattr(load(a.old, module), fn)
        new = getattr(importlib.import_module(f"shuili.platforms.reference.{module}"), fn)
        if fn == "cache_write":  # in place: compare the written caches
            c_old, c_new = args[0].clone(), args[0].clone()
            old(c_old, *args[1:])
            new(c_new, *args[1:])
            assert torch.equal(c_old, c_new), f"{name}: bits differ"
        else:
            assert torch.equal(bits(old(*args)), bits(new(*args))), f"{name}: bits differ"
        to, tn = [], []
        for _ in range(a.rounds):
            to.append(cpu_per_call(old, args, n))
            tn.append(cpu_per_call(new, args, n))
        to.sort()
        tn.sort()
        m = len(to) // 2
        print(f"{name}: old {to[0] * 1e6:.0f} (median {to[m] * 1e6:.0f}), new {tn[0] * 1e6:.0f} "
              f"(median {tn[m] * 1e6:.0f}); bits equal")


if __name__ == "__main__":
    main()
