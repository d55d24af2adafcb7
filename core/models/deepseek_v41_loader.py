"""DeepSeek-V4.1 weights: the tensor schema (transformers' module names), the released-name table,
seeded random init, and safetensors loading.

Two namings are read, each through an explicit table (a tensor in neither is an error):
  transformers  what `DeepseekV41ForCausalLM.save_pretrained` writes (model.layers.{i}.self_attn.q_a_proj...)
  released      the DeepSeek checkpoint (layers.{i}.attn.wq_a..., per-expert experts.{j}.w1/w2/w3)
Storage (v4_arch.md §4.5): float tensors, FP8 e4m3 linears with one e8m0 scale per 32x32 block
(`scale` / `weight_scale_inv`), routed experts MXFP4 (int8 nibbles [N, K/2] + e8m0 [N, K/32]).
FP8 32x32 linears are kept as stored, in the contract's `fp8_block32` format (e4m3 data, float32
power-of-two scales), when the platform declares it for linear and grouped_linear (`weight_formats`;
None = keep); otherwise, or where a 32x32 block would straddle wo_a's groups, they are decoded to the
compute dtype at load (exact: e4m3 times a power of two; the reference gives the same bits either way).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

from shuili.core.models.deepseek_v4_loader import _DEVICE_NORMAL_MIN
from shuili.core.models.deepseek_v41_config import V41Config
from shuili.hal import numerics
from shuili.hal.types import Weight


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    kind: str  # linear | dense | f32 | grouped | experts


def schema(cfg: V41Config) -> dict[str, Spec]:
    """Every backbone tensor under its transformers name (Engram tables excluded: host memory)."""
    D, H, d, q = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    m, E, I = cfg.hc_mult, cfg.n_routed_experts, cfg.moe_intermediate_size
    nh, di = cfg.index_n_heads, cfg.index_head_dim
    s: dict[str, Spec] = {"model.embed_tokens.weight": Spec((cfg.vocab_size, D), "dense"),
                          "model.norm.weight": Spec((D,), "f32")}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = Spec((cfg.vocab_size, D), "dense")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        s[a + "q_a_proj.weight"] = Spec((q, D), "linear")
        s[a + "q_a_norm.weight"] = Spec((q,), "f32")
        s[a + "q_b_proj.weight"] = Spec((H * d, q), "linear")
        s[a + "kv_proj.weight"] = Spec((d, D), "linear")
        s[a + "kv_norm.weight"] = Spec((d,), "f32")
        s[a + "o_a_proj.weight"] = Spec((cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups), "grouped")
        s[a + "o_b_proj.weight"] = Spec((D, cfg.o_groups * cfg.o_lora_rank), "linear")
        s[a + "sinks"] = Spec((H,), "f32")
        role = cfg.role(i)
        if role == "full":
            s[a + "compressor.kv_proj.weight"] = Spec((d, D), "dense")
            if cfg.ratio(i) > 1:
                s[a + "compressor.gate_proj.weight"] = Spec((d, D), "dense")
            s[a + "compressor.kv_norm.weight"] = Spec((d,), "f32")
            s[a + "indexer.k_proj.weight"] = Spec((di, d), "dense")
            s[a + "indexer.k_norm.weight"] = Spec((di,), "f32")
        if role in ("full", "reindex"):
            s[a + "indexer.q_b_proj.weight"] = Spec((nh * di, q), "linear")
            s[a + "indexer.weights_proj.weight"] = Spec((nh, D), "dense")
        for site in ("attn_hc", "ffn_hc"):
            s[f"{p}{site}.fn"] = Spec((m * (m + 2), m * D), "f32")
            s[f"{p}{site}.base"] = Spec((m * (m + 2),), "f32")
            s[f"{p}{site}.scale"] = Spec((3,), "f32")
        s[p + "input_layernorm.weight"] = Spec((D,), "f32")
        s[p + "post_attention_layernorm.weight"] = Spec((D,), "f32")
        f = p + "mlp."
        s[f + "gate.weight"] = Spec((E, D), "f32")
        s[f + "gate.e_score_correction_bias"] = Spec((E,), "f32")
        s[f + "experts.gate_up_proj"] = Spec((E, 2 * I, D), "experts")
        s[f + "experts.down_proj"] = Spec((E, D, I), "experts")
        if cfg.n_shared_experts:
            s[f + "shared_experts.gate_proj.weight"] = Spec((I, D), "linear")
            s[f + "shared_experts.up_proj.weight"] = Spec((I, D), "linear")
            s[f + "shared_experts.down_proj.weight"] = Spec((D, I), "linear")
        if i in cfg.engram_layer_ids:
            e = p + "engram."
            s[e + "wkv.weight"] = Spec(((m + 1) * D, cfg.n_engram_cols * cfg.engram_head_dim), "linear")
            s[e + "q_weight"] = Spec((m, D), "f32")
            s[e + "k_weight"] = Spec((m, D), "f32")
    return s


# transformers name (with {i}) -> released name; the experts and tables are handled apart
_RELEASED = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.layers.{i}.self_attn.q_a_proj.weight": "layers.{i}.attn.wq_a.weight",
    "model.layers.{i}.self_attn.q_a_norm.weight": "layers.{i}.attn.q_norm.weight",
    "model.layers.{i}.self_attn.q_b_proj.weight": "layers.{i}.attn.wq_b.weight",
    "model.layers.{i}.self_attn.kv_proj.weight": "layers.{i}.attn.wkv.weight",
    "model.layers.{i}.self_attn.kv_norm.weight": "layers.{i}.attn.kv_norm.weight",
    "model.layers.{i}.self_attn.o_a_proj.weight": "layers.{i}.attn.wo_a.weight",
    "model.layers.{i}.self_attn.o_b_proj.weight": "layers.{i}.attn.wo_b.weight",
    "model.layers.{i}.self_attn.sinks": "layers.{i}.attn.attn_sink",
    "model.layers.{i}.self_attn.compressor.kv_proj.weight": "layers.{i}.attn.compressor.wkv.weight",
    "model.layers.{i}.self_attn.compressor.gate_proj.weight": "layers.{i}.attn.compressor.wgate.weight",
    "model.layers.{i}.self_attn.compressor.kv_norm.weight": "layers.{i}.attn.compressor.norm.weight",
    "model.layers.{i}.self_attn.indexer.k_proj.weight": "layers.{i}.attn.indexer.wk.weight",
    "model.layers.{i}.self_attn.indexer.k_norm.weight": "layers.{i}.attn.indexer.k_norm.weight",
    "model.layers.{i}.self_attn.indexer.q_b_proj.weight": "layers.{i}.attn.indexer.wq_b.weight",
    "model.layers.{i}.self_attn.indexer.weights_proj.weight": "layers.{i}.attn.indexer.weights_proj.weight",
    "model.layers.{i}.attn_hc.fn": "layers.{i}.hc_attn_fn",
    "model.layers.{i}.attn_hc.base": "layers.{i}.hc_attn_base",
    "model.layers.{i}.attn_hc.scale": "layers.{i}.hc_attn_scale",
    "model.layers.{i}.ffn_hc.fn": "layers.{i}.hc_ffn_fn",
    "model.layers.{i}.ffn_hc.base": "layers.{i}.hc_ffn_base",
    "model.layers.{i}.ffn_hc.scale": "layers.{i}.hc_ffn_scale",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate.weight": "layers.{i}.ffn.gate.weight",
    "model.layers.{i}.mlp.gate.e_score_correction_bias": "layers.{i}.ffn.gate.bias",
    "model.layers.{i}.mlp.shared_experts.gate_proj.weight": "layers.{i}.ffn.shared_experts.w1.weight",
    "model.layers.{i}.mlp.shared_experts.up_proj.weight": "layers.{i}.ffn.shared_experts.w3.weight",
    "model.layers.{i}.mlp.shared_experts.down_proj.weight": "layers.{i}.ffn.shared_experts.w2.weight",
    "model.layers.{i}.engram.wkv.weight": "layers.{i}.engram.wkv.weight",
    "model.layers.{i}.engram.q_weight": "layers.{i}.engram.q_weight",
    "model.layers.{i}.engram.k_weight": "layers.{i}.engram.k_weight",
}
# present in checkpoints, not used by the text backbone: VL router bias, DSpark, vision, Engram tables
_IGNORED_HF = re.compile(r"(^|\.)(mtp|vision|aligner)\.|^model\.(image_(start|end|newline)$|engram_tables\.)"
                         r"|\.mlp\.gate\.e_score_correction_bias_vl$")
_IGNORED_REL = re.compile(r"^(mtp|vision|aligner)\.|^image_(start|end|newline)$|^engram_tables?\."
                          r"|\.ffn\.gate\.bias_vl$|\.engram\.(table|emb)")


def released_name(hf: str) -> str | None:
    """The released name of a transformers tensor name (None for the stacked experts)."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)", hf)
    key = f"model.layers.{{i}}.{m.group(2)}" if m else hf
    rel = _RELEASED.get(key)
    return rel.replace("{i}", m.group(1)) if (rel and m) else rel


