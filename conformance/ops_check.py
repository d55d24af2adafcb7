"""Op-level checks: every op of the contract, on fuzzed cases, against the reference platform.

Per op, three checks, each over `cases` fuzzed inputs (fresh seeds unless a seed is given):
  vs_reference       the platform's output vs the reference's on the same inputs: bitwise when
                     the op declares portable_bitwise, else within the dtype's tolerance
  run_to_run         two identical calls give identical bits (held when declared >= run_to_run)
  batch_invariance   each sampled unit (row / token / sequence) computed alone is bit-identical
                     to its part of the batched call (held when declared >= batch_invariant;
                     measured and reported as info otherwise)
A declared level the op does not meet is a FAIL naming the claim, the case and the divergence.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import torch

from shuili.conformance import fuzz
from shuili.conformance.compare import Divergence, compare_outputs
from shuili.conformance.report import CheckResult
from shuili.hal import DeterminismLevel, ResolvedPlatform
from shuili.hal.ops import OP_NAMES, OP_SPECS, accepts
from shuili.hal.types import Weight

L = DeterminismLevel
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def case_seed(run_seed: int, op: str, index: int) -> int:
    """Stable per (run seed, op, case index) on every host (crc32, not Python's salted hash)."""
    return (run_seed * 1_000_003 + zlib.crc32(op.encode()) * 7919 + index) % (2 ** 63)


# ------------------------------------------------------------------------------ moving arguments
def _map(value: Any, fn: Callable[[torch.Tensor, bool], torch.Tensor], act: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value, act)
    if isinstance(value, Weight):
        scale = None if value.scale is None else fn(value.scale, False)
        return Weight(value.format, fn(value.data, act and value.format == "dense"), scale, value.shape)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return type(value)(fn(v, act) for v in value)
    return value


def place(kwargs: dict, act: tuple[str, ...], device: str, dtype: torch.dtype) -> dict:
    """Fresh copies of the arguments on `device`, activations in `dtype` (ops may write in place)."""

    def move(t: torch.Tensor, is_act: bool) -> torch.Tensor:
        t = t.to(device)
        if is_act and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        return t.clone()

    return {k: _map(v, move, k in act) for k, v in kwargs.items()}


def outputs(op: str, kwargs: dict, ret: Any) -> list[torch.Tensor]:
    if op in ("cache_write", "kv_write"):
        if ret is not None:
            raise TypeError(f"{op} must return None (it writes in place), returned {type(ret)}")
        ret = kwargs["cache"]
    items = list(ret) if isinstance(ret, (tuple, list)) else [ret]
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op} output {i} is {type(t).__name__}, the contract returns tensors")
    return [t.detach().cpu() for t in items]


def call(fn: Callable, op: str, kwargs: dict, act: tuple[str, ...], device: str,
         dtype: torch.dtype) -> list[torch.Tensor]:
    args = place(kwargs, act, device, dtype)
    # optional contract hints go only to an implementation that names them (HAL 1.2)
    for name in OP_SPECS[op].hints:
        if name in args and not accepts(fn, name):
            del args[name]
    return outputs(op, args, fn(**args))


# ----------------------------------------------------------------------------------- the checks
@dataclasses.dataclass
class Plan:
    """What to run for one op on one platform."""

    op: str
    level: DeterminismLevel
    dtypes: tuple[str, ...]
    formats: tuple[str | None, ...]  # None: the op has no format axis


def _declared(names, allowed) -> tuple[str, ...]:
    return tuple(n for n in names if n in allowed)


def plan_op(platform: ResolvedPlatform, op: str, reference: ResolvedPlatform) -> Plan:
    cap = platform.capabilities.op(op)
    dtypes = _declared([d.name for d in cap.dtypes], FLOAT_DTYPES)
    if not dtypes:
        dtypes = _declared(platform.capabilities.compute_dtypes, FLOAT_DTYPES) or ("float32",)
    formats: tuple[str | None, ...] = (None,)
    declared = tuple(f.name for f in cap.formats)
    if op in fuzz.FORMAT_AXES:
        axis = fuzz.FORMAT_AXES[op]
        formats = _declared(declared, axis) or (("dense",) if axis == fuzz.WEIGHT_FORMATS else axis)
    return Plan(op, cap.determinism, dtypes, formats)


