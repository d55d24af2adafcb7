"""DeepSeek-V4 weights: the tensor schema (released names), seeded random init, and safetensors loading.

Checkpoint formats (v4_arch.md §4.5): non-expert linears are float (bf16/f16/f32) or FP8 e4m3 `weight` +
e8m0 `scale` [ceil(N/128), ceil(K/128)]; routed experts are float, FP8 the same way, or MXFP4 (int8/uint8
`weight` [N, K/2], low nibble first, + e8m0 `scale` [N, K/32]). Everything is read through safetensors'
memory map, one tensor at a time, so peak host memory stays near one tensor.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from shuili.core.models.deepseek_v4_config import V4Config
from shuili.core.models.safetensors_index import (Checkpoint, CheckpointError, check_tensor,  # noqa: F401
                                                  write_checkpoint)
from shuili.core.models.safetensors_index import open_safetensors as _open_safetensors  # noqa: F401 (old name)
from shuili.hal import numerics
from shuili.hal.types import Weight

# kinds: "linear" (float or fp8), "dense" (float, kept in compute dtype), "f32" (kept float32),
# "i64", "experts" (stacked per-expert weights: float, fp8 or mxfp4), "grouped" (wo_a: linear viewed [G, r, K])
@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    kind: str


def schema(cfg: V4Config, with_mtp: bool = True) -> dict[str, Spec]:
    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    m, E, I = cfg.hc_mult, cfg.n_routed_experts, cfg.moe_intermediate_size
    s: dict[str, Spec] = {"embed.weight": Spec((cfg.vocab_size, D), "dense"),
                          "norm.weight": Spec((D,), "f32"),
                          "hc_head_fn": Spec((m, m * D), "f32"), "hc_head_base": Spec((m,), "f32"),
                          "hc_head_scale": Spec((1,), "f32")}
    if not cfg.tie_word_embeddings:
        s["head.weight"] = Spec((cfg.vocab_size, D), "dense")

    def comp(p: str, dim: int, ratio: int, coff: int):
        s[p + "wkv.weight"] = Spec((coff * dim, D), "dense")
        s[p + "wgate.weight"] = Spec((coff * dim, D), "dense")
        s[p + "ape"] = Spec((ratio, coff * dim), "f32")
        s[p + "norm.weight"] = Spec((dim,), "f32")

    def block(p: str, kind: str, mlp: str):
        a = p + "attn."
        s[a + "wq_a.weight"] = Spec((cfg.q_lora_rank, D), "linear")
        s[a + "q_norm.weight"] = Spec((cfg.q_lora_rank,), "f32")
        s[a + "wq_b.weight"] = Spec((H * d, cfg.q_lora_rank), "linear")
        s[a + "wkv.weight"] = Spec((d, D), "linear")
        s[a + "kv_norm.weight"] = Spec((d,), "f32")
        s[a + "wo_a.weight"] = Spec((cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups), "grouped")
        s[a + "wo_b.weight"] = Spec((D, cfg.o_groups * cfg.o_lora_rank), "linear")
        s[a + "attn_sink"] = Spec((H,), "f32")
        if kind == "csa":
            comp(a + "compressor.", d, cfg.csa_ratio, 2)
            s[a + "indexer.wq_b.weight"] = Spec((cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "linear")
            s[a + "indexer.weights_proj.weight"] = Spec((cfg.index_n_heads, D), "dense")
            comp(a + "indexer.compressor.", cfg.index_head_dim, cfg.csa_ratio, 2)
        elif kind == "hca":
            comp(a + "compressor.", d, cfg.hca_ratio, 1)
        for site in ("attn", "ffn"):
            s[f"{p}hc_{site}_fn"] = Spec((m * (m + 2), m * D), "f32")
            s[f"{p}hc_{site}_base"] = Spec((m * (m + 2),), "f32")
            s[f"{p}hc_{site}_scale"] = Spec((3,), "f32")
        s[p + "attn_norm.weight"] = Spec((D,), "f32")
        s[p + "ffn_norm.weight"] = Spec((D,), "f32")
        f = p + "ffn."
        s[f + "gate.weight"] = Spec((E, D), "f32")
        if mlp == "hash":
            s[f + "gate.tid2eid"] = Spec((cfg.vocab_size, cfg.num_experts_per_tok), "i64")
        else:
            s[f + "gate.bias"] = Spec((E,), "f32")
        s[f + "experts.w13"] = Spec((E, 2 * I, D), "experts")
        s[f + "experts.w2"] = Spec((E, D, I), "experts")
        if cfg.n_shared_experts:
            s[f + "shared_experts.w1.weight"] = Spec((I, D), "linear")
            s[f + "shared_experts.w3.weight"] = Spec((I, D), "linear")
            s[f + "shared_experts.w2.weight"] = Spec((D, I), "linear")

    for i in range(cfg.num_hidden_layers):
        block(f"layers.{i}.", cfg.attn_kinds[i], cfg.mlp_kinds[i])
    if with_mtp:
        for j in range(min(cfg.num_nextn_predict_layers, 1)):
            p = f"mtp.{j}."
            block(p, "swa", "topk")
            s[p + "e_proj.weight"] = Spec((D, D), "linear")
            s[p + "h_proj.weight"] = Spec((D, D), "linear")
            for n in ("enorm", "hnorm", "norm"):
                s[p + n + ".weight"] = Spec((D,), "f32")
            s[p + "hc_head_fn"] = Spec((m, m * D), "f32")
            s[p + "hc_head_base"] = Spec((m,), "f32")
            s[p + "hc_head_scale"] = Spec((1,), "f32")
    return s


def _grouped_dense(t: torch.Tensor, cfg: V4Config) -> Weight:
    return Weight.dense(t.reshape(cfg.o_groups, cfg.o_lora_rank, -1))


# ----------------------------------------------------------------------------------- random weights
_DEVICE_NORMAL_MIN = 1 << 20  # elements; tiny-v4's tensors all stay below it


def random_params(cfg: V4Config, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                  with_mtp: bool = True, transform=None) -> dict:
    """Seeded random weights in schema order (one RNG stream, no per-expert Python loops), drawn
    on the CPU and then moved to `device`, so a seed is the same model on every device. What a
    default init leaves at zero is randomised too: sinks, ape, router bias, mHC bases, and
    tid2eid (distinct experts per token). transform(name, value), when given, replaces each value as
    soon as it is drawn (a parallel rank keeps its shard only: core/parallel/sharding.py)."""
    keep = transform or (lambda name, value: value)
    # a CUDA generator draws other numbers from the same seed: the reference (CPU) and a GPU
    # platform would then compare two different models
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt, std = getattr(torch, dtype), cfg.initializer_range
    out: dict = {}
    for name, sp in schema(cfg, with_mtp and cfg.num_nextn_predict_layers > 0).items():
        if sp.kind == "i64":
            r = torch.rand(sp.shape[0], cfg.n_routed_experts, generator=g)
            out[name] = keep(name, r.argsort(dim=-1)[:, : sp.shape[1]].contiguous().to(device))
            continue
        # numerics.normal, not normal_: torch's normal transform has host-dependent bits, and a
        # random-weight model must be the same model on every host
        # large tensors are transformed on the target device (same bits, IEEE float64 elementwise
        # ops): on the CPU alone a multi-GB random model takes tens of minutes
        dev = device if math.prod(sp.shape) >= _DEVICE_NORMAL_MIN else None
        if name.endswith(("norm.weight", "_scale")):
            t = torch.ones(sp.shape, dtype=torch.float32)
        elif name.endswith(("_base", "ape")):
            t = numerics.normal(sp.shape, g, 0.0, 0.5, device=dev)
        elif name.endswith("attn_sink"):
            t = numerics.normal(sp.shape, g, 0.0, 1.0, device=dev)
        elif name.endswith("gate.bias"):
            t = numerics.normal(sp.shape, g, 0.0, 0.05, device=dev)
        else:
            t = numerics.normal(sp.shape, g, 0.0, std, device=dev)
        out[name] = keep(name, _as_param(t, sp, cfg, dt).to(device))
    return out


def _as_param(t: torch.Tensor, sp: Spec, cfg: V4Config, dt: torch.dtype):
    if sp.kind == "f32":
        return t.float()
    if sp.kind == "dense":
        return t.to(dt)
    if sp.kind == "grouped":
        return _grouped_dense(t.to(dt), cfg)
    return Weight.dense(t.to(dt))


# ------------------------------------------------------------------------------------ checkpoints


def read_config(path: str, **overrides) -> V4Config:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    from shuili.core.errors import read_json

    raw = read_json(cfg_path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: expected an object of config fields, got {type(raw).__name__}")
    return V4Config.from_hf(raw, **overrides)


def _e8m0_to_f32(s: torch.Tensor) -> torch.Tensor:
    if s.dtype == torch.float8_e8m0fnu:
        return s.float()
    if s.dtype in (torch.uint8, torch.int8):
        return numerics.pow2(s.view(torch.uint8).to(torch.int64) - 127).to(torch.float32)
    return s.float()


def _e8m0_bytes(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.uint8)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(rd, name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple) -> None:
    check_tensor(name, t.dtype, t.shape, shape, dtypes, getattr(rd, "where", {}).get(name, ""))


def _load_linear(rd: Checkpoint, name: str, shape: tuple[int, int], dt: torch.dtype, dev: str) -> Weight:
    """A float or fp8_block128 2-D linear weight, as stored."""
    w = rd.get(name)
    if w.dtype == torch.float8_e4m3fn:
        _check(rd, name, w, shape, (torch.float8_e4m3fn,))
        sname = name[: -len("weight")] + "scale"
        s = rd.get(sname)
        _check(rd, sname, s, (-(-shape[0] // 128), -(-shape[1] // 128)),
               (torch.float8_e8m0fnu, torch.float32, torch.uint8))
        return Weight("fp8_block128", w.to(dev), _e8m0_to_f32(s).to(dev), tuple(shape))
    _check(rd, name, w, shape, _FLOATS + (torch.float8_e4m3fn,))  # names fp8 as allowed in the message
    return Weight.dense(w.to(device=dev, dtype=dt))


def _load_expert(rd, name: str, shape: tuple[int, int]) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """`rd` needs only get(name) (the V4.1 loader passes its own reader)."""
    w = rd.get(name)
    N, K = shape
    sname = name[: -len("weight")] + "scale"
    if w.dtype in (torch.int8, torch.uint8):
        _check(rd, name, w, (N, K // 2), (torch.int8, torch.uint8))
        s = rd.get(sname)
        _check(rd, sname, s, (N, K // 32), (torch.float8_e8m0fnu, torch.uint8))
        return "mxfp4", w.view(torch.uint8), _e8m0_bytes(s)
    if w.dtype == torch.float8_e4m3fn:
        _check(rd, name, w, shape, (torch.float8_e4m3fn,))
        s = rd.get(sname)
        _check(rd, sname, s, (-(-N // 128), -(-K // 128)), (torch.float8_e8m0fnu, torch.float32, torch.uint8))
        return "fp8_block128", w, _e8m0_to_f32(s)
    _check(rd, name, w, shape, _FLOATS + (torch.float8_e4m3fn, torch.int8, torch.uint8))
    return "dense", w, None


def _stack_experts(rd: Checkpoint, prefix: str, cfg: V4Config, which: str, dt, dev: str,
                   reject=None, num_experts: int | None = None) -> Weight:
    """Stack experts.{j}.w1|w3 into [E, 2I, D] (gate rows then up rows) or experts.{j}.w2 into [E, D, I].
    `reject(name, fmt)`, when given, raises for a stored format the caller cannot read (the V4.1 loader's)."""
    E, I, D = num_experts or cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    parts = ("w1", "w3") if which == "w13" else ("w2",)
    shape = (I, D) if which == "w13" else (D, I)
    datas, scales, fmt = [], [], None
    for j in range(E):
        ds, ss = [], []
        for wname in parts:
            name = f"{prefix}experts.{j}.{wname}.weight"
            f, w, s = _load_expert(rd, name, shape)
            if reject is not None:
                reject(name, f)
            if fmt is None:
                fmt = f
            elif f != fmt:
                raise CheckpointError(f"tensor {name!r} is {f} but earlier experts of this layer are {fmt}")
            ds.append(w.to(dev) if f != "dense" else w.to(device=dev, dtype=dt))
            ss.append(s.to(dev) if s is not None else None)
        datas.append(torch.cat(ds, 0) if len(ds) > 1 else ds[0])
        if fmt != "dense":
            if fmt == "fp8_block128" and len(ss) > 1 and I % 128:
                raise CheckpointError(f"{prefix}experts: fp8 w1/w3 with moe_intermediate_size {I} not a "
                                      "multiple of 128 cannot be stacked")
            scales.append(torch.cat(ss, 0) if len(ss) > 1 else ss[0])
    data = torch.stack(datas)
    full = (E, 2 * I, D) if which == "w13" else (E, D, I)
    return Weight(fmt, data, torch.stack(scales) if scales else None, full)


def load_params(path: str, cfg: V4Config, device: str = "cpu", dtype: str = "float32", with_mtp: bool = False,
                progress: bool = True) -> dict:
    """Read every tensor of `schema(cfg)` (mtp.* only when with_mtp and present). Errors name the tensor."""
    from tqdm import tqdm

    rd = Checkpoint(path)
    dt = getattr(torch, dtype)
    want_mtp = with_mtp and cfg.num_nextn_predict_layers > 0 and rd.has("mtp.0.e_proj.weight")
    sch = schema(cfg, want_mtp)
    out: dict = {}
    for name, sp in tqdm(sch.items(), desc="loading deepseek_v4", disable=not progress, unit="tensor"):
        if sp.kind == "experts":
            prefix = name[: -len("experts.w13")] if name.endswith("w13") else name[: -len("experts.w2")]
            out[name] = _stack_experts(rd, prefix, cfg, name.rsplit(".", 1)[1], dt, device)
        elif sp.kind in ("linear", "grouped"):
            w = _load_linear(rd, name, sp.shape, dt, device)
            out[name] = _grouped(w, cfg, name) if sp.kind == "grouped" else w
        elif sp.kind == "i64":
            out[name] = _expert_ids(rd, name, sp.shape, cfg).to(device)
        else:
            t = rd.get(name, sp.shape, _FLOATS)
            out[name] = t.to(device=device, dtype=torch.float32 if sp.kind == "f32" else dt)
    return out


def _expert_ids(rd, name: str, shape, cfg: V4Config) -> torch.Tensor:
    """tid2eid, checked once here: hash routing indexes the experts with it every step, and neither a
    captured decode graph nor an engine step checks the ids it gives (platforms/nvidia/common.check)."""
    t = rd.get(name, shape, (torch.int64, torch.int32))
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= cfg.n_routed_experts):
        raise CheckpointError(f"tensor {name!r} has expert ids outside [0, {cfg.n_routed_experts})")
    return t.long()