def _released_table(cfg: V41Config) -> dict[str, str]:
    """released name -> transformers name, every non-expert tensor of the schema."""
    out = {}
    for name, sp in schema(cfg).items():
        if sp.kind != "experts":
            rel = released_name(name)
            if rel is None:
                raise AssertionError(f"no released name for {name}")
            out[rel] = name
    return out


# ------------------------------------------------------------------------------ DSpark draft layers
def dspark_layer_config(cfg: V41Config) -> V41Config:
    """The draft layers as a config of their own: num_nextn_predict_layers window-only layers (ratio 0,
    no Engram) whose MoE has dspark_n_routed_experts experts, top dspark_num_experts_per_tok."""
    n = cfg.num_nextn_predict_layers
    return V41Config(**{**cfg.model_dump(), "num_hidden_layers": n, "compress_ratios": (0,) * n,
                        "kv_source_layer_ids": (), "index_source_layer_ids": (), "candidate_source_layer_id": -1,
                        "engram_layer_ids": (), "engram_num_embeddings": (), "num_nextn_predict_layers": 0,
                        "dspark_target_layer_ids": (), "n_routed_experts": cfg.dspark_n_routed_experts,
                        "num_experts_per_tok": cfg.dspark_num_experts_per_tok})


def dspark_schema(cfg: V41Config) -> dict[str, Spec]:
    """The draft tensors under shuili's transformers-style names (transformers has no DSpark module:
    these names are our choice, `model.mtp.{k}.` + a decoder layer's module names). mtp.0 carries
    main_proj/main_norm, the last one the final norm and the Markov and confidence heads."""
    if cfg.num_nextn_predict_layers <= 0:
        return {}
    D, V, r, L = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank, cfg.num_nextn_predict_layers - 1
    s: dict[str, Spec] = {}
    for name, sp in schema(dspark_layer_config(cfg)).items():
        if name.startswith("model.layers."):
            s["model.mtp." + name[len("model.layers."):]] = sp
    s["model.mtp.0.main_proj.weight"] = Spec((D, len(cfg.dspark_taps) * D), "linear")
    s["model.mtp.0.main_norm.weight"] = Spec((D,), "f32")
    s[f"model.mtp.{L}.norm.weight"] = Spec((D,), "f32")
    s[f"model.mtp.{L}.markov_head.markov_w1.weight"] = Spec((V, r), "dense")
    s[f"model.mtp.{L}.markov_head.markov_w2.weight"] = Spec((V, r), "linear")
    s[f"model.mtp.{L}.confidence_head.proj.weight"] = Spec((1, D + r), "f32")
    return s


