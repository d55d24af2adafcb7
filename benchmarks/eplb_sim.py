"""EPLB simulator: replay skewed routing traces, plan placements, report max/mean rank load.

A trace is a sequence of steps; each step routes `tokens` tokens to top-k of E experts drawn
from a skewed popularity (log-normal per layer, sigma --skew) that drifts a little each step.
The planner sees the load of the first half of the trace (the counters the engine keeps) and is
scored on the second half, so the numbers are what a placement planned from the past does to
the future. Before: experts placed contiguously, no redundancy. After: `core/parallel/eplb.plan`,
hierarchical over nodes of --gpus-per-node ranks, with --redundant extra slots.

    PYTHONPATH=. python benchmarks/eplb_sim.py                 # 64 and 256 ranks, V4's 256 experts
    PYTHONPATH=. python benchmarks/eplb_sim.py --ranks 64 --json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from shuili.core.parallel.eplb import Placement, imbalance, plan
from shuili.hal.numerics import normal


def trace(layers: int, experts: int, k: int, steps: int, tokens: int, skew: float, seed: int) -> torch.Tensor:
    """int64 [steps, layers, experts]: pairs routed per expert in each step."""
    g = torch.Generator().manual_seed(seed)
    logp = normal((layers, experts), g, 0.0, skew)  # host-independent draws
    out = torch.zeros(steps, layers, experts, dtype=torch.int64)
    for s in range(steps):
        logp = logp + normal((layers, experts), g, 0.0, 0.05)  # slow drift
        p = torch.softmax(logp, -1)
        for layer in range(layers):
            ids = torch.multinomial(p[layer].expand(tokens, -1), k, replacement=False, generator=g)
            out[s, layer] = torch.bincount(ids.flatten(), minlength=experts)
    return out


def run(ranks: int, experts: int, k: int, layers: int, steps: int, tokens: int, skew: float, redundant: int,
        gpus_per_node: int, seed: int) -> dict:
    tr = trace(layers, experts, k, steps, tokens, skew, seed)
    past, future = tr[: steps // 2].sum(0), tr[steps // 2:].sum(0)
    before = Placement.contiguous(layers, experts, ranks)
    t0 = time.process_time()
    nodes = max(1, ranks // gpus_per_node)
    after = plan(past.double(), ranks, (experts + redundant) // ranks, nodes)
    plan_s = time.process_time() - t0
    flat = plan(past.double(), ranks, (experts + redundant) // ranks, 1)
    return {"ranks": ranks, "experts": experts, "top_k": k, "layers": layers, "redundant": redundant,
            "nodes": nodes, "tokens_per_step": tokens, "steps": steps, "skew": skew,
            "max_over_mean_before": round(imbalance(before.rank_load(future)), 3),
            "max_over_mean_after_hierarchical": round(imbalance(after.rank_load(future)), 3),
            "max_over_mean_after_global": round(imbalance(flat.rank_load(future)), 3),
            "max_over_mean_after_on_planned_window": round(imbalance(after.rank_load(past)), 3),
            "plan_cpu_s": round(plan_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="*", default=[64, 256])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4, help="MoE layers simulated (each planned on its own)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens routed per step")
    ap.add_argument("--skew", type=float, default=1.0, help="sigma of the log-normal expert popularity")
    ap.add_argument("--redundant-per-rank", type=int, default=1, help="extra slots per rank")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = [run(r, a.experts, a.top_k, a.layers, a.steps, a.tokens, a.skew, a.redundant_per_rank * r,
                a.gpus_per_node, a.seed) for r in a.ranks]
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print("ranks  slots/rank  nodes  max/mean before  after (hier.)  after (global)  plan CPU s")
    for r in rows:
        print(f"{r['ranks']:>5}  {(r['experts'] + r['redundant']) // r['ranks']:>10}  {r['nodes']:>5}  "
              f"{r['max_over_mean_before']:>15}  {r['max_over_mean_after_hierarchical']:>13}  "
              f"{r['max_over_mean_after_global']:>14}  {r['plan_cpu_s']:>10}")


if __name__ == "__main__":
    main()
