"""MoE routing. Scores are computed in float64 and rounded once to float32 (so they land on the
reference's correctly-rounded values almost always); selection is an exact top-k on an int64 key
(score desc, expert id asc). T x E is small: torch is the right tool, and every op is row-wise."""
from __future__ import annotations

import torch

from shuili.platforms.nvidia.common import check, desc_key, in_range, key_ids, tree_sum

SCORINGS = ("sqrtsoftplus", "softmax", "sigmoid")


def _score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    x = logits.to(torch.float64)
    if scoring == "sqrtsoftplus":
        return torch.sqrt(torch.nn.functional.softplus(x, threshold=1e9).to(torch.float32))
    if scoring == "softmax":
        return torch.softmax(x, -1).to(torch.float32)
    if scoring == "sigmoid":
        return torch.sigmoid(x).to(torch.float32)
    raise ValueError(f"unknown scoring {scoring!r}; use one of {SCORINGS}")


def _finish(s, ids, renormalize, scaling):
    w = torch.gather(s, 1, ids)
    if renormalize:
        w = w / (tree_sum(w) + 1e-20)[:, None]
    return (w * scaling).to(torch.float32), ids


def moe_route_topk(logits, bias, topk, scoring, renormalize, scaling):
    t, e = logits.shape
    if not 0 < topk <= e:
        raise ValueError(f"topk {topk} must be in [1, {e}] (the number of experts)")
    s = _score(logits, scoring)
    biased = s if bias is None else s + bias.to(torch.float32)
    ids = torch.arange(e, device=logits.device).expand(t, e)
    top = torch.topk(desc_key(biased, ids), topk, dim=1, sorted=True).values
    return _finish(s, key_ids(top), renormalize, scaling)


def moe_route_hash(logits, token_ids, tid2eid, scoring, renormalize, scaling):
    tok = token_ids.to(torch.int64)
    e = logits.shape[1]
    check(tok, in_range(0, tid2eid.shape[0]), f"token ids must lie in [0, {tid2eid.shape[0]})")
    ids = tid2eid.to(torch.int64)[tok]
    check(ids, in_range(0, e), f"tid2eid holds expert ids outside [0, {e})")
    return _finish(_score(logits, scoring), ids, renormalize, scaling)
