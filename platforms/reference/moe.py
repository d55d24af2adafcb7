"""MoE routing: biased top-k and hash routing. Scores via `numerics` (position independent)."""
from __future__ import annotations

import torch

from shuili.hal import numerics

SCORINGS = ("sqrtsoftplus", "softmax", "sigmoid")


def _score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    x = logits.to(torch.float32)
    if scoring == "sqrtsoftplus":
        return numerics.sqrt(numerics.softplus(x))
    if scoring == "softmax":
        return numerics.softmax_last(x)
    if scoring == "sigmoid":
        return numerics.sigmoid(x)
    raise ValueError(f"unknown scoring {scoring!r}; use one of {SCORINGS}")


def _finish(s: torch.Tensor, ids: torch.Tensor, renormalize: bool, scaling: float):
    w = torch.gather(s, 1, ids)
    if renormalize:
        w = w / (numerics.tree_sum(w) + 1e-20)[:, None]
    return (w * scaling).to(torch.float32), ids


def moe_route_topk(logits: torch.Tensor, bias: torch.Tensor | None, topk: int, scoring: str,
                   renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: a stable descending sort of s + bias (equal scores keep the lower expert id first),
    the first topk; weights: the unbiased s at ids, renormalised by a `tree_sum` (+1e-20), scaled.
    """
    t, e = logits.shape
    if not 0 < topk <= e:
        raise ValueError(f"topk {topk} must be in [1, {e}] (the number of experts)")
    s = _score(logits, scoring)
    biased = s if bias is None else s + bias.to(torch.float32)
    ids = torch.sort(biased, dim=1, descending=True, stable=True).indices[:, :topk]
    return _finish(s, ids.to(torch.int64), renormalize, scaling)


def moe_route_hash(logits: torch.Tensor, token_ids: torch.Tensor, tid2eid: torch.Tensor,
                   scoring: str, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ids = tid2eid[token_ids]; weights as in `moe_route_topk`."""
    tok = token_ids.to(torch.int64)
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= tid2eid.shape[0]):
        raise ValueError(f"token ids must lie in [0, {tid2eid.shape[0]}) (rows of tid2eid)")
    ids = tid2eid.to(torch.int64)[tok]
    e = logits.shape[1]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= e):
        raise ValueError(f"tid2eid holds expert ids outside [0, {e})")
    return _finish(_score(logits, scoring), ids, renormalize, scaling)
