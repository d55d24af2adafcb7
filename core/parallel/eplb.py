"""EPLB: where each expert lives, and a planner that moves and replicates experts by load.

A `Placement` maps every physical expert slot of every MoE layer to a logical expert:
phys2log int64 [L, W * S] (W EP ranks, S slots each; rank r owns slots [r*S, (r+1)*S)). A logical
expert may have several slots (replicas); a token's pair goes to one of them, chosen by its pair
index, and a replica computes the same bits wherever it runs (the experts op is row-wise), so a
placement change moves work and never output bits.

The planner follows the hierarchical policy DeepSeek published for EPLB: (1) pack experts onto
nodes so each node gets about the same load, (2) within a node, give extra slots to the experts
with the highest load per replica, (3) pack the node's physical experts onto its ranks so each
rank gets about the same load. Without several nodes it is the same algorithm with one node.
Loads come from the routing counters the parallel model keeps (`ParallelV4Model.expert_load`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class Placement:
    phys2log: torch.Tensor  # int64 [L, W * S]
    ranks: int  # W

    @property
    def slots_per_rank(self) -> int:
        return self.phys2log.shape[1] // self.ranks

    @classmethod
    def contiguous(cls, layers: int, experts: int, ranks: int, redundant: int = 0) -> "Placement":
        """Rank r holds experts [r*E/W, (r+1)*E/W); redundant slots replicate experts 0, 1, ..."""
        if (experts + redundant) % ranks:
            raise ValueError(f"{experts} experts + {redundant} redundant slots do not divide over {ranks} "
                             f"EP ranks; pick num_redundant_experts so that the sum is a multiple of {ranks}")
        row = list(range(experts)) + [i % experts for i in range(redundant)]
        if redundant:  # a planner pass on uniform load spreads the replicas over ranks
            return plan(torch.ones(layers, experts), ranks, (experts + redundant) // ranks)
        return cls(torch.tensor([row] * layers, dtype=torch.int64).reshape(layers, -1), ranks)

    def local(self, rank: int) -> tuple[tuple[int, ...], ...]:
        S = self.slots_per_rank
        return tuple(tuple(r) for r in self.phys2log[:, rank * S:(rank + 1) * S].tolist())

    def replicas(self, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log2phys int64 [L, E, R] padded with -1, count int64 [L, E]); slots ascending."""
        L, P = self.phys2log.shape
        count = torch.zeros(L, experts, dtype=torch.int64)
        for layer in range(L):
            count[layer] = torch.bincount(self.phys2log[layer], minlength=experts)
        if int(count.min()) < 1:
            raise ValueError("a placement must hold every logical expert at least once")
        R = int(count.max())
        table = torch.full((L, experts, R), -1, dtype=torch.int64)
        for layer in range(L):
            seen = [0] * experts
            for p, e in enumerate(self.phys2log[layer].tolist()):
                table[layer, e, seen[e]] = p
                seen[e] += 1
        return table, count

    def rank_load(self, load: torch.Tensor) -> torch.Tensor:
        """float64 [L, W]: each rank's load when a logical expert's load splits evenly over its replicas."""
        L, E = load.shape
        _, count = self.replicas(E)
        per_slot = load.double().gather(1, self.phys2log) / count.double().gather(1, self.phys2log)
        return per_slot.view(L, self.ranks, -1).sum(-1)


# ------------------------------------------------------------------------------------ the planner
def _pack(weights: list[float], packs: int) -> list[int]:
    """Pack index of each item: heaviest first onto the lightest pack with room (n/packs each)."""
    cap = len(weights) // packs
    heap = [(0.0, p) for p in range(packs)]
    fill = [0] * packs
    out = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        skipped = []
        while True:
            w, p = heapq.heappop(heap)
            if fill[p] < cap:
                break
            skipped.append((w, p))
        out[i] = p
        fill[p] += 1
        heapq.heappush(heap, (w + weights[i], p))
        for s in skipped:
            heapq.heappush(heap, s)
    return out


def _replicate(weights: list[float], slots: int) -> list[int]:
    """Replica count per expert: one each, then extra slots to the highest load per replica."""
    count = [1] * len(weights)
    heap = [(-w, i) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    for _ in range(slots - len(weights)):
        _, i = heapq.heappop(heap)
        count[i] += 1
        heapq.heappush(heap, (-weights[i] / count[i], i))
    return count


def plan_layer(load: list[float], ranks: int, slots_per_rank: int, nodes: int = 1) -> list[int]:
    """phys2log of one layer: W * S logical ids, rank r's slots at [r*S, (r+1)*S)."""
    E = len(load)
    if E % nodes or ranks % nodes:
        raise ValueError(f"{E} experts and {ranks} ranks must both divide over {nodes} nodes")
    per_node_ranks, slots = ranks // nodes, ranks * slots_per_rank
    if slots < E:
        raise ValueError(f"{slots} slots cannot hold {E} experts")
    node_of = _pack(load, nodes)
    out = [0] * slots
    for n in range(nodes):
        experts = [e for e in range(E) if node_of[e] == n]
        count = _replicate([load[e] for e in experts], slots // nodes)
        phys = [(experts[i], load[experts[i]] / count[i]) for i in range(len(experts)) for _ in range(count[i])]
        rank_of = _pack([w for _, w in phys], per_node_ranks)
        fill = [0] * per_node_ranks
        for (e, _), r in zip(phys, rank_of):
            gr = n * per_node_ranks + r
            out[gr * slots_per_rank + fill[r]] = e
            fill[r] += 1
    return out


def plan(load: torch.Tensor, ranks: int, slots_per_rank: int, nodes: int = 1) -> Placement:
    """A Placement for loads [L, E] (tokens routed to each expert): hierarchical when nodes > 1."""
    rows = [plan_layer([float(v) for v in layer], ranks, slots_per_rank, nodes) for layer in load.tolist()]
    return Placement(torch.tensor(rows, dtype=torch.int64), ranks)


def imbalance(rank_load: torch.Tensor) -> float:
    """max / mean rank load, averaged over layers (1.0 = perfectly even)."""
    mean = rank_load.mean(-1).clamp(min=1e-12)
    return float((rank_load.max(-1).values / mean).mean())