def _kv_formats(platform: ResolvedPlatform, op: str) -> tuple[str, ...]:
    cap = platform.capabilities.op(op)
    return _declared([f.name for f in cap.formats], fuzz.KV_FORMATS)


def _units(case: fuzz.Case, seed: int) -> list[int]:
    """First, last and one in between: enough to catch position and population dependence."""
    n = case.units
    mid = (seed % (n - 2)) + 1 if n > 2 else 0
    return sorted({0, n - 1, mid})


class _Tally:
    def __init__(self, name: str, level: str | None):
        self.result = CheckResult(name=name, kind="op", status="pass", level=level)

    def case(self, seed: int) -> None:
        self.result.cases += 1
        self.result.seeds.append(seed)

    def diverged(self, div: Divergence, case: fuzz.Case, dtype: str, message: str,
                 status: str = "fail") -> None:
        if self.result.divergence is None:  # keep the first divergence, count the rest
            self.result.status = status  # type: ignore[assignment]
            self.result.divergence = div
            self.result.message = message
            self.result.details["case"] = f"seed={case.seed} dtype={dtype} {case.describe()}"
        self.result.details["failed_cases"] = self.result.details.get("failed_cases", 0) + 1

    def crashed(self, exc: BaseException, case: fuzz.Case, dtype: str, who: str) -> None:
        self.result.details["failed_cases"] = self.result.details.get("failed_cases", 0) + 1
        if self.result.status == "pass":
            self.result.status = "fail" if who == "platform" else "error"
            self.result.message = f"{who} raised {type(exc).__name__}: {exc}"
            self.result.details["case"] = f"seed={case.seed} dtype={dtype} {case.describe()}"

    def finish(self, passed_message: str) -> CheckResult:
        if self.result.status == "pass":
            self.result.message = passed_message.format(n=self.result.cases)
        return self.result


def check_op(platform: ResolvedPlatform, reference: ResolvedPlatform, op: str, seed: int,
             cases: int = 4, min_units: int = 1) -> list[CheckResult]:
    plan = plan_op(platform, op, reference)
    lvl = plan.level
    fn, ref_fn = platform.ops.get(op), reference.ops.get(op)
    mode = "bitwise" if lvl >= L.portable_bitwise else "tolerance"
    vs = _Tally(f"op.{op}.vs_reference", f"{lvl.name} ({mode})")
    rr = _Tally(f"op.{op}.run_to_run", lvl.name if lvl >= L.run_to_run else None)
    bi = _Tally(f"op.{op}.batch_invariance", lvl.name if lvl >= L.batch_invariant else None)
    kv_formats = _kv_formats(platform, op)
    device = platform.device
    index = big = 0
    for dtype_name in plan.dtypes:
        dtype = getattr(torch, dtype_name)
        for fmt in plan.formats:
            # the boundary sizes, then one case at the size where platforms take their prefill paths
            # (fuzz.LARGE_UNITS), seeded apart so the others keep their seeds
            large_ones = [True] if op in fuzz.LARGE_UNITS and cases > 0 else []
            for large in [False] * cases + large_ones:
                if large:
                    s, big = case_seed(seed, f"{op}/large", big), big + 1
                else:
                    s, index = case_seed(seed, op, index), index + 1
                try:
                    case = fuzz.generate(op, s, fmt, kv_formats, reference.ops, min_units, large)
                    # the reference sees exactly the values the platform sees (rounded to dtype)
                    ref_in = place(case.kwargs, case.act, "cpu", dtype)
                    expected = call(ref_fn, op, _to_f32(ref_in, case.act), case.act, "cpu", torch.float32)
                except Exception as exc:  # the suite's own inputs or the reference broke
                    vs.crashed(exc, fuzz.Case(op, s, {}, (), 0), dtype_name, "reference/generator")
                    continue
                for t in (vs, rr, bi):
                    t.case(s)
                try:
                    got = call(fn, op, case.kwargs, case.act, device, dtype)
                except Exception as exc:
                    vs.crashed(exc, case, dtype_name, "platform")
                    continue
                scales = _sum_scales(op, ref_in) if mode == "tolerance" else None
                div = compare_outputs(expected, got, mode, {"case_seed": s}, scales)
                if div is not None:
                    vs.diverged(div, case, dtype_name,
                                f"declares {lvl.name}: output differs from the reference ({mode})")
                if lvl >= L.run_to_run:
                    _run_to_run(rr, fn, op, case, device, dtype, dtype_name, got, lvl)
                _batch_invariance(bi, fn, op, case, device, dtype, dtype_name, got, lvl, s)
    out = [vs.finish(f"{mode} match with the reference on {{n}} cases")]
    if lvl >= L.run_to_run:
        out.append(rr.finish("identical bits on a repeated call, {n} cases"))
    else:
        out.append(CheckResult(name=rr.result.name, kind="op", status="skip",
                               message=f"declared {lvl.name}: no run-to-run claim to check"))
    if lvl < L.batch_invariant and bi.result.status == "pass":
        bi.result.status = "info"
        bi.result.message = f"declared {lvl.name}; observed batch-invariant on {bi.result.cases} cases"
    out.append(bi.finish("each unit alone equals its rows of the batch, {n} cases"))
    for r in out:
        r.details.update({"dtypes": list(plan.dtypes), "formats": [f for f in plan.formats if f],
                          "source": platform.ops.sources.get(op, platform.name)})
    return out


