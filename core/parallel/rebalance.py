"""Moving expert weights to a new `Placement` between steps, over the HAL's all_to_all.

Every rank computes the same transfer plan from the old and the new placement: each new slot is
filled from the lowest old physical slot holding its expert (possibly on this rank). Weights are
copied as bytes, so a moved or replicated expert has exactly the bits it had.
"""
from __future__ import annotations

import torch

from shuili.core.parallel.eplb import Placement
from shuili.hal.types import Weight


def transfer_plan(old: Placement, new: Placement, layer: int) -> list[tuple[int, int, int, int]]:
    """(src rank, src slot, dst rank, dst slot) for every new slot, sorted by (src, dst, dst slot)."""
    S0, S1 = old.slots_per_rank, new.slots_per_rank
    first: dict[int, int] = {}
    for p, e in enumerate(old.phys2log[layer].tolist()):
        first.setdefault(e, p)
    moves = []
    for q, e in enumerate(new.phys2log[layer].tolist()):
        if e not in first:
            raise ValueError(f"layer {layer}: expert {e} has no slot in the current placement")
        p = first[e]
        moves.append((p // S0, p % S0, q // S1, q % S1))
    return sorted(moves, key=lambda m: (m[0], m[2], m[3]))  # rows to each rank in its slot order


def _exchange(ops, t: torch.Tensor, moves, rank: int, ranks: int, slots: int, group) -> torch.Tensor:
    """t [S_old, ...] local rows -> [S_new, ...] rows of the new placement (bytes copied)."""
    mine = [m for m in moves if m[0] == rank]
    rows = t[[m[1] for m in mine]] if mine else t[:0]
    send = [sum(1 for m in mine if m[2] == r) for r in range(ranks)]
    into = [m for m in moves if m[2] == rank]  # sorted by source rank, then dst slot: arrival order
    recv = [sum(1 for m in into if m[0] == r) for r in range(ranks)]
    flat = rows.reshape(rows.shape[0], -1).contiguous().view(torch.uint8)
    got = ops.all_to_all(flat, send, recv, group)
    out = torch.empty((slots, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out.view(slots, -1).view(torch.uint8)[[m[3] for m in into]] = got
    return out


def apply_placement(model, new: Placement, groups) -> None:
    """Replace the model's local expert stacks with those of `new` (collective: every rank calls)."""
    old = model.placement
    if old is None:
        raise ValueError("the model has no expert placement (expert parallel is off)")
    if new.ranks != old.ranks or new.phys2log.shape[0] != old.phys2log.shape[0]:
        raise ValueError("a new placement must keep the EP size and the layer count")
    S = new.slots_per_rank
    layers = {}
    for i, blk in enumerate(model.blocks):
        moves = transfer_plan(old, new, i)
        out = []
        for w in (blk.ffn.w13, blk.ffn.w2):
            data = _exchange(model.ops, w.data, moves, groups.ep_rank, groups.ep, S, groups.ep_group)
            scale = None if w.scale is None else _exchange(model.ops, w.scale, moves, groups.ep_rank,
                                                            groups.ep, S, groups.ep_group)
            out.append(Weight(w.format, data, scale, (S, *w.shape[1:])))
        layers[i] = tuple(out)
    model.load_experts(new, layers)
