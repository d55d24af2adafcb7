"""DeepSeek-V4.1 config: a pydantic model, the NAMED test/benchmark configs, and the config.json parser.

Two config.json shapes are read (v4_arch.md §1.2): the released `deepseek_v41` one (text fields nested
under `text_config`, `quantization_config` at the top level) and the flat `deepseek_v41_text` one that
transformers writes for the text-only model. Per-layer roles of the causal encoder-decoder (CED):

  swa      compress_ratios[i] == 0: sliding window only
  full     i in kv_source_layer_ids: owns the compressor and the indexer key projection, publishes the
           group's compressed KV and indexer keys, and (as an index source) its top-k
  reindex  i in index_source_layer_ids, not a KV source: own indexer query weights, scored against the
           group's keys
  reuse    the rest with ratio > 0: reads the group's compressed KV at the last index source's top-k
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shuili.core.models.deepseek_v4_config import (KvFormat, YarnConfig, check_experts, check_kv_formats,
                                                  check_o_groups)

Role = Literal["swa", "full", "reindex", "reuse"]


class QuantConfig(BaseModel):
    """The checkpoint's storage formats (top-level `quantization_config` of the released config)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    quant_method: Literal["fp8"] = "fp8"
    fmt: Literal["e4m3"] = "e4m3"
    scale_fmt: Literal["ue8m0"] = "ue8m0"
    weight_block_size: tuple[int, int] = (32, 32)
    expert_dtype: Literal["fp4", "fp8", "bf16"] = "fp4"