# draft head tensors: shuili name (after model.mtp.{k}.) -> released name (after mtp.{k}.), as in the
# released V4.1 checkpoint and vLLM's loader (its Markov factors are called embed / head there)
_DSPARK_HEADS = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight",
                 "norm.weight": "norm.weight", "markov_head.markov_w1.weight": "markov_head.embed.weight",
                 "markov_head.markov_w2.weight": "markov_head.head.weight",
                 "confidence_head.proj.weight": "confidence_head.proj.weight"}


def released_dspark_name(name: str) -> str | None:
    """The released name of a `dspark_schema` name (None for the stacked experts)."""
    m = re.match(r"model\.mtp\.(\d+)\.(.*)", name)
    if m is None:
        raise ValueError(f"{name!r} is not a DSpark tensor name")
    k, rest = m.groups()
    if rest in _DSPARK_HEADS:
        return f"mtp.{k}.{_DSPARK_HEADS[rest]}"
    rel = released_name(f"model.layers.{k}.{rest}")
    return None if rel is None else "mtp." + rel[len("layers."):]


def random_dspark_params(cfg: V41Config, device: str = "cpu", dtype: str = "float32", seed: int = 0) -> dict:
    """Seeded random draft weights (their own RNG stream: the backbone's draw does not change)."""
    return _random(dspark_schema(cfg), cfg, device, dtype, torch.Generator(device="cpu").manual_seed(seed + 104729))


