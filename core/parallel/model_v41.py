"""DeepSeek-V4.1 on one rank of a TP x DP (x EP) group: `DeepseekV41Model` over local shards
(core/parallel/sharding_v41.py); every exchange a HAL collective, as for V4 (core/parallel/model.py).

What is exact and what is not (reference platform; docs/parallel.md):
  - vocab-split embedding and head, row-split Engram wkv: gathers, no arithmetic -> one rank's bits;
  - head-split attention (every role: swa, full, reindex, reuse): heads are independent; the KV
    sources' compressors, the indexer and the shared KV pools are replicated (one K=V latent), so
    every rank of a TP group writes the same pools and picks the same top-k; o_b_proj's sum over
    G*o_lora_rank becomes t partial sums added in rank order (all_reduce) -> TP changes bits;
  - EP experts: whole pairs on their owner, combined in j order -> one rank's bits (float32);
  - TP-split experts and shared expert (EP off): partial sums over I, all_reduce -> TP changes bits.
"""
from __future__ import annotations

import os

import torch

from shuili.core.model_api import ForwardBatch
from shuili.core.models.deepseek_v4 import shared_expert
from shuili.core.models.deepseek_v41 import DeepseekV41Model, EngramWeights, Moe
from shuili.core.parallel.eplb import Placement
from shuili.core.parallel.model import Groups, ParallelV4Model
from shuili.core.parallel.sharding_v41 import ShardPlanV41


class ParallelV41Model(DeepseekV41Model):
    supports_static_decode = False

    # the EP pieces are the V4 ones: they read only the placement, the MoE's w13 / w2 and `layer`
    set_placement = ParallelV4Model.set_placement
    load_experts = ParallelV4Model.load_experts
    _count_load = ParallelV4Model._count_load
    _ep_experts = ParallelV4Model._ep_experts
    _embed_tp = ParallelV4Model._embed

    def __init__(self, plan: ShardPlanV41, ops, params: dict, groups: Groups, placement: Placement | None,
                 device: str = "cpu", dtype: str = "float32", max_model_len: int | None = None, tokenizer=None,
                 engram=None):
        super().__init__(plan.local_cfg(), ops, params, device=device, dtype=dtype, max_model_len=max_model_len,
                         tokenizer=tokenizer, engram=engram)
        self.full_cfg, self.plan, self.g = plan.cfg, plan, groups
        self.vocab_size = plan.cfg.vocab_size
        for i, blk in enumerate(self.blocks):
            blk.ffn.layer = i
        self.expert_load = torch.zeros(len(self.blocks), plan.cfg.n_routed_experts, dtype=torch.int64,
                                       device=device)
        self.set_placement(placement)

    # ---------------------------------------------------------------- forward
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if not self.caches:
            raise RuntimeError("bind_caches() must be called before forward()")
        if batch.input_ids.numel() == 0:  # an idle DP group: only its part in the EP exchanges
            return self._idle()
        return super().forward(batch)

    def _idle(self) -> torch.Tensor:
        if self.placement is not None:
            k, dev = self.cfg.num_experts_per_tok, self.device
            x = torch.zeros(0, self.cfg.hidden_size, dtype=self.dtype, device=dev)
            for blk in self.blocks:
                self._ep_experts(blk.ffn, x, torch.zeros(0, k, dtype=torch.int64, device=dev),
                                 torch.zeros(0, k, dtype=torch.float32, device=dev))
        return torch.zeros(0, self.vocab_size, dtype=torch.float32, device=self.device)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed_tp(ids)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        local = super()._logits(h)  # [N, V/t], each logit a whole dot product
        return local if self.g.tp == 1 else self.ops.all_gather(local.contiguous(), self.g.tp_group, dim=-1)

    def _engram_kv(self, rows: torch.Tensor, e: EngramWeights) -> torch.Tensor:
        local = super()._engram_kv(rows, e)  # [T, (m+1)D/t]
        return local if self.g.tp == 1 else self.ops.all_gather(local.contiguous(), self.g.tp_group, dim=-1)

    def _attention(self, p, layer, x, meta, shared) -> torch.Tensor:
        y = super()._attention(p, layer, x, meta, shared)  # local heads and groups; o_b partial
        return y if self.g.tp == 1 else self.ops.all_reduce(y, self.g.tp_group)

    def _moe(self, p: Moe, x: torch.Tensor) -> torch.Tensor:
        ops, cfg, g = self.ops, self.cfg, self.g
        logits = ops.linear(x.float(), p.gate).float()
        if cfg.gate_temp != 1.0:
            logits = logits / cfg.gate_temp
        w, idx = ops.moe_route_topk(logits, p.bias, cfg.num_experts_per_tok, cfg.scoring_func,
                                    cfg.norm_topk_prob, cfg.routed_scaling_factor)
        if self.placement is None:  # experts split along I by TP: partial sums, one all_reduce
            y = self._shared(p, x, ops.moe_experts(x, idx, w, p.w13, p.w2, cfg.swiglu_limit))
            return y if g.tp == 1 else ops.all_reduce(y, g.tp_group)
        T = x.shape[0]  # EP: the TP ranks hold the same tokens; each dispatches its own slice
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
        if p.shared_gate_up is None:
            return y
        return y + shared_expert(self.ops, x, p.shared_gate_up, p.shared_down, self.cfg.swiglu_limit)