class V41Config(BaseModel):
    """One DeepSeek-V4.1 text architecture. Lists are per backbone layer (DSpark layers dropped)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20  # < 0: no two-level top-k
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2304
    scoring_func: Literal["sqrtsoftplus", "softmax", "sigmoid"] = "sqrtsoftplus"
    gate_temp: float = 1.0
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float | None = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig | None = YarnConfig(factor=16, original_max_position_embeddings=65536)
    max_position_embeddings: int = 1048576
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 16_000_000
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    # DSpark draft layers (mtp.0..n-1, v4_arch.md §2.9; core/models/deepseek_v41_dspark.py)
    dspark_block_size: int = Field(5, ge=1)
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()  # empty: the last three layers (the release: 37, 38, 39)
    dspark_markov_rank: int = Field(256, ge=1)
    dspark_n_routed_experts: int = Field(128, ge=1)
    dspark_num_experts_per_tok: int = Field(3, ge=1)
    bos_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = 2
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    quantization: QuantConfig | None = None
    # storage formats of the KV cache groups ("none" = compute dtype rows; the QAT values either way)
    window_kv_format: KvFormat = "none"
    compressed_kv_format: KvFormat = "none"
    indexer_k_format: KvFormat = "none"

    @model_validator(mode="after")
    def _check(self):
        n, r = self.num_hidden_layers, self.compress_ratios
        if len(r) != n:
            raise ValueError(f"compress_ratios: needs num_hidden_layers = {n} entries, got {len(r)}")
        if any(x < 0 for x in r):
            raise ValueError(f"compress_ratios: entries must be >= 0, got {list(r)}")
        ks, ix = self.kv_source_layer_ids, self.index_source_layer_ids
        if list(ks) != sorted(set(ks)) or list(ix) != sorted(set(ix)):
            raise ValueError("kv_source_layer_ids and index_source_layer_ids must be increasing, without repeats")
        for name, ids in (("kv_source_layer_ids", ks), ("index_source_layer_ids", ix),
                          ("engram_layer_ids", self.engram_layer_ids)):
            if any(i < 0 or i >= n for i in ids):
                raise ValueError(f"{name}: {list(ids)} out of range [0, {n})")
        if any(r[i] == 0 for i in ks + ix):
            raise ValueError(f"kv_source_layer_ids {list(ks)} / index_source_layer_ids {list(ix)}: every "
                             "source needs compress_ratios[i] > 0")
        for i in range(n):
            if r[i] == 0:
                continue
            src = self.kv_source_of(i)
            if src is None:
                raise ValueError(f"compress_ratios[{i}] = {r[i]} but no kv_source_layer_ids entry is at or "
                                 "before layer {i}: add one")
            if r[src] != r[i]:
                raise ValueError(f"compress_ratios[{i}] = {r[i]} differs from its KV source layer {src}'s "
                                 f"ratio {r[src]}: a layer reads its source's compressed entries")
            if self.index_source_of(i) is None:
                raise ValueError(f"layer {i} has a compressed branch but no index_source_layer_ids entry "
                                 "at or before it publishes top-k indices")
        if self.num_nextn_predict_layers > 0:
            self._check_dspark()
        c = self.candidate_source_layer_id
        if c >= 0 and c not in ix:
            raise ValueError(f"candidate_source_layer_id ({c}) must be in index_source_layer_ids {list(ix)}")
        if c >= 0 and (self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0):
            raise ValueError("candidate_topk_blocks and candidate_block_size must be positive")
        check_o_groups(self)
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and <= head_dim and "
                             "index_head_dim (the indexer ropes its last channels)")
        check_experts(self)
        if self.gate_temp <= 0:
            raise ValueError(f"gate_temp must be > 0, got {self.gate_temp}")
        if self.engram_layer_ids and len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError(f"engram_num_embeddings (len {len(self.engram_num_embeddings)}) must match "
                             f"engram_layer_ids (len {len(self.engram_layer_ids)})")
        check_kv_formats(self)
        return self

    def _check_dspark(self) -> None:
        n = self.num_hidden_layers
        if any(i < 0 or i >= n for i in self.dspark_target_layer_ids):
            raise ValueError(f"dspark_target_layer_ids: {list(self.dspark_target_layer_ids)} out of range [0, {n})")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            raise ValueError(f"dspark_noise_token_id {self.dspark_noise_token_id} is not a token id "
                             f"(vocab_size {self.vocab_size})")
        if self.dspark_num_experts_per_tok > self.dspark_n_routed_experts:
            raise ValueError("dspark_num_experts_per_tok exceeds dspark_n_routed_experts")

    # ------------------------------------------------------------------ derived
    @property
    def dspark_taps(self) -> tuple[int, ...]:
        """The target layers whose attention inputs feed the DSpark draft layers."""
        n = self.num_hidden_layers
        return self.dspark_target_layer_ids or tuple(range(max(0, n - 3), n))

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int | None:
        """The last KV source at or before `layer` (the owner of the entries it reads)."""
        s = [i for i in self.kv_source_layer_ids if i <= layer]
        return s[-1] if s else None

    def index_source_of(self, layer: int) -> int | None:
        """The last index source at or before `layer` (whose top-k it uses)."""
        s = [i for i in self.index_source_layer_ids if i <= layer]
        return s[-1] if s else None

    def role(self, layer: int) -> Role:
        if self.compress_ratios[layer] == 0:
            return "swa"
        if layer in self.kv_source_layer_ids:
            return "full"
        return "reindex" if layer in self.index_source_layer_ids else "reuse"

    def source_ratios(self) -> tuple[int, ...]:
        """The distinct ratios of the KV sources, ascending."""
        return tuple(sorted({self.compress_ratios[i] for i in self.kv_source_layer_ids}))

    def sources_with_ratio(self, ratio: int) -> tuple[int, ...]:
        return tuple(i for i in self.kv_source_layer_ids if self.compress_ratios[i] == ratio)

    @property
    def n_engram_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def num_params(self, with_engram_tables: bool = True) -> int:
        """Parameter count of the backbone (no DSpark), computed, not built."""
        D, H, d, m = self.hidden_size, self.num_attention_heads, self.head_dim, self.hc_mult
        q, di, nh = self.q_lora_rank, self.index_head_dim, self.index_n_heads
        E, I = self.n_routed_experts, self.moe_intermediate_size
        hc = m * (m + 2) * m * D + m * (m + 2) + 3
        total = self.vocab_size * D * (1 if self.tie_word_embeddings else 2) + D
        for i in range(self.num_hidden_layers):
            t = D * q + q + q * H * d + D * d + d + H * d * self.o_lora_rank + self.o_groups * self.o_lora_rank * D
            t += H + 2 * hc + 2 * D
            t += (E + self.n_shared_experts) * 3 * D * I + E * D + 2 * E
            role = self.role(i)
            if role == "full":
                t += D * d * (2 if self.compress_ratios[i] > 1 else 1) + d + d * di + di
            if role in ("full", "reindex"):
                t += q * nh * di + nh * D
            if i in self.engram_layer_ids:
                k = self.engram_layer_ids.index(i)
                t += self.n_engram_cols * self.engram_head_dim * (m + 1) * D + 2 * m * D
                if with_engram_tables:
                    t += self.engram_num_embeddings[k] * self.engram_head_dim
            total += t
        return total

    # ------------------------------------------------------------------ config.json
    @classmethod
    def from_hf(cls, raw: dict[str, Any], **overrides: Any) -> "V41Config":
        """Parse a config.json dict of model_type deepseek_v41 (nested) or deepseek_v41_text (flat)."""
        if not isinstance(raw, dict):
            raise ValueError(f"config.json: expected an object, got {type(raw).__name__}")
        mt = raw.get("model_type", "deepseek_v41")
        if mt == "deepseek_v41":
            g = raw.get("text_config")
            if g is None:  # a composite config saved from a flat text config keeps the fields on top
                g = {k: v for k, v in raw.items() if k not in ("vision_config", "architectures")}
            elif not isinstance(g, dict):
                raise ValueError(f"text_config: expected an object of text fields, got {type(g).__name__}")
            g = dict(g)
            if "quantization_config" in raw:
                g.setdefault("quantization_config", raw["quantization_config"])
        elif mt == "deepseek_v41_text":
            g = dict(raw)
        else:
            raise ValueError(f"model_type {mt!r} is not deepseek_v41 or deepseek_v41_text")
        n = _int(g, "num_hidden_layers", 40)
        nextn = _int(g, "num_nextn_predict_layers", 3)
        ratios = g.get("compress_ratios")
        if ratios is None:
            ratios = [0] * min(2, n) + [2] * max(0, (n - min(2, n) + 1) // 2)
            ratios += [1] * (n - len(ratios))
        if not isinstance(ratios, list) or not all(isinstance(x, int) for x in ratios):
            raise ValueError(f"compress_ratios: expected a list of integers, got {ratios!r}")
        if not n <= len(ratios) <= n + nextn:
            raise ValueError(f"compress_ratios: has {len(ratios)} entries; expected num_hidden_layers ({n}) "
                             f"up to num_hidden_layers + num_nextn_predict_layers ({n + nextn})")
        ratios = ratios[:n]
        ks = g.get("kv_source_layer_ids")
        if ks is None:
            ks = [i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])]
        ix = g.get("index_source_layer_ids")
        if ix is None:
            ix = list(ks)
        cand = g.get("candidate_source_layer_id")
        if cand is None:
            cand = ks[-1] if ks else -1
        hd = _int(g, "head_dim", 512)
        rope_dim = g.get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = int(hd * float(g.get("partial_rotary_factor", 64 / 512)))
        rope_theta = float(g.get("rope_theta", 10000.0))
        compress_theta = float(g.get("compress_rope_theta", 160000.0))
        rp = g.get("rope_parameters") or g.get("rope_scaling") or {}
        if not isinstance(rp, dict):
            raise ValueError(f"rope_scaling: expected an object, got {rp!r}")
        if isinstance(rp.get("main"), dict):
            rope_theta = float(rp["main"].get("rope_theta", rope_theta))
            rp = rp.get("compress") or {}
            compress_theta = float(rp.get("rope_theta", compress_theta))
        yarn = None
        if rp.get("rope_type", rp.get("type")) == "yarn":
            for k in ("factor",):
                if k not in rp:
                    raise ValueError(f"rope_scaling.{k}: a yarn rope needs it")
            yarn = YarnConfig(factor=float(rp["factor"]),
                              original_max_position_embeddings=int(rp.get("original_max_position_embeddings",
                                                                          g.get("max_position_embeddings", 65536))),
                              beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1))
        eos = g.get("eos_token_id", 1)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),) if eos is not None else ()
        qc = g.get("quantization_config")
        quant = None
        if qc is not None:
            if not isinstance(qc, dict):
                raise ValueError(f"quantization_config: expected an object, got {qc!r}")
            try:
                quant = QuantConfig(**qc)
            except ValidationError as exc:
                e = exc.errors(include_url=False)[0]
                raise ValueError(f"quantization_config.{'.'.join(map(str, e['loc']))}: {e['msg']}, got "
                                 f"{e.get('input')!r}") from None
        pad = g.get("engram_pad_id", g.get("engram_pad_token_id", 2))
        fields = dict(
            vocab_size=g.get("vocab_size", 129280), hidden_size=g.get("hidden_size", 5120), num_hidden_layers=n,
            num_attention_heads=g.get("num_attention_heads", 64), head_dim=hd, qk_rope_head_dim=rope_dim,
            q_lora_rank=g.get("q_lora_rank", 1280), o_groups=g.get("o_groups", 8),
            o_lora_rank=g.get("o_lora_rank", 1024), sliding_window=g.get("sliding_window", 128),
            compress_ratios=tuple(ratios), kv_source_layer_ids=tuple(ks), index_source_layer_ids=tuple(ix),
            candidate_source_layer_id=cand, candidate_topk_blocks=g.get("candidate_topk_blocks", 2048),
            candidate_block_size=g.get("candidate_block_size", 8), index_n_heads=g.get("index_n_heads", 32),
            index_head_dim=g.get("index_head_dim", 128), index_topk=g.get("index_topk", 512),
            n_routed_experts=g.get("n_routed_experts", 384), num_experts_per_tok=g.get("num_experts_per_tok", 6),
            n_shared_experts=g.get("n_shared_experts", 1), moe_intermediate_size=g.get("moe_intermediate_size", 2304),
            scoring_func=g.get("scoring_func", "sqrtsoftplus"), gate_temp=g.get("gate_temp", 1.0),
            topk_method=g.get("topk_method", "noaux_tc"), norm_topk_prob=g.get("norm_topk_prob", True),
            routed_scaling_factor=g.get("routed_scaling_factor", 1.5), swiglu_limit=g.get("swiglu_limit", 10.0),
            hc_mult=g.get("hc_mult", 4), hc_sinkhorn_iters=g.get("hc_sinkhorn_iters", 20),
            hc_eps=g.get("hc_eps", 1e-6), rms_norm_eps=g.get("rms_norm_eps", 1e-20), rope_theta=rope_theta,
            compress_rope_theta=compress_theta, yarn=yarn,
            max_position_embeddings=g.get("max_position_embeddings", 1048576),
            engram_layer_ids=tuple(g.get("engram_layer_ids") or ()),
            engram_vocab_size=g.get("engram_vocab_size", 16_000_000),
            engram_num_embeddings=tuple(g.get("engram_num_embeddings")
                                        or [0] * len(g.get("engram_layer_ids") or ())),
            engram_max_ngram_size=g.get("engram_max_ngram_size", 4), engram_n_heads=g.get("engram_n_heads", 8),
            engram_head_dim=g.get("engram_head_dim", 256), engram_pad_id=pad,
            engram_compressed_vocab_size=g.get("engram_compressed_vocab_size", 99092),
            num_nextn_predict_layers=nextn,
            **{k: g[k] for k in ("dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank",
                                 "dspark_n_routed_experts", "dspark_num_experts_per_tok") if g.get(k) is not None},
            dspark_target_layer_ids=tuple(g.get("dspark_target_layer_ids") or ()),
            bos_token_id=g.get("bos_token_id") if g.get("bos_token_id") is not None else 0,
            eos_token_ids=eos, pad_token_id=g.get("pad_token_id", raw.get("pad_token_id")),
            tie_word_embeddings=g.get("tie_word_embeddings", False),
            initializer_range=g.get("initializer_range", 0.02), quantization=quant,
        )
        fields.update(overrides)
        try:
            return cls(**fields)
        except ValidationError as exc:
            from shuili.core.errors import field_problems

            raise ValueError("config.json: " + "; ".join(field_problems(exc))) from None

    def to_hf(self, nested: bool = False) -> dict[str, Any]:
        """A config.json dict (flat deepseek_v41_text, or the released nested shape) that from_hf reads back."""
        t = dict(model_type="deepseek_v41_text", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                 num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                 num_key_value_heads=1, head_dim=self.head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                 q_lora_rank=self.q_lora_rank, o_groups=self.o_groups, o_lora_rank=self.o_lora_rank,
                 sliding_window=self.sliding_window, compress_ratios=list(self.compress_ratios),
                 kv_source_layer_ids=list(self.kv_source_layer_ids),
                 index_source_layer_ids=list(self.index_source_layer_ids),
                 candidate_source_layer_id=self.candidate_source_layer_id,
                 candidate_topk_blocks=self.candidate_topk_blocks, candidate_block_size=self.candidate_block_size,
                 index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim, index_topk=self.index_topk,
                 n_routed_experts=self.n_routed_experts, num_experts_per_tok=self.num_experts_per_tok,
                 n_shared_experts=self.n_shared_experts, moe_intermediate_size=self.moe_intermediate_size,
                 scoring_func=self.scoring_func, gate_temp=self.gate_temp, topk_method=self.topk_method,
                 norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor,
                 swiglu_limit=self.swiglu_limit, hc_mult=self.hc_mult, hc_sinkhorn_iters=self.hc_sinkhorn_iters,
                 hc_eps=self.hc_eps, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                 compress_rope_theta=self.compress_rope_theta, max_position_embeddings=self.max_position_embeddings,
                 engram_layer_ids=list(self.engram_layer_ids), engram_vocab_size=self.engram_vocab_size,
                 engram_num_embeddings=list(self.engram_num_embeddings),
                 engram_max_ngram_size=self.engram_max_ngram_size, engram_n_heads=self.engram_n_heads,
                 engram_head_dim=self.engram_head_dim, engram_pad_id=self.engram_pad_id,
                 engram_compressed_vocab_size=self.engram_compressed_vocab_size,
                 num_nextn_predict_layers=self.num_nextn_predict_layers, dspark_block_size=self.dspark_block_size,
                 dspark_noise_token_id=self.dspark_noise_token_id,
                 dspark_target_layer_ids=list(self.dspark_target_layer_ids), dspark_markov_rank=self.dspark_markov_rank,
                 dspark_n_routed_experts=self.dspark_n_routed_experts,
                 dspark_num_experts_per_tok=self.dspark_num_experts_per_tok, bos_token_id=self.bos_token_id,
                 eos_token_id=list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
                 pad_token_id=self.pad_token_id, tie_word_embeddings=self.tie_word_embeddings,
                 initializer_range=self.initializer_range)
        if self.yarn is not None:
            t["rope_scaling"] = {"rope_type": "yarn", **self.yarn.model_dump()}
        if not nested:
            return t
        t.pop("model_type")
        out = dict(architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41", text_config=t)
        if self.quantization is not None:
            q = self.quantization
            out["quantization_config"] = dict(quant_method=q.quant_method, fmt=q.fmt, scale_fmt=q.scale_fmt,
                                              weight_block_size=list(q.weight_block_size),
                                              expert_dtype=q.expert_dtype)
        return out


def _int(g: dict, key: str, default: int) -> int:
    v = g.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{key}: expected an integer, got {v!r}")
    return v


def _engram_rows(layers: tuple[int, ...], vocab: int, ngram: int, heads: int) -> tuple[int, ...]:
    """Rows of each Engram table: the sum of its layer's hash primes (core/models/engram_hash.py)."""
    from shuili.core.models.engram_hash import EngramSpec

    spec = EngramSpec(layer_ids=layers, max_ngram_size=ngram, n_heads=heads, head_dim=32, vocab_size=vocab,
                      pad_id=0, compressed_vocab_size=vocab, num_embeddings=(1 << 40,) * len(layers))
    return tuple(spec.table_rows)


