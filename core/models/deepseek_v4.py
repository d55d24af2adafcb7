"""DeepSeek-V4(-Flash) on the HAL: every GEMM, norm, rope, routing, cache write and attention is a
`DispatchTable` op; what stays in plain torch is row-wise glue (views, gathers, elementwise math and
reductions along a row's own fixed-size dims), so a token's bits do not depend on its batch.

Per layer (v4_arch.md §2): mHC collapse -> attn_norm -> attention -> mHC expand, then the same around
the MoE. Attention: low-rank q with a per-head unweighted q norm, one shared K=V latent with
interleaved RoPE on its last qk_rope_head_dim channels, a sliding window of raw latents plus, on CSA
layers, the indexer's top-k compressed entries and, on HCA layers, every visible compressed entry, all
in ONE `sparse_attention` softmax with per-head sinks; the output's rope slice is rotated back at the
query position before the grouped output projection.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from shuili.core.model_api import CacheGroupSpec, ForwardBatch, bind_group_caches
from shuili.core.models.deepseek_v4_cache import cache_groups
from shuili.core.models.deepseek_v4_config import V4Config, named
from shuili.core.models.driver import CacheDriver
from shuili.core.models.tokenizer import ByteTokenizer, deepseek_chat
from shuili.hal import DispatchTable, numerics
from shuili.hal.types import Weight


# ------------------------------------------------------------------------------------------ weights
@dataclass
class HC:
    fn: Weight  # float32 dense [m(m+2), m*D] (or [m, m*D] for a head)
    base: torch.Tensor
    scale: torch.Tensor
    # a head's (one scale) base and scale as hc_split_sinkhorn's [m(m+2)] and [3]: zeros after its m
    # pre columns, ones after its scale; built once, not in every step's logits
    sinkhorn_base: torch.Tensor | None = field(default=None, init=False)
    sinkhorn_scale: torch.Tensor | None = field(default=None, init=False)

    def __post_init__(self):
        if self.scale.numel() == 1:
            m = self.base.numel()
            dev = self.base.device
            self.sinkhorn_base = torch.cat([self.base.float(), torch.zeros(m * (m + 1), device=dev)])
            self.sinkhorn_scale = torch.cat([self.scale.float().reshape(1), torch.ones(2, device=dev)])


@dataclass
class Compressor:
    w: Weight  # dense [2 * coff * dim, D]: rows [0, coff*dim) kv, then gate
    ape: torch.Tensor  # float32 [ratio, coff * dim]
    norm: torch.Tensor  # float32 [dim]
    dim: int
    ratio: int
    coff: int
    # float32 [ratio, 2 * coff * dim]: -0.0 over the kv columns, then ape. x + -0.0 is x bit for bit
    # (+0, -0, inf and NaN included), so one add writes kv | gate + ape with no copy of the kv half
    ape_row: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.ape_row = torch.cat([torch.full_like(self.ape, -0.0), self.ape], dim=1)


@dataclass
class Indexer:
    wq_b: Weight
    weights_proj: Weight
    comp: Compressor


@dataclass
class Attention:
    kind: str
    wq_a: Weight
    q_norm: torch.Tensor
    wq_b: Weight
    wkv: Weight
    kv_norm: torch.Tensor
    wo_a: Weight  # grouped, logical [G, o_lora_rank, H*d/G]
    wo_b: Weight
    sink: torch.Tensor  # float32 [H]
    comp: Compressor | None = None
    indexer: Indexer | None = None


@dataclass
class Moe:
    gate: Weight  # float32 dense [E, D]
    bias: torch.Tensor | None
    tid2eid: torch.Tensor | None
    w13: Weight  # [E, 2I, D]
    w2: Weight  # [E, D, I]
    shared_w13: tuple[Weight, ...] | None  # see gate_up
    shared_w2: Weight | None


@dataclass
class Block:
    attn: Attention
    ffn: Moe
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HC
    hc_ffn: HC


@dataclass
class Mtp:
    block: Block
    e_proj: Weight
    h_proj: Weight
    enorm: torch.Tensor
    hnorm: torch.Tensor
    norm: torch.Tensor
    hc_head: HC


# -------------------------------------------------------------------------------------------- rope
def rope_tables(cfg: V4Config, compressed: bool, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [max_len, rope_dim/2]; YaRN (no mscale) only on compressed layers' tables.
    Computed on the CPU in float32 like HF's `pos.float() * inv_freq`, with pow, log, sin and cos
    from `hal.numerics`, so every platform and every host gets the same bits.
    """
    r = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    inv = 1.0 / numerics.pow_f32(base, torch.arange(0, r, 2, dtype=torch.int64).float() / r)
    if compressed and cfg.yarn is not None:
        y = cfg.yarn

        def log(v: float) -> float:
            return float(numerics.log64(torch.tensor(v, dtype=torch.float64)))

        def corr(rot: float) -> float:
            return (r * log(y.original_max_position_embeddings / (rot * 2 * math.pi))) / (2 * log(base))

        low, high = max(math.floor(corr(y.beta_fast)), 0), min(math.ceil(corr(y.beta_slow)), r - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extra = 1 - ramp
        inv = (inv / y.factor) * (1 - extra) + inv * extra
    return numerics.rotary_tables(torch.arange(max_len, dtype=torch.int64), inv)


# ------------------------------------------------------------------------------------ batch metadata
@dataclass
class _NewEntries:
    """Compressed entries completed in this step for one ratio: N entries."""

    src_slots: torch.Tensor  # int64 [N, span] state-group slots of the source tokens (-1: before the sequence)
    out_slots: torch.Tensor  # int64 [N] compressed-group slots
    positions: torch.Tensor  # int64 [N] rope position = the block's first token


class _Meta:
    """Everything derived from a ForwardBatch once and shared by all layers.

    Eager batches use the host lists for exact sizes; a static decode batch (graph capture) derives
    everything on the device with sizes fixed by the tensors' shapes: each token may complete one
    compressed entry per ratio (out slot -1 when it does not) and the HCA index width is every entry
    the block table can hold (-1 past the visible ones). Padding changes no bits: the ops are
    row-wise and skip -1 indices.
    """

    def __init__(self, m: "DeepseekV4Model", b: ForwardBatch):
        cfg, dev, P = m.cfg, b.input_ids.device, b.tokens_per_block
        if P != m.tokens_per_block:
            raise ValueError(f"batch tokens_per_block {P} != the {m.tokens_per_block} the caches were bound with")
        self.batch, self.P = b, P
        self.pos = b.positions.long()
        self.qsl = b.query_start_loc
        if b.static_decode:
            self.tok_seq = torch.arange(len(self.pos), device=dev)
        else:
            self.ctx = b.context_lens_cpu or b.context_lens.tolist()
            self.sl = b.seq_lens_cpu or b.seq_lens.tolist()
            qsl = b.query_start_loc_cpu or b.query_start_loc.tolist()
            counts = torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)], dtype=torch.int64)
            self.tok_seq = torch.repeat_interleave(torch.arange(len(counts)), counts).to(dev)
        W = cfg.sliding_window
        win_pos = self.pos[:, None] - (W - 1) + torch.arange(W, device=dev)[None]
        self.win_idx = m.ops.paged_slots(b.block_tables["swa_kv"], self.tok_seq[:, None], win_pos, P).int()
        self.new: dict[str, _NewEntries] = {}
        self.pos_mod: dict[int, torch.Tensor] = {}  # ratio -> pos % ratio, the compressors' ape rows
        for kind, ratio in (("csa", cfg.csa_ratio), ("hca", cfg.hca_ratio)):
            if cfg.layers_of(kind):
                seq, ent, done = self._completed(b, ratio)
                self.new[kind] = _new_entries(m.ops, b, kind, ratio, seq, ent, done)
                self.pos_mod[ratio] = self.pos % ratio
        self.hca_idx = None
        if cfg.layers_of("hca"):
            r = cfg.hca_ratio
            vis = torch.div(self.pos + 1, r, rounding_mode="floor")
            if b.static_decode:
                n = b.block_tables["hca_kv"].shape[1] * (P // r)
            else:
                n = max([s // r for s in self.sl] + [0])
            e = torch.arange(n, device=dev)[None].expand(len(self.pos), n)
            idx = m.ops.paged_slots(b.block_tables["hca_kv"], self.tok_seq[:, None], e, P // r)
            self.hca_idx = torch.where(e < vis[:, None], idx, torch.full_like(idx, -1)).int()

    def _completed(self, b: ForwardBatch, ratio: int):
        """(seq, entry, done) of the compressed entries this step completes: int64 [N] each."""
        if b.static_decode:
            nxt = self.pos + 1
            ent = torch.div(nxt, ratio, rounding_mode="floor") - 1
            return self.tok_seq, ent.clamp(min=0), (nxt % ratio == 0) & (ent >= 0)
        seqs, ents = [], []
        for s, (c, n) in enumerate(zip(self.ctx, self.sl)):
            for e in range(c // ratio, n // ratio):
                seqs.append(s)
                ents.append(e)
        dev = b.input_ids.device
        seq = torch.tensor(seqs, dtype=torch.int64, device=dev)
        return seq, torch.tensor(ents, dtype=torch.int64, device=dev), None


def _new_entries(ops, b: ForwardBatch, kind: str, ratio: int, seq: torch.Tensor, ent: torch.Tensor,
                 done: torch.Tensor | None) -> _NewEntries:
    first = -ratio if kind == "csa" else 0  # CSA pools the previous block's Ca half too
    span = ratio - first
    src = ent[:, None] * ratio + first + torch.arange(span, device=ent.device)[None]
    src_slots = ops.paged_slots(b.block_tables[f"{kind}_state"], seq[:, None], src, b.tokens_per_block)
    out = ops.paged_slots(b.block_tables[f"{kind}_kv"], seq, ent, b.tokens_per_block // ratio)
    if done is not None:
        out = torch.where(done, out, torch.full_like(out, -1))
    return _NewEntries(src_slots, out, ent * ratio)


# ------------------------------------------------------------------------------------------- model
class DeepseekV4Model:
    """Implements `shuili.core.model_api.Model` for DeepSeek-V4 checkpoints and random configs."""

    supports_static_decode = True

    def __init__(self, cfg: V4Config, ops: DispatchTable, params: dict, device: str = "cpu",
                 dtype: str = "float32", max_model_len: int | None = None, tokenizer=None, with_mtp: bool = False):
        self.cfg, self.ops, self.device, self.dtype_name = cfg, ops, device, dtype
        self.dtype = getattr(torch, dtype)
        self.vocab_size = cfg.vocab_size
        self.max_model_len = min(max_model_len or 131072, cfg.max_position_embeddings)
        self.tokenizer = tokenizer or ByteTokenizer(cfg.vocab_size, bos_token_id=cfg.bos_token_id,
                                                    eos_token_ids=cfg.eos_token_ids)
        self.with_mtp = with_mtp and cfg.num_nextn_predict_layers > 0
        self.embed = params["embed.weight"]
        self.head = _w(params["embed.weight"] if cfg.tie_word_embeddings else params["head.weight"])
        self.norm = params["norm.weight"]
        self.hc_head = _hc(params, "hc_head_")
        self.blocks = [_block(cfg, params, f"layers.{i}.", cfg.attn_kinds[i], cfg.mlp_kinds[i])
                       for i in range(cfg.num_hidden_layers)]
        self.mtp = None
        if cfg.num_nextn_predict_layers and "mtp.0.e_proj.weight" in params:
            p = "mtp.0."
            self.mtp = Mtp(_block(cfg, params, p, "swa", "topk"), params[p + "e_proj.weight"],
                           params[p + "h_proj.weight"], params[p + "enorm.weight"], params[p + "hnorm.weight"],
                           params[p + "norm.weight"],
                           _hc(params, p + "hc_head_"))
        n = self.max_model_len
        self.rope = {False: tuple(t.to(device) for t in rope_tables(cfg, False, n)),
                     True: tuple(t.to(device) for t in rope_tables(cfg, True, n))}
        self.caches: dict[str, dict[int, torch.Tensor]] = {}
        self.tokens_per_block = 0
        self.last_hidden: torch.Tensor | None = None  # [T, m, D] pre-head streams of the last forward

    # ---------------------------------------------------------------- Model protocol
    def cache_groups(self) -> list[CacheGroupSpec]:
        return cache_groups(self.cfg, self.dtype_name, self.with_mtp)

    def bind_caches(self, caches: dict[str, list[torch.Tensor]], tokens_per_block: int) -> None:
        self.caches.update(bind_group_caches(self.cache_groups(), caches, tokens_per_block))
        self.tokens_per_block = tokens_per_block

    def apply_chat_template(self, prompt: str) -> str:
        return deepseek_chat(self.tokenizer, prompt)

    def forward(self, batch: ForwardBatch, keep_hidden: bool = False) -> torch.Tensor:
        """float32 logits [len(logits_indices), vocab]."""
        if not self.caches:
            raise RuntimeError("bind_caches() must be called before forward()")
        ops, cfg = self.ops, self.cfg
        meta = _Meta(self, batch)
        h = ops.embedding(batch.input_ids, self.embed)
        x = h[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()  # [T, m, D] residual streams
        for i, blk in enumerate(self.blocks):
            x = self._block(blk, i, x, meta, batch.input_ids)
        self.last_hidden = x if keep_hidden else None
        return self._logits(x[batch.logits_indices], self.hc_head, self.norm)

    def forward_mtp(self, batch: ForwardBatch, hidden: torch.Tensor, keep_hidden: bool = False) -> torch.Tensor:
        """The MTP block: batch.input_ids are the NEXT tokens (t+1) at positions t, hidden [T, m, D]
        the main model's pre-head streams at t; returns logits for t+2 at logits_indices.
        keep_hidden: `last_mtp_hidden` = the block's output streams at logits_indices (the hidden a
        chained MTP step at t+1 reads, core/spec/mtp.py)."""
        if self.mtp is None or not self.with_mtp:
            raise RuntimeError("this model was built without its MTP block (with_mtp=False or no mtp.* weights)")
        ops, cfg, mt = self.ops, self.cfg, self.mtp
        meta = _Meta(self, batch)
        e = ops.rms_norm(ops.embedding(batch.input_ids, self.embed), mt.enorm, cfg.rms_norm_eps)
        T, m, D = hidden.shape
        hn = ops.rms_norm(hidden.reshape(T * m, D), mt.hnorm, cfg.rms_norm_eps)
        x = ops.linear(e, mt.e_proj)[:, None, :] + ops.linear(hn, mt.h_proj).view(T, m, D)
        x = self._block(mt.block, cfg.num_hidden_layers, x, meta, batch.input_ids)
        self.last_mtp_hidden = x[batch.logits_indices] if keep_hidden else None
        return self._logits(x[batch.logits_indices], mt.hc_head, mt.norm)

    # ---------------------------------------------------------------- pieces
    def _logits(self, x: torch.Tensor, hc: HC, norm: torch.Tensor) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        T, m, D = x.shape
        flat = ops.rms_norm(x.reshape(T, m * D).float(), None, cfg.rms_norm_eps)
        mix = ops.linear(flat, hc.fn).float()  # [T, m]
        # pre = sigmoid(mix * scale + base) + eps is the first output of the mHC op; going through
        # it keeps the transcendental off torch's CPU kernels, whose bits depend on a row's place
        # in the buffer (vector body vs scalar tail)
        mix = torch.nn.functional.pad(mix, (0, m * (m + 1)))
        pre = ops.hc_split_sinkhorn(mix, hc.sinkhorn_scale, hc.sinkhorn_base, m, 1, cfg.hc_eps)[0]
        y = ops.hc_collapse(x, pre)  # the streams are in self.dtype, so no second cast
        return ops.linear(ops.rms_norm(y, norm, cfg.rms_norm_eps), self.head).float()

    def _hc_pre(self, hc: HC, x: torch.Tensor):
        ops, cfg = self.ops, self.cfg
        pre, post, comb = ops.hc_mix(x, hc.fn, hc.scale, hc.base, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                     cfg.rms_norm_eps)
        return ops.hc_collapse(x, pre), post, comb  # [T, D]

    def _block(self, blk: Block, layer: int, x: torch.Tensor, meta: _Meta, ids: torch.Tensor) -> torch.Tensor:
        ops, eps = self.ops, self.cfg.rms_norm_eps
        u, post, comb = self._hc_pre(blk.hc_attn, x)
        a = self._attention(blk.attn, layer, ops.rms_norm(u, blk.attn_norm, eps), meta)
        x = ops.hc_expand(a, x, post, comb)
        u, post, comb = self._hc_pre(blk.hc_ffn, x)
        f = self._moe(blk.ffn, ops.rms_norm(u, blk.ffn_norm, eps), ids)
        return ops.hc_expand(f, x, post, comb)

    def _moe(self, p: Moe, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        logits = ops.linear(x.float(), p.gate).float()
        if p.tid2eid is not None:
            w, idx = ops.moe_route_hash(logits, ids, p.tid2eid, cfg.scoring_func, cfg.norm_topk_prob,
                                        cfg.routed_scaling_factor)
        else:
            w, idx = ops.moe_route_topk(logits, p.bias, cfg.num_experts_per_tok, cfg.scoring_func,
                                        cfg.norm_topk_prob, cfg.routed_scaling_factor)
        y = ops.moe_experts(x, idx, w, p.w13, p.w2, cfg.swiglu_limit)
        if p.shared_w13 is not None:
            y = y + shared_expert(ops, x, p.shared_w13, p.shared_w2, cfg.swiglu_limit)
        return y

    def _attention(self, p: Attention, layer: int, x: torch.Tensor, meta: _Meta) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        T, H, d, r = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        cos, sin = self.rope[p.kind != "swa"]
        pos = meta.pos
        qr = ops.rms_norm(ops.linear(x, p.wq_a), p.q_norm, cfg.rms_norm_eps)
        q = ops.rms_norm_rope(ops.linear(qr, p.wq_b).view(T, H, d), None, cfg.rms_norm_eps, pos, cos, sin, r)
        kv = ops.rms_norm_rope(ops.linear(x, p.wkv).view(T, 1, d), p.kv_norm, cfg.rms_norm_eps, pos, cos, sin,
                               r).reshape(T, d)
        win = self.caches["swa_kv"][layer]
        self._write(win, meta.batch.slot_mapping["swa_kv"], kv, cfg.window_kv_format)
        kvs, idxs, fmts = [win], [meta.win_idx], [cfg.window_kv_format]
        if p.kind == "csa":
            state = self.caches["csa_state"][layer]
            n = 2 * p.comp.coff * p.comp.dim
            proj = torch.empty(T, n + 2 * p.indexer.comp.coff * p.indexer.comp.dim, device=x.device)
            self._comp_proj(p.comp, x, meta, proj[:, :n])
            self._comp_proj(p.indexer.comp, x, meta, proj[:, n:])
            self._write(state, meta.batch.slot_mapping["csa_state"], proj, "none")
            new = meta.new["csa"]
            off = 4 * d
            self._emit(p.comp, state, 0, new, self.caches["csa_kv"][layer], cfg.compressed_kv_format)
            self._emit(p.indexer.comp, state, off, new, self.caches["csa_idx"][layer], cfg.indexer_k_format)
            kvs.append(self.caches["csa_kv"][layer])
            idxs.append(self._indexer(p.indexer, layer, x, qr, meta))
            fmts.append(cfg.compressed_kv_format)
        elif p.kind == "hca":
            state = self.caches["hca_state"][layer]
            proj = torch.empty(T, 2 * p.comp.coff * p.comp.dim, device=x.device)
            self._comp_proj(p.comp, x, meta, proj)
            self._write(state, meta.batch.slot_mapping["hca_state"], proj, "none")
            self._emit(p.comp, state, 0, meta.new["hca"], self.caches["hca_kv"][layer], cfg.compressed_kv_format)
            if meta.hca_idx.shape[1]:
                kvs.append(self.caches["hca_kv"][layer])
                idxs.append(meta.hca_idx)
                fmts.append(cfg.compressed_kv_format)
        o = ops.sparse_attention(q, kvs, idxs, d ** -0.5, p.sink, fmts)
        o = ops.rope(o, pos, cos, sin, r, inverse=True, may_overwrite=True)
        # wo_a [G, o_lora_rank, H*d/G]: one block per group of heads
        return ops.linear(ops.block_diagonal_linear(o.reshape(T, H * d), p.wo_a), p.wo_b)

    def _write(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fmt: str) -> None:
        self.ops.kv_write(cache, slots, rows, fmt)

    def _comp_proj(self, c: Compressor, x: torch.Tensor, meta: _Meta, out: torch.Tensor) -> None:
        """out (float32 [T, 2*coff*dim], a view of the state row) = kv, then gate + ape[pos % ratio]:
        one add into place (the kv half adds -0.0), so neither part nor the CSA pair is copied or
        concatenated."""
        torch.add(self.ops.linear(x, c.w), c.ape_row[meta.pos_mod[c.ratio]], out=out)

    def _emit(self, c: Compressor, state: torch.Tensor, off: int, new: _NewEntries, out: torch.Tensor,
              fmt: str) -> None:
        """Pool the entries completed this step from the per-token state and write them to `out`."""
        if new.out_slots.numel() == 0:
            return
        ops, cfg = self.ops, self.cfg
        dim = c.dim
        # a static decode step lists every token; the op reads only the entries completed (out slot >= 0)
        pooled = ops.compress_pool(state.view(-1, state.shape[-1]), new.src_slots, new.out_slots, off, dim,
                                   c.coff == 2).to(self.dtype)  # [N, dim]
        cos, sin = self.rope[True]
        pooled = ops.rms_norm_rope(pooled.view(-1, 1, dim), c.norm, cfg.rms_norm_eps, new.positions, cos, sin,
                                   cfg.qk_rope_head_dim).reshape(-1, dim)
        self._write(out, new.out_slots, pooled, fmt)

    def _indexer(self, p: Indexer, layer: int, x: torch.Tensor, qr: torch.Tensor, meta: _Meta) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        T, nh, di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
        cos, sin = self.rope[True]
        q = ops.rope(ops.linear(qr, p.wq_b).view(T, nh, di), meta.pos, cos, sin, cfg.qk_rope_head_dim,
                     may_overwrite=True)
        w = ops.linear(x, p.weights_proj).float() * (nh ** -0.5 * di ** -0.5)
        bt = meta.batch.block_tables["csa_idx"]
        ids = ops.indexer_topk(q, w, self.caches["csa_idx"][layer], bt, meta.qsl, meta.pos, cfg.csa_ratio,
                               cfg.index_topk, cfg.indexer_k_format)
        # ids are -1 or entries the table holds: -1 stays -1, the rest become their slots
        return ops.paged_slots(meta.batch.block_tables["csa_kv"], meta.tok_seq[:, None], ids,
                               meta.P // cfg.csa_ratio).int()

    # ---------------------------------------------------------------- convenience
    def driver(self, max_seqs: int = 1, max_len: int | None = None, tokens_per_block: int | None = None,
               device: str | None = None) -> CacheDriver:
        """Allocate caches with contiguous block tables and bind them (tests, benchmarks, no engine)."""
        return CacheDriver(self, max_seqs, max_len or self.max_model_len, tokens_per_block, device)


def _w(t) -> Weight:
    return t if isinstance(t, Weight) else Weight.dense(t)


def gate_up(gate, up) -> tuple[Weight, ...]:
    """A SwiGLU's gate and up weights as one, their rows joined (one linear and no concatenated
    outputs: a decode step's shared experts were two linears and a cat each), or as the two where
    an fp8 scale block would straddle them (Weight.join_rows)."""
    parts = [_w(gate), _w(up)]
    joined = Weight.join_rows(parts)
    return (joined,) if joined is not None else tuple(parts)


def shared_expert(ops, x: torch.Tensor, gu_w: tuple[Weight, ...], down: Weight, limit: float | None):
    """down(swiglu([gate | up](x))) with gu_w from gate_up."""
    gu = ops.linear(x, gu_w[0]) if len(gu_w) == 1 else torch.cat([ops.linear(x, w) for w in gu_w], dim=-1)
    return ops.linear(ops.swiglu(gu, limit), down)


def _compressor(params: dict, p: str, dim: int, ratio: int, coff: int) -> Compressor:
    w = torch.cat([_w(params[p + "wkv.weight"]).data, _w(params[p + "wgate.weight"]).data], dim=0)
    return Compressor(Weight.dense(w), params[p + "ape"], params[p + "norm.weight"], dim, ratio, coff)


def _block(cfg: V4Config, params: dict, p: str, kind: str, mlp: str) -> Block:
    a = p + "attn."
    attn = Attention(kind, params[a + "wq_a.weight"], params[a + "q_norm.weight"], params[a + "wq_b.weight"],
                     params[a + "wkv.weight"], params[a + "kv_norm.weight"], params[a + "wo_a.weight"],
                     params[a + "wo_b.weight"], params[a + "attn_sink"])
    if kind == "csa":
        attn.comp = _compressor(params, a + "compressor.", cfg.head_dim, cfg.csa_ratio, 2)
        attn.indexer = Indexer(params[a + "indexer.wq_b.weight"], _w(params[a + "indexer.weights_proj.weight"]),
                               _compressor(params, a + "indexer.compressor.", cfg.index_head_dim, cfg.csa_ratio, 2))
    elif kind == "hca":
        attn.comp = _compressor(params, a + "compressor.", cfg.head_dim, cfg.hca_ratio, 1)
    f = p + "ffn."
    sh = cfg.n_shared_experts > 0
    ffn = Moe(_w(params[f + "gate.weight"]), params.get(f + "gate.bias") if mlp == "topk" else None,
              params.get(f + "gate.tid2eid") if mlp == "hash" else None,
              params[f + "experts.w13"], params[f + "experts.w2"],
              gate_up(params[f + "shared_experts.w1.weight"], params[f + "shared_experts.w3.weight"])
              if sh else None,
              params[f + "shared_experts.w2.weight"] if sh else None)
    return Block(attn, ffn, params[p + "attn_norm.weight"], params[p + "ffn_norm.weight"],
                 _hc(params, p + "hc_attn_"), _hc(params, p + "hc_ffn_"))


def _hc(params: dict, p: str) -> HC:
    return HC(_w(params[p + "fn"]), params[p + "base"], params[p + "scale"])


# --------------------------------------------------------------------------------------- entry points
def build(name: str, ops: DispatchTable, device: str = "cpu", dtype: str = "float32", seed: int = 0,
          with_mtp: bool = False, max_model_len: int | None = None, **overrides) -> DeepseekV4Model:
    """A named config (tiny-v4, mid-v4) with seeded random weights generated on `device`."""
    from shuili.core.models.deepseek_v4_loader import random_params

    cfg = named(name, **overrides)
    params = random_params(cfg, device=device, dtype=dtype, seed=seed)
    return DeepseekV4Model(cfg, ops, params, device=device, dtype=dtype, max_model_len=max_model_len,
                           with_mtp=with_mtp)


def load_checkpoint(path: str, ops: DispatchTable, device: str = "cpu", dtype: str = "float32",
                    with_mtp: bool = False, max_model_len: int | None = None, progress: bool = True,
                    **overrides) -> DeepseekV4Model:
    """A directory of config.json + *.safetensors with the released tensor names."""
    from shuili.core.models.deepseek_v4_loader import load_params, read_config
    from shuili.core.models.tokenizer import load_tokenizer

    cfg = read_config(path, **overrides)
    params = load_params(path, cfg, device=device, dtype=dtype, with_mtp=with_mtp, progress=progress)
    tok = load_tokenizer(path, cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)
    return DeepseekV4Model(cfg, ops, params, device=device, dtype=dtype, max_model_len=max_model_len,
                           tokenizer=tok, with_mtp=with_mtp)
