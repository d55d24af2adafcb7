"""Op input generators: one per op of the HAL contract, fuzzed shapes and values from a seed.

A `Case` is one call of one op: float32 CPU inputs (the reference's view of them), the names of
the arguments that take the platform's compute dtype, and how to cut the batch into independent
units (rows, tokens or sequences) for the batch-invariance check: `split(i)` gives the inputs of
unit i alone and, for each output, which part of the batched call's output is unit i's.

Batch sizes are drawn from `BOUNDARY_SIZES`, which straddle the usual tile and graph-bucket edges.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from shuili.hal import numerics
from shuili.hal.formats import KV_FORMATS, WEIGHT_FORMATS, bytes_per_row, weight_scale_shape
from shuili.hal.ops import OP_NAMES
from shuili.hal.types import Weight

BOUNDARY_SIZES = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)
# ops that platforms switch to their prefill paths by size get one more case of this many units:
# the nvidia default mode goes to cuBLAS, the dense copies and tensor-core hc_mix from 256 rows, and
# to sparse attention's direct and decode-once paths from 528 (4 x 132 SMs) and 256 queries
LARGE_UNITS = {"linear": 300, "block_diagonal_linear": 300, "moe_experts": 600, "hc_mix": 300,
               "sparse_attention": 600}

Select = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclass
class Case:
    op: str
    seed: int
    kwargs: dict[str, Any]
    act: tuple[str, ...]  # arguments in the compute dtype (the rest keep their contract dtype)
    units: int  # independent units of the batch (rows / tokens / sequences)
    split: Callable[[int], tuple[dict[str, Any], Select, Select]] | None = None
    params: dict[str, Any] = field(default_factory=dict)  # shapes and flags, for the report

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items())


# ---------------------------------------------------------------------------------------- helpers
class Rng:
    """All randomness of one case, from one seed (torch.Generator: same stream on every host)."""

    def __init__(self, seed: int, min_size: int = 1, large: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.min_size = min_size
        self.large = large  # > 0: size() gives this many units (LARGE_UNITS), past the boundary sizes

    def int(self, lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=self.g))

    def choice(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def coin(self, p: float = 0.5) -> bool:
        return float(torch.rand((), generator=self.g)) < p

    def normal(self, *shape, std: float = 1.0) -> torch.Tensor:
        return numerics.normal(shape, self.g) * std  # torch.randn's bits depend on the CPU's ISA

    def uniform(self, *shape, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(*shape, generator=self.g)

    def ints(self, lo: int, hi: int, shape) -> torch.Tensor:  # [lo, hi)
        return torch.randint(lo, hi, tuple(shape), generator=self.g, dtype=torch.int64)

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.g)

    def size(self, max_size: int = 129) -> int:
        if self.large:
            return self.large
        return self.choice([s for s in BOUNDARY_SIZES if min(self.min_size, max_size) <= s <= max_size])


def _rows(name_dims: dict[str, int]):
    """split for row-wise ops: arguments named here are sliced on the given dim."""

    def make(case: Case):
        def split(i: int):
            kw = dict(case.kwargs)
            for name, dim in name_dims.items():
                if kw.get(name) is not None:
                    kw[name] = kw[name].narrow(dim, i, 1)
            sel = lambda outs: [o.narrow(0, i, 1) for o in outs]  # noqa: E731
            return kw, sel, lambda outs: outs

        return split

    return make


def _fp8_block_weight(rng: Rng, shape: tuple[int, ...], fmt: str = "fp8_block128") -> Weight:
    data = rng.normal(*shape, std=2.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = rng.ints(-8, 1, weight_scale_shape(fmt, tuple(shape)))
    return Weight(fmt, data, numerics.pow2(exps).to(torch.float32), tuple(shape))


def _mxfp4_weight(rng: Rng, shape: tuple[int, ...]) -> Weight:
    *lead, n, k = shape
    data = rng.ints(0, 256, (*lead, n, k // 2)).to(torch.uint8)
    scale = rng.ints(118, 126, (*lead, n, k // 32)).to(torch.uint8)  # 2^-9 .. 2^-2
    return Weight("mxfp4", data, scale, tuple(shape))


def make_weight(rng: Rng, fmt: str, shape: tuple[int, ...]) -> Weight:
    if fmt == "dense":
        return Weight.dense(rng.normal(*shape, std=shape[-1] ** -0.5))
    if fmt in ("fp8_block128", "fp8_block32"):
        return _fp8_block_weight(rng, shape, fmt)
    if fmt == "mxfp4":
        return _mxfp4_weight(rng, shape)
    raise ValueError(f"unknown weight format {fmt!r}; the contract has {WEIGHT_FORMATS}")


# ------------------------------------------------------------------------------------------ GEMMs
def gen_linear(rng: Rng, fmt: str = "dense", **_) -> Case:
    t, k, n = rng.size(), 32 * rng.int(1, 8), rng.int(1, 200)
    w = make_weight(rng, fmt, (n, k))
    bias = rng.normal(n) if rng.coin(0.3) else None
    case = Case("linear", 0, {"x": rng.normal(t, k), "w": w, "bias": bias}, ("x", "w", "bias"), t,
                params={"T": t, "K": k, "N": n, "format": fmt, "bias": bias is not None})
    case.split = _rows({"x": 0})(case)
    return case


def gen_block_diagonal_linear(rng: Rng, fmt: str = "dense", **_) -> Case:
    # K up to 1280: long enough that the GPU's grouped GEMM splits it (its split-K sum included)
    t, g, k, n = rng.size(), rng.int(1, 4), 32 * rng.int(1, 40), rng.int(1, 96)
    w = make_weight(rng, fmt, (g, n, k))
    case = Case("block_diagonal_linear", 0, {"x": rng.normal(t, g * k), "w": w}, ("x", "w"), t,
                params={"T": t, "G": g, "K": k, "N": n, "format": fmt})
    case.split = _rows({"x": 0})(case)
    return case


def gen_grouped_linear(rng: Rng, fmt: str = "dense", **_) -> Case:
    e, k, n = rng.int(1, 6), 32 * rng.int(1, 4), rng.int(1, 96)
    sizes = torch.tensor([rng.choice([0, 1, 2, 5, 9, 17]) for _ in range(e)], dtype=torch.int64)
    if int(sizes.sum()) == 0:
        sizes[0] = 3
    m = int(sizes.sum())
    w = make_weight(rng, fmt, (e, n, k))
    case = Case("grouped_linear", 0, {"x": rng.normal(m, k), "w": w, "group_sizes": sizes},
                ("x", "w"), m, params={"M": m, "E": e, "K": k, "N": n, "format": fmt,
                                       "group_sizes": sizes.tolist()})
    group_of = torch.repeat_interleave(torch.arange(e), sizes)

    def split(i: int):
        one = torch.zeros(e, dtype=torch.int64)
        one[int(group_of[i])] = 1
        kw = {"x": case.kwargs["x"][i:i + 1], "w": w, "group_sizes": one}
        return kw, (lambda outs: [o[i:i + 1] for o in outs]), (lambda outs: outs)

    case.split = split
    return case


def gen_moe_experts(rng: Rng, fmt: str = "dense", **_) -> Case:
    t, e = rng.size(65), rng.int(2, 8)
    k, d, inter = rng.int(1, min(4, e)), 32 * rng.int(1, 3), 32 * rng.int(1, 3)
    ids = torch.stack([rng.perm(e)[:k] for _ in range(t)])
    weights = torch.softmax(rng.normal(t, k), -1)
    limit = rng.choice([None, 7.0, 1.0])
    kw = {"x": rng.normal(t, d), "topk_ids": ids, "topk_weights": weights,
          "w13": make_weight(rng, fmt, (e, 2 * inter, d)), "w2": make_weight(rng, fmt, (e, d, inter)),
          "swiglu_limit": limit}
    case = Case("moe_experts", 0, kw, ("x", "w13", "w2"), t,
                params={"T": t, "E": e, "k": k, "D": d, "I": inter, "format": fmt, "limit": limit})
    case.split = _rows({"x": 0, "topk_ids": 0, "topk_weights": 0})(case)
    return case


# ------------------------------------------------------------------------------- elementwise etc
def gen_rms_norm(rng: Rng, **_) -> Case:
    t, d = rng.size(), rng.choice([16, 64, 96, 128, 512])
    heads = rng.choice([None, 1, 4])
    shape = (t, d) if heads is None else (t, heads, d)
    weight = rng.normal(d, std=0.2) + 1.0 if rng.coin(0.8) else None
    kw = {"x": rng.normal(*shape, std=rng.choice([0.01, 1.0, 30.0])), "weight": weight,
          "eps": rng.choice([1e-6, 1e-5])}
    case = Case("rms_norm", 0, kw, ("x", "weight"), t,
                params={"shape": list(shape), "weight": weight is not None, "eps": kw["eps"]})
    case.split = _rows({"x": 0})(case)
    return case


def gen_add_rms_norm(rng: Rng, **_) -> Case:
    t, d = rng.size(), rng.choice([16, 64, 128, 384])
    weight = rng.normal(d, std=0.2) + 1.0 if rng.coin(0.8) else None
    kw = {"x": rng.normal(t, d), "residual": rng.normal(t, d, std=4.0), "weight": weight, "eps": 1e-6}
    case = Case("add_rms_norm", 0, kw, ("x", "residual", "weight"), t,
                params={"T": t, "D": d, "weight": weight is not None})
    case.split = _rows({"x": 0, "residual": 0})(case)
    return case


def gen_rope(rng: Rng, **_) -> Case:
    t, h, rope_dim = rng.size(), rng.int(1, 4), 2 * rng.int(2, 32)
    d = rope_dim + rng.choice([0, 16, 64])
    max_pos = rng.choice([64, 300, 4096])
    # host-independent tables (numerics), so a case is the same case on every host
    inv = 1.0 / numerics.pow_f32(10000.0, torch.arange(rope_dim // 2, dtype=torch.float32) * 2 / rope_dim)
    cos, sin = numerics.rotary_tables(torch.arange(max_pos), inv)
    kw = {"x": rng.normal(t, h, d), "positions": rng.ints(0, max_pos, (t,)),
          "cos": cos, "sin": sin, "rope_dim": rope_dim,
          "interleaved": rng.coin(), "inverse": rng.coin(0.3)}
    if rng.coin(0.5):  # the host hint (each call gets its own copy of x, so it is truthful)
        kw["may_overwrite"] = True
    case = Case("rope", 0, kw, ("x",), t, params={"T": t, "H": h, "D": d, "rope_dim": rope_dim,
                                                 "interleaved": kw["interleaved"], "inverse": kw["inverse"],
                                                 "may_overwrite": "may_overwrite" in kw})
    case.split = _rows({"x": 0, "positions": 0})(case)
    return case


def gen_rms_norm_rope(rng: Rng, **_) -> Case:
    t, h, rope_dim = rng.size(), rng.choice([1, 3, 16]), rng.choice([16, 64])
    d = rng.choice([rope_dim, 128, 512])
    max_pos = rng.choice([64, 4096])
    inv = 1.0 / numerics.pow_f32(10000.0, torch.arange(rope_dim // 2, dtype=torch.float32) * 2 / rope_dim)
    cos, sin = numerics.rotary_tables(torch.arange(max_pos), inv)
    weight = rng.normal(d, std=0.2) + 1.0 if rng.coin(0.7) else None
    kw = {"x": rng.normal(t, h, d, std=rng.choice([0.01, 1.0, 30.0])), "weight": weight,
          "eps": rng.choice([1e-6, 1e-5]), "positions": rng.ints(0, max_pos, (t,)), "cos": cos, "sin": sin,
          "rope_dim": rope_dim, "interleaved": rng.coin(0.8)}
    case = Case("rms_norm_rope", 0, kw, ("x", "weight"), t,
                params={"T": t, "H": h, "D": d, "rope_dim": rope_dim, "weight": weight is not None,
                        "interleaved": kw["interleaved"]})
    case.split = _rows({"x": 0, "positions": 0})(case)
    return case


def gen_swiglu(rng: Rng, **_) -> Case:
    t, inter = rng.size(), rng.choice([8, 32, 96, 256])
    limit = rng.choice([None, 7.0, 0.5])
    kw = {"gate_up": rng.normal(t, 2 * inter, std=3.0), "limit": limit}
    case = Case("swiglu", 0, kw, ("gate_up",), t, params={"T": t, "I": inter, "limit": limit})
    case.split = _rows({"gate_up": 0})(case)
    return case


def gen_embedding(rng: Rng, **_) -> Case:
    t, v, d = rng.size(), rng.int(2, 500), rng.choice([8, 64, 96])
    kw = {"ids": rng.ints(0, v, (t,)), "table": rng.normal(v, d)}
    case = Case("embedding", 0, kw, ("table",), t, params={"T": t, "V": v, "D": d})
    case.split = _rows({"ids": 0})(case)
    return case


def gen_hc_split_sinkhorn(rng: Rng, **_) -> Case:
    t, m = rng.size(), rng.choice([2, 4])
    kw = {"mix": rng.normal(t, m * (m + 2)), "scale": rng.uniform(3, lo=0.1, hi=2.0),
          "base": rng.normal(m * (m + 2), std=0.5), "hc_mult": m, "iters": rng.choice([1, 3, 20]),
          "eps": 1e-6}
    case = Case("hc_split_sinkhorn", 0, kw, (), t, params={"T": t, "m": m, "iters": kw["iters"]})
    case.split = _rows({"mix": 0})(case)
    return case


def gen_hc_mix(rng: Rng, **_) -> Case:
    t, m, d = rng.size(), rng.choice([1, 2, 4]), rng.choice([8, 64, 256, 1000])
    # streams of unequal scales (the norm is over all m*D values); fn ~ 1 / sqrt(m*D): mix of order 1
    x = rng.normal(t, m, d) * rng.uniform(1, m, 1, lo=0.05, hi=30.0)
    fn = Weight.dense(rng.normal(m * (m + 2), m * d, std=(m * d) ** -0.5))
    kw = {"x": x, "fn": fn, "scale": rng.uniform(3, lo=0.1, hi=2.0), "base": rng.normal(m * (m + 2), std=0.5),
          "iters": rng.choice([1, 3, 20]), "eps": 1e-6, "norm_eps": rng.choice([1e-6, 1e-20])}
    case = Case("hc_mix", 0, kw, ("x",), t, params={"T": t, "m": m, "D": d, "iters": kw["iters"]})
    case.split = _rows({"x": 0})(case)
    return case


def gen_engram_gate(rng: Rng, **_) -> Case:
    t, m, d = rng.size(), rng.choice([1, 4]), rng.choice([32, 64, 256])
    # q * k weights near 1, streams and kv of unequal scales: gates spread over (0, 1)
    kw = {"x": rng.normal(t, m, d, std=rng.choice([0.05, 1.0, 30.0])), "kv": rng.normal(t, (m + 1) * d),
          "q_weight": 1.0 + rng.normal(m, d, std=0.3), "k_weight": 1.0 + rng.normal(m, d, std=0.3),
          "eps": rng.choice([1e-20, 1e-6])}
    case = Case("engram_gate", 0, kw, ("x", "kv"), t, params={"T": t, "m": m, "D": d})
    case.split = _rows({"x": 0, "kv": 0})(case)
    return case


def _streams(rng: Rng) -> tuple[int, int, int, torch.Tensor]:
    """T, m, D and the streams x [T, m, D]: streams of unequal scales, as after many layers."""
    t, m, d = rng.size(), rng.choice([1, 2, 4]), rng.choice([8, 64, 256])
    return t, m, d, rng.normal(t, m, d) * rng.uniform(1, m, 1, lo=0.05, hi=30.0)


def gen_hc_collapse(rng: Rng, **_) -> Case:
    t, m, d, x = _streams(rng)
    kw = {"x": x, "pre": rng.uniform(t, m, lo=1e-6, hi=1.0)}  # sigmoid + eps: (0, 1]
    case = Case("hc_collapse", 0, kw, ("x",), t, params={"T": t, "m": m, "D": d})
    case.split = _rows({"x": 0, "pre": 0})(case)
    return case


def gen_hc_expand(rng: Rng, **_) -> Case:
    t, m, d, x = _streams(rng)
    kw = {"f": rng.normal(t, d, std=rng.choice([0.1, 1.0, 10.0])), "x": x,
          "post": rng.uniform(t, m, lo=0.0, hi=2.0),  # 2 sigmoid
          "comb": rng.uniform(t, m, m)}  # Sinkhorn: non-negative, rows and columns near 1
    case = Case("hc_expand", 0, kw, ("f", "x"), t, params={"T": t, "m": m, "D": d})
    case.split = _rows({"f": 0, "x": 0, "post": 0, "comb": 0})(case)
    return case


# ---------------------------------------------------------------------------------------- routing
_SCORINGS = ("sqrtsoftplus", "softmax", "sigmoid")


def gen_moe_route_topk(rng: Rng, **_) -> Case:
    t, e = rng.size(), rng.choice([4, 8, 16, 64])
    kw = {"logits": rng.normal(t, e, std=2.0), "bias": rng.normal(e, std=0.1) if rng.coin() else None,
          "topk": rng.int(1, min(8, e)), "scoring": rng.choice(_SCORINGS), "renormalize": rng.coin(),
          "scaling": rng.choice([1.0, 2.5])}
    case = Case("moe_route_topk", 0, kw, (), t, params={"T": t, "E": e, "topk": kw["topk"],
                                                        "scoring": kw["scoring"]})
    case.split = _rows({"logits": 0})(case)
    return case


def gen_moe_route_hash(rng: Rng, **_) -> Case:
    t, e, v = rng.size(), rng.choice([4, 8, 16]), rng.int(2, 300)
    k = rng.int(1, min(6, e))
    kw = {"logits": rng.normal(t, e, std=2.0), "token_ids": rng.ints(0, v, (t,)),
          "tid2eid": torch.stack([rng.perm(e)[:k] for _ in range(v)]),
          "scoring": rng.choice(_SCORINGS), "renormalize": rng.coin(), "scaling": rng.choice([1.0, 1.5])}
    case = Case("moe_route_hash", 0, kw, (), t, params={"T": t, "E": e, "k": k, "scoring": kw["scoring"]})
    case.split = _rows({"logits": 0, "token_ids": 0})(case)
    return case


# --------------------------------------------------------------------------------------- KV cache
def _kv_rows(rng: Rng, n: int, d: int) -> torch.Tensor:
    x = rng.normal(n, d) * numerics.pow_f32(10.0, rng.uniform(n, 1, lo=-5, hi=3))
    if n > 2:
        x[1] = 0.0  # all-zero row: exercises the scale floor
    return x


def gen_kv_quantize(rng: Rng, fmt: str = "mxfp8", **_) -> Case:
    n, d = rng.size(), rng.choice([32, 64, 128, 512])
    case = Case("kv_quantize", 0, {"x": _kv_rows(rng, n, d), "fmt": fmt}, ("x",), n,
                params={"N": n, "D": d, "fmt": fmt})
    case.split = _rows({"x": 0})(case)
    return case


def gen_kv_dequantize(rng: Rng, fmt: str = "mxfp8", reference=None, **_) -> Case:
    n, d = rng.size(), rng.choice([32, 64, 128, 512])
    packed = reference.kv_quantize(_kv_rows(rng, n, d), fmt)  # valid codes only (no e4m3 NaN bytes)
    case = Case("kv_dequantize", 0, {"packed": packed, "fmt": fmt, "dim": d}, (), n,
                params={"N": n, "D": d, "fmt": fmt})
    case.split = _rows({"packed": 0})(case)
    return case


def gen_paged_slots(rng: Rng, **_) -> Case:
    b, nb, per_block = rng.int(1, 6), rng.int(1, 9), rng.choice([1, 4, 16, 128])
    tables = rng.ints(-1, 64, (b, nb)).to(torch.int32)  # -1: a freed block
    t = rng.size()
    span = nb * per_block
    if rng.coin():  # a window per token: seq [T, 1] against positions [T, W]
        w = rng.choice([1, 8, 33])
        seq, pos = rng.ints(0, b, (t, 1)), rng.ints(-span // 2 - 2, span + 3, (t, w))
    else:
        seq, pos = rng.ints(0, b, (t,)), rng.ints(-3, span + 3, (t,))
    kw = {"block_tables": tables, "seq_idx": seq, "pos": pos, "per_block": per_block}
    case = Case("paged_slots", 0, kw, (), t, params={"T": t, "B": b, "blocks": nb, "per_block": per_block,
                                                     "shape": list(pos.shape)})
    case.split = _rows({"seq_idx": 0, "pos": 0})(case)
    return case


def gen_compress_pool(rng: Rng, **_) -> Case:
    n, dim, overlap = rng.size(), rng.choice([8, 64, 128]), rng.coin()
    ratio = rng.choice([1, 2, 4, 8] if overlap else [1, 4, 16, 128])
    span = 2 * ratio if overlap else ratio
    offset = rng.choice([0, 3, 2 * dim])
    width = offset + (4 if overlap else 2) * dim + rng.choice([0, 5])
    rows = max(span, rng.int(1, 300))
    src = rng.ints(0, rows, (n, span))
    src[rng.ints(0, n, (n // 3,)), rng.ints(0, span, (n // 3,))] = -1  # tokens before the sequence
    if n > 1:
        src[rng.int(0, n - 1)] = -1  # an entry with no token at all: zeros
    out = rng.ints(0, 10 * n, (n,))
    out[rng.ints(0, n, (n // 4,))] = -1  # not completed this step
    state = rng.normal(rows, width)
    cols = torch.arange(width)  # gates of unequal scales: peaked and flat softmaxes
    gate = (cols >= offset + (2 if overlap else 1) * dim) & (cols < offset + (4 if overlap else 2) * dim)
    state = torch.where(gate, state * rng.choice([0.1, 1.0, 8.0]), state)
    kw = {"state": state, "src_slots": src, "out_slots": out, "offset": offset, "dim": dim, "overlap": overlap}
    case = Case("compress_pool", 0, kw, (), n, params={"N": n, "L": span, "dim": dim, "overlap": overlap,
                                                        "offset": offset})
    case.split = _rows({"src_slots": 0, "out_slots": 0})(case)
    return case


def gen_cache_write(rng: Rng, **_) -> Case:
    nb, bs, d = rng.int(1, 6), rng.choice([4, 16]), rng.choice([8, 32])
    n = rng.int(1, nb * bs)
    slots = rng.perm(nb * bs)[:n].clone()
    slots[rng.ints(0, n, (n // 4,))] = -1
    kw = {"cache": rng.normal(nb, bs, d), "slot_mapping": slots, "values": rng.normal(n, d)}
    case = Case("cache_write", 0, kw, ("cache", "values"), n,
                params={"blocks": nb, "block_size": bs, "D": d, "N": n})

    def split(i: int):
        sub = {"cache": kw["cache"], "slot_mapping": slots[i:i + 1], "values": kw["values"][i:i + 1]}
        slot = int(slots[i])

        def sel(outs):  # the slot row unit i wrote
            return [o.view(-1, d)[slot:slot + 1] for o in outs]

        if slot < 0:  # a skipped write: alone, it must leave the whole cache as it was
            return sub, (lambda outs: [kw["cache"]]), (lambda outs: outs)
        return sub, sel, sel

    case.split = split
    return case


def gen_kv_write(rng: Rng, fmt: str = "mxfp8", **_) -> Case:
    nb, bs, d = rng.int(1, 6), rng.choice([4, 16]), rng.choice([32, 64, 128, 512])
    n = rng.int(1, nb * bs)
    slots = rng.perm(nb * bs)[:n].clone()
    slots[rng.ints(0, n, (n // 4,))] = -1  # skipped rows
    rb = bytes_per_row(fmt, d)
    cache = rng.ints(0, 256, (nb, bs, rb)).to(torch.uint8)  # stale bytes: only the written rows change
    kw = {"cache": cache, "slot_mapping": slots, "rows": _kv_rows(rng, n, d), "fmt": fmt}
    case = Case("kv_write", 0, kw, ("rows",), n, params={"blocks": nb, "block_size": bs, "D": d, "N": n,
                                                         "fmt": fmt})

    def split(i: int):
        sub = dict(kw, slot_mapping=slots[i:i + 1], rows=kw["rows"][i:i + 1])
        slot = int(slots[i])

        def sel(outs):  # the slot row unit i wrote
            return [o.view(-1, rb)[slot:slot + 1] for o in outs]

        if slot < 0:  # a skipped row: alone, it must leave the whole cache as it was
            return sub, (lambda outs: [cache]), (lambda outs: outs)
        return sub, sel, sel

    case.split = split
    return case


# -------------------------------------------------------------------------------------- attention
def _seq_layout(rng: Rng, b: int, max_len: int, block_size: int):
    seq_lens = [rng.int(1, max_len) for _ in range(b)]
    q_lens = [1 if rng.coin(0.4) else rng.int(1, s) for s in seq_lens]
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    pool = sum(blocks) + rng.int(0, 3)
    phys = rng.perm(pool)
    max_blocks = max(blocks) + rng.int(0, 2)
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    at = 0
    for i, nbk in enumerate(blocks):
        table[i, :nbk] = phys[at:at + nbk].to(torch.int32)
        at += nbk
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return torch.tensor(seq_lens, dtype=torch.int32), q_lens, table, qsl, pool


def _per_seq_split(case: Case, q_names: tuple[str, ...], qsl: torch.Tensor, table_name: str,
                   seq_names: tuple[str, ...]):
    def split(b: int):
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        kw = dict(case.kwargs)
        for name in q_names:
            kw[name] = kw[name][lo:hi]
        for name in seq_names:
            kw[name] = kw[name][b:b + 1]
        kw[table_name] = kw[table_name][b:b + 1]
        kw["query_start_loc"] = torch.tensor([0, hi - lo], dtype=torch.int32)
        return kw, (lambda outs: [o[lo:hi] for o in outs]), (lambda outs: outs)

    return split


def gen_paged_attention(rng: Rng, **_) -> Case:
    b, bs = rng.choice([1, 2, 3, 5, 9]), rng.choice([4, 16])
    kvh, groups, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([16, 32, 64])
    seq_lens, q_lens, table, qsl, pool = _seq_layout(rng, b, 70, bs)
    t = int(qsl[-1])
    kw = {"q": rng.normal(t, kvh * groups, d), "k_cache": rng.normal(pool, bs, kvh, d),
          "v_cache": rng.normal(pool, bs, kvh, d), "block_tables": table, "seq_lens": seq_lens,
          "query_start_loc": qsl, "scale": d ** -0.5, "window": rng.choice([0, 0, 5, 16]),
          "sinks": rng.normal(kvh * groups) if rng.coin(0.4) else None}
    case = Case("paged_attention", 0, kw, ("q", "k_cache", "v_cache"), b,
                params={"B": b, "T": t, "H": kvh * groups, "KVH": kvh, "D": d, "block_size": bs,
                        "seq_lens": seq_lens.tolist(), "q_lens": q_lens, "window": kw["window"],
                        "sinks": kw["sinks"] is not None})
    case.split = _per_seq_split(case, ("q",), qsl, "block_tables", ("seq_lens",))
    return case


def gen_sparse_attention(rng: Rng, formats: tuple[str, ...] = (), reference=None, **_) -> Case:
    t, h, d = rng.size(65), rng.choice([1, 4, 8]), rng.choice([32, 64])
    n_caches = rng.int(1, 2)
    kv, idx, fmts = [], [], []
    for _ in range(n_caches):
        nb, bs = rng.int(1, 4), rng.choice([4, 16])
        fmt = rng.choice(("none",) + tuple(formats))
        rows = rng.normal(nb * bs, d)
        if fmt == "none":
            kv.append(rows.view(nb, bs, d))
        else:
            kv.append(reference.kv_quantize(rows, fmt).view(nb, bs, -1))
        width = rng.int(1, 12)
        ind = rng.ints(0, nb * bs, (t, width)).to(torch.int32)
        ind[rng.uniform(t, width) < 0.25] = -1
        idx.append(ind)
        fmts.append(fmt)
    if t > 1:
        for ind in idx:
            ind[0] = -1  # a query with no entry: zeros, or the sink alone
    sinks = rng.normal(h) if rng.coin(0.4) else None
    use_fmts = None if all(f == "none" for f in fmts) and rng.coin() else fmts
    kw = {"q": rng.normal(t, h, d), "kv": kv, "indices": idx, "scale": d ** -0.5, "sinks": sinks,
          "kv_formats": use_fmts}
    act = ("q", "kv") if all(f == "none" for f in fmts) else ("q",)
    case = Case("sparse_attention", 0, kw, act, t,
                params={"T": t, "H": h, "D": d, "caches": len(kv), "formats": fmts,
                        "widths": [i.shape[1] for i in idx], "sinks": sinks is not None})

    def split(i: int):
        sub = dict(kw)
        sub["q"] = kw["q"][i:i + 1]
        sub["indices"] = [ind[i:i + 1] for ind in idx]
        return sub, (lambda outs: [o[i:i + 1] for o in outs]), (lambda outs: outs)

    case.split = split
    return case


def gen_indexer_topk(rng: Rng, formats: tuple[str, ...] = (), reference=None, **_) -> Case:
    b, bs, ratio = rng.choice([1, 2, 4]), rng.choice([4, 8]), rng.choice([1, 4])
    h, dk, topk = rng.choice([1, 4]), rng.choice([32, 64]), rng.choice([1, 4, 8])
    fmt = rng.choice(("none",) + tuple(f for f in formats if f == "mxfp4"))
    tok_lens = [rng.int(1, 80) for _ in range(b)]
    q_lens = [1 if rng.coin(0.4) else rng.int(1, n) for n in tok_lens]
    n_entries = [max(1, n // ratio) for n in tok_lens]
    blocks = [math.ceil(e / bs) for e in n_entries]
    pool = sum(blocks) + 1
    phys = rng.perm(pool)
    table = torch.full((b, max(blocks)), -1, dtype=torch.int32)
    at = 0
    for i, nbk in enumerate(blocks):
        table[i, :nbk] = phys[at:at + nbk].to(torch.int32)
        at += nbk
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(tok_lens, q_lens)]).to(torch.int64)
    rows = rng.normal(pool * bs, dk)
    k_cache = (rows.view(pool, bs, dk) if fmt == "none"
               else reference.kv_quantize(rows, fmt).view(pool, bs, -1))
    t = int(qsl[-1])
    kw = {"q": rng.normal(t, h, dk), "weights": rng.uniform(t, h, lo=-1, hi=1), "k_cache": k_cache,
          "block_tables": table, "query_start_loc": qsl, "positions": positions, "ratio": ratio,
          "topk": topk, "k_format": fmt}
    act = ("q", "k_cache") if fmt == "none" else ("q",)
    case = Case("indexer_topk", 0, kw, act, b,
                params={"B": b, "T": t, "H": h, "Dk": dk, "ratio": ratio, "topk": topk, "format": fmt,
                        "tokens": tok_lens, "q_lens": q_lens})
    case.split = _per_seq_split(case, ("q", "weights", "positions"), qsl, "block_tables", ())
    return case


def gen_indexer_select(rng: Rng, formats: tuple[str, ...] = (), reference=None, **_) -> Case:
    """indexer_topk's layout plus the V4.1 levels: a candidate pool per query (later index
    sources) or a level-one block selection (the candidate source), or neither."""
    case = gen_indexer_topk(rng, formats, reference)
    kw = dict(case.kwargs)
    t = kw["q"].shape[0]
    mode = rng.choice(["plain", "pool", "level_one"])
    size = rng.choice([1, 2, 4])
    kw["candidate_block_size"] = size
    kw["candidate_topk"] = rng.choice([1, 2, 3]) if mode == "level_one" else 0
    kw["candidates"] = None
    if mode == "pool":
        width = rng.choice([1, 2, 3])
        kw["candidates"] = rng.ints(-1, 12, (t, width)).to(torch.int32)
    params = dict(case.params, mode=mode, candidate_block_size=size, candidate_topk=kw["candidate_topk"])
    out = Case("indexer_select", 0, kw, case.act, case.units, params=params)
    qsl = kw["query_start_loc"]
    per_q = ("q", "weights", "positions") + (("candidates",) if mode == "pool" else ())
    out.split = _per_seq_split(out, per_q, qsl, "block_tables", ())
    return out


# --------------------------------------------------------------------------------------- sampling
def gen_log_softmax(rng: Rng, **_) -> Case:
    b, v = rng.size(65), rng.choice([2, 17, 100, 1000, 4099])
    logits = rng.normal(b, v, std=rng.choice([0.1, 3.0, 30.0])) + rng.choice([0.0, 1e4])
    case = Case("log_softmax", 0, {"logits": logits}, ("logits",), b, params={"B": b, "V": v})
    case.split = _rows({"logits": 0})(case)
    return case


def gen_apply_penalties(rng: Rng, **_) -> Case:
    b, v = rng.size(65), rng.choice([16, 100, 1000])
    kw = {"logits": rng.normal(b, v, std=3.0),
          "token_counts": (rng.ints(0, 4, (b, v)) * (rng.uniform(b, v) < 0.1)).to(torch.int32),
          "prompt_mask": rng.uniform(b, v) < 0.1, "repetition": rng.uniform(b, lo=1.0, hi=1.5),
          "presence": rng.uniform(b, lo=0.0, hi=1.0), "frequency": rng.uniform(b, lo=0.0, hi=0.5)}
    case = Case("apply_penalties", 0, kw, (), b, params={"B": b, "V": v})
    case.split = _rows({k: 0 for k in kw})(case)
    return case


def gen_sample(rng: Rng, **_) -> Case:
    b, v = rng.size(65), rng.choice([16, 100, 1000])
    temp = torch.where(rng.uniform(b) < 0.3, 0.0, rng.uniform(b, lo=0.3, hi=1.5))
    kw = {"logits": rng.normal(b, v, std=2.0), "temperature": temp,
          "top_k": torch.where(rng.uniform(b) < 0.5, 0, rng.ints(1, v + 1, (b,))).to(torch.int32),
          "top_p": torch.where(rng.uniform(b) < 0.5, 1.0, rng.uniform(b, lo=0.1, hi=1.0)),
          "min_p": torch.where(rng.uniform(b) < 0.7, 0.0, rng.uniform(b, lo=0.0, hi=0.3)),
          "seeds": rng.ints(0, 2 ** 62, (b,)), "positions": rng.ints(0, 10000, (b,))}
    if rng.coin(0.3):
        kw["temperature"] = torch.zeros(b)
    if rng.coin(0.3):
        kw["top_k"], kw["top_p"], kw["min_p"] = torch.zeros(b, dtype=torch.int32), torch.ones(b), torch.zeros(b)
    if rng.coin(0.5):  # the host hints, truthful (and still true for any subset of rows)
        kw["all_greedy"] = bool((kw["temperature"] == 0).all())
        kw["any_filter"] = bool(((kw["top_k"] > 0) | (kw["top_p"] < 1.0) | (kw["min_p"] > 0.0)).any())
    case = Case("sample", 0, kw, (), b, params={"B": b, "V": v, "hints": "all_greedy" in kw})
    case.split = _rows({k: 0 for k, t in kw.items() if isinstance(t, torch.Tensor)})(case)
    return case


# ------------------------------------------------------------------------------------ collectives
def gen_all_reduce(rng: Rng, **_) -> Case:
    t = rng.size()
    case = Case("all_reduce", 0, {"x": rng.normal(t, rng.choice([8, 64])), "group": None}, ("x",), t,
                params={"T": t, "ranks": 1})
    case.split = _rows({"x": 0})(case)
    return case


def gen_all_gather(rng: Rng, **_) -> Case:
    t = rng.size()
    case = Case("all_gather", 0, {"x": rng.normal(t, rng.choice([8, 64])), "group": None, "dim": 0},
                ("x",), t, params={"T": t, "ranks": 1})
    case.split = _rows({"x": 0})(case)
    return case


def gen_all_to_all(rng: Rng, **_) -> Case:
    # one rank here: the rows come back as sent; tests/parallel runs 2 and 4 gloo ranks
    t = rng.size()
    case = Case("all_to_all", 0, {"x": rng.normal(t, rng.choice([8, 64])), "send_counts": [t],
                                  "recv_counts": [t], "group": None}, ("x",), t, params={"T": t, "ranks": 1})

    def split(i: int):
        kw = dict(case.kwargs, x=case.kwargs["x"].narrow(0, i, 1), send_counts=[1], recv_counts=[1])
        return kw, lambda outs: [o.narrow(0, i, 1) for o in outs], lambda outs: outs

    case.split = split
    return case


GENERATORS: dict[str, Callable[..., Case]] = {
    name[len("gen_"):]: fn for name, fn in globals().items() if name.startswith("gen_")
}
# ops whose cases vary by a format argument: (kind, default formats when the platform lists none)
FORMAT_AXES = {
    "linear": WEIGHT_FORMATS, "grouped_linear": WEIGHT_FORMATS, "block_diagonal_linear": WEIGHT_FORMATS,
    "moe_experts": WEIGHT_FORMATS,
    "kv_quantize": KV_FORMATS, "kv_dequantize": KV_FORMATS, "kv_write": KV_FORMATS,
}
assert set(GENERATORS) == set(OP_NAMES), sorted(set(OP_NAMES) ^ set(GENERATORS))


def generate(op: str, seed: int, fmt: str | None = None, formats: tuple[str, ...] = (),
             reference=None, min_units: int = 1, large: bool = False) -> Case:
    """One fuzzed case of `op`. `reference` (a DispatchTable) packs valid quantized KV rows. large:
    LARGE_UNITS[op] units (an op not listed there has no large case)."""
    if large and op not in LARGE_UNITS:
        raise ValueError(f"op {op!r} has no large case; those that do: {sorted(LARGE_UNITS)}")
    if op not in GENERATORS:
        raise ValueError(f"no input generator for op {op!r}; the contract has {list(OP_NAMES)}")
    kw: dict[str, Any] = {"formats": formats, "reference": reference}
    if fmt is not None:
        kw["fmt"] = fmt
    case = GENERATORS[op](Rng(seed, min_units, LARGE_UNITS[op] if large else 0), **kw)
    return replace(case, seed=seed, params={**case.params, **({"large": True} if large else {})})