# ----------------------------------------------------------------------------------- random weights
def random_params(cfg: V41Config, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                  transform=None) -> dict:
    """Seeded random weights in schema order (one CPU RNG stream through `numerics.normal`, so a seed
    is the same model on every device and host). What a default init leaves trivial is randomised
    too: sinks, router bias, mHC bases. transform(name, value), when given, replaces each value as
    soon as it is drawn (a parallel rank keeps its shard: core/parallel/sharding_v41.py)."""
    return _random(schema(cfg), cfg, device, dtype, torch.Generator(device="cpu").manual_seed(seed), transform)


def _random(sch: dict[str, Spec], cfg: V41Config, device: str, dtype: str, g: torch.Generator,
            transform=None) -> dict:
    dt, std = getattr(torch, dtype), cfg.initializer_range
    out: dict = {}
    for name, sp in sch.items():
        # large tensors: the normal transform runs on `device` (same bits; deepseek_v4_loader)
        dev = device if math.prod(sp.shape) >= _DEVICE_NORMAL_MIN else None
        if name.endswith(("norm.weight", ".scale", "q_weight", "k_weight")):
            t = torch.ones(sp.shape, dtype=torch.float32)
        elif name.endswith(".base"):
            t = numerics.normal(sp.shape, g, 0.0, 0.5, device=dev)
        elif name.endswith("sinks"):
            t = numerics.normal(sp.shape, g, 0.0, 1.0, device=dev)
        elif name.endswith("e_score_correction_bias"):
            t = numerics.normal(sp.shape, g, 0.0, 0.05, device=dev)
        else:
            t = numerics.normal(sp.shape, g, 0.0, std, device=dev)
        out[name] = _as_param(t, sp, cfg, dt).to(device)
        if transform is not None:
            out[name] = transform(name, out[name])
    return out


def _as_param(t, sp: Spec, cfg: V41Config, dt: torch.dtype):
    if isinstance(t, Weight):  # kept in a quantized format by the loader
        return t
    if sp.kind == "f32":
        return t.float()
    if sp.kind == "dense":
        return t.to(dt)
    if sp.kind == "grouped":
        return Weight.dense(t.to(dt).reshape(cfg.o_groups, cfg.o_lora_rank, -1))
    return Weight.dense(t.to(dt))


