"""Cost of calling an op through the resolved DispatchTable vs through a pluggy hook.

shuili resolves a platform once into a frozen table of plain callables; this measures what that
saves per call against the alternative design where every op call goes through `pm.hook`.

    python benchmarks/hal_dispatch_bench.py [--json]
"""
from __future__ import annotations

import argparse
import json
import platform
import timeit

import pluggy
import torch

from shuili.hal import PlatformConfig, resolve_platform

spec = pluggy.HookspecMarker("shuili_bench")
impl = pluggy.HookimplMarker("shuili_bench")


class OpHooks:
    @spec(firstresult=True)
    def bench_rms_norm(self, x, weight, eps):
        """per-op dispatch through pluggy (the design shuili does not use)"""


def hooked_manager(fn, n_impls: int):
    pm = pluggy.PluginManager("shuili_bench")
    pm.add_hookspecs(OpHooks)

    class Impl:
        @impl
        def bench_rms_norm(self, x, weight, eps):
            return fn(x, weight, eps)

    class Decline:  # another plugin that answers None for this platform, as firstresult allows
        @impl
        def bench_rms_norm(self, x, weight, eps):
            return None

    pm.register(Impl())
    for _ in range(n_impls - 1):
        pm.register(Decline(), name=f"decline{_}")
    return pm


def best_ns(stmt, number: int, repeat: int = 7) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=repeat)) / number * 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--number", type=int, default=20000)
    args = ap.parse_args()
    ops = resolve_platform(PlatformConfig(platform="reference")).ops
    noop = lambda x, weight, eps: x  # noqa: E731  isolates dispatch cost from the op's work
    x, w = torch.randn(1, 576), torch.randn(576)
    rows = []
    for label, fn in (("no-op body", noop), ("rms_norm [1,576]", ops.rms_norm)):
        table_fn = fn
        pm1, pm2 = hooked_manager(fn, 1), hooked_manager(fn, 2)
        rows.append({
            "op": label,
            "direct_ns": best_ns(lambda: table_fn(x, w, 1e-6), args.number),
            "dispatch_table_ns": best_ns(lambda: ops.rms_norm(x, w, 1e-6), args.number)
            if fn is not noop else best_ns(lambda: noop(x, w, 1e-6), args.number),
            "pm_hook_1impl_ns": best_ns(lambda: pm1.hook.bench_rms_norm(x=x, weight=w, eps=1e-6), args.number),
            "pm_hook_2impl_ns": best_ns(lambda: pm2.hook.bench_rms_norm(x=x, weight=w, eps=1e-6), args.number),
        })
    env = {"python": platform.python_version(), "pluggy": pluggy.__version__, "torch": torch.__version__,
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps({"env": env, "rows": rows}, indent=2))
        return
    print(f"env: {env}")
    print(f"{'op':<18} {'direct':>9} {'table':>9} {'pm.hook':>9} {'pm.hook x2':>11}   (ns per call, best of 7)")
    for r in rows:
        print(f"{r['op']:<18} {r['direct_ns']:9.0f} {r['dispatch_table_ns']:9.0f} "
              f"{r['pm_hook_1impl_ns']:9.0f} {r['pm_hook_2impl_ns']:11.0f}")


if __name__ == "__main__":
    main()
