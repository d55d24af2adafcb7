"""Reference sampling ops: log_softmax, apply_penalties, sample (semantics in shuili.hal.ops).

Batch invariance by construction: exp, log and the row sum come from
`shuili.hal.numerics` (elementwise IEEE basics and a fixed pairwise tree whose
order depends only on V), so a row's bits depend on nothing but the row. Penalties are
elementwise add/mul/div, exact-rounded in any lane. Top-k/top-p need a per-row sort and cumsum,
so filtered rows are handled one at a time; the Gumbel noise is keyed by token id, so the sort's
order never reaches the result.
"""
from __future__ import annotations

import torch

from shuili.hal import noise, numerics
from shuili.platforms.reference import native


# rows per pass bound the float64 temporaries of exp to ~2 MB each (5 rows of a 49152 vocabulary),
# a size that exp64's ~30 passes can keep in a core's cache
_CHUNK_ELEMENTS = 1 << 18


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"log_softmax takes logits [B, V], got shape {tuple(logits.shape)}")
    if logits.dtype == torch.float32 and native.enabled("rowops"):  # one compiled loop, same bits
        return native.log_softmax(logits)
    rows = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[1]))
    if logits.shape[0] <= rows:
        return log_softmax_torch(logits)
    # a row's bits depend only on that row, so row chunks give the whole tensor's bits
    return torch.cat([log_softmax_torch(c) for c in logits.split(rows)])


def log_softmax_torch(logits: torch.Tensor) -> torch.Tensor:
    """float32 log_softmax of [B, V] rows as torch ops: the compiled loop's definition."""
    x = logits.to(torch.float32)
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all -inf row: no inf - inf
    z = x - m
    s = numerics.tree_sum(numerics.exp(z))
    return z - numerics.log64(s).to(torch.float32)[:, None]


def gumbel(seed, position, ids) -> torch.Tensor:
    """float64 -log(-log(u)) with the position-independent log, broadcast over the keys."""
    return -numerics.log64(-numerics.log64(noise.uniform(seed, position, ids)))


def apply_penalties(logits, token_counts, prompt_mask, repetition, presence, frequency):
    lg = logits.to(torch.float32)
    seen = prompt_mask | (token_counts > 0)
    r = repetition.to(torch.float32)[:, None]
    lg = torch.where(seen, torch.where(lg > 0, lg / r, lg * r), lg)
    counts = token_counts.to(torch.float32)
    lg = lg - (frequency.to(torch.float32)[:, None] * counts
               + presence.to(torch.float32)[:, None] * (counts > 0).to(torch.float32))
    return lg.clone()


def _first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> int64 [B]: the lowest id among each row's maxima (exact, row-wise); V for a row
    holding NaN (no element equals its max). torch.argmax returns the first maximal index (its
    documented tie rule, any thread split), which is that id; it would pick a NaN's own index, hence
    the amax. Two passes over x, where a mask of x == max and an id grid took five (~2 ms a SmolLM2
    step at batch 16)."""
    best = x.argmax(-1)
    return torch.where(torch.isnan(x.amax(-1)), torch.full_like(best, x.shape[-1]), best)


def _keep_mask(lp: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """lp float32 [V] -> bool [V] of tokens kept by top-k, top-p and min-p."""
    V = lp.shape[0]
    keep = torch.ones(V, dtype=torch.bool)
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
        return keep
    # rank by (lp desc, id asc): a stable sort of -lp keeps equal values in id order
    order = torch.sort(-lp.to(torch.float64), stable=True).indices
    if 0 < top_k < V:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        probs = numerics.exp64(lp.to(torch.float64))[order]
        csum = torch.cumsum(probs, 0)
        # keep every token before the crossing one, and the crossing one
        n_keep = int((csum < top_p).sum()) + 1
        keep[order[n_keep:]] = False
    if min_p > 0.0:
        p = numerics.exp64(lp.to(torch.float64))
        keep &= p >= min_p * p.max()
    return keep


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions, *, all_greedy=None,
           any_filter=None):
    B, V = logits.shape
    x = logits.to(torch.float32)
    greedy = temperature == 0
    best = _first_argmax(x)
    if all_greedy or bool(greedy.all()):
        return best
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    lp = log_softmax(x / t[:, None])
    keep = torch.ones(B, V, dtype=torch.bool, device=x.device)
    ks, ps, mps = top_k.tolist(), top_p.tolist(), min_p.tolist()
    for b in range(B if any_filter is not False else 0):
        if ks[b] > 0 or ps[b] < 1.0 or mps[b] > 0.0:
            keep[b] = _keep_mask(lp[b], int(ks[b]), float(ps[b]), float(mps[b]))
    ids = torch.arange(V, dtype=torch.int64, device=x.device)
    g = gumbel(seeds.to(torch.int64)[:, None], positions.to(torch.int64)[:, None], ids[None])
    score = torch.where(keep, lp.to(torch.float64) + g, torch.tensor(float("-inf"), dtype=torch.float64))
    return torch.where(greedy, best, _first_argmax(score))


SAMPLING_OPS = {"log_softmax": log_softmax, "apply_penalties": apply_penalties, "sample": sample}