def _dequantized(w) -> torch.Tensor:
    """A weight's logical values, float64 (the tolerance scales' arithmetic)."""
    from shuili.platforms.reference.public import dequantize_weight

    return (w.data if w.format == "dense" else dequantize_weight(w)).double()


def _linear_scale(kw: dict) -> list[torch.Tensor]:
    # [T, N]: sum_k |x[t, k] * w[n, k]|, plus |bias|
    mag = kw["x"].double().abs() @ _dequantized(kw["w"]).abs().t()
    return [mag if kw.get("bias") is None else mag + kw["bias"].double().abs()]


def _block_diagonal_scale(kw: dict) -> list[torch.Tensor]:
    wf = _dequantized(kw["w"]).abs()  # [G, N, K]
    g, n, k = wf.shape
    x = kw["x"].double().abs()
    # [T, G*N]: block g's sum_k |x[t, g*K + k] * w[g, n, k]|
    return [torch.einsum("tgk,gnk->tgn", x.view(x.shape[0], g, k), wf).reshape(x.shape[0], g * n)]


def _moe_scale(kw: dict) -> list[torch.Tensor]:
    """[T, D]: the magnitudes an expert output's rounding error scales with. Per (token, slot):
    GEMM1's terms |W13| @ |x| carry into a = silu(g) * u through its slope (|u| silu'(g) +
    |silu(g)|, silu' <= 1.1), and GEMM2's terms are |W2| @ (|a| + that), weighted by |w|."""
    x, ids, wts = kw["x"].double(), kw["topk_ids"].long(), kw["topk_weights"].double()
    w13, w2, lim = _dequantized(kw["w13"]), _dequantized(kw["w2"]), kw.get("swiglu_limit")
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for j in range(ids.shape[1]):
        w1e, w2e = w13[ids[:, j]], w2[ids[:, j]]  # [T, 2I, D], [T, D, I]
        h = torch.einsum("tnd,td->tn", w1e, x)
        mag1 = torch.einsum("tnd,td->tn", w1e.abs(), x.abs())
        g, u = h[:, :inter], h[:, inter:]
        if lim is not None:
            g, u = g.clamp(max=lim), u.clamp(-lim, lim)
        s = torch.nn.functional.silu(g)
        a = (s.abs() * u.abs()) + (1.1 * u.abs() + s.abs()) * (mag1[:, :inter] + mag1[:, inter:])
        out += wts[:, j, None].abs() * torch.einsum("tdi,ti->td", w2e.abs(), a)
    return [out]


# ops whose outputs are dot products, with the magnitudes their rounding error scales with
_SUM_SCALES: dict[str, Callable[[dict], list[torch.Tensor]]] = {
    "linear": _linear_scale, "block_diagonal_linear": _block_diagonal_scale, "moe_experts": _moe_scale}


def _sum_scales(op: str, kwargs: dict) -> list[torch.Tensor] | None:
    fn = _SUM_SCALES.get(op)
    return fn(kwargs) if fn is not None else None


