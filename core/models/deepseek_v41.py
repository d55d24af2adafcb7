"""DeepSeek-V4.1(-Flash) on the HAL: the causal encoder-decoder (CED) with cross-layer compressed-KV
reuse, the two-level indexer, single-pass mHC and QAT fake-quant (v4_arch.md §2.1, §2.5-2.8).

Per layer: [Engram write into the streams] -> attention site (its own pre/post/comb; the collapse
uses the PREVIOUS site's pre, one-hot stream 0 for the very first) -> FFN site (collapse with the
attention site's pre) -> hand the FFN site's pre on. The final collapse uses the last FFN pre; no
hc_head. Attention: low-rank q (no per-head q norm in V4.1), one K=V latent, interleaved RoPE on
its last channels (compress theta + YaRN on every layer with ratio > 0), window KV fake-quantized to
MXFP8 before it is stored; on ratio > 0 layers the group's shared compressed entries at the index
source's top-k, all in ONE `sparse_attention` softmax with sinks; inverse RoPE; grouped output.
KV sources (role "full") pool their group's entries (ratio 2: per-channel softmax gate over a pair,
ratio 1: no gate), derive indexer keys from the pre-RoPE latent, and publish both once for the
layers after them; index sources ("full", "reindex") score with `indexer_select`, the candidate
source also picking the candidate blocks that restrict every later index source.
Parameter names are transformers' `DeepseekV41ForCausalLM` module names (the loader maps the
released names onto them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shuili.core.model_api import CacheGroupSpec, ForwardBatch, bind_group_caches
from shuili.core.models.deepseek_v41_cache import cache_groups, idx_group, kv_group, state_group
from shuili.core.models.deepseek_v41_config import V41Config, named
from shuili.core.models.deepseek_v41_static import StaticMeta
from shuili.core.models.deepseek_v4 import gate_up, rope_tables, shared_expert
from shuili.core.models.driver import CacheDriver
from shuili.core.models.tokenizer import ByteTokenizer, deepseek_chat
from shuili.hal import DispatchTable, numerics
from shuili.hal.types import Weight


# ------------------------------------------------------------------------------------------ weights
@dataclass
class HC:
    fn: Weight  # float32 dense [m(m+2), m*D]
    base: torch.Tensor
    scale: torch.Tensor


@dataclass
class Compressor:
    w: Weight  # dense [d, D] (ratio 1) or [2d, D]: rows [0, d) kv, [d, 2d) gate
    norm: torch.Tensor  # [d]
    ratio: int


@dataclass
class Indexer:
    q_b: Weight  # [nh * di, q_lora]
    weights_proj: Weight  # [nh, D]
    k_proj: Weight | None = None  # [di, d] (KV sources only)
    k_norm: torch.Tensor | None = None


@dataclass
class Attention:
    role: str
    ratio: int
    q_a: Weight
    q_a_norm: torch.Tensor
    q_b: Weight
    kv_proj: Weight
    kv_norm: torch.Tensor
    o_a: Weight  # grouped, logical [G, o_lora_rank, H*d/G]
    o_b: Weight
    sinks: torch.Tensor  # float32 [H]
    comp: Compressor | None = None
    indexer: Indexer | None = None


@dataclass
class Moe:
    gate: Weight  # float32 dense [E, D]
    bias: torch.Tensor  # e_score_correction_bias float32 [E]
    w13: Weight  # [E, 2I, D]
    w2: Weight  # [E, D, I]
    shared_gate_up: tuple[Weight, ...] | None  # deepseek_v4.gate_up
    shared_down: Weight | None


@dataclass
class EngramWeights:
    wkv: Weight  # [(m + 1) D, n_cols * engram_head_dim]: m keys, then the shared value
    q_weight: torch.Tensor  # float32 [m, D]
    k_weight: torch.Tensor  # float32 [m, D]


@dataclass
class Block:
    attn: Attention
    ffn: Moe
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HC
    hc_ffn: HC
    engram: EngramWeights | None = None


# ------------------------------------------------------------------------------------ batch metadata
@dataclass
class _NewEntries:
    """Compressed entries of one KV source completed in this step: N entries."""

    src: torch.Tensor  # int64 [N, r]: state slots of the source tokens (r > 1) or [N] token rows (r = 1)
    out_slots: torch.Tensor  # int64 [N] slots in the source's kv / idx groups
    positions: torch.Tensor  # int64 [N] rope position = the group's first token
    done: torch.Tensor | None = None  # bool [N] (static decode, deepseek_v41_static.py); None: all complete


class _Meta:
    """Everything derived from a ForwardBatch once and shared by all layers (eager batches only)."""

    def __init__(self, m: "DeepseekV41Model", b: ForwardBatch):
        cfg, dev, P = m.cfg, b.input_ids.device, b.tokens_per_block
        if P != m.tokens_per_block:
            raise ValueError(f"batch tokens_per_block {P} != the {m.tokens_per_block} the caches were bound with")
        if b.static_decode:
            raise ValueError("static decode batches take StaticMeta (deepseek_v41_static.py), not _Meta")
        self.batch, self.P = b, P
        self.pos = b.positions.long()
        self.index_pos = self.pos  # the indexer's positions (StaticMeta: -1 on padding rows)
        self.qsl = b.query_start_loc
        self.ctx = b.context_lens_cpu or b.context_lens.tolist()
        self.sl = b.seq_lens_cpu or b.seq_lens.tolist()
        qsl = b.query_start_loc_cpu or b.query_start_loc.tolist()
        counts = torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)], dtype=torch.int64)
        self.tok_seq = torch.repeat_interleave(torch.arange(len(counts)), counts).to(dev)
        W = cfg.sliding_window
        win_pos = self.pos[:, None] - (W - 1) + torch.arange(W, device=dev)[None]
        self.win_idx = m.ops.paged_slots(b.block_tables["swa_kv"], self.tok_seq[:, None], win_pos, P).int()
        self.new: dict[int, _NewEntries] = {}
        for src in cfg.kv_source_layer_ids:
            r = cfg.ratio(src)
            if r == 1:  # every new token is an entry
                out = m.ops.paged_slots(b.block_tables[kv_group(src)], self.tok_seq, self.pos, P)
                self.new[src] = _NewEntries(torch.arange(len(self.pos), device=dev), out, self.pos)
                continue
            seqs, ents = [], []
            for s, (c, n) in enumerate(zip(self.ctx, self.sl)):
                for e in range(c // r, n // r):
                    seqs.append(s)
                    ents.append(e)
            seq = torch.tensor(seqs, dtype=torch.int64, device=dev)
            ent = torch.tensor(ents, dtype=torch.int64, device=dev)
            toks = ent[:, None] * r + torch.arange(r, device=dev)[None]
            src_slots = m.ops.paged_slots(b.block_tables[state_group(src)], seq[:, None], toks, P)
            out = m.ops.paged_slots(b.block_tables[kv_group(src)], seq, ent, P // r)
            self.new[src] = _NewEntries(src_slots, out, ent * r)


@dataclass
class _Shared:
    """What the layers of one forward hand on: the last index source's top-k (as slots of its
    group's kv pool) and the candidate source's blocks."""

    topk: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- model
class DeepseekV41Model:
    """Implements `shuili.core.model_api.Model` for DeepSeek-V4.1 checkpoints and random configs."""

    @property
    def supports_static_decode(self) -> bool:
        """Decode steps replay as device graphs (StaticMeta; Engram rows through device-mapped
        tables, `Engram.static_rows`): always without Engram, else where the tables can be mapped."""
        return self.engram is None or self.engram.static_capable

    def attach_transfer(self, transfer) -> None:
        """The engine hands over its platform's transfer service: Engram uploads through it, and
        static (graph) decode on an accelerator needs its `map_host` to read the tables' host pages."""
        if self.engram is not None:
            self.engram.transfer = transfer

    def __init__(self, cfg: V41Config, ops: DispatchTable, params: dict, device: str = "cpu",
                 dtype: str = "float32", max_model_len: int | None = None, tokenizer=None, engram=None,
                 with_dspark: bool = False):
        self.cfg, self.ops, self.device, self.dtype_name = cfg, ops, device, dtype
        self.dtype = getattr(torch, dtype)
        self.vocab_size = cfg.vocab_size
        self.max_model_len = min(max_model_len or 131072, cfg.max_position_embeddings)
        # a 256-id random model (tiny-v41) keeps every byte: its specials share ids 0-2 with control bytes
        self.tokenizer = tokenizer or ByteTokenizer(cfg.vocab_size, offset=0 if cfg.vocab_size < 259 else 3,
                                                    bos_token_id=cfg.bos_token_id, eos_token_ids=cfg.eos_token_ids)
        self.embed = params["model.embed_tokens.weight"]
        self.head = _w(params["model.embed_tokens.weight"] if cfg.tie_word_embeddings else params["lm_head.weight"])
        self.norm = params["model.norm.weight"]
        self.blocks = [_block(cfg, params, i) for i in range(cfg.num_hidden_layers)]
        # host-memory Engram tables, hashing and the per-step gather (core/models/engram.py)
        if cfg.engram_layer_ids and engram is None:
            raise ValueError(f"engram_layer_ids {list(cfg.engram_layer_ids)} need the Engram service (tables and "
                             "token map): build the model with build() / load_checkpoint()")
        self.engram = engram if cfg.engram_layer_ids else None
        self.engram_lookback = self.engram.lookback if self.engram is not None else 0  # the runner reads it
        n = self.max_model_len
        self.rope = {False: tuple(t.to(device) for t in rope_tables(cfg, False, n)),
                     True: tuple(t.to(device) for t in rope_tables(cfg, True, n))}
        self.caches: dict[str, dict[int, torch.Tensor]] = {}
        self.tokens_per_block = 0
        # DSpark draft layers (core/models/deepseek_v41_dspark.py), built only when asked for
        self.dspark = None
        self.last_hidden: torch.Tensor | None = None  # [T, n_taps * D] the draft layers' input, keep_hidden
        if with_dspark:
            from shuili.core.models.deepseek_v41_dspark import DSpark, dspark_weights

            if cfg.num_nextn_predict_layers <= 0:
                raise ValueError("this DeepSeek-V4.1 config has num_nextn_predict_layers = 0: no DSpark draft layers")
            self.dspark = DSpark(self, dspark_weights(cfg, params))

    # ---------------------------------------------------------------- Model protocol
    def cache_groups(self) -> list[CacheGroupSpec]:
        return cache_groups(self.cfg, self.dtype_name,
                            self.cfg.num_nextn_predict_layers if self.dspark is not None else 0)

    def bind_caches(self, caches: dict[str, list[torch.Tensor]], tokens_per_block: int) -> None:
        self.caches.update(bind_group_caches(self.cache_groups(), caches, tokens_per_block))
        self.tokens_per_block = tokens_per_block

    def apply_chat_template(self, prompt: str) -> str:
        return deepseek_chat(self.tokenizer, prompt)

    def forward(self, batch: ForwardBatch, keep_hidden: bool = False) -> torch.Tensor:
        """float32 logits [len(logits_indices), vocab]. keep_hidden: `last_hidden` = the DSpark taps
        (each tap layer's input streams, mean over the streams), concatenated [T, n_taps * D]."""
        if not self.caches:
            raise RuntimeError("bind_caches() must be called before forward()")
        ops, cfg = self.ops, self.cfg
        meta = StaticMeta(self, batch) if batch.static_decode else _Meta(self, batch)
        h = self._embed(batch.input_ids)
        m = cfg.hc_mult
        x = h[:, None, :].expand(-1, m, -1).contiguous()  # [T, m, D] residual streams
        pre = torch.zeros(x.shape[0], m, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0  # the first site reads stream 0
        rows = self.engram.step(batch) if self.engram is not None else None  # gather starts now
        shared = _Shared()
        taps = {}
        for i, blk in enumerate(self.blocks):
            if blk.engram is not None:  # before the layer's first mHC site
                kv = self._engram_kv(rows.get(i), blk.engram)
                x = ops.engram_gate(x, kv, blk.engram.q_weight, blk.engram.k_weight, cfg.rms_norm_eps)
            if keep_hidden and i in cfg.dspark_taps:
                taps[i] = (numerics.tree_sum(x.float(), dim=1) / m).to(self.dtype)
            x, pre = self._block(blk, i, x, pre, meta, shared)
        self.last_hidden = torch.cat([taps[i] for i in cfg.dspark_taps], dim=-1) if keep_hidden else None
        x = x[batch.logits_indices]
        u = ops.hc_collapse(x, pre[batch.logits_indices])  # the streams are in self.dtype: no second cast
        return self._logits(ops.rms_norm(u, self.norm, cfg.rms_norm_eps))

    # the three places a tensor-parallel subclass (core/parallel/model_v41.py) gathers its shards
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embedding(ids, self.embed)

    def _engram_kv(self, rows: torch.Tensor, e: EngramWeights) -> torch.Tensor:
        return self.ops.linear(rows, e.wkv)  # [T, (m + 1) D]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(h, self.head).float()

    def engram_prefetch(self, ids, history) -> None:
        """The runner's hint: a prefill's next chunk (all ids known) can be gathered now."""
        if self.engram is not None:
            self.engram.prefetch(ids, history)

    # ---------------------------------------------------------------- pieces
    def _block(self, blk: Block, layer: int, x: torch.Tensor, pre: torch.Tensor, meta: _Meta, shared: _Shared):
        ops, eps = self.ops, self.cfg.rms_norm_eps
        pre_a, post, comb = self._hc(blk.hc_attn, x)
        a = self._attention(blk.attn, layer, ops.rms_norm(ops.hc_collapse(x, pre), blk.attn_norm, eps), meta, shared)
        x = ops.hc_expand(a, x, post, comb)
        pre_f, post, comb = self._hc(blk.hc_ffn, x)
        f = self._moe(blk.ffn, ops.rms_norm(ops.hc_collapse(x, pre_a), blk.ffn_norm, eps))
        return ops.hc_expand(f, x, post, comb), pre_f

    def _hc(self, hc: HC, x: torch.Tensor):
        cfg = self.cfg
        return self.ops.hc_mix(x, hc.fn, hc.scale, hc.base, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                               cfg.rms_norm_eps)

    def _moe(self, p: Moe, x: torch.Tensor) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        logits = ops.linear(x.float(), p.gate).float()
        if cfg.gate_temp != 1.0:
            logits = logits / cfg.gate_temp
        w, idx = ops.moe_route_topk(logits, p.bias, cfg.num_experts_per_tok, cfg.scoring_func,
                                    cfg.norm_topk_prob, cfg.routed_scaling_factor)
        y = ops.moe_experts(x, idx, w, p.w13, p.w2, cfg.swiglu_limit)
        if p.shared_gate_up is not None:
            y = y + shared_expert(ops, x, p.shared_gate_up, p.shared_down, cfg.swiglu_limit)
        return y

    def _fake_quant(self, rows: torch.Tensor, fmt: str) -> torch.Tensor:
        """QAT: the values a `fmt` row stores (rows [N, D]); rows whose width the format cannot
        block pass through, as in the reference."""
        from shuili.hal.formats import kv_spec

        if rows.shape[0] == 0 or rows.shape[-1] % kv_spec(fmt)[1]:
            return rows
        ops = self.ops
        return ops.kv_dequantize(ops.kv_quantize(rows, fmt), fmt, rows.shape[-1]).to(rows.dtype)

    def _store(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fmt: str) -> None:
        """rows are already fake-quantized: packing them again is exact."""
        self.ops.kv_write(cache, slots, rows, fmt)

    def _attention(self, p: Attention, layer: int, x: torch.Tensor, meta: _Meta, shared: _Shared) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        T, H, d, r = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        cos, sin = self.rope[p.ratio > 0]
        pos = meta.pos
        qr = ops.rms_norm(ops.linear(x, p.q_a), p.q_a_norm, cfg.rms_norm_eps)
        q = ops.rope(ops.linear(qr, p.q_b).view(T, H, d), pos, cos, sin, r, may_overwrite=True)
        kv = ops.rms_norm_rope(ops.linear(x, p.kv_proj).view(T, 1, d), p.kv_norm, cfg.rms_norm_eps, pos, cos,
                               sin, r)
        kv = self._fake_quant(kv.reshape(T, d), "mxfp8")
        win = self.caches["swa_kv"][layer]
        self._store(win, meta.batch.slot_mapping["swa_kv"], kv, cfg.window_kv_format)
        kvs, idxs, fmts = [win], [meta.win_idx], [cfg.window_kv_format]
        if p.ratio > 0:
            src = cfg.kv_source_of(layer)
            if p.role == "full":
                self._compress(p.comp, p.indexer, src, x, meta)
            if p.role in ("full", "reindex"):
                self._index(p.indexer, layer, src, x, qr, meta, shared)
            if shared.topk is not None and shared.topk.shape[1]:
                kvs.append(self.caches[kv_group(src)][src])
                idxs.append(shared.topk)
                fmts.append(cfg.compressed_kv_format)
        o = ops.sparse_attention(q, kvs, idxs, d ** -0.5, p.sinks, fmts)
        o = ops.rope(o, pos, cos, sin, r, inverse=True, may_overwrite=True)
        # o_a [G, o_lora_rank, H*d/G]: one block per group of heads
        return ops.linear(ops.block_diagonal_linear(o.reshape(T, H * d), p.o_a), p.o_b)

    def _compress(self, c: Compressor, ix: Indexer, src: int, x: torch.Tensor, meta: _Meta) -> None:
        """Pool the entries source `src` completes this step; publish their indexer keys (from the
        pre-RoPE latent) and their rotated, FP4-rounded latents to the group's pools."""
        ops, cfg = self.ops, self.cfg
        d, new = cfg.head_dim, meta.new[src]
        if c.ratio == 1:
            latent = ops.linear(x, c.w)
        else:
            proj = ops.linear(x.float(), c.w).float()  # [T, 2d]: kv | gate, float32 as the reference
            state = self.caches[state_group(src)][src]
            self.ops.cache_write(state, meta.batch.slot_mapping[state_group(src)], proj)
            if new.out_slots.numel() == 0:
                return
            # static decode: a row that completes no entry has out slot -1; the op reads nothing for
            # it and returns zeros, which are never stored
            latent = ops.compress_pool(state.view(-1, 2 * d), new.src, new.out_slots, 0, d, False).to(self.dtype)
        if new.out_slots.numel() == 0:
            return
        latent = ops.rms_norm(latent, c.norm, cfg.rms_norm_eps)
        cos, sin = self.rope[True]
        rr = cfg.qk_rope_head_dim
        k = ops.rms_norm_rope(ops.linear(latent, ix.k_proj).unsqueeze(1), ix.k_norm, cfg.rms_norm_eps,
                              new.positions, cos, sin, rr)
        k = self._fake_quant(k.squeeze(1), "mxfp4")
        self._store(self.caches[idx_group(src)][src], new.out_slots, k, cfg.indexer_k_format)
        main = ops.rope(latent.unsqueeze(1), new.positions, cos, sin, rr).squeeze(1)
        main = self._fake_quant(main, "fp4_e4m3")
        self._store(self.caches[kv_group(src)][src], new.out_slots, main, cfg.compressed_kv_format)

    def _index(self, ix: Indexer, layer: int, src: int, x: torch.Tensor, qr: torch.Tensor, meta: _Meta,
               shared: _Shared) -> None:
        ops, cfg = self.ops, self.cfg
        T, nh, di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
        cos, sin = self.rope[True]
        q = ops.rope(ops.linear(qr, ix.q_b).view(T, nh, di), meta.pos, cos, sin, cfg.qk_rope_head_dim,
                     may_overwrite=True)
        q = self._fake_quant(q.reshape(T * nh, di), "mxfp4").view(T, nh, di)
        w = ops.linear(x, ix.weights_proj).float() * (nh ** -0.5 * di ** -0.5)
        cand_src = cfg.candidate_source_layer_id
        is_cand = layer == cand_src
        pool = shared.candidates if 0 <= cand_src < layer else None
        ratio = cfg.ratio(src)
        ids, cand = ops.indexer_select(q, w, self.caches[idx_group(src)][src], meta.batch.block_tables[idx_group(src)],
                                       meta.qsl, meta.index_pos, ratio, cfg.index_topk, cfg.indexer_k_format,
                                       pool, cfg.candidate_topk_blocks if is_cand else 0, cfg.candidate_block_size)
        if is_cand:
            shared.candidates = cand
        shared.topk = ops.paged_slots(meta.batch.block_tables[kv_group(src)], meta.tok_seq[:, None], ids,
                                      meta.P // ratio).int()

    # ---------------------------------------------------------------- convenience
    def driver(self, max_seqs: int = 1, max_len: int | None = None, tokens_per_block: int | None = None,
               device: str | None = None) -> CacheDriver:
        """Allocate caches with contiguous block tables and bind them (tests, benchmarks, no engine)."""
        return CacheDriver(self, max_seqs, max_len or self.max_model_len, tokens_per_block, device)


def _w(t) -> Weight:
    return t if isinstance(t, Weight) else Weight.dense(t)


def _hc(params: dict, p: str) -> HC:
    return HC(_w(params[p + "fn"]), params[p + "base"], params[p + "scale"])


def _block(cfg: V41Config, params: dict, i: int) -> Block:
    p = f"model.layers.{i}."
    a = p + "self_attn."
    role, ratio = cfg.role(i), cfg.ratio(i)
    attn = Attention(role, ratio, params[a + "q_a_proj.weight"], params[a + "q_a_norm.weight"],
                     params[a + "q_b_proj.weight"], params[a + "kv_proj.weight"], params[a + "kv_norm.weight"],
                     params[a + "o_a_proj.weight"], params[a + "o_b_proj.weight"], params[a + "sinks"])
    if role == "full":
        c = a + "compressor."
        w = _w(params[c + "kv_proj.weight"]).data
        if ratio > 1:
            w = torch.cat([w, _w(params[c + "gate_proj.weight"]).data], dim=0)
        attn.comp = Compressor(Weight.dense(w), params[c + "kv_norm.weight"], ratio)
    if role in ("full", "reindex"):
        x = a + "indexer."
        attn.indexer = Indexer(params[x + "q_b_proj.weight"], _w(params[x + "weights_proj.weight"]),
                               _w(params[x + "k_proj.weight"]) if role == "full" else None,
                               params[x + "k_norm.weight"] if role == "full" else None)
    f = p + "mlp."
    sh = cfg.n_shared_experts > 0
    ffn = Moe(_w(params[f + "gate.weight"]), params[f + "gate.e_score_correction_bias"],
              params[f + "experts.gate_up_proj"], params[f + "experts.down_proj"],
              gate_up(params[f + "shared_experts.gate_proj.weight"],
                      params[f + "shared_experts.up_proj.weight"]) if sh else None,
              params[f + "shared_experts.down_proj.weight"] if sh else None)
    eng = None
    if i in cfg.engram_layer_ids:
        e = p + "engram."
        eng = EngramWeights(_w(params[e + "wkv.weight"]), params[e + "q_weight"], params[e + "k_weight"])
    return Block(attn, ffn, params[p + "input_layernorm.weight"], params[p + "post_attention_layernorm.weight"],
                 _hc(params, p + "attn_hc."), _hc(params, p + "ffn_hc."), eng)


# --------------------------------------------------------------------------------------- entry points
def build(name: str, ops: DispatchTable, device: str = "cpu", dtype: str = "float32", seed: int = 0,
          max_model_len: int | None = None, with_dspark: bool = False, **overrides) -> DeepseekV41Model:
    """A named config (tiny-v41, mid-v41) with seeded random weights generated on `device`
    (with_dspark: also the DSpark draft layers, from their own RNG stream)."""
    from shuili.core.models.deepseek_v41_loader import random_dspark_params, random_engram, random_params

    cfg = named(name, **overrides)
    params = random_params(cfg, device=device, dtype=dtype, seed=seed)
    if with_dspark:
        params.update(random_dspark_params(cfg, device=device, dtype=dtype, seed=seed))
    engram = random_engram(cfg, ops, device=device, dtype=dtype, seed=seed)
    return DeepseekV41Model(cfg, ops, params, device=device, dtype=dtype, max_model_len=max_model_len,
                            engram=engram, with_dspark=with_dspark)


def load_checkpoint(path: str, ops: DispatchTable, device: str = "cpu", dtype: str = "float32",
                    max_model_len: int | None = None, progress: bool = True, with_dspark: bool = False,
                    weight_formats=None, **overrides) -> DeepseekV41Model:
    """A directory of config.json + safetensors (released or transformers tensor names); with_dspark
    also reads the mtp.* DSpark draft layers. weight_formats: the weight formats the platform's
    linear / grouped_linear declare (`deepseek_v41_loader.gemm_weight_formats`); FP8 linears in a
    format outside it are decoded at load. None keeps every stored contract format."""
    from shuili.core.models.deepseek_v41_loader import load_engram, load_params, read_config
    from shuili.core.models.tokenizer import load_tokenizer

    cfg = read_config(path, **overrides)
    params = load_params(path, cfg, device=device, dtype=dtype, progress=progress,
                         with_dspark=with_dspark, weight_formats=weight_formats)
    import os

    # without tokenizer.json the model's byte tokenizer (which also fits a 256-id vocabulary)
    tok = (load_tokenizer(path, cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)
           if os.path.isfile(os.path.join(path, "tokenizer.json")) else None)
    engram = load_engram(path, cfg, tok, ops, device=device, dtype=dtype)
    return DeepseekV41Model(cfg, ops, params, device=device, dtype=dtype, max_model_len=max_model_len,
                            tokenizer=tok, engram=engram, with_dspark=with_dspark)