def is_v41(model: str) -> bool:
    """A V4.1 name (tiny-v41, mid-v41) or a checkpoint directory whose config says deepseek_v41."""
    from shuili.core.models import V41_NAMES

    if model in V41_NAMES:
        return True
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return False
    from shuili.core.errors import read_json

    raw = read_json(path)
    return isinstance(raw, dict) and raw.get("model_type") in ("deepseek_v41", "deepseek_v41_text")


def v41_config(model: str):
    from shuili.core.models import V41_NAMES

    if model in V41_NAMES:
        from shuili.core.models.deepseek_v41_config import named

        return named(model)
    from shuili.core.models.deepseek_v41_loader import read_config

    return read_config(model)


def load_rank_model_v41(model: str, ops, groups: Groups, expert_parallel: bool, redundant: int = 0,
                        device: str = "cpu", dtype: str = "float32", seed: int = 0,
                        placement: Placement | None = None) -> ParallelV41Model:
    """This rank's V4.1: a named random config or a checkpoint directory, shard by shard; its own
    host-resident Engram tables (random: seeded as one rank's; checkpoint: memory-mapped)."""
    from shuili.core.models import V41_NAMES
    from shuili.core.models import deepseek_v41_loader as L
    from shuili.core.parallel.sharding_v41 import load_sharded_v41, random_sharded_v41

    cfg = v41_config(model)
    if expert_parallel and placement is None:
        placement = Placement.contiguous(cfg.num_hidden_layers, cfg.n_routed_experts, groups.ep, redundant)
    plan = ShardPlanV41(cfg, groups.tp, groups.tp_rank, expert_parallel,
                        placement.local(groups.ep_rank) if expert_parallel else ())
    tokenizer = None
    if model in V41_NAMES:
        params = random_sharded_v41(plan, device, dtype, seed)
        engram = L.random_engram(cfg, ops, device=device, dtype=dtype, seed=seed)
    else:
        from shuili.core.models.tokenizer import load_tokenizer

        if os.path.isfile(os.path.join(model, "tokenizer.json")):
            tokenizer = load_tokenizer(model, cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)
        params = load_sharded_v41(model, plan, device, dtype)
        engram = L.load_engram(model, cfg, tokenizer, ops, device=device, dtype=dtype)
    return ParallelV41Model(plan, ops, params, groups, placement if expert_parallel else None, device=device,
                            dtype=dtype, tokenizer=tokenizer, engram=engram)