def _tiny() -> V41Config:
    # the transformers parity fixture's config (tests/fixtures/deepseek_v41_tiny): every CED role, SWA 0-1,
    # FULL r2 (2), REUSE r2 (3), FULL r1 + candidate source (4), REUSE r1 (5, 7), REINDEX (6); 12 indexer
    # heads of dim 32 so ReLU zeros make no ties at the top-k cut-offs
    return V41Config(
        vocab_size=256, hidden_size=32, num_hidden_layers=8, num_attention_heads=2, head_dim=64,
        qk_rope_head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=32,
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(2, 4), index_source_layer_ids=(2, 4, 6),
        candidate_source_layer_id=4, candidate_topk_blocks=3, candidate_block_size=4,
        index_n_heads=12, index_head_dim=32, index_topk=4, sliding_window=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        max_position_embeddings=1024, num_nextn_predict_layers=3, pad_token_id=2,
        yarn=YarnConfig(factor=16.0, original_max_position_embeddings=64),
        # small DSpark draft layers (built only for --speculative-method dspark): blocks of 4, taps 5-7,
        # Markov rank 8, 4 experts top-2
        dspark_block_size=4, dspark_noise_token_id=255, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=8,
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
        # the byte tokenizer of a random model maps ids to themselves (the fixture's word tokenizer
        # gives its own compressed size and table rows; see its config.json)
        engram_layer_ids=(1, 4), engram_vocab_size=50, engram_max_ngram_size=4, engram_n_heads=2,
        engram_head_dim=32, engram_pad_id=2, engram_compressed_vocab_size=256,
        engram_num_embeddings=_engram_rows((1, 4), 50, 4, 2))


