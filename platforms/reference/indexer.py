"""DeepSeek-V4 Lightning Indexer top-k, one query at a time."""
from __future__ import annotations

import torch

from shuili.hal import numerics
from shuili.platforms.reference.attention import _rows, _slots


def _check(t: int, query_start_loc: torch.Tensor, ratio: int, topk: int) -> list[int]:
    qsl = query_start_loc.tolist()
    if len(qsl) < 2 or qsl[0] != 0 or qsl[-1] != t:
        raise ValueError(f"query_start_loc {qsl} must run from 0 to the {t} query tokens")
    if ratio <= 0 or topk <= 0:
        raise ValueError(f"ratio ({ratio}) and topk ({topk}) must be positive")
    return qsl


def _scores(qf: torch.Tensor, wf: torch.Tensor, k_cache: torch.Tensor, k_format: str,
            block_table: torch.Tensor, pos: torch.Tensor, ratio: int, b: int):
    """Sequence b's queries (qf [q, H, Dk], wf [q, H] float32, pos [q]) against its visible entries:
    (score [q, n] float32, -inf past each query's own n; n_t [q]), or None when no query sees an entry."""
    bs = k_cache.shape[1]
    n_t = (pos + 1) // ratio  # [q] entries each query sees
    n = int(n_t.max())
    if n == 0:
        return None
    if -(-n // bs) > block_table.shape[0]:
        raise ValueError(f"a query of sequence {b} sees {n} entries but block_tables has only "
                         f"{block_table.shape[0]} blocks of {bs}")
    keys = _rows(k_cache, k_format, qf.shape[2], _slots(block_table, torch.arange(n), bs))
    dots = numerics.dot(qf, keys)  # [q, H, n]
    score = numerics.tree_sum(wf[:, :, None] * dots.clamp_min(0.0), dim=1)  # [q, n]
    # entries past a query's own n rank after every real score and are cut by the callers
    score = torch.where(torch.arange(n)[None, :] < n_t[:, None], score,
                        torch.full_like(score, float("-inf")))
    return score, n_t


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                 block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                 positions: torch.Tensor, ratio: int, topk: int, k_format: str = "none") -> torch.Tensor:
    """Per query t of sequence b: entries 0 .. n-1 (n = (pos + 1) // ratio); dots [H, n] by
    `numerics.dot` (exact, per query and entry); score[e] = tree_sum_h(weights[t, h] * relu(dot[h, e]))
    (float32); stable descending sort (ties keep the lower entry id); the first topk, -1 padded.
    """
    t = q.shape[0]
    qsl = _check(t, query_start_loc, ratio, topk)
    pos = positions.to(torch.int64)
    qf = q.to(torch.float32)
    wf = weights.to(torch.float32)
    out = torch.full((t, topk), -1, dtype=torch.int32)
    for b in range(len(qsl) - 1):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        scored = _scores(qf[lo:hi], wf[lo:hi], k_cache, k_format, block_tables[b], pos[lo:hi], ratio, b)
        if scored is None:
            continue
        score, n_t = scored
        order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :topk]
        keep = torch.arange(order.shape[1])[None, :] < n_t[:, None]
        out[lo:hi, :order.shape[1]] = torch.where(keep, order, torch.full_like(order, -1)).to(torch.int32)
    return out


def indexer_select(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                   block_tables: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                   ratio: int, topk: int, k_format: str = "none", candidates: torch.Tensor | None = None,
                   candidate_topk: int = 0, candidate_block_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V4.1 two-level indexer, one sequence at a time: scores as `indexer_topk`
    (exact dots, tree sum over heads), -inf outside the visible entries and the candidate blocks,
    stable descending sorts (ties keep the lower id) for the entries and the candidate blocks.
    """
    t = q.shape[0]
    qsl = _check(t, query_start_loc, ratio, topk)
    if candidate_topk < 0 or candidate_block_size <= 0:
        raise ValueError(f"candidate_topk ({candidate_topk}) must be >= 0 and candidate_block_size "
                         f"({candidate_block_size}) > 0")
    if candidates is not None and (candidates.dim() != 2 or candidates.shape[0] != t):
        raise ValueError(f"candidates must be int32 [{t}, C], got {tuple(candidates.shape)}")
    S = candidate_block_size
    pos = positions.to(torch.int64)
    qf, wf = q.to(torch.float32), weights.to(torch.float32)
    out = torch.full((t, topk), -1, dtype=torch.int32)
    cand_out = torch.full((t, candidate_topk), -1, dtype=torch.int32)
    ninf = float("-inf")
    for b in range(len(qsl) - 1):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        scored = _scores(qf[lo:hi], wf[lo:hi], k_cache, k_format, block_tables[b], pos[lo:hi], ratio, b)
        if scored is None:
            continue
        score, n_t = scored
        n = score.shape[1]
        if candidates is not None:
            ent = torch.arange(n)
            allowed = ((ent // S)[None, :, None] == candidates[lo:hi, None, :].to(torch.int64)).any(-1)
            score = torch.where(allowed, score, torch.full_like(score, ninf))
        order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :topk]
        keep = torch.gather(score, 1, order) > ninf
        out[lo:hi, :order.shape[1]] = torch.where(keep, order, torch.full_like(order, -1)).to(torch.int32)
        if candidate_topk:
            nblk = -(-n // S)
            padded = torch.full((hi - lo, nblk * S), ninf)
            padded[:, :n] = score
            bscore = padded.view(hi - lo, nblk, S).amax(-1)
            last = torch.div(n_t - 1, S, rounding_mode="floor")
            pin = (torch.arange(nblk)[None, :] == last[:, None]) & (n_t[:, None] > 0)
            bscore = torch.where(pin, torch.full_like(bscore, float("inf")), bscore)
            border = torch.sort(bscore, dim=1, descending=True, stable=True).indices[:, :candidate_topk]
            bkeep = torch.gather(bscore, 1, border) > ninf
            cand_out[lo:hi, :border.shape[1]] = torch.where(bkeep, border,
                                                            torch.full_like(border, -1)).to(torch.int32)
    return out, cand_out
