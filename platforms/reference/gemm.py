"""GEMMs: linear, grouped_linear, moe_experts, all on one fixed-M tiled matmul.

Batch invariance by construction: every torch.mm call has exactly TILE rows (zero-padded), K
zero-padded to a multiple of K_ALIGN, the same weight layout and a 64-byte aligned tile start, so
a row's bits depend only on that row and the weight, never on its neighbours, the batch size or
its place in the tile. Measured on MKL (torch 2.13 CPU, AVX512): without the K padding, shapes
such as K = 7, N = 5 give a row different bits at different places in one 16-row tile (MKL's
edge kernels); with K a multiple of 16 no tested shape does (tests/reference checks both).
Quantized weights are dequantized to float32 once and cached per Weight object.
"""
from __future__ import annotations

import weakref

import torch

from shuili.hal.types import Weight
from shuili.platforms.reference import numerics

TILE = 16
K_ALIGN = 16
_DEQUANT_CACHE: "weakref.WeakKeyDictionary[Weight, torch.Tensor]" = weakref.WeakKeyDictionary()


def weight_f32(w: Weight) -> torch.Tensor:
    """The float32 weight ([N, K] or [E, N, K]); for quantized formats cached and already padded
    along K to a multiple of K_ALIGN (zeros), which `tiled_matmul` accepts as is.
    """
    if not isinstance(w, Weight):
        raise TypeError(f"expected a shuili.hal.types.Weight, got {type(w).__name__}; wrap dense "
                        "tensors with Weight.dense(t)")
    if w.format == "dense":
        return w.data.to(torch.float32).contiguous()
    cached = _DEQUANT_CACHE.get(w)
    if cached is None:
        from shuili.platforms.reference.quant import dequantize_weight

        cached = _pad_k(dequantize_weight(w))
        _DEQUANT_CACHE[w] = cached
    return cached


def _pad_k(w: torch.Tensor) -> torch.Tensor:
    k = w.shape[-1]
    if k % K_ALIGN == 0:
        return w.contiguous()
    return torch.nn.functional.pad(w, (0, K_ALIGN - k % K_ALIGN)).contiguous()


def tiled_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T in float32 as ceil(M / TILE) matmuls of exactly TILE rows, K padded
    with zeros to a multiple of K_ALIGN (w may come pre-padded) -> [M, N].
    """
    m, k = x.shape
    if w.shape[-1] != k and w.shape[-1] != -(-k // K_ALIGN) * K_ALIGN:
        raise ValueError(f"x has {k} input features but the weight has {w.shape[-1]}")
    w = _pad_k(w.to(torch.float32))
    n, kp = w.shape
    padded = -(-m // TILE) * TILE
    xp = torch.zeros(padded, kp, dtype=torch.float32)
    xp[:m, :k] = x
    out = torch.empty(padded, n, dtype=torch.float32)
    wt = w.t()
    for i in range(0, padded, TILE):
        torch.mm(xp[i:i + TILE], wt, out=out[i:i + TILE])
    return out[:m]


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias): W dequantized to float32, `tiled_matmul`, bias added after (float32).
    Returns x's dtype.
    """
    wf = weight_f32(w)
    if wf.dim() != 2:
        raise ValueError(f"linear needs a 2D weight, got logical shape {tuple(w.shape)}; "
                         "use grouped_linear for [E, N, K]")
    if x.dim() != 2:
        raise ValueError(f"linear takes x [T, K], got shape {tuple(x.shape)}; flatten tokens first")
    if x.shape[1] != w.in_features:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {w.in_features}")
    y = tiled_matmul(x.to(torch.float32), wf)
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
    """Per group e: rows [off_e, off_e + size_e) times W[e]^T via `tiled_matmul` (tiles restart
    at each group's first row). Returns [M, N] in x's dtype.
    """
    wf = weight_f32(w)
    if wf.dim() != 3:
        raise ValueError(f"grouped_linear needs an [E, N, K] weight, got {tuple(w.shape)}")
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"grouped_linear takes x [M, {w.in_features}], got {tuple(x.shape)}")
    offs = _offsets(group_sizes, wf.shape[0], x.shape[0])
    out = torch.zeros(x.shape[0], w.out_features, dtype=torch.float32)
    xf = x.to(torch.float32)
    for e in range(wf.shape[0]):
        if offs[e + 1] > offs[e]:
            out[offs[e]:offs[e + 1]] = tiled_matmul(xf[offs[e]:offs[e + 1]], wf[e])
    return out.to(x.dtype)


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: Weight,
                w2: Weight, swiglu_limit: float | None = None) -> torch.Tensor:
    """Routed SwiGLU experts. For each expert e, the (t, j) pairs routed to it, in increasing
    t * k + j order, go through `tiled_matmul` with w13[e] and then w2[e]; the activation is
    `numerics.silu` (float64, rounded once) times up, float32. y_t = sum_j w[t, j] * out[t, j],
    added in increasing j starting from zero. Returns [T, D] in x's dtype.
    """
    w13f, w2f = weight_f32(w13), weight_f32(w2)
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
    xf = x.to(torch.float32)
    per_pair = torch.zeros(t * k, d, dtype=torch.float32)
    for e in torch.unique(flat).tolist():
        pairs = torch.nonzero(flat == e).flatten()
        gu = tiled_matmul(xf[pairs // k], w13f[e])
        g, u = gu[:, :inter], gu[:, inter:]
        if swiglu_limit is not None:
            g = g.clamp(max=swiglu_limit)
            u = u.clamp(-swiglu_limit, swiglu_limit)
        per_pair[pairs] = tiled_matmul(numerics.silu(g) * u, w2f[e])
    per_pair = per_pair.view(t, k, d)
    wts = topk_weights.to(torch.float32)
    y = torch.zeros(t, d, dtype=torch.float32)
    for j in range(k):
        y = y + wts[:, j:j + 1] * per_pair[:, j]
    return y.to(x.dtype)
