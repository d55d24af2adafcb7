"""DeepSeek-V4 Lightning Indexer top-k, one query at a time."""
from __future__ import annotations

import torch

from shuili.platforms.reference.attention import _fresh, _rows, _slots
from shuili.platforms.reference.numerics import tree_sum


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                 block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                 positions: torch.Tensor, ratio: int, topk: int, k_format: str = "none") -> torch.Tensor:
    """Per query t of sequence b: gather entries 0 .. n-1 (n = (pos + 1) // ratio) into a fresh
    buffer; dots [H, n] by one matmul; score[e] = tree_sum_h(weights[t, h] * relu(dot[h, e]))
    (float32); stable descending sort (ties keep the lower entry id); the first topk, -1 padded.
    """
    t, h, dk = q.shape
    nb, bs = k_cache.shape[:2]
    qsl = query_start_loc.tolist()
    if len(qsl) < 2 or qsl[0] != 0 or qsl[-1] != t:
        raise ValueError(f"query_start_loc {qsl} must run from 0 to the {t} query tokens")
    if ratio <= 0 or topk <= 0:
        raise ValueError(f"ratio ({ratio}) and topk ({topk}) must be positive")
    pos = positions.to(torch.int64).tolist()
    qf = q.to(torch.float32)
    wf = weights.to(torch.float32)
    out = torch.full((t, topk), -1, dtype=torch.int32)
    for b in range(len(qsl) - 1):
        for ti in range(qsl[b], qsl[b + 1]):
            n = (pos[ti] + 1) // ratio
            if n == 0:
                continue
            if -(-n // bs) > block_tables.shape[1]:
                raise ValueError(f"query {ti} sees {n} entries but block_tables has only "
                                 f"{block_tables.shape[1]} blocks of {bs}")
            keys = _rows(k_cache, k_format, dk, _slots(block_tables[b], torch.arange(n), bs))
            dots = torch.mm(_fresh(qf[ti]), _fresh(keys.t()))  # [H, n]
            score = tree_sum((wf[ti][:, None] * dots.clamp_min(0.0)).t())  # [n]
            order = torch.sort(score, descending=True, stable=True).indices[:topk]
            out[ti, :order.numel()] = order.to(torch.int32)
    return out
