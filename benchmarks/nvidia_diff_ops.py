"""Per-op differential run of a V4 workload on the nvidia op table against the reference ops.

Every op call the nvidia-table model makes is repeated by the reference op on CPU copies of the
same inputs, so each call's error is its own (errors do not accumulate). Prints the ops ranked by
their worst relative error, the first call over --threshold, whether the two models hold the same
weights, and the teacher-forced logprobs against the reference model (built on the CPU, same seed)
with the first position beyond the engine check's cross_platform tolerance. One GPU run pinpoints
a divergence; the same script checks itself on the CPU:

    python benchmarks/nvidia_diff_ops.py                                   # CUDA, batch-invariant
    TRITON_INTERPRET=1 python benchmarks/nvidia_diff_ops.py --device cpu --prompts 0
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import torch

# the interpreter switch is read when the kernels are decorated: before any nvidia import
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shuili.conformance.engine_check import MODEL_TOLERANCE  # noqa: E402
from shuili.conformance.workloads import get as get_workload  # noqa: E402
from shuili.core.models import deepseek_v4  # noqa: E402
from shuili.hal.ops import OP_NAMES, DispatchTable  # noqa: E402
from shuili.hal.types import Weight  # noqa: E402
from shuili.platforms.nvidia.ops import make_ops  # noqa: E402
from shuili.platforms.reference.ops import OPS as REF  # noqa: E402


def to_cpu(x, memo: dict):
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, Weight):  # weights never change: copy each once
        if id(x) not in memo:
            memo[id(x)] = (x, Weight(x.format, to_cpu(x.data, memo),
                                     None if x.scale is None else to_cpu(x.scale, memo), x.shape))
        return memo[id(x)][1]
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v, memo) for v in x)
    if isinstance(x, dict):
        return {k: to_cpu(v, memo) for k, v in x.items()}
    return x


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| for floats (inf on a non-finite mismatch); the fraction of
    differing elements for integers (selection ops: any differing id matters)."""
    got = got.detach().cpu()
    if got.shape != want.shape:
        return math.inf
    if got.numel() == 0:
        return 0.0
    if not want.is_floating_point():
        return float((got != want.to(got.dtype)).double().mean())
    a, b = got.double(), want.double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(a[~fb].nan_to_num(0.0), b[~fb].nan_to_num(0.0)):
        return math.inf
    num, den = float((a[fb] - b[fb]).norm()), float(b[fb].norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def outputs(name, result, args):
    if name == "cache_write":  # in place: the cache is the output
        return (args[0],)
    return result if isinstance(result, tuple) else (result,)


def shapes(args) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
        if isinstance(x, Weight):
            return f"W{x.format}{list(x.shape)}"
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(one(v) for v in x) + "]"
        return repr(x) if isinstance(x, (int, float, str, bool)) or x is None else type(x).__name__
    return ", ".join(one(a) for a in args)


@dataclasses.dataclass
class Call:
    index: int
    op: str
    err: float
    args: str


class Differential:
    """An op table that runs `impls` and, on CPU copies of the same inputs, the reference."""

    def __init__(self, impls: dict):
        self.calls: list[Call] = []
        self.memo: dict = {}
        wrapped = {n: self._wrap(n, impls[n]) for n in OP_NAMES}
        self.table = DispatchTable("nvidia", wrapped, {n: "nvidia" for n in OP_NAMES})

    def _wrap(self, name, fn):
        ref = REF[name]

        def call(*args, **kwargs):
            cargs, ckw = to_cpu(args, self.memo), to_cpu(kwargs, self.memo)
            out = fn(*args, **kwargs)
            want = ref(*cargs, **ckw)
            errs = [rel_err(g, w) for g, w in zip(outputs(name, out, args), outputs(name, want, cargs))
                    if isinstance(g, torch.Tensor)]
            self.calls.append(Call(len(self.calls), name, max(errs, default=0.0), shapes(args)))
            return out

        return call


def tensors(obj, prefix: str = ""):
    """(name, tensor) of every tensor reachable through a model's dataclasses, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Weight):
        yield from tensors(obj.data, prefix + ".data")
        if obj.scale is not None:
            yield from tensors(obj.scale, prefix + ".scale")
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from tensors(getattr(obj, f.name), f"{prefix}.{f.name}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}[{i}]")


def model_tensors(m) -> dict[str, torch.Tensor]:
    out = {}
    for attr in ("embed", "head", "norm", "hc_head", "blocks", "mtp"):
        out.update(tensors(getattr(m, attr), attr))
    return out


def run_model(model, prompts: list[list[int]], ops) -> list[torch.Tensor]:
    """Teacher-forced logprobs (float32) of tokens 1..n-1 of each prompt, all prompts in one batch."""
    drv = model.driver(max_seqs=len(prompts), max_len=max(len(p) for p in prompts) + 16)
    logits = model.forward(drv.batch(list(enumerate(prompts)), logits="all"))
    lp = ops.log_softmax(logits).cpu()
    out, row = [], 0
    for p in prompts:
        tgt = torch.tensor(p[1:], dtype=torch.int64)
        out.append(lp[row:row + len(p) - 1].gather(1, tgt[:, None])[:, 0])
        row += len(p)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workload", default="tiny-v4")
    ap.add_argument("--prompts", type=int, nargs="*", default=[0, 3], help="workload prompt indices")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (the engine's default is 0)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--default-mode", action="store_true", help="nvidia default mode, not batch-invariant")
    ap.add_argument("--threshold", type=float, default=1e-4)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()

    w = get_workload(a.workload)
    diff = Differential(make_ops(batch_invariant=not a.default_mode))
    ref_ops = DispatchTable("reference", dict(REF), {n: "reference" for n in OP_NAMES})
    t0 = time.perf_counter()
    nv = deepseek_v4.build(w.model, diff.table, device=a.device, dtype=a.dtype, seed=a.seed)
    ref = deepseek_v4.build(w.model, ref_ops, device="cpu", dtype=a.dtype, seed=a.seed)
    prompts = [nv.tokenizer.encode(w.prompts[i]) for i in a.prompts]
    print(f"workload {w.name}, model {w.model}, seed {a.seed}, {a.dtype}, nvidia on {a.device} "
          f"({'default' if a.default_mode else 'batch-invariant'} mode), prompts {a.prompts} "
          f"({[len(p) for p in prompts]} tokens)")

    # 1. the same model? (random weights drawn on another device's RNG are another model)
    pn, pr = model_tensors(nv), model_tensors(ref)
    differ = [k for k in pr if k not in pn or pn[k].shape != pr[k].shape
              or not torch.equal(pn[k].cpu(), pr[k])]
    print(f"weights: {len(pr)} tensors, {len(differ)} differ from the CPU reference model"
          + (f" (first: {differ[0]})" if differ else " (identical)"))

    # 2. every op call against the reference on the same inputs
    lp_nv = run_model(nv, prompts, diff.table)
    lp_ref = run_model(ref, prompts, ref_ops)
    calls = diff.calls
    worst: dict[str, Call] = {}
    count: dict[str, int] = {}
    for c in calls:
        count[c.op] = count.get(c.op, 0) + 1
        if c.op not in worst or c.err > worst[c.op].err:
            worst[c.op] = c
    print(f"\n{len(calls)} op calls in {time.perf_counter() - t0:.1f}s; worst relative error per op "
          "(integer outputs: fraction of differing elements)")
    print(f"{'op':<18} {'calls':>5} {'max rel err':>12} {'at call':>8}  inputs of that call")
    for c in sorted(worst.values(), key=lambda c: -c.err)[:a.top]:
        print(f"{c.op:<18} {count[c.op]:>5} {c.err:>12.3e} {c.index:>8}  {c.args[:110]}")
    first = next((c for c in calls if c.err > a.threshold), None)
    if first is None:
        print(f"\nno op call over {a.threshold:g}")
    else:
        print(f"\nFIRST call over {a.threshold:g}: #{first.index} {first.op} rel err {first.err:.3e}\n"
              f"  inputs: {first.args}")

    # 3. teacher-forced logprobs, as the engine's cross_platform check compares them
    tol = MODEL_TOLERANCE
    bad_any = False
    print(f"\nteacher-forced logprobs vs the reference model (|d| <= {tol['atol']:g} + {tol['rtol']:g}|ref|)")
    for i, (g, r) in zip(a.prompts, zip(lp_nv, lp_ref)):
        d = (g.double() - r.double()).abs()
        bad = (~(d <= tol["atol"] + tol["rtol"] * r.double().abs())).nonzero()
        msg = f"  prompt {i}: max |d| {float(d.max()):.3e}"
        if bad.numel():
            k = int(bad[0])
            bad_any = True
            msg += f"; FIRST beyond tolerance at position {k + 1}: {float(g[k]):.6f} vs reference {float(r[k]):.6f}"
        print(msg)
    return 1 if (first is not None or bad_any or differ) else 0


if __name__ == "__main__":
    sys.exit(main())