def _mid() -> V41Config:
    # v4_arch.md §5.3 analogue: the real head_dim/rope/window/top-k/candidate pool/vocab, one GPU
    return V41Config(
        vocab_size=129280, hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=512,
        compress_ratios=(0, 0) + (2,) * 5 + (1,) * 5, kv_source_layer_ids=(2, 7),
        index_source_layer_ids=(2, 7, 9, 11), candidate_source_layer_id=7, candidate_topk_blocks=2048,
        candidate_block_size=8, index_n_heads=32, index_head_dim=128, index_topk=512, sliding_window=128,
        n_routed_experts=32, num_experts_per_tok=6, moe_intermediate_size=768, n_shared_experts=1,
        num_nextn_predict_layers=3, quantization=QuantConfig(),
        dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=(9, 10, 11), dspark_markov_rank=256,
        dspark_n_routed_experts=16, dspark_num_experts_per_tok=3,
        # the released Engram row shape (24 rows of 256 per token per layer) with smaller tables
        # (~12M rows, 3.2 GB each as fp8 rows) in host memory; the identity token map of the byte tokenizer
        engram_layer_ids=(1, 5), engram_vocab_size=500_000, engram_max_ngram_size=4, engram_n_heads=8,
        engram_head_dim=256, engram_pad_id=2, engram_compressed_vocab_size=129280,
        engram_num_embeddings=_engram_rows((1, 5), 500_000, 4, 8))


NAMED: dict[str, V41Config] = {"tiny-v41": _tiny(), "mid-v41": _mid()}


def named(name: str, **overrides: Any) -> V41Config:
    if name not in NAMED:
        raise ValueError(f"unknown V4.1 config {name!r}; named configs: {sorted(NAMED)}")
    cfg = NAMED[name]
    return cfg if not overrides else V41Config(**{**cfg.model_dump(), **overrides})
