"""DeepSeek-V4 config: a pydantic model, the NAMED test/benchmark configs, and the HF config.json parser.

Field names follow the released `config.json` / HF `DeepseekV4Config`, normalised to one form: every
layer has an attention kind ("swa", "csa" or "hca") and an MLP kind ("hash" or "topk").
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

AttnKind = Literal["swa", "csa", "hca"]
MlpKind = Literal["hash", "topk"]
KvFormat = Literal["none", "mxfp8", "fp4_e4m3", "mxfp4"]

_HF_LAYER_TYPES = {"sliding_attention": "swa", "compressed_sparse_attention": "csa",
                   "heavily_compressed_attention": "hca"}
_HF_MLP_TYPES = {"hash_moe": "hash", "moe": "topk"}


# checks shared with V41Config (deepseek_v41_config.py); each message names the field to fix
def check_o_groups(cfg) -> None:
    if cfg.num_attention_heads % cfg.o_groups:
        raise ValueError(f"num_attention_heads {cfg.num_attention_heads} must be a multiple of "
                         f"o_groups {cfg.o_groups}")


def check_experts(cfg) -> None:
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ValueError("num_experts_per_tok exceeds n_routed_experts")
    if cfg.n_shared_experts not in (0, 1):
        raise ValueError("n_shared_experts must be 0 or 1 (the shared expert has width moe_intermediate_size)")


def check_kv_formats(cfg) -> None:
    for name, fmt, allowed in (("window_kv_format", cfg.window_kv_format, ("none", "mxfp8")),
                               ("compressed_kv_format", cfg.compressed_kv_format, ("none", "fp4_e4m3")),
                               ("indexer_k_format", cfg.indexer_k_format, ("none", "mxfp4"))):
        if fmt not in allowed:
            raise ValueError(f"{name}={fmt!r}: use one of {allowed}")


class YarnConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


class V4Config(BaseModel):
    """One DeepSeek-V4 architecture. Derived per-layer lists are checked against num_hidden_layers."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    attn_kinds: tuple[AttnKind, ...] = ()
    csa_ratio: int = 4
    hca_ratio: int = 128
    mlp_kinds: tuple[MlpKind, ...] = ()
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: Literal["sqrtsoftplus", "softmax", "sigmoid"] = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float | None = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig | None = YarnConfig(factor=16, original_max_position_embeddings=65536)
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    bos_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (1,)
    tie_word_embeddings: bool = False
    # storage formats of the KV cache groups ("none" = compute dtype rows)
    window_kv_format: KvFormat = "none"
    compressed_kv_format: KvFormat = "none"
    indexer_k_format: KvFormat = "none"
    initializer_range: float = 0.02

    @model_validator(mode="after")
    def _check(self):
        n = self.num_hidden_layers
        if len(self.attn_kinds) != n or len(self.mlp_kinds) != n:
            raise ValueError(f"attn_kinds ({len(self.attn_kinds)}) and mlp_kinds ({len(self.mlp_kinds)}) must "
                             f"each have num_hidden_layers = {n} entries")
        check_o_groups(self)
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and <= head_dim")
        if self.index_head_dim < self.qk_rope_head_dim and "csa" in self.attn_kinds:
            raise ValueError("index_head_dim must be >= qk_rope_head_dim (the indexer ropes its last channels)")
        check_experts(self)
        check_kv_formats(self)
        return self

    # ------------------------------------------------------------------ derived
    def ratio(self, layer: int) -> int:
        kind = self.attn_kinds[layer]
        return 0 if kind == "swa" else self.csa_ratio if kind == "csa" else self.hca_ratio

    def layers_of(self, kind: AttnKind) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.attn_kinds) if k == kind)

    def num_params(self, with_mtp: bool = True) -> int:
        """Parameter count of the main model (plus the MTP blocks), computed, not built."""
        d, h, hd = self.hidden_size, self.num_attention_heads, self.head_dim
        m = self.hc_mult
        hc = (m * (m + 2)) * m * d + m * (m + 2) + 3
        ffn = (self.n_routed_experts + self.n_shared_experts) * 3 * d * self.moe_intermediate_size
        ffn += self.n_routed_experts * d + self.n_routed_experts

        def block(kind: str) -> int:
            attn = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * hd + d * hd + hd
            attn += h * hd * self.o_lora_rank + self.o_groups * self.o_lora_rank * d + h
            if kind == "csa":
                attn += 2 * (2 * hd) * d + self.csa_ratio * 2 * hd + hd
                di = self.index_head_dim
                attn += 2 * (2 * di) * d + self.csa_ratio * 2 * di + di
                attn += self.q_lora_rank * self.index_n_heads * di + self.index_n_heads * d
            elif kind == "hca":
                attn += 2 * hd * d + self.hca_ratio * hd + hd
            return attn + ffn + 2 * hc + 2 * d

        total = sum(block(k) for k in self.attn_kinds)
        total += self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d + m * m * d + m + 1
        total += with_mtp * self.num_nextn_predict_layers * (block("swa") + 2 * d * d + 3 * d + m * m * d + m + 1)
        return total

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf(cls, raw: dict[str, Any], **overrides: Any) -> "V4Config":
        """Parse a `config.json` of model_type deepseek_v4 (released or HF-serialised spelling)."""
        if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ValueError(f"model_type {raw.get('model_type')!r} is not deepseek_v4")
        g = dict(raw)
        n = int(g.get("num_hidden_layers", 43))
        rates = dict(g.get("compress_rates") or {})
        csa = int(g.get("compress_rate_csa", rates.get("compressed_sparse_attention", 4)))
        hca = int(g.get("compress_rate_hca", rates.get("heavily_compressed_attention", 128)))
        if g.get("layer_types"):
            try:
                kinds = [_HF_LAYER_TYPES[t] for t in g["layer_types"]]
            except KeyError as e:
                raise ValueError(f"layer_types entry {e} is not one of {sorted(_HF_LAYER_TYPES)}") from None
        elif g.get("compress_ratios") is not None:
            kinds = []
            for r in g["compress_ratios"]:
                if r == 0:
                    kinds.append("swa")
                elif r == 4:
                    kinds.append("csa")
                else:
                    kinds.append("hca")
                    hca = int(r)
        else:  # HF default schedule
            kinds = ["hca"] * min(n, 2) + ["csa" if i % 2 else "hca" for i in range(max(n - 2, 0))]
        kinds = kinds[:n]
        if g.get("mlp_layer_types"):
            mlp = [_HF_MLP_TYPES[t] for t in g["mlp_layer_types"]][:n]
        else:
            nh = int(g.get("num_hash_layers", 3))
            mlp = ["hash"] * min(n, nh) + ["topk"] * max(0, n - nh)
        hd = int(g.get("head_dim", 512))
        if g.get("qk_rope_head_dim") is not None:
            rope_dim = int(g["qk_rope_head_dim"])
        elif g.get("partial_rotary_factor") is not None:
            rope_dim = int(hd * float(g["partial_rotary_factor"]))
        else:
            rope_dim = 64
        rope_theta = float(g.get("rope_theta", 10000.0))
        compress_theta = float(g.get("compress_rope_theta", 160000.0))
        rp = g.get("rope_parameters") or g.get("rope_scaling") or {}
        if isinstance(rp.get("main"), dict):
            rope_theta = float(rp["main"].get("rope_theta", rope_theta))
            rp = rp.get("compress") or {}
            compress_theta = float(rp.get("rope_theta", compress_theta))
        yarn = None
        if rp.get("rope_type", rp.get("type")) == "yarn":
            yarn = YarnConfig(factor=float(rp["factor"]),
                              original_max_position_embeddings=int(rp.get("original_max_position_embeddings",
                                                                          g.get("max_position_embeddings"))),
                              beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1))
        eos = g.get("eos_token_id", 1)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),) if eos is not None else ()
        fields = dict(
            vocab_size=g.get("vocab_size", 129280), hidden_size=g.get("hidden_size", 4096), num_hidden_layers=n,
            num_attention_heads=g.get("num_attention_heads", 64), head_dim=hd, qk_rope_head_dim=rope_dim,
            q_lora_rank=g.get("q_lora_rank", 1024), o_groups=g.get("o_groups", 8),
            o_lora_rank=g.get("o_lora_rank", 1024), sliding_window=g.get("sliding_window", 128),
            attn_kinds=tuple(kinds), csa_ratio=csa, hca_ratio=hca, mlp_kinds=tuple(mlp),
            n_routed_experts=g.get("n_routed_experts", 256), num_experts_per_tok=g.get("num_experts_per_tok", 6),
            n_shared_experts=g.get("n_shared_experts", 1), moe_intermediate_size=g.get("moe_intermediate_size", 2048),
            scoring_func=g.get("scoring_func", "sqrtsoftplus"), norm_topk_prob=g.get("norm_topk_prob", True),
            routed_scaling_factor=g.get("routed_scaling_factor", 1.5), swiglu_limit=g.get("swiglu_limit", 10.0),
            hc_mult=g.get("hc_mult", 4), hc_sinkhorn_iters=g.get("hc_sinkhorn_iters", 20),
            hc_eps=g.get("hc_eps", 1e-6), rms_norm_eps=g.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
            compress_rope_theta=compress_theta, yarn=yarn,
            max_position_embeddings=g.get("max_position_embeddings", 1048576),
            index_n_heads=g.get("index_n_heads", 64), index_head_dim=g.get("index_head_dim", 128),
            index_topk=g.get("index_topk", 512), num_nextn_predict_layers=g.get("num_nextn_predict_layers", 1),
            bos_token_id=g.get("bos_token_id", 0) if g.get("bos_token_id") is not None else 0,
            eos_token_ids=eos, tie_word_embeddings=g.get("tie_word_embeddings", False),
            initializer_range=g.get("initializer_range", 0.02),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `from_hf` (and HF `DeepseekV4Config`) read back to this architecture."""
        inv_l = {v: k for k, v in _HF_LAYER_TYPES.items()}
        inv_m = {v: k for k, v in _HF_MLP_TYPES.items()}
        d = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
                 vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                 num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                 num_key_value_heads=1, head_dim=self.head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                 q_lora_rank=self.q_lora_rank, o_groups=self.o_groups, o_lora_rank=self.o_lora_rank,
                 sliding_window=self.sliding_window, layer_types=[inv_l[k] for k in self.attn_kinds],
                 compress_rates={"compressed_sparse_attention": self.csa_ratio,
                                 "heavily_compressed_attention": self.hca_ratio},
                 mlp_layer_types=[inv_m[k] for k in self.mlp_kinds], n_routed_experts=self.n_routed_experts,
                 num_experts_per_tok=self.num_experts_per_tok, n_shared_experts=self.n_shared_experts,
                 moe_intermediate_size=self.moe_intermediate_size, scoring_func=self.scoring_func,
                 norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor,
                 swiglu_limit=self.swiglu_limit, hc_mult=self.hc_mult, hc_sinkhorn_iters=self.hc_sinkhorn_iters,
                 hc_eps=self.hc_eps, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                 compress_rope_theta=self.compress_rope_theta,
                 max_position_embeddings=self.max_position_embeddings, index_n_heads=self.index_n_heads,
                 index_head_dim=self.index_head_dim, index_topk=self.index_topk,
                 num_nextn_predict_layers=self.num_nextn_predict_layers, bos_token_id=self.bos_token_id,
                 eos_token_id=list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
                 tie_word_embeddings=self.tie_word_embeddings, initializer_range=self.initializer_range)
        if self.yarn is not None:
            d["rope_parameters"] = {"rope_type": "yarn", **self.yarn.model_dump()}
        return d


def _tiny() -> V4Config:
    # v4_arch.md §5.1 (verified against HF), with one MTP block and 32 indexer heads against ReLU ties
    return V4Config(
        vocab_size=1024, hidden_size=256, num_hidden_layers=5, num_attention_heads=4, head_dim=128,
        qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=64, moe_intermediate_size=128,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        attn_kinds=("swa", "swa", "csa", "hca", "csa"), mlp_kinds=("hash", "topk", "topk", "topk", "topk"),
        csa_ratio=4, hca_ratio=16, sliding_window=16, index_n_heads=32, index_head_dim=64, index_topk=4,
        max_position_embeddings=1024, num_nextn_predict_layers=1,
        yarn=YarnConfig(factor=16.0, original_max_position_embeddings=64))


def _mid() -> V4Config:
    # v4_arch.md §5.3: ~2.6B, the real head_dim/rope/window/ratios/top-k/vocab
    return V4Config(
        vocab_size=129280, hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=512, moe_intermediate_size=768,
        n_routed_experts=32, num_experts_per_tok=6, n_shared_experts=1,
        attn_kinds=("swa", "swa") + ("csa", "hca") * 5, mlp_kinds=("hash",) * 3 + ("topk",) * 9,
        csa_ratio=4, hca_ratio=128, sliding_window=128, index_n_heads=32, index_head_dim=128, index_topk=512,
        max_position_embeddings=1048576, num_nextn_predict_layers=1)


NAMED: dict[str, V4Config] = {"tiny-v4": _tiny(), "mid-v4": _mid()}


def named(name: str, **overrides: Any) -> V4Config:
    if name not in NAMED:
        raise ValueError(f"unknown V4 config {name!r}; named configs: {sorted(NAMED)}")
    cfg = NAMED[name]
    return cfg if not overrides else V4Config(**{**cfg.model_dump(), **overrides})
