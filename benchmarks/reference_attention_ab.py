"""A/B of the reference platform's paged_attention: another tree's attention.py against this one's,
in one process, alternating (a busy host's noise hits both alike), plus float32 -> float64
widening done in one mixed-dtype multiply or as a copy and an in-place multiply.

Asserts bit-equal outputs, prints process CPU ms per call (min and median of --rounds).

    python benchmarks/reference_attention_ab.py --old /path/to/other/tree [--rounds 8]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time

import torch


def case(g, b: int, qlen: int, ctx: int, window: int = 0, h: int = 9, kvh: int = 3, d: int = 64, p: int = 16):
    per = ctx // p + 2
    kc = torch.rand(b * per, p, kvh, d, generator=g) - 0.5
    vc = torch.rand(b * per, p, kvh, d, generator=g) - 0.5
    lens = torch.tensor([ctx - b // 2 + i for i in range(b)], dtype=torch.int32)
    table = torch.randperm(b * per, generator=g).reshape(b, per).to(torch.int32)
    qsl = torch.arange(b + 1, dtype=torch.int32) * qlen
    q = torch.rand(b * qlen, h, d, generator=g) - 0.5
    return q, kc, vc, table, lens, qsl, 0.125, window


def cpu_per_call(fn, args, n: int) -> float:
    c = time.process_time()
    for _ in range(n):
        fn(*args)
    return (time.process_time() - c) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="root of the other tree (its platforms/reference/attention.py)")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from shuili.platforms.reference import attention as new
    from shuili.platforms.reference.malloc import keep_freed_blocks

    keep_freed_blocks()  # as the reference platform runs
    spec = importlib.util.spec_from_file_location(
        "old_attention", os.path.join(a.old, "platforms", "reference", "attention.py"))
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    g = torch.Generator().manual_seed(0)
    print(f"1 thread, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}; ms per call")
    for name, args, n in (("decode: 16 seqs, ~80 keys", case(g, 16, 1, 80), 20),
                          ("decode: 16 seqs, ~300 keys, window 64", case(g, 16, 1, 300, 64), 20),
                          ("prefill: 16 seqs x 32 queries", case(g, 16, 32, 40), 5)):
        ref, got = old.paged_attention(*args), new.paged_attention(*args)
        assert torch.equal(ref.view(torch.int32), got.view(torch.int32)), f"{name}: bits differ"
        to, tn = [], []
        for _ in range(a.rounds):
            to.append(cpu_per_call(old.paged_attention, args, n))
            tn.append(cpu_per_call(new.paged_attention, args, n))
        to.sort()
        tn.sort()
        m = len(to) // 2
        print(f"{name}: old {to[0] * 1e3:.2f} (median {to[m] * 1e3:.2f}), "
              f"new {tn[0] * 1e3:.2f} (median {tn[m] * 1e3:.2f}); bits equal")
    for shape, sshape in (((16, 576), (16, 1)), ((16, 3, 75, 64), (16, 3, 75, 1)),
                          ((512, 576), (512, 1)), ((16, 3, 300, 64), (16, 3, 300, 1))):
        x = torch.rand(shape, generator=g) - 0.5
        s = torch.rand(sshape, generator=g, dtype=torch.float64)
        assert torch.equal(x * s, x.to(torch.float64).mul_(s))
        n = max(20, int(2e6 / x.numel()))
        mixed = min(cpu_per_call(lambda: x * s, (), n) for _ in range(a.rounds))
        copy = min(cpu_per_call(lambda: x.to(torch.float64).mul_(s), (), n) for _ in range(a.rounds))
        print(f"widen {list(shape)}: mixed-dtype multiply {mixed * 1e3:.3f}, copy + mul_ {copy * 1e3:.3f}")


if __name__ == "__main__":
    main()