def _to_f32(kwargs: dict, act: tuple[str, ...]) -> dict:
    def up(t: torch.Tensor, is_act: bool) -> torch.Tensor:
        return t.float() if is_act and t.is_floating_point() else t

    return {k: _map(v, up, k in act) for k, v in kwargs.items()}


def _run_to_run(tally, fn, op, case, device, dtype, dtype_name, first, lvl) -> None:
    try:
        again = call(fn, op, case.kwargs, case.act, device, dtype)
    except Exception as exc:
        tally.crashed(exc, case, dtype_name, "platform")
        return
    div = compare_outputs(first, again, "bitwise", {"case_seed": case.seed, "call": 2})
    if div is not None:
        tally.diverged(div, case, dtype_name, f"declares {lvl.name}: a repeated identical call gave other bits")


def _batch_invariance(tally, fn, op, case, device, dtype, dtype_name, batched, lvl, seed) -> None:
    if case.split is None or case.units < 2:
        return
    for unit in _units(case, seed):
        sub, sel_batched, sel_alone = case.split(unit)
        try:
            alone = call(fn, op, sub, case.act, device, dtype)
        except Exception as exc:
            tally.crashed(exc, case, dtype_name, "platform")
            return
        div = compare_outputs(sel_batched(batched), sel_alone(alone), "bitwise",
                              {"case_seed": case.seed, "unit": unit, "of_units": case.units})
        if div is not None:
            div.note = (div.note + "; " if div.note else "") + "expected = in the batch, got = alone"
            claim = f"declares {lvl.name}" if lvl >= L.batch_invariant else f"declared {lvl.name} (no claim)"
            tally.diverged(div, case, dtype_name,
                           f"{claim}: unit {unit} computed alone differs from the same unit in a "
                           f"batch of {case.units}",
                           status="fail" if lvl >= L.batch_invariant else "info")
            return


def check_ops(platform: ResolvedPlatform, reference: ResolvedPlatform, seed: int, cases: int = 4,
              ops: list[str] | None = None) -> list[CheckResult]:
    names = list(ops) if ops else list(OP_NAMES)
    unknown = [n for n in names if n not in OP_NAMES]
    if unknown:
        raise ValueError(f"unknown ops {unknown}; the contract has {list(OP_NAMES)}")
    results: list[CheckResult] = []
    for op in names:
        results += check_op(platform, reference, op, seed, cases)
    return results


# ------------------------------------------------------------------------------ negative control
def _one_ulp(fn: Callable) -> Callable:
    def wrapped(**kw):
        y = fn(**kw)
        return torch.nextafter(y, torch.full_like(y, float("inf")))

    return wrapped


def _row_count_dependent_linear(x, w, bias=None):
    # the naive-vendor GEMM: a plain matmul, whose kernel (and bits) depend on the row count
    from shuili.platforms.reference.public import dequantize_weight

    wf = w.data.float() if w.format == "dense" else dequantize_weight(w)
    y = x.float() @ wf.t()
    return y if bias is None else y + bias


def negative_control(reference: ResolvedPlatform, seed: int) -> list[CheckResult]:
    """Prove the op checks can fail: a 1-ulp-perturbed op must fail vs_reference, and a
    row-count-dependent GEMM must fail batch_invariance. Passing here means they were caught."""
    caps = reference.capabilities
    ops = reference.ops.as_dict()
    ops["rms_norm"] = _one_ulp(ops["rms_norm"])
    ops["linear"] = _row_count_dependent_linear
    from shuili.hal.ops import DispatchTable

    fake = dataclasses.replace(reference, ops=DispatchTable("negative-control", ops, {}),
                               capabilities=caps)
    out = []
    for op, check in (("rms_norm", "vs_reference"), ("linear", "batch_invariance")):
        res = {r.name: r for r in check_op(fake, reference, op, seed, cases=2, min_units=8)}[f"op.{op}.{check}"]
        caught = res.status == "fail"
        out.append(CheckResult(
            name=f"control.op.{op}.{check}", kind="control", status="pass" if caught else "fail",
            level="must fail", seeds=res.seeds, cases=res.cases, divergence=res.divergence,
            message=("caught: " + res.message) if caught else
            f"NOT caught: a deliberately broken {op} passed {check}; the suite is not sensitive"))
    return out
