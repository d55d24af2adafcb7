"""KV blocks a byte budget buys per cache group, under the old rule (every pool the same size) and
core/kv_sizing.py's (sliding pools sized by their window), against what a batch of long prompts
needs. CPU only; shapes from the model's cache groups.

    python benchmarks/kv_capacity.py [--model mid-v4 --kv-gib 8 --block 128 --budget 8192]
"""
from __future__ import annotations

import argparse

from shuili.core.kv_sizing import cdiv, pool_sizes
from shuili.core.models.deepseek_v4_cache import cache_groups
from shuili.core.models.deepseek_v4_config import named


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mid-v4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-gib", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--output-len", type=int, default=49)
    ap.add_argument("--cases", default="64:128,8:1024,8:4096,8:16384,32:4096,8:65536,1:1048000",
                    help="batch:prompt pairs")
    args = ap.parse_args()
    P, budget = args.block, args.kv_gib << 30
    groups = cache_groups(named(args.model), args.dtype)
    per = {g.name: g.bytes_per_block(P) for g in groups}
    print("bytes per block:", ", ".join(f"{k} {v / 2**20:.3f} MiB" for k, v in per.items()))
    print(f"{'batch':>5} {'prompt':>8} {'blocks needed':>14} {'old pools':>10} {'new full pools':>15} "
          f"{'new sliding':>12}")
    for case in args.cases.split(","):
        b, n = (int(v) for v in case.split(":"))
        max_len = n + args.output_len + 15
        need = b * cdiv(n + args.output_len, P)
        cap = b * cdiv(max_len, P) + 1
        old = min(budget // sum(per.values()), cap)
        new = pool_sizes(groups, P, budget, b, args.budget, max_len)
        full = min(v for k, v in new.items() if k.endswith(("_kv", "_idx")) and k != "swa_kv")
        print(f"{b:>5} {n:>8} {need:>14} {old:>10} {full:>15} {new['swa_kv']:>12}"
              + ("   old rule: runs in waves" if old < need else ""))


if __name__ == "__main__":
    main()
