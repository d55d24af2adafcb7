"""Comparators: bitwise (raw bits; +0 != -0) and tolerance (per dtype), both reporting the first
divergence with both values and both bit patterns. NaN in the checked output is always a failure.
"""
from __future__ import annotations

import struct
from typing import Any

import torch
from pydantic import BaseModel

# (rtol, atol) for tolerance-level claims, by the dtype of the lower-precision side.
# float32 admits a different reduction order over a few thousand terms; the 16-bit ones ~2 ulp.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "bfloat16": (1.6e-2, 1e-2),
    "float16": (2e-3, 1e-3),
}
# for outputs that are sums (a GEMM's dot products), the rounding error scales with the sum of the
# terms' magnitudes, not with the result: a cancelling dot product of 0.006 from terms summing to 170
# is off by ~1e-7 * 170 in float32 whatever the order. Bound: SUM_RTOL * sum_k |x_k w_k| on top.
SUM_RTOL: dict[str, float] = {"float64": 1e-13, "float32": 2e-6, "bfloat16": 1.6e-2, "float16": 2e-3}
_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}


class Divergence(BaseModel):
    """Where two results first differ. `where` names the place (output/index, request/step)."""

    where: dict[str, Any]
    expected: Any = None
    got: Any = None
    expected_bits: str | None = None
    got_bits: str | None = None
    mismatches: int = 0
    total: int = 0
    max_abs_diff: float | None = None
    note: str = ""

    def line(self) -> str:
        place = ", ".join(f"{k}={v}" for k, v in self.where.items())
        vals = f"expected {self.expected!r}"
        if self.expected_bits:
            vals += f" ({self.expected_bits})"
        vals += f", got {self.got!r}"
        if self.got_bits:
            vals += f" ({self.got_bits})"
        extra = f"; {self.mismatches}/{self.total} elements differ" if self.total else ""
        if self.max_abs_diff is not None:
            extra += f", max |diff| {self.max_abs_diff:.3e}"
        note = f" [{self.note}]" if self.note else ""
        return f"at {place}: {vals}{extra}{note}"


def f32_bits(x: float) -> str:
    return "0x%08x" % struct.unpack("<I", struct.pack("<f", x))[0]


def bits_of(t: torch.Tensor) -> str | None:
    """Hex bit pattern of a one-element tensor (None for integer and bool dtypes)."""
    if t.dtype not in _INT_VIEW:
        return None
    width = t.element_size() * 2
    raw = int(t.reshape(1).view(_INT_VIEW[t.dtype])[0]) & ((1 << (width * 4)) - 1)
    return f"0x{raw:0{width}x}"


def _scalar(t: torch.Tensor):
    return t.item() if t.numel() == 1 else t.tolist()


def _at(t: torch.Tensor, flat: int) -> tuple[list[int], torch.Tensor]:
    idx = list(torch.unravel_index(torch.tensor(flat), t.shape)) if t.dim() else []
    return [int(i) for i in idx], t.reshape(-1)[flat:flat + 1]


def _divergence(where: dict, exp: torch.Tensor, got: torch.Tensor, bad: torch.Tensor,
                note: str = "") -> Divergence:
    flat = int(bad.reshape(-1).nonzero()[0])
    index, e = _at(exp, flat)
    _, g = _at(got, flat)
    diff = None
    if exp.is_floating_point() and got.is_floating_point():
        d = (exp.double() - got.double()).abs()
        d = d[torch.isfinite(d)]
        diff = float(d.max()) if d.numel() else None
    return Divergence(where={**where, "index": index}, expected=_scalar(e), got=_scalar(g),
                      expected_bits=bits_of(e), got_bits=bits_of(g), mismatches=int(bad.sum()),
                      total=bad.numel(), max_abs_diff=diff, note=note)


def compare(expected: torch.Tensor, got: torch.Tensor, mode: str, where: dict | None = None,
            tolerance_dtype: str | None = None, scale: torch.Tensor | None = None) -> Divergence | None:
    """None when `got` matches `expected` under `mode` ("bitwise" | "tolerance"), else where not.

    `scale` (tolerance only): per element, the sum of the magnitudes of the terms that were added
    to make it; the bound grows by SUM_RTOL times it.

    Bitwise across dtypes compares `expected` rounded to `got`'s dtype (a platform claiming
    portable_bitwise in bfloat16 must equal the reference's float32 result rounded to bfloat16).
    """
    where = dict(where or {})
    if mode not in ("bitwise", "tolerance"):
        raise ValueError(f"compare mode {mode!r}: use 'bitwise' or 'tolerance'")
    exp, got = expected.detach().cpu(), got.detach().cpu()
    if tuple(exp.shape) != tuple(got.shape):
        return Divergence(where=where, expected=list(exp.shape), got=list(got.shape),
                          note="shape differs")
    if exp.numel() == 0:
        return None
    if exp.is_floating_point() != got.is_floating_point():
        return Divergence(where=where, expected=str(exp.dtype), got=str(got.dtype), note="dtype kind differs")
    if got.is_floating_point():
        nan = torch.isnan(got)
        if bool(nan.any()):
            return _divergence(where, exp, got, nan, "NaN in output")
        if exp.dtype != got.dtype:
            exp = exp.to(got.dtype) if mode == "bitwise" else exp
    elif exp.dtype != got.dtype:
        exp, got = exp.to(torch.int64), got.to(torch.int64)
    if not got.is_floating_point():
        bad = exp != got
        return _divergence(where, exp, got, bad) if bool(bad.any()) else None
    if mode == "bitwise":
        bad = exp.contiguous().view(_INT_VIEW[exp.dtype]) != got.contiguous().view(_INT_VIEW[got.dtype])
        return _divergence(where, exp, got, bad, "bits differ") if bool(bad.any()) else None
    name = tolerance_dtype or _lower(exp.dtype, got.dtype)
    rtol, atol = TOLERANCES[name]
    e, g = exp.double(), got.double()
    same_inf = torch.isinf(e) & (e == g)
    bound = atol + rtol * e.abs()
    note = f"beyond {name} tolerance rtol={rtol:g} atol={atol:g}"
    if scale is not None:
        bound = bound + SUM_RTOL[name] * scale.detach().cpu().double().expand_as(e)
        note += f" + {SUM_RTOL[name]:g} * sum|terms|"
    bad = ~same_inf & ~((e - g).abs() <= bound)
    return _divergence(where, exp, got, bad, note) if bool(bad.any()) else None


def _lower(a: torch.dtype, b: torch.dtype) -> str:
    order = ["float16", "bfloat16", "float32", "float64"]
    names = [str(a).replace("torch.", ""), str(b).replace("torch.", "")]
    names = [n if n in order else "float32" for n in names]
    return min(names, key=order.index)


def compare_outputs(expected: list[torch.Tensor], got: list[torch.Tensor], mode: str,
                    where: dict | None = None,
                    scales: list[torch.Tensor | None] | None = None) -> Divergence | None:
    if len(expected) != len(got):
        return Divergence(where=dict(where or {}), expected=len(expected), got=len(got),
                          note="number of outputs differs")
    for k, (e, g) in enumerate(zip(expected, got)):
        scale = scales[k] if scales is not None and k < len(scales) else None
        div = compare(e, g, mode, {**(where or {}), "output": k}, scale=scale)
        if div is not None:
            return div
    return None