def _grouped(w: Weight, cfg: V4Config, name: str) -> Weight:
    """wo_a [G*r, K] as a grouped weight [G, r, K]."""
    G, r = cfg.o_groups, cfg.o_lora_rank
    if w.format == "dense":
        return Weight.dense(w.data.reshape(G, r, -1))
    if r % 128:
        # the 128-row scale blocks straddle groups: decode to dense (exact: e4m3 x power of two)
        K = w.shape[1]
        s = w.scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: G * r, :K]
        return Weight.dense((w.data.float() * s).reshape(G, r, K))
    return Weight("fp8_block128", w.data.reshape(G, r, -1), w.scale.reshape(G, r // 128, -1),
                  (G, r, w.shape[1]))


# ---------------------------------------------------------------------------------- checkpoint writer
def released_tensors(cfg: V4Config, params: dict) -> dict[str, torch.Tensor]:
    """Flatten assembled params back to the released per-expert tensor names (float weights)."""
    out: dict[str, torch.Tensor] = {}
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    for name, v in params.items():
        t = v.data if isinstance(v, Weight) else v
        if isinstance(v, Weight) and v.format != "dense":
            raise ValueError(f"released_tensors writes float weights only; {name} is {v.format}")
        if name.endswith("experts.w13"):
            p = name[: -len("w13")]
            for j in range(E):
                out[f"{p}{j}.w1.weight"] = t[j, :I].contiguous()
                out[f"{p}{j}.w3.weight"] = t[j, I:].contiguous()
        elif name.endswith("experts.w2"):
            p = name[: -len("w2")]
            for j in range(E):
                out[f"{p}{j}.w2.weight"] = t[j].contiguous()
        elif name.endswith("wo_a.weight"):
            out[name] = t.reshape(-1, t.shape[-1]).contiguous()
        else:
            out[name] = t.contiguous()
    return out


def save_checkpoint(path: str, cfg: V4Config, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Write config.json + safetensors shards (released names) + the HF shard index to `path`."""
    write_checkpoint(path, cfg.to_hf(), tensors, shards)
