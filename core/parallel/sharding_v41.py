"""Which slice of each DeepSeek-V4.1 tensor a rank holds, and loading exactly that slice.

The same split as V4 (core/parallel/sharding.py), on V4.1's transformers tensor names, for rank r of t:
  embed_tokens / lm_head         rows (vocabulary)          [V/t]  gathered back exactly
  self_attn.q_b_proj, sinks      rows (query heads)         [H/t]  heads are independent
  self_attn.o_a_proj (grouped)   rows (output groups)       [G/t]  group g reads heads g*H/G..
  self_attn.o_b_proj             columns (G*o_lora_rank)           partial products, then all_reduce
  mlp.experts (EP off)           gate/up rows, down columns [I/t]  partial products, then all_reduce
  mlp.shared_experts (EP off)    the same split as the experts; replicated under EP
  engram.wkv                     rows (its (m+1)*D outputs) [/t]   each output a whole dot product,
                                                                   gathered back exactly
Replicated: q_a_proj + q_a_norm, kv_proj + kv_norm (the one K=V latent: every rank of a TP group
holds the same window, compressed-KV and indexer-key pools), the KV sources' compressors and the
indexer (q_b, weights_proj, k_proj: its score sums over all indexer heads, a split would need a
reduction), mHC, norms, router, the Engram gate's q/k weights (it normalises over D).
EP (enable_expert_parallel): rank e of the t*d ranks holds the placement's physical expert slots
[e*S, (e+1)*S), whole experts (gate_up_proj [S, 2I, D], down_proj [S, D, I]).
Engram tables are not model parameters: each rank keeps its own host-resident copy (memory-mapped
from the checkpoint, so the ranks of one node share the page cache; docs/parallel.md).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from shuili.core.models.deepseek_v41_config import V41Config
from shuili.hal.types import Weight

_HEAD_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ShardPlanV41:
    cfg: V41Config
    tp: int = 1
    tp_rank: int = 0
    ep: bool = False  # experts whole, placed by `slots`; else split along I by TP
    slots: tuple[tuple[int, ...], ...] = ()  # per layer: the logical expert of each local slot

    def rule(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of a non-expert tensor (transformers name), None = whole."""
        if self.tp == 1:
            return None
        c, t, r = self.cfg, self.tp, self.tp_rank

        def part(n: int, dim: int):
            return dim, r * n // t, (r + 1) * n // t

        if name in _HEAD_ROWS:
            return part(c.vocab_size, 0)
        if name.endswith("self_attn.q_b_proj.weight"):
            return part(c.num_attention_heads * c.head_dim, 0)
        if name.endswith("self_attn.sinks"):
            return part(c.num_attention_heads, 0)
        if name.endswith("self_attn.o_a_proj.weight"):
            return part(c.o_groups * c.o_lora_rank, 0)
        if name.endswith("self_attn.o_b_proj.weight"):
            return part(c.o_groups * c.o_lora_rank, 1)
        if name.endswith("engram.wkv.weight"):
            return part((c.hc_mult + 1) * c.hidden_size, 0)
        if not self.ep and ".shared_experts." in name:
            return part(c.moe_intermediate_size, 1 if name.endswith("down_proj.weight") else 0)
        return None

    def expert_ids(self, layer: int) -> list[int]:
        if not self.ep:
            return list(range(self.cfg.n_routed_experts))
        return list(self.slots[layer])

    def intermediate(self) -> tuple[int, int]:
        I = self.cfg.moe_intermediate_size
        if self.ep or self.tp == 1:
            return 0, I
        return self.tp_rank * I // self.tp, (self.tp_rank + 1) * I // self.tp

    def local_cfg(self) -> V41Config:
        """The config the local shards satisfy: H/t heads, G/t output groups (vocabulary, experts
        and the Engram width stay global: the model gathers them back)."""
        c = self.cfg
        return c.model_copy(update={"num_attention_heads": c.num_attention_heads // self.tp,
                                    "o_groups": c.o_groups // self.tp})

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        rule = self.rule(name)
        if rule is None:
            return tuple(shape)
        out = list(shape)
        out[rule[0]] = rule[2] - rule[1]
        return tuple(out)

    # ---------------------------------------------------------------- slicing in memory
    def take(self, name: str, value):
        """The local shard of one full parameter (the random-init path)."""
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return self._take_experts(name, value)
        rule = self.rule(name)
        if rule is None:
            return value
        dim, a, b = rule
        if name.endswith("o_a_proj.weight"):  # grouped [G, r, K]: whole groups
            r = self.cfg.o_lora_rank
            return Weight.dense(value.data[a // r:b // r].contiguous())
        if isinstance(value, Weight):
            if value.format != "dense":
                raise ValueError(f"{name}: in-memory sharding takes dense weights (got {value.format})")
            return Weight.dense(value.data.narrow(dim, a, b - a).contiguous())
        return value.narrow(dim, a, b - a).contiguous()

    def _take_experts(self, name: str, w: Weight) -> Weight:
        layer = int(name.split(".")[2])
        data = w.data[self.expert_ids(layer)]
        lo, hi = self.intermediate()
        I = self.cfg.moe_intermediate_size
        if name.endswith("gate_up_proj"):
            data = torch.cat([data[:, lo:hi], data[:, I + lo:I + hi]], dim=1)
        else:
            data = data[:, :, lo:hi]
        return Weight.dense(data.contiguous())


def random_sharded_v41(plan: ShardPlanV41, device: str = "cpu", dtype: str = "float32", seed: int = 0) -> dict:
    """The seeded random model's local shards: the numbers of `random_params(cfg, seed)`, each
    tensor sliced as soon as it is drawn (the whole model never exists on a rank)."""
    from shuili.core.models.deepseek_v41_loader import random_params

    return random_params(plan.cfg, device=device, dtype=dtype, seed=seed, transform=plan.take)


# -------------------------------------------------------------------------------- checkpoints
class _Slices:
    """Row / column ranges of checkpoint tensors through safetensors slices (never the whole tensor)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def slice(self, name: str):
        self.ckpt._need(name)
        self.ckpt._read.add(name)
        return self.ckpt._handle(self.ckpt.where[name]).get_slice(name)

    def rows(self, name: str, dim: int, a: int, b: int) -> torch.Tensor:
        sl = self.slice(name)
        if dim == 0:
            return sl[a:b]
        if dim == 1:
            return sl[:, a:b]
        return sl[:, :, a:b]


def load_sharded_v41(path: str, plan: ShardPlanV41, device: str = "cpu", dtype: str = "float32") -> dict:
    """This rank's params from a V4.1 checkpoint directory (transformers or released names, read
    through `safetensors_index.Checkpoint` and its index): the same values as `load_params` sliced
    by the plan, each tensor read only in the rows/columns this rank keeps (FP8 linears with the
    matching 32x32 scale blocks; released MXFP4 experts with their 1x32 scales)."""
    from shuili.core.models import deepseek_v41_loader as L
    from shuili.core.models.safetensors_index import Checkpoint, CheckpointError

    cfg, local = plan.cfg, plan.local_cfg()
    ckpt = Checkpoint(path)
    rd = _Slices(ckpt)
    where = ckpt.where
    hf = any(k.startswith("model.layers.") or k == "model.embed_tokens.weight" for k in where)
    inv = {n: n for n in L.schema(cfg)} if hf else {v: k for k, v in L._released_table(cfg).items()}
    block = tuple(cfg.quantization.weight_block_size) if cfg.quantization else (32, 32)
    dt = getattr(torch, dtype)

    def read(name: str, src: str, shape: tuple[int, ...]) -> torch.Tensor:
        rule = plan.rule(name)
        code = rd.slice(src).get_dtype()
        if code == "F8_E4M3":
            scale = next((src[: -len("weight")] + s for s in ("scale", "weight_scale_inv")
                          if src[: -len("weight")] + s in where), None)
            if scale is None:
                raise CheckpointError(f"tensor {src!r} is float8_e4m3fn but the checkpoint has no scale for it")
            if rule is None:
                t = L._dequant_fp8(ckpt.get(src), ckpt.get(scale), block)
                L._check(src, t, shape, L._FLOATS)
                return t
            dim, a, b = rule
            if a % block[dim]:
                raise CheckpointError(f"{src}: shard start {a} splits a {block[dim]}-wide FP8 scale block; "
                                      f"choose a tensor_parallel_size whose shard widths are multiples of {block[dim]}")
            w = rd.rows(src, dim, a, b)
            s = rd.rows(scale, dim, a // block[dim], -(-b // block[dim]))
            t = L._dequant_fp8(w, s, block)
        else:
            t = rd.rows(src, *rule) if rule is not None else ckpt.get(src)
        L._check(src, t, shape, L._FLOATS)  # the local shape: a wrong-sized tensor is named
        return t

    out: dict = {}
    for name, sp in L.schema(cfg).items():
        if sp.kind == "experts":
            out[name] = _experts(name, plan, rd, ckpt, hf, dt, device)
            continue
        shape = plan.local_shape(name, sp.shape)
        t = read(name, inv[name], shape)
        kind = sp.kind
        out[name] = L._as_param(t.to(device), L.Spec(shape, kind), local, torch.float32 if kind == "f32" else dt)
    return out


_PART = re.compile(r"experts\.(gate_up_proj|down_proj)$")


def _experts(name: str, plan: ShardPlanV41, rd: _Slices, ckpt, hf: bool, dt, device) -> Weight:
    """This rank's experts of one layer: the placement's slots (EP) or every expert's I/t (TP)."""
    from shuili.core.models.deepseek_v4_loader import _load_expert
    from shuili.core.models.safetensors_index import CheckpointError
    from shuili.core.parallel.sharding import ShardReader

    cfg = plan.cfg
    layer = int(name.split(".")[2])
    up = _PART.search(name).group(1) == "gate_up_proj"
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    lo, hi = plan.intermediate()
    ids = plan.expert_ids(layer)
    if hf:  # stacked float [E, 2I, D] / [E, D, I]: one slice per local expert
        sl = rd.slice(name)
        want = (cfg.n_routed_experts, 2 * I, D) if up else (cfg.n_routed_experts, D, I)
        if tuple(sl.get_shape()) != want:
            raise CheckpointError(f"tensor {name!r} has shape {list(sl.get_shape())}, expected {list(want)}")
        rows = []
        for e in ids:
            if up:
                rows.append(torch.cat([sl[e:e + 1, lo:hi], sl[e:e + 1, I + lo:I + hi]], dim=1))
            else:
                rows.append(sl[e:e + 1, :, lo:hi])
        t = torch.cat(rows)
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(f"tensor {name!r}: stacked experts must be float, got {t.dtype}")
        return Weight.dense(t.to(device=device, dtype=dt))
    # released per-expert w1 / w3 ([I, D], split along rows) and w2 ([D, I], split along columns)
    whole = (lo, hi) == (0, I)

    class _Rd:
        def get(self, n):
            if whole:
                return ckpt.get(n)
            dim = 1 if ".w2." in n else 0
            return ShardReader(ckpt, None)._read(n, dim, lo, hi)

    parts, shape = (("w1", "w3"), (hi - lo, D)) if up else (("w2",), (D, hi - lo))
    datas, scales, fmt = [], [], None
    for e in ids:
        ds, ss = [], []
        for wn in parts:
            n = f"layers.{layer}.ffn.experts.{e}.{wn}.weight"
            f, w, s = _load_expert(_Rd(), n, shape)
            if f == "fp8_block128":
                raise CheckpointError(f"tensor {n!r}: FP8 experts are not read by the V4.1 loader")
            if fmt is not None and f != fmt:
                raise CheckpointError(f"tensor {n!r} is {f} but earlier experts of this layer are {fmt}")
            fmt = f
            ds.append(w.to(device) if f != "dense" else w.to(device=device, dtype=dt))
            ss.append(None if s is None else s.to(device))
        datas.append(torch.cat(ds, 0) if len(ds) > 1 else ds[0])
        if fmt != "dense":
            scales.append(torch.cat(ss, 0) if len(ss) > 1 else ss[0])
    full = (len(ids), 2 * (hi - lo), D) if up else (len(ids), D, hi - lo)
    return Weight(fmt, torch.stack(datas), torch.stack(scales) if scales else None, full)
