"""DeepSeek-V4 on one rank of a TP x DP (x EP) group: `DeepseekV4Model` over local shards
(core/parallel/sharding.py), with every exchange a HAL collective (`ops.all_reduce`,
`ops.all_gather`, `ops.all_to_all`); nothing here calls torch.distributed.

What is exact and what is not (reference platform; docs/parallel.md):
  - vocab-split embedding and head: gathers, no arithmetic -> the same bits as one rank;
  - head-split attention: heads are independent, but wo_b's sum over G*o_lora_rank becomes t
    partial sums added in rank order (all_reduce) -> TP changes bits;
  - EP experts: each (token, expert) pair computed whole on its owner, combined in j order as
    `moe_experts` does -> the same bits as one rank (float32 compute) wherever experts live;
  - TP-split experts (EP off): partial sums over I, all_reduce -> TP changes bits.
A fixed (TP, EP) gives a request the same bits in any batch and on any DP rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shuili.core.model_api import ForwardBatch
from shuili.core.models.deepseek_v4 import DeepseekV4Model, Moe, _Meta, shared_expert
from shuili.core.parallel.eplb import Placement
from shuili.core.parallel.sharding import ShardPlan


@dataclass
class Groups:
    """This rank's place: process-group handles are opaque to the model (None = one rank)."""
    tp: int = 1
    tp_rank: int = 0
    tp_group: object | None = None
    ep: int = 1  # EP ranks (TP x DP) when expert parallel, else 1
    ep_rank: int = 0
    ep_group: object | None = None


