"""Which slice of each DeepSeek-V4 tensor a rank holds, and loading exactly that slice.

TP (tensor_parallel_size) splits, for rank r of t:
  embed / head          rows (vocabulary)           [V/t]  gathered back exactly (no arithmetic)
  attn.wq_b, attn_sink  rows (query heads)          [H/t]  heads are independent
  attn.wo_a             rows (output groups)        [G/t]  group g reads heads g*H/G..: same split
  attn.wo_b             columns (G*o_lora_rank)            partial products, then all_reduce
  experts (EP off)      w1/w3 rows, w2 columns (I)  [I/t]  partial products, then all_reduce
  shared expert (EP off) the same split as the experts; replicated under EP
Everything else (wq_a + q_norm, wkv, compressors, indexer, mHC, norms, router) is replicated:
q_norm and the compressors normalise over their whole width, so a split would need a reduction.
EP (enable_expert_parallel) gives rank e of the E_p = t * d ranks the physical expert slots
[e*S, (e+1)*S) of the placement (`eplb.Placement`), each a whole logical expert.

A checkpoint is read through safetensors' slices: a rank reads only its rows/columns (and the
matching fp8/mxfp4 scale blocks), never a whole tensor it does not keep. Random models
(tiny-v4) generate one full tensor at a time, slice it and drop it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from shuili.core.models.deepseek_v4_config import V4Config
from shuili.hal.types import Weight

_EXPERT = re.compile(r"^(.*\.ffn\.)experts\.(\d+)\.(w1|w2|w3)\.(weight|scale)$")


@dataclass(frozen=True)
class ShardPlan:
    cfg: V4Config
    tp: int = 1
    tp_rank: int = 0
    ep: bool = False  # experts whole, placed by `slots`; else split along I by TP
    slots: tuple[tuple[int, ...], ...] = ()  # per layer: the logical expert of each local slot

    # ---------------------------------------------------------------- what a name keeps
    def rule(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of a non-expert tensor in logical units, None = whole."""
        if self.tp == 1:
            return None
        c, t, r = self.cfg, self.tp, self.tp_rank

        def part(n: int, dim: int):
            return dim, r * n // t, (r + 1) * n // t

        if name in ("embed.weight", "head.weight"):
            return part(c.vocab_size, 0)
        if name.endswith("attn.wq_b.weight"):
            return part(c.num_attention_heads * c.head_dim, 0)
        if name.endswith("attn.attn_sink"):
            return part(c.num_attention_heads, 0)
        if name.endswith("attn.wo_a.weight"):
            return part(c.o_groups * c.o_lora_rank, 0)
        if name.endswith("attn.wo_b.weight"):
            return part(c.o_groups * c.o_lora_rank, 1)
        if not self.ep and ".shared_experts." in name:
            return part(c.moe_intermediate_size, 1 if ".w2." in name else 0)
        return None

    def expert_ids(self, layer_prefix: str) -> list[int]:
        """Global ids of the experts this rank stacks for a layer (its physical slots)."""
        if not self.ep:
            return list(range(self.cfg.n_routed_experts))
        return list(self.slots[int(layer_prefix.split(".")[1])])

    def intermediate(self) -> tuple[int, int]:
        """[lo, hi) of the moe_intermediate_size this rank keeps."""
        I = self.cfg.moe_intermediate_size
        if self.ep or self.tp == 1:
            return 0, I
        return self.tp_rank * I // self.tp, (self.tp_rank + 1) * I // self.tp

    def local_cfg(self) -> V4Config:
        """The config the local shards satisfy: H/t heads and G/t output groups (vocab stays V:
        the model gathers its logits back to the whole vocabulary)."""
        c = self.cfg
        return c.model_copy(update={"num_attention_heads": c.num_attention_heads // self.tp,
                                    "o_groups": c.o_groups // self.tp})

    # ---------------------------------------------------------------- slicing in memory
    def take(self, name: str, value):
        """The local shard of one full parameter (random init path)."""
        if name.endswith(("experts.w13", "experts.w2")):
            return self._take_experts(name, value)
        rule = self.rule(name)
        if name.endswith("wo_a.weight"):  # grouped [G, r, K]: groups are rows of the flat view
            g0 = rule[1] // self.cfg.o_lora_rank if rule else 0
            g1 = rule[2] // self.cfg.o_lora_rank if rule else self.cfg.o_groups
            return Weight.dense(value.data[g0:g1].contiguous())
        if rule is None:
            return value
        dim, a, b = rule
        if isinstance(value, Weight):
            if value.format != "dense":
                raise ValueError(f"{name}: in-memory sharding takes dense weights (got {value.format})")
            return Weight.dense(value.data.narrow(dim, a, b - a).contiguous())
        return value.narrow(dim, a, b - a).contiguous()

    def _take_experts(self, name: str, w: Weight):
        prefix = name[: -len("experts.w13")] if name.endswith("w13") else name[: -len("experts.w2")]
        data = w.data[self.expert_ids(prefix)]
        lo, hi = self.intermediate()
        I = self.cfg.moe_intermediate_size
        if name.endswith("w13"):
            data = torch.cat([data[:, lo:hi], data[:, I + lo:I + hi]], dim=1)
        else:
            data = data[:, :, lo:hi]
        return Weight.dense(data.contiguous())


# -------------------------------------------------------------------------------- checkpoints
class ShardReader:
    """`Checkpoint` look-alike for `deepseek_v4_loader`: get(name) reads only this rank's slice.
    Expert names use LOCAL slot numbers (what `_stack_experts` asks for); they are mapped to the
    global expert of the slot here."""

    def __init__(self, rd, plan: ShardPlan):
        self.rd, self.plan = rd, plan

    def has(self, name: str) -> bool:
        return self.rd.has(name)

    def _slice(self, name: str):
        return self.rd._handle(self.rd.where[name]).get_slice(name)

    def info(self, name: str, shape=None, dtypes=None):
        return self.rd.info(name, shape, dtypes)

    def get(self, name: str, shape=None, dtypes=None) -> torch.Tensor:
        """This rank's part of `name`; shape / dtypes (the local ones) checked as the loader asks."""
        from shuili.core.models.safetensors_index import check_tensor

        t = self._get(name)
        if shape is not None or dtypes is not None:
            check_tensor(name, t.dtype, tuple(t.shape), shape, dtypes, self.rd.where.get(name, ""))
        return t

    def _get(self, name: str) -> torch.Tensor:
        m = _EXPERT.match(name)
        if m:
            prefix, j, part, kind = m.groups()
            g = self.plan.expert_ids(prefix)[int(j)]
            name = f"{prefix}experts.{g}.{part}.{kind}"
            lo, hi = self.plan.intermediate()
            if (lo, hi) == (0, self.plan.cfg.moe_intermediate_size):
                return self.rd.get(name)
            return self._read(name, 1 if part == "w2" else 0, lo, hi)
        base = name[: -len("scale")] + "weight" if name.endswith(".scale") else name
        rule = self.plan.rule(base)
        if rule is None or name not in self.rd.where:
            return self.rd.get(name)
        return self._read(name, *rule)

    def _read(self, name: str, dim: int, a: int, b: int) -> torch.Tensor:
        if name not in self.rd.where:
            return self.rd.get(name)  # raises the loader's missing-tensor error
        if name.endswith(".scale"):
            wdt = self._slice(name[: -len("scale")] + "weight").get_dtype()
            if wdt == "F8_E4M3":
                blk = 128
            elif wdt in ("I8", "U8"):
                blk = 1 if dim == 0 else 32  # mxfp4: one e8m0 per 32 along K
            else:
                blk = 1
            if a % blk:
                raise ValueError(f"{name}: shard start {a} splits a {blk}-wide scale block; choose a "
                                 f"tensor_parallel_size whose shard widths are multiples of {blk}")
            a, b = a // blk, -(-b // blk)
        elif self._slice(name).get_dtype() in ("I8", "U8") and dim == 1:
            a, b = a // 2, b // 2  # mxfp4 packs two elements per byte along K
        sl = self._slice(name)
        return sl[a:b] if dim == 0 else sl[:, a:b]


def load_sharded(path: str, plan: ShardPlan, device: str = "cpu", dtype: str = "float32") -> dict:
    """This rank's params from a checkpoint directory: `deepseek_v4_loader.load_params` on the
    local config, reading through `ShardReader` (no MTP block under parallelism)."""
    from shuili.core.models import deepseek_v4_loader as L

    local = plan.local_cfg()
    lo, hi = plan.intermediate()
    n_exp = len(plan.expert_ids("layers.0.")) if plan.cfg.num_hidden_layers else plan.cfg.n_routed_experts
    # the experts' stacking shapes come from this config; n_routed_experts stays global elsewhere
    experts_cfg = local.model_copy(update={"n_routed_experts": n_exp, "moe_intermediate_size": hi - lo})
    rd = ShardReader(L.Checkpoint(path), plan)
    dt = getattr(torch, dtype)
    out: dict = {}
    for name, sp in L.schema(local, with_mtp=False).items():
        rule = plan.rule(name)
        shape = list(sp.shape)
        if rule is not None and name.endswith(("wq_b.weight", "wo_b.weight", "embed.weight", "head.weight",
                                               "shared_experts.w1.weight", "shared_experts.w2.weight",
                                               "shared_experts.w3.weight", "attn_sink")):
            shape[rule[0]] = rule[2] - rule[1]
        if sp.kind == "experts":
            prefix = name[: -len("experts.w13")] if name.endswith("w13") else name[: -len("experts.w2")]
            out[name] = L._stack_experts(rd, prefix, experts_cfg, name.rsplit(".", 1)[1], dt, device)
        elif sp.kind in ("linear", "grouped"):
            w = L._load_linear(rd, name, tuple(shape), dt, device)
            out[name] = L._grouped(w, local, name) if sp.kind == "grouped" else w
        elif sp.kind == "i64":
            out[name] = L._expert_ids(rd, name, sp.shape, local).to(device)
        else:
            t = rd.get(name, tuple(shape), L._FLOATS)
            out[name] = t.to(device=device, dtype=torch.float32 if sp.kind == "f32" else dt)
    return out


def random_sharded(plan: ShardPlan, device: str = "cpu", dtype: str = "float32", seed: int = 0) -> dict:
    """The seeded random model's local shards: the same numbers as `random_params(cfg, seed)`
    (one RNG stream over the full schema), each tensor sliced as soon as it is drawn."""
    from shuili.core.models.deepseek_v4_loader import random_params

    return random_params(plan.cfg, device=device, dtype=dtype, seed=seed, with_mtp=False, transform=plan.take)