def random_engram(cfg: V41Config, ops, device: str = "cpu", dtype: str = "float32", seed: int = 0):
    """The Engram service of a random-weight model: seeded float32 tables held in host memory
    (numpy, never a torch tensor on the device) and the identity compressed-token map (a byte
    tokenizer has nothing to merge). None without Engram layers."""
    if not cfg.engram_layer_ids:
        return None
    import numpy as np

    from shuili.core.models.engram import Engram, EngramTable
    from shuili.core.models.engram_hash import EngramSpec

    spec = EngramSpec.from_config(cfg)
    g = torch.Generator(device="cpu").manual_seed(seed + 7919)
    tables = {}
    for lid, n in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        what = f"random Engram table of layer {lid}"
        if n * cfg.engram_head_dim <= 1 << 22:  # small: float32 normal rows
            rows = numerics.normal((n, cfg.engram_head_dim), g, 0.0, 1.0).numpy()
            tables[lid] = EngramTable(np.ascontiguousarray(rows).view(np.uint8), None, "float32",
                                      cfg.engram_head_dim, what)
            continue
        # large (mid-v41): fp8 rows as the release stores them, random e4m3 bytes without NaN codes
        # (0x7F / 0xFF) and one scale 2^-4 per 32, from numpy's PCG64 (the same bytes on every host)
        rng = np.random.default_rng(seed * 1000 + lid)
        data = rng.integers(0, 256, size=(n, cfg.engram_head_dim), dtype=np.uint8)
        data[(data & 0x7F) == 0x7F] ^= 0x01
        scale = np.full((n, cfg.engram_head_dim // 32), 127 - 4, dtype=np.uint8)
        tables[lid] = EngramTable(data, scale, "mxfp8", cfg.engram_head_dim, what)
    token_map = list(range(cfg.vocab_size))
    if cfg.engram_compressed_vocab_size != cfg.vocab_size:
        raise ValueError(f"a random-weight Engram model uses the identity token map: set "
                         f"engram_compressed_vocab_size = vocab_size ({cfg.vocab_size})")
    return Engram(spec, token_map, tables, ops, device=device, dtype=getattr(torch, dtype))


# ------------------------------------------------------------------------------------ checkpoints
from shuili.core.models.safetensors_index import Checkpoint, CheckpointError, write_checkpoint  # noqa: E402


# Engram table tensor names: (data, scale) per naming; the tables are mapped, never loaded
_ENGRAM_NAMES = {"transformers": ("model.engram_tables.{L}.weight", "model.engram_tables.{L}.weight_scale_inv"),
                 "released": ("layers.{L}.engram.embed.weight", "layers.{L}.engram.embed.scale")}


def load_engram(path: str, cfg: V41Config, tokenizer, ops, device: str = "cpu", dtype: str = "float32"):
    """The Engram service of a checkpoint: each table memory-mapped from its safetensors shard (found
    through the index), the compressed-token map built from the checkpoint's tokenizer."""
    if not cfg.engram_layer_ids:
        return None
    from shuili.core.models.engram import Engram, EngramTable
    from shuili.core.models.engram_hash import EngramSpec, build_compressed_token_map

    ckpt = Checkpoint(path)
    where = ckpt.where
    tables = {}
    for lid in cfg.engram_layer_ids:
        for naming, (wn, sn) in _ENGRAM_NAMES.items():
            w, s = wn.format(L=lid), sn.format(L=lid)
            if w in where:
                break
        else:
            raise CheckpointError(f"checkpoint has no Engram table for layer {lid}: expected "
                                  f"{_ENGRAM_NAMES['transformers'][0].format(L=lid)!r} or "
                                  f"{_ENGRAM_NAMES['released'][0].format(L=lid)!r}")
        try:
            tables[lid] = EngramTable.from_safetensors(os.path.join(path, where[w]), w, s if s in where else None)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(str(exc)) from None
        if s in where and where[s] != where[w]:
            raise CheckpointError(f"Engram table {w!r} and its scale {s!r} sit in different shards; "
                                  "the mapped reader needs them in one file")
    if not hasattr(tokenizer, "_tok"):
        raise CheckpointError(f"{path}: the Engram hash needs the checkpoint's tokenizer.json (the compressed "
                              "token map is derived from it)")
    token_map, size = build_compressed_token_map(tokenizer)
    if size != cfg.engram_compressed_vocab_size:
        raise CheckpointError(f"{path}: the tokenizer gives {size} compressed ids but engram_compressed_vocab_size "
                              f"is {cfg.engram_compressed_vocab_size}: the tokenizer is not the checkpoint's")
    return Engram(EngramSpec.from_config(cfg), token_map, tables, ops, device=device, dtype=getattr(torch, dtype))


def read_config(path: str, **overrides) -> V41Config:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    from shuili.core.errors import read_json

    raw = read_json(cfg_path)
    try:
        return V41Config.from_hf(raw, **overrides)
    except ValueError as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from None


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple) -> None:
    if t.dtype not in dtypes:
        raise CheckpointError(f"tensor {name!r} has dtype {str(t.dtype).replace('torch.', '')}, expected one of "
                              f"{[str(x).replace('torch.', '') for x in dtypes]}")
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")


# fp8 block shape of quantization_config.weight_block_size -> the contract format that holds it
_FP8_FORMATS = {(32, 32): "fp8_block32", (128, 128): "fp8_block128"}


def fp8_format(block: tuple[int, int], weight_formats=None) -> str | None:
    """The contract format FP8 linears of `block` are kept in, or None to decode them at load: the
    block has no contract format, or the platform (its `weight_formats` for linear and
    grouped_linear; None = every contract format) does not declare it."""
    fmt = _FP8_FORMATS.get(tuple(block))
    if fmt is None or (weight_formats is not None and fmt not in weight_formats):
        return None
    return fmt


def gemm_weight_formats(caps) -> tuple[str, ...]:
    """Weight formats a platform's capabilities declare for both linear and grouped_linear."""
    names = [{f.name for f in caps.op(op).formats} for op in ("linear", "grouped_linear")]
    return tuple(sorted(names[0] & names[1]))


def _kept_fp8(fmt: str, w: torch.Tensor, s: torch.Tensor, shape, sp: Spec, cfg: V41Config, device) -> Weight | None:
    """The stored e4m3 data and e8m0 scales as a `fmt` Weight ([G, r, K] for wo_a), or None where the
    format cannot hold them (K % 32, or scale blocks straddling wo_a's groups): decode instead."""
    from shuili.core.models.deepseek_v4_loader import _e8m0_to_f32
    from shuili.hal.formats import fp8_weight_block

    b = fp8_weight_block(fmt)
    if fmt == "fp8_block32" and shape[1] % b:
        return None
    sf = _e8m0_to_f32(s)
    if s.dtype == torch.float32 and not bool((torch.frexp(sf)[0].abs() == 0.5).all()):
        return None  # float32 scales that are not powers of two are outside the contract format
    sf = sf.to(device)
    if sp.kind != "grouped":
        return Weight(fmt, w.to(device), sf, tuple(shape))
    G, r = cfg.o_groups, cfg.o_lora_rank
    if r % b:
        return None
    return Weight(fmt, w.to(device).reshape(G, r, -1), sf.reshape(G, r // b, -1), (G, r, shape[1]))


def _dequant_fp8(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    from shuili.core.models.deepseek_v4_loader import _e8m0_to_f32

    sf = _e8m0_to_f32(s)
    full = sf.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
    return w.float() * full


def load_params(path: str, cfg: V41Config, device: str = "cpu", dtype: str = "float32",
                progress: bool = True, with_dspark: bool = False, weight_formats=None) -> dict:
    """Every tensor of `schema(cfg)` (and of `dspark_schema(cfg)` with_dspark), read by the
    transformers name or the released one (decided by the checkpoint's names); a tensor the backbone
    does not know is an error naming it. Without with_dspark the mtp.* tensors are skipped unread.
    FP8 linears stay in their contract format where `fp8_format(block, weight_formats)` names one."""
    from tqdm import tqdm

    ckpt = Checkpoint(path)  # honours model.safetensors.index.json
    where = ckpt.where
    dt = getattr(torch, dtype)
    sch = schema(cfg)
    dsch = dspark_schema(cfg) if with_dspark else {}
    if with_dspark and not dsch:
        raise CheckpointError(f"{path}: config.json has num_nextn_predict_layers = 0: the checkpoint has no "
                              "DSpark draft layers (speculative method dspark needs them)")
    hf = any(k.startswith("model.layers.") or k == "model.embed_tokens.weight" for k in where)
    if hf:
        table = {n: n for n, sp in {**sch, **dsch}.items() if sp.kind != "experts"}
        ignore = _IGNORED_HF
    else:
        table = _released_table(cfg)
        table.update({released_dspark_name(n): n for n, sp in dsch.items() if sp.kind != "experts"})
        ignore = _IGNORED_REL
    inv = {v: k for k, v in table.items()}
    block = tuple(cfg.quantization.weight_block_size) if cfg.quantization else (32, 32)
    keep = fp8_format(block, weight_formats)
    known = set(table)
    expert_re = (re.compile(r"model\.(layers|mtp)\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$") if hf else
                 re.compile(r"(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$"))
    scale_re = re.compile(r"\.(scale|weight_scale_inv)$")
    draft_re = re.compile(r"^(model\.)?mtp\.")
    for k in where:
        ignored = ignore.search(k) and not (with_dspark and draft_re.match(k) and not k.endswith("bias_vl"))
        if k in known or ignored or (expert_re.match(k) and (with_dspark or not draft_re.match(k))):
            continue
        if scale_re.search(k) and (re.sub(r"\.(scale|weight_scale_inv)$", ".weight", k) in known):
            continue
        raise CheckpointError(f"tensor {k!r} is neither a {'transformers' if hf else 'released'} "
                              f"DeepSeek-V4.1 tensor name of this config ({cfg.num_hidden_layers} layers) nor "
                              "a known ignored one: the checkpoint does not match its config.json")

    def get(name: str) -> torch.Tensor:
        return ckpt.get(name)

    def scale_of(name: str) -> torch.Tensor:
        base = name[: -len("weight")]
        for s in ("scale", "weight_scale_inv"):
            if base + s in where:
                return get(base + s)
        raise CheckpointError(f"tensor {name!r} is float8_e4m3fn but the checkpoint has no {base}scale "
                              f"(or {base}weight_scale_inv) for its {block[0]}x{block[1]} blocks")

    def linear(name: str, sp: Spec):
        shape = sp.shape
        w = get(name)
        if w.dtype == torch.float8_e4m3fn:
            _check(name, w, shape, (torch.float8_e4m3fn,))
            s = scale_of(name)
            want = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
            _check(name[: -len("weight")] + "scale", s, want, (torch.float8_e8m0fnu, torch.uint8, torch.float32))
            kept = _kept_fp8(keep, w, s, shape, sp, cfg, device) if keep else None
            return kept if kept is not None else _dequant_fp8(w, s, block).to(dt)
        _check(name, w, shape, _FLOATS + (torch.float8_e4m3fn,))
        return w.to(dt)

    out: dict = {}
    for name, sp in tqdm({**sch, **dsch}.items(), desc="loading deepseek_v41", disable=not progress, unit="tensor"):
        if sp.kind == "experts":
            out[name] = _experts(name, sp, cfg, hf, get, where, dt, device)
            continue
        src = inv[name]
        if sp.kind in ("linear", "grouped"):
            t = linear(src, sp)
        else:
            t = get(src)
            _check(src, t, sp.shape, _FLOATS)
        out[name] = _as_param(t.to(device), sp, cfg, torch.float32 if sp.kind == "f32" else dt)
    return out


def _experts(name: str, sp: Spec, cfg: V41Config, hf: bool, get, where, dt, device) -> Weight:
    """gate_up_proj [E, 2I, D] / down_proj [E, D, I]: stacked as stored (float) or from the released
    per-expert w1/w3 (gate rows, then up rows) or w2, float or MXFP4."""
    if hf:
        t = get(name)
        _check(name, t, sp.shape, _FLOATS)
        return Weight.dense(t.to(device=device, dtype=dt))
    from shuili.core.models.deepseek_v4_loader import _stack_experts

    class _Rd:  # only get(): error messages stay without the shard name, as the V4.1 loader's always were
        def get(self, n):
            return get(n)

    def no_fp8(n: str, f: str) -> None:
        if f == "fp8_block128":
            raise CheckpointError(f"tensor {n!r}: FP8 experts of V4.1 use {cfg.quantization.weight_block_size if cfg.quantization else '?'} "
                                  "blocks, which this loader reads only for non-expert linears")

    kind, layer = re.match(r"model\.(layers|mtp)\.(\d+)\.", name).groups()
    which = "w13" if name.endswith("gate_up_proj") else "w2"
    # the draft layers (mtp.*) have their own expert count (dspark_n_routed_experts)
    return _stack_experts(_Rd(), f"{kind}.{layer}.ffn.", cfg, which, dt, device, reject=no_fp8,
                          num_experts=sp.shape[0])


# ---------------------------------------------------------------------------------- checkpoint writer
def tensors_for(cfg: V41Config, params: dict, naming: str = "transformers") -> dict[str, torch.Tensor]:
    """Float tensors of assembled params under `naming` ("transformers" or "released")."""
    out: dict[str, torch.Tensor] = {}
    I = cfg.moe_intermediate_size
    for name, v in params.items():
        t = v.data if isinstance(v, Weight) else v
        if isinstance(v, Weight) and v.format != "dense":
            raise ValueError(f"tensors_for writes float weights only; {name} is {v.format}")
        if name.endswith("o_a_proj.weight"):
            t = t.reshape(-1, t.shape[-1])
        if naming == "transformers":
            out[name] = t.contiguous()
            continue
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            kind, layer = name.split(".")[1:3]
            for j in range(t.shape[0]):
                p = f"{kind}.{layer}.ffn.experts.{j}."
                if name.endswith("gate_up_proj"):
                    out[p + "w1.weight"] = t[j, :I].contiguous()
                    out[p + "w3.weight"] = t[j, I:].contiguous()
                else:
                    out[p + "w2.weight"] = t[j].contiguous()
            continue
        out[released_dspark_name(name) if name.startswith("model.mtp.") else released_name(name)] = t.contiguous()
    return out


def save_checkpoint(path: str, cfg: V41Config, tensors: dict[str, torch.Tensor], shards: int = 1,
                    nested: bool = True) -> None:
    """config.json (nested deepseek_v41 or flat deepseek_v41_text) + safetensors shards + the index."""
    write_checkpoint(path, cfg.to_hf(nested=nested), tensors, shards)
