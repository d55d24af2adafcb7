"""The conformance suite's op and engine checks for the nvidia platform, printed as they finish
(the `shuili conformance run` CLI reports only at the end; on a time-limited device call a
partial log is worth more). Same library calls as the CLI: ops_check.check_op per op, then
engine_check.check_workload.

    SHUILI_NVIDIA_BATCH_INVARIANT=1 python benchmarks/nvidia_conformance.py --cases 1 --json out.json
"""
from __future__ import annotations

import argparse
import json
import time

from shuili.conformance import engine_check, ops_check, workloads
from shuili.hal import PlatformConfig, resolve_platform
from shuili.hal.ops import OP_NAMES


def show(r, log):
    line = f"{r.status:>5}  {r.name:<44} {r.message}"
    if r.status not in ("pass", "info", "skip") and r.details.get("case"):
        line += f"  [{r.details['case']}]"
    print(line, flush=True)
    log.append({"name": r.name, "status": r.status, "message": r.message,
                "case": r.details.get("case"), "divergence": str(r.divergence) if r.divergence else None})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-ops", action="store_true")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--workload", default="tiny-v4")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    plat = resolve_platform(PlatformConfig(platform="nvidia"))
    ref = resolve_platform(PlatformConfig(platform="reference"))
    log: list = []
    t0 = time.perf_counter()
    if not a.no_ops:
        for op in OP_NAMES:
            for r in ops_check.check_op(plat, ref, op, a.seed, cases=a.cases):
                show(r, log)
    if not a.no_engine:
        results, _ = engine_check.check_workload(workloads.get(a.workload), "nvidia", a.seed)
        for r in results:
            show(r, log)
    bad = [x for x in log if x["status"] in ("fail", "error")]
    print(f"{len(log)} checks, {len(bad)} failed, {time.perf_counter() - t0:.0f}s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(log, f, indent=1)


if __name__ == "__main__":
    main()
