"""GEMMs: linear, grouped_linear, block_diagonal_linear, moe_experts, all on `numerics.dot`'s exact
fixed-point products.

Batch invariance and host independence by construction: each activation row and each weight row
is rounded to its own fixed-point grid and the integer products are summed exactly by a float64
matmul (any BLAS, any blocking, any thread count gives the same integers), then rounded once to
float32. A row's bits depend only on that row and the weight: never on its neighbours, the batch
size, the CPU's ISA or the BLAS. The weight's grid is computed once and cached per Weight object.
The sums run in the compiled kernel of `native.py` where it builds (the same bits: every partial
sum is exact), else in torch's float64 matmul.
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch

from shuili.hal.types import Weight
from shuili.hal import numerics
from shuili.platforms.reference import native

# Weight -> (data version, FixedWeight)
_FIXED_CACHE: "weakref.WeakKeyDictionary[Weight, tuple]" = weakref.WeakKeyDictionary()


_CHUNK_ELEMENTS = 1 << 22  # rows of x per float64 product: at most ~32 MB of it (a prefill's lm_head)


def _check_weight(w: Weight) -> None:
    if not isinstance(w, Weight):
        raise TypeError(f"expected a shuili.hal.types.Weight, got {type(w).__name__}; wrap dense "
                        "tensors with Weight.dense(t)")


def weight_f32(w: Weight) -> torch.Tensor:
    """The logical float32 weight ([N, K] or [E, N, K]), dequantized exactly."""
    _check_weight(w)
    from shuili.platforms.reference.quant import dequantize_weight

    return dequantize_weight(w).contiguous()


class FixedWeight(NamedTuple):
    """A weight's rows on their fixed-point grids (`numerics.to_fixed`, the weight side's bits of
    `numerics.dot_bits` for K = in_features): q [..., N, K] float64 integers, or None when the
    compiled kernel holds them instead as `panels` (`native.pack`: affine 4- or 8-bit codes for a
    GGUF-quantized weight, an eighth to a quarter of float32's bytes, else float32 panels, half the
    float64 grid); e [..., N, 1] the row exponents, pb the bits, scale [..., 1, N] = 2**(e - pb)
    (`numerics.fixed_matmul`'s sb), n the rows N."""
    q: torch.Tensor | None
    e: torch.Tensor
    pb: int
    scale: torch.Tensor
    panels: native.Panels | None
    n: int


def weight_fixed(w: Weight) -> FixedWeight:
    """The weight's `FixedWeight`, computed once and cached until the data changes."""
    _check_weight(w)
    version = (w.data._version, w.data.data_ptr())
    hit = _FIXED_CACHE.get(w)
    if hit is not None and hit[0] == version:
        return hit[1]
    pb = numerics.dot_bits(w.in_features)[1]
    q, e = numerics.to_fixed(weight_f32(w), pb)
    scale = numerics.pow2((e - pb).clamp(-1022, 1023)).transpose(-1, -2)
    if pb <= native.MAX_BITS and native.enabled():
        fw = FixedWeight(None, e, pb, scale, native.pack(q), q.shape[-2])
    else:
        fw = FixedWeight(q, e, pb, scale, None, q.shape[-2])
    _FIXED_CACHE[w] = (version, fw)
    return fw


def fixed_linear(x: torch.Tensor, fw: FixedWeight, expert: int | None = None) -> torch.Tensor:
    """float32 x [M, K] times a weight grid (of group `expert` of a grouped weight) -> float32 [M, N];
    the bits of `numerics.fixed_matmul`."""
    pick = (lambda t: t) if expert is None else (lambda t: t[expert])
    pa = numerics.dot_bits(x.shape[-1])[0]
    panels = fw.panels if fw.panels is None or expert is None else fw.panels.group(expert)
    if panels is not None and x.shape[1]:  # the grids are built inside the compiled call
        return native.linear(x, pa, panels, pick(fw.scale), fw.n)
    if 0 < x.shape[0] <= _HOST_SCALE_ROWS and x.shape[1]:
        sx, sa = _row_scales(x, pa)
        qa = numerics._widen_mul(x, sx).round_()
    else:
        qa, ea = numerics.to_fixed(x, pa)
        sa = numerics.pow2((ea - pa).clamp(-1022, 1023))
    if panels is not None:
        return native.gemm(qa, sa, panels, pick(fw.scale), fw.n)
    return numerics.scaled_matmul(qa, sa, pick(fw.q), pick(fw.scale))


_HOST_SCALE_ROWS = 64  # up to here a Python loop over the row maxima beats ~20 tiny tensor ops


def _exponent_bound(m: float) -> int:
    """`numerics.exponent_bound` of one row from its max |x| (a float32 value, so a normal float64
    or zero): frexp's exponent is the float64 exponent field - 1022; nan -> 0 (m > 0 fails),
    inf -> the field's 1025, clamped to 1023."""
    if m != m or m == 0.0:
        return 0
    if m == math.inf:
        return 1023
    return min(max(math.frexp(m)[1], numerics._MIN_EXP), 1023)


def _row_scales(x: torch.Tensor, pa: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [M, 1] (2**(pa - e), 2**(e - pa)) for float32 x [M, K] and e its rows'
    `numerics.exponent_bound`, clamped to [-1022, 1023] as `to_fixed` and `fixed_matmul` clamp:
    the same values, from the M row maxima on the host (a decode step's rows are few)."""
    es = [_exponent_bound(m) for m in x.abs().amax(-1).tolist()]
    sx = [math.ldexp(1.0, min(max(pa - e, -1022), 1023)) for e in es]
    sa = [math.ldexp(1.0, min(max(e - pa, -1022), 1023)) for e in es]
    return (torch.tensor(sx, dtype=torch.float64)[:, None], torch.tensor(sa, dtype=torch.float64)[:, None])


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias): `numerics.dot` of x's rows and W's rows, bias added after (float32).
    Returns x's dtype.
    """
    _check_weight(w)
    if len(w.shape) != 2:
        raise ValueError(f"linear needs a 2D weight, got logical shape {tuple(w.shape)}; "
                         "use grouped_linear for [E, N, K]")
    if x.dim() != 2:
        raise ValueError(f"linear takes x [T, K], got shape {tuple(x.shape)}; flatten tokens first")
    if x.shape[1] != w.in_features:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {w.in_features}")
    fw = weight_fixed(w)
    xf = x.to(torch.float32)
    rows = max(1, _CHUNK_ELEMENTS // w.out_features)
    if xf.shape[0] <= rows:
        y = fixed_linear(xf, fw)
    else:  # a row's bits depend only on that row: chunks bound the float64 product's memory
        y = torch.cat([fixed_linear(c, fw) for c in xf.split(rows)])
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def _offsets(group_sizes: torch.Tensor, experts: int, rows: int) -> list[int]:
    sizes = [int(s) for s in group_sizes.tolist()]
    if len(sizes) != experts:
        raise ValueError(f"group_sizes has {len(sizes)} entries but the weight has {experts} groups")
    if any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"group_sizes {sizes} must be non-negative and sum to the {rows} rows of x")
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return offs


def grouped_linear(x: torch.Tensor, w: Weight, group_sizes: torch.Tensor) -> torch.Tensor:
    """Per group e: rows [off_e, off_e + size_e) times W[e]^T, as `linear`. Returns [M, N] in x's
    dtype.
    """
    _check_weight(w)
    if len(w.shape) != 3:
        raise ValueError(f"grouped_linear needs an [E, N, K] weight, got {tuple(w.shape)}")
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"grouped_linear takes x [M, {w.in_features}], got {tuple(x.shape)}")
    fw = weight_fixed(w)
    offs = _offsets(group_sizes, fw.e.shape[0], x.shape[0])
    out = torch.zeros(x.shape[0], w.out_features, dtype=torch.float32)
    xf = x.to(torch.float32)
    for e in range(fw.e.shape[0]):
        if offs[e + 1] > offs[e]:
            out[offs[e]:offs[e + 1]] = fixed_linear(xf[offs[e]:offs[e + 1]], fw, e)
    return out.to(x.dtype)


def check_block_diagonal_args(x: torch.Tensor, w: Weight) -> None:
    """block_diagonal_linear's argument checks (public: every platform's errors read the same)."""
    if len(w.shape) != 3:
        raise ValueError(f"block_diagonal_linear needs the blocks as a [G, N, K] weight, got "
                         f"{tuple(w.shape)}")
    g, _, k = w.shape
    if x.dim() != 2 or x.shape[1] != g * k:
        raise ValueError(f"block_diagonal_linear takes x [T, G*K] = [T, {g * k}] for {g} blocks of "
                         f"K={k}, got {tuple(x.shape)}")


def block_diagonal_linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """Block g: columns [g*K, (g+1)*K) of x times W[g]^T, as `linear` (the same exact products
    grouped_linear takes, so the same bits as the rows regrouped). Returns [T, G*N] in x's dtype."""
    _check_weight(w)
    check_block_diagonal_args(x, w)
    g, n, k = w.shape
    fw = weight_fixed(w)
    out = torch.empty(x.shape[0], g * n, dtype=torch.float32)
    xf = x.to(torch.float32)
    for e in range(g):
        out[:, e * n:(e + 1) * n] = fixed_linear(xf[:, e * k:(e + 1) * k], fw, e)
    return out.to(x.dtype)


def composed_block_diagonal_linear(grouped_linear):
    """block_diagonal_linear from a table's grouped_linear (public): the rows regrouped by block
    (a copy), one grouped GEMM of T rows a group, the result regrouped back."""

    def block_diagonal_linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
        check_block_diagonal_args(x, w)
        t, (g, n, k) = x.shape[0], w.shape
        xg = x.reshape(t, g, k).transpose(0, 1).reshape(g * t, k)
        sizes = torch.full((g,), t, dtype=torch.int64, device=x.device)
        return grouped_linear(xg, w, sizes).view(g, t, n).transpose(0, 1).reshape(t, g * n)

    return block_diagonal_linear


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Weight,
                w2: Weight, swiglu_limit: float | None = None) -> torch.Tensor:
    """Routed SwiGLU experts. For each expert e, the (t, j) pairs routed to it, in increasing
    t * k + j order, go through `linear`'s product with w13[e] and then w2[e]; the activation is
    `numerics.silu` (float64, rounded once) times up, float32. y_t = sum_j w[t, j] * out[t, j],
    added in increasing j starting from zero. Returns [T, D] in x's dtype.
    """
    _check_weight(w13)
    _check_weight(w2)
    if len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError(f"moe_experts needs [E, 2I, D] and [E, D, I] weights, got {w13.shape} and "
                         f"{w2.shape}")
    n_exp, two_i, d = w13.shape
    inter = two_i // 2
    if tuple(w2.shape) != (n_exp, d, inter):
        raise ValueError(f"w2 logical shape {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}:"
                         f" expected {(n_exp, d, inter)}")
    t, k = topk_ids.shape
    if topk_weights.shape != (t, k) or x.shape != (t, d):
        raise ValueError(f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)} disagree (want x [T, {d}], both ids and weights [T, k])")
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n_exp):
        raise ValueError(f"topk_ids must lie in [0, {n_exp}); got range [{int(flat.min())}, "
                         f"{int(flat.max())}]")
    f13, f2 = weight_fixed(w13), weight_fixed(w2)
    xf = x.to(torch.float32)
    per_pair = torch.zeros(t * k, d, dtype=torch.float32)
    for e in torch.unique(flat).tolist():
        pairs = torch.nonzero(flat == e).flatten()
        gu = fixed_linear(xf[pairs // k], f13, e)
        g, u = gu[:, :inter], gu[:, inter:]
        if swiglu_limit is not None:
            g = g.clamp(max=swiglu_limit)
            u = u.clamp(-swiglu_limit, swiglu_limit)
        per_pair[pairs] = fixed_linear(numerics.silu(g) * u, f2, e)
    per_pair = per_pair.view(t, k, d)
    wts = topk_weights.to(torch.float32)
    y = torch.zeros(t, d, dtype=torch.float32)
    for j in range(k):
        y = y + wts[:, j:j + 1] * per_pair[:, j]
    return y.to(x.dtype)
