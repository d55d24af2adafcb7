"""DeepSeek-V4 Lightning Indexer top-k, one query at a time."""
from __future__ import annotations

import torch

from shuili.hal import numerics
from shuili.platforms.reference.attention import _rows, _slots


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                 block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                 positions: torch.Tensor, ratio: int, topk: int, k_format: str = "none") -> torch.Tensor:
    """Per query t of sequence b: entries 0 .. n-1 (n = (pos + 1) // ratio); dots [H, n] by
    `numerics.dot` (exact, per query and entry); score[e] = tree_sum_h(weights[t, h] * relu(dot[h, e]))
    (float32); stable descending sort (ties keep the lower entry id); the first topk, -1 padded.
    """
    t, h, dk = q.shape
    nb, bs = k_cache.shape[:2]
    qsl = query_start_loc.tolist()
    if len(qsl) < 2 or qsl[0] != 0 or qsl[-1] != t:
        raise ValueError(f"query_start_loc {qsl} must run from 0 to the {t} query tokens")
    if ratio <= 0 or topk <= 0:
        raise ValueError(f"ratio ({ratio}) and topk ({topk}) must be positive")
    pos = positions.to(torch.int64)
    qf = q.to(torch.float32)
    wf = weights.to(torch.float32)
    out = torch.full((t, topk), -1, dtype=torch.int32)
    for b in range(len(qsl) - 1):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        n_t = (pos[lo:hi] + 1) // ratio  # [q] entries each query sees
        n = int(n_t.max())
        if n == 0:
            continue
        if -(-n // bs) > block_tables.shape[1]:
            raise ValueError(f"a query of sequence {b} sees {n} entries but block_tables has only "
                             f"{block_tables.shape[1]} blocks of {bs}")
        keys = _rows(k_cache, k_format, dk, _slots(block_tables[b], torch.arange(n), bs))
        dots = numerics.dot(qf[lo:hi], keys)  # [q, H, n]
        score = numerics.tree_sum(wf[lo:hi, :, None] * dots.clamp_min(0.0), dim=1)  # [q, n]
        # entries past a query's own n rank after every real score and are cut below
        score = torch.where(torch.arange(n)[None, :] < n_t[:, None], score,
                            torch.full_like(score, float("-inf")))
        order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :topk]
        keep = torch.arange(order.shape[1])[None, :] < n_t[:, None]
        out[lo:hi, :order.shape[1]] = torch.where(keep, order, torch.full_like(order, -1)).to(torch.int32)
    return out