class ParallelV4Model(DeepseekV4Model):
    supports_static_decode = False  # eager: graph capture of collectives is issue 21's

    def __init__(self, plan: ShardPlan, ops, params: dict, groups: Groups, placement: Placement | None,
                 device: str = "cpu", dtype: str = "float32", max_model_len: int | None = None, tokenizer=None):
        super().__init__(plan.local_cfg(), ops, params, device=device, dtype=dtype,
                         max_model_len=max_model_len, tokenizer=tokenizer, with_mtp=False)
        self.full_cfg, self.plan, self.g = plan.cfg, plan, groups
        self.vocab_size = plan.cfg.vocab_size
        for i, blk in enumerate(self.blocks):
            blk.ffn.layer = i  # the MoE needs its layer for the placement and the counters
        E = plan.cfg.n_routed_experts
        # pairs routed per expert since the last reset (EP only: EPLB needs EP); on the device, so
        # counting never syncs the host
        self.expert_load = torch.zeros(len(self.blocks), E, dtype=torch.int64, device=device)
        self.set_placement(placement)

    # ---------------------------------------------------------------- placement (EPLB)
    def set_placement(self, placement: Placement | None) -> None:
        self.placement = placement
        if placement is not None:
            table, count = placement.replicas(self.full_cfg.n_routed_experts)
            self._log2phys, self._count = table.to(self.device), count.to(self.device)

    def load_experts(self, placement: Placement, layer_weights: dict[int, tuple]) -> None:
        """Install new local expert stacks (w13, w2 per layer) and the placement they follow."""
        for i, (w13, w2) in layer_weights.items():
            self.blocks[i].ffn.w13, self.blocks[i].ffn.w2 = w13, w2
        self.set_placement(placement)

    # ---------------------------------------------------------------- forward
    def forward(self, batch: ForwardBatch, keep_hidden: bool = False) -> torch.Tensor:
        if not self.caches:
            raise RuntimeError("bind_caches() must be called before forward()")
        if batch.input_ids.numel() == 0:  # an idle DP group: only its part in the EP exchanges
            return self._idle()
        meta = _Meta(self, batch)
        h = self._embed(batch.input_ids)
        x = h[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        for i, blk in enumerate(self.blocks):
            x = self._block(blk, i, x, meta, batch.input_ids)
        self.last_hidden = x if keep_hidden else None
        return self._logits(x[batch.logits_indices], self.hc_head, self.norm)

    def _idle(self) -> torch.Tensor:
        if self.placement is not None:
            k, dev = self.cfg.num_experts_per_tok, self.device
            x = torch.zeros(0, self.cfg.hidden_size, dtype=self.dtype, device=dev)
            for blk in self.blocks:
                self._ep_experts(blk.ffn, x, torch.zeros(0, k, dtype=torch.int64, device=dev),
                                 torch.zeros(0, k, dtype=torch.float32, device=dev))
        return torch.zeros(0, self.vocab_size, dtype=torch.float32, device=self.device)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        ops, g = self.ops, self.g
        if g.tp == 1:
            return ops.embedding(ids, self.embed)
        n = self.embed.shape[0]  # V / t rows here
        local = (ids - g.tp_rank * n).clamp(0, n - 1)
        rows = ops.all_gather(ops.embedding(local, self.embed), g.tp_group)  # [t*T, D]
        T = ids.shape[0]
        return rows.view(g.tp, T, -1)[ids // n, torch.arange(T, device=ids.device)]

    def _logits(self, x, hc, norm) -> torch.Tensor:
        local = super()._logits(x, hc, norm)  # [N, V/t]: each logit a whole dot product
        return local if self.g.tp == 1 else self.ops.all_gather(local.contiguous(), self.g.tp_group, dim=-1)

    def _attention(self, p, layer, x, meta) -> torch.Tensor:
        y = super()._attention(p, layer, x, meta)  # local heads and groups; wo_b partial
        return y if self.g.tp == 1 else self.ops.all_reduce(y, self.g.tp_group)

    def _moe(self, p: Moe, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ops, cfg, g = self.ops, self.cfg, self.g
        logits = ops.linear(x.float(), p.gate).float()
        if p.tid2eid is not None:
            w, idx = ops.moe_route_hash(logits, ids, p.tid2eid, cfg.scoring_func, cfg.norm_topk_prob,
                                        cfg.routed_scaling_factor)
        else:
            w, idx = ops.moe_route_topk(logits, p.bias, cfg.num_experts_per_tok, cfg.scoring_func,
                                        cfg.norm_topk_prob, cfg.routed_scaling_factor)
        if self.placement is None:  # experts split along I by TP: partial sums, one all_reduce
            y = ops.moe_experts(x, idx, w, p.w13, p.w2, cfg.swiglu_limit)
            y = self._shared(p, x, y)
            return y if g.tp == 1 else ops.all_reduce(y, g.tp_group)
        # EP: the TP ranks hold the same tokens; each dispatches its own slice of them
        T = x.shape[0]
        part = -(-T // g.tp)
        lo, hi = min(T, g.tp_rank * part), min(T, (g.tp_rank + 1) * part)
        self._count_load(p.layer, idx[lo:hi])
        y = self._ep_experts(p, x[lo:hi], idx[lo:hi], w[lo:hi])
        if g.tp > 1:
            pad = torch.zeros(part - (hi - lo), y.shape[1], dtype=y.dtype, device=y.device)
            y = ops.all_gather(torch.cat([y, pad]), g.tp_group)
            y = torch.cat([y[r * part:r * part + max(0, min(T, (r + 1) * part) - r * part)] for r in range(g.tp)])
        return self._shared(p, x, y)

    def _shared(self, p: Moe, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if p.shared_w13 is None:
            return y
        return y + shared_expert(self.ops, x, p.shared_w13, p.shared_w2, self.cfg.swiglu_limit)

    def _count_load(self, layer: int, idx: torch.Tensor) -> None:
        self.expert_load[layer] += torch.bincount(idx.reshape(-1), minlength=self.expert_load.shape[1])

    def _ep_experts(self, p: Moe, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Dispatch each (token, j) pair to a slot of its expert, run it there, bring it back and
        combine y_t = sum_j w[t, j] * out[t, j] from zero in increasing j, as `moe_experts` does."""
        ops, g = self.ops, self.g
        t, k = idx.shape
        W, S = g.ep, self.placement.slots_per_rank
        flat = idx.reshape(-1)
        pair = torch.arange(t * k, device=x.device)
        cnt = self._count[p.layer][flat]
        phys = self._log2phys[p.layer][flat, pair % cnt]  # replicas share pairs round-robin
        dest = phys // S
        order = torch.sort(dest, stable=True).indices
        send = torch.bincount(dest, minlength=W).cpu()
        recv = ops.all_to_all(send, [1] * W, [1] * W, g.ep_group).tolist()
        send = send.tolist()
        xr = ops.all_to_all(x[order // k], send, recv, g.ep_group)
        slot = ops.all_to_all((phys % S)[order], send, recv, g.ep_group)
        ones = torch.ones(slot.shape[0], 1, dtype=torch.float32, device=x.device)
        out = ops.moe_experts(xr, slot[:, None], ones, p.w13, p.w2, self.cfg.swiglu_limit)
        back = ops.all_to_all(out, recv, send, g.ep_group)
        per_pair = torch.empty(t * k, x.shape[1], dtype=back.dtype, device=x.device)
        per_pair[order] = back
        per_pair = per_pair.view(t, k, x.shape[1]).float()
        y = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        for j in range(k):
            y = y + w[:, j:j + 1] * per_pair[:, j]
        return y.to(x.dtype)


def load_rank_model(model: str, ops, groups: Groups, expert_parallel: bool, redundant: int = 0,
                    device: str = "cpu", dtype: str = "float32", seed: int = 0,
                    placement: Placement | None = None) -> ParallelV4Model:
    """This rank's model: a named random V4 config (tiny-v4, mid-v4) or a checkpoint directory,
    loaded shard by shard."""
    import os

    from shuili.core.models import V4_NAMES
    from shuili.core.models.deepseek_v4_config import named
    from shuili.core.parallel.model_v41 import is_v41, load_rank_model_v41
    from shuili.core.parallel.sharding import load_sharded, random_sharded

    if is_v41(model):
        return load_rank_model_v41(model, ops, groups, expert_parallel, redundant, device, dtype, seed, placement)
    tokenizer = None
    if model in V4_NAMES:
        cfg = named(model)
    elif os.path.isdir(model):
        from shuili.core.models.deepseek_v4_loader import read_config
        from shuili.core.models.tokenizer import load_tokenizer

        cfg = read_config(model)
        tokenizer = load_tokenizer(model, cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)
    else:
        raise ValueError(f"parallel serving runs DeepSeek-V4 and V4.1 models: a name ({', '.join(V4_NAMES)}, "
                         f"tiny-v41, mid-v41) or a checkpoint directory, not {model!r}")
    if expert_parallel and placement is None:
        placement = Placement.contiguous(cfg.num_hidden_layers, cfg.n_routed_experts, groups.ep, redundant)
    plan = ShardPlan(cfg, groups.tp, groups.tp_rank, expert_parallel,
                     placement.local(groups.ep_rank) if expert_parallel else ())
    params = (random_sharded(plan, device, dtype, seed) if model in V4_NAMES
              else load_sharded(model, plan, device, dtype))
    return ParallelV4Model(plan, ops, params, groups, placement if expert_parallel else None, device=device,
                           dtype=dtype, tokenizer=tokenizer)
