"""Reference sampling ops: log_softmax, apply_penalties, sample (semantics in shuili.hal.ops).

Batch invariance by construction: every row is copied into a fresh contiguous buffer and reduced
on its own, so its bits cannot depend on the other rows, the batch size or the row's place (the
vectorised/scalar split of a transcendental or a reduction is then a function of V alone).
Penalties are elementwise IEEE add/mul/div, which are exact-rounded in any lane, so they run on the
whole batch at once.
"""
from __future__ import annotations

import torch

from shuili.core import noise


def _row_log_softmax(row: torch.Tensor) -> torch.Tensor:
    x = row.to(torch.float32).clone()
    m = x.max()
    if torch.isinf(m) and m < 0:
        return torch.full_like(x, float("-inf"))
    z = x - m
    return z - torch.log(torch.exp(z).sum())


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"log_softmax takes logits [B, V], got shape {tuple(logits.shape)}")
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for b in range(logits.shape[0]):
        out[b] = _row_log_softmax(logits[b])
    return out


def apply_penalties(logits, token_counts, prompt_mask, repetition, presence, frequency):
    lg = logits.to(torch.float32)
    seen = prompt_mask | (token_counts > 0)
    r = repetition.to(torch.float32)[:, None]
    lg = torch.where(seen, torch.where(lg > 0, lg / r, lg * r), lg)
    counts = token_counts.to(torch.float32)
    lg = lg - (frequency.to(torch.float32)[:, None] * counts
               + presence.to(torch.float32)[:, None] * (counts > 0).to(torch.float32))
    return lg.clone()


def _first_argmax(x: torch.Tensor) -> int:
    # lowest id among the maxima, independent of torch.argmax's tie behaviour
    return int(torch.nonzero(x == x.max())[0, 0])


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
        probs = torch.exp(lp.to(torch.float64))[order]
        csum = torch.cumsum(probs, 0)
        # keep every token before the crossing one, and the crossing one
        n_keep = int((csum < top_p).sum()) + 1
        keep[order[n_keep:]] = False
    if min_p > 0.0:
        p = torch.exp(lp.to(torch.float64))
        keep &= p >= min_p * p.max()
    return keep


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64)
    ids = torch.arange(V, dtype=torch.int64)
    temps, ks, ps, mps = temperature.tolist(), top_k.tolist(), top_p.tolist(), min_p.tolist()
    sds, pos = seeds.tolist(), positions.tolist()
    for b in range(B):
        row = logits[b].to(torch.float32).clone()
        if temps[b] == 0.0:
            out[b] = _first_argmax(row)
            continue
        lp = _row_log_softmax(row / torch.tensor(temps[b], dtype=torch.float32))
        keep = _keep_mask(lp, int(ks[b]), float(ps[b]), float(mps[b]))
        score = lp.to(torch.float64) + noise.gumbel(int(sds[b]), int(pos[b]), ids)
        score = torch.where(keep, score, torch.tensor(float("-inf"), dtype=torch.float64))
        out[b] = _first_argmax(score)
    return out.to(logits.device)


SAMPLING_OPS = {"log_softmax": log_softmax, "apply_penalties": apply_penalties, "sample": sample}
