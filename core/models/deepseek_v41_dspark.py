"""DeepSeek-V4.1's DSpark draft layers on the HAL (v4_arch.md §2.9, §7): a semi-autoregressive drafter
that proposes a block of tokens from the target's own features, with a Markov head for the in-block
dependency and a confidence head for the draft lengths. Used by core/spec/dspark.py.

  context   main_x = main_norm(main_proj(concat over the tap layers of the layer's attention input,
            the mean over the hc streams)) [T, D], one row per target token; every draft layer k writes
            kv_norm(kv_proj(main_x)) (RoPE at the token's position, MXFP8 fake-quant as the target's
            window KV) into its own window cache: layer num_hidden_layers + k of the swa_kv group.
  block     per request, ids [x_t, noise x (block_size - 1)] at positions t .. t + block_size - 1
            (x_t: the target's newest token, not yet computed by the target). The draft layers are
            V4.1 decoder layers (window-only, ratio 0; the shifted single-pass mHC of the target;
            their own MoE with dspark_n_routed_experts, top dspark_num_experts_per_tok). Attention of
            every block row: the W context positions t - W .. t - 1 of its layer's cache plus all
            block_size rows of the block (non-causal inside the block), one softmax with the sinks.
            Head: the collapse with the last FFN site's pre (V4.1 has no hc_head), h [block, D];
            base logits U = head(norm(h)) through the target's lm_head.
  drafts    row k of the block proposes the token at position t + k + 1, sequentially:
            logits_k = U_k + B(x_{k-1}), B(x) = W2 W1[x] (Markov head, x_0 = x_t), the token sampled
            with the target's counter-based noise at its position; confidence
            c_k = w . [h_k ; W1[x_{k-1}]] in float32 (the caller applies the sigmoid).

Choices where public facts stop (also in docs/speculative.md): h_k fed to the confidence head is the
pre-norm collapsed hidden (what vLLM's DSpark forward returns); the context window is the W positions
before the block for every block row; the tap is the residual streams entering the tap layer (after
its Engram write), averaged over the hc streams in fixed order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shuili.core.models.deepseek_v4 import shared_expert
from shuili.hal.types import Weight


@dataclass
class DSparkWeights:
    main_proj: Weight  # [D, n_taps * D]
    main_norm: torch.Tensor  # [D]
    blocks: list  # deepseek_v41.Block, window-only
    norm: torch.Tensor  # [D]
    markov_w1: torch.Tensor  # [V, r] compute dtype (an embedding)
    markov_w2: Weight  # [V, r]
    confidence: Weight  # float32 [1, D + r]


def dspark_weights(cfg, params: dict) -> DSparkWeights:
    from shuili.core.models.deepseek_v41 import _block, _w
    from shuili.core.models.deepseek_v41_loader import dspark_layer_config, dspark_schema

    missing = [n for n in dspark_schema(cfg) if n not in params]
    if missing:
        raise ValueError(f"the DSpark draft layers need {len(missing)} more tensors, e.g. {missing[0]!r}: load "
                         "the checkpoint with its mtp.* weights (with_dspark=True)")
    dcfg = dspark_layer_config(cfg)
    view = {"model.layers." + n[len("model.mtp."):]: v for n, v in params.items() if n.startswith("model.mtp.")}
    L = f"model.mtp.{cfg.num_nextn_predict_layers - 1}."
    return DSparkWeights(
        _w(params["model.mtp.0.main_proj.weight"]), params["model.mtp.0.main_norm.weight"],
        [_block(dcfg, view, k) for k in range(cfg.num_nextn_predict_layers)], params[L + "norm.weight"],
        _w(params[L + "markov_head.markov_w1.weight"]).data, _w(params[L + "markov_head.markov_w2.weight"]),
        Weight.dense(params[L + "confidence_head.proj.weight"].float()))


class DSpark:
    """The draft layers of one DeepseekV41Model (`model.dspark`)."""

    def __init__(self, model, w: DSparkWeights):
        from shuili.core.models.deepseek_v41_loader import dspark_layer_config

        self.m, self.w = model, w
        self.cfg = model.cfg
        self.dcfg = dspark_layer_config(model.cfg)
        self.layer0 = model.cfg.num_hidden_layers  # draft layer k's window cache: swa_kv layer layer0 + k

    # ------------------------------------------------------------------ context
    def write_context(self, batch, taps: torch.Tensor) -> None:
        """Every draft layer's context KV for the rows of `batch` (taps [T, n_taps * D])."""
        m, ops, cfg = self.m, self.m.ops, self.cfg
        eps, d, r = cfg.rms_norm_eps, cfg.head_dim, cfg.qk_rope_head_dim
        x = ops.rms_norm(ops.linear(taps, self.w.main_proj), self.w.main_norm, eps)  # [T, D]
        cos, sin = m.rope[False]
        pos = batch.positions.long()
        for k, blk in enumerate(self.w.blocks):
            kv = ops.rms_norm_rope(ops.linear(x, blk.attn.kv_proj).view(-1, 1, d), blk.attn.kv_norm, eps, pos,
                                   cos, sin, r)
            kv = m._fake_quant(kv.reshape(-1, d), "mxfp8")
            m._store(m.caches["swa_kv"][self.layer0 + k], batch.slot_mapping["swa_kv"], kv, cfg.window_kv_format)

    # ------------------------------------------------------------------ one block per request
    def block(self, anchor: torch.Tensor, t: torch.Tensor, tables: torch.Tensor, P: int):
        """anchor int64 [C] (x_t), t int64 [C] (its position), tables [C, max_blocks] (swa_kv).
        Returns (h [C, b, D] pre-norm hidden, U float32 [C, b, V] base logits)."""
        m, ops, cfg = self.m, self.m.ops, self.cfg
        C, b, W, dev = anchor.shape[0], cfg.dspark_block_size, cfg.sliding_window, anchor.device
        ids = torch.full((C, b), cfg.dspark_noise_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = anchor
        ar = torch.arange(b, device=dev)
        # [C*b]; rows past the model's last position (a request about to hit max_model_len) reuse it:
        # their drafts cannot be verified anyway
        pos = (t[:, None] + ar[None]).reshape(-1).clamp(max=m.max_model_len - 1)
        seq = torch.arange(C, device=dev)
        ctx_pos = t[:, None] - W + torch.arange(W, device=dev)[None]  # [C, W]
        ctx = ops.paged_slots(tables, seq[:, None], ctx_pos, P)
        ctx_idx = ctx.repeat_interleave(b, 0).int()  # [C*b, W]
        blk_idx = (seq[:, None] * b + ar[None]).repeat_interleave(b, 0).int()  # [C*b, b]
        x = ops.embedding(ids.reshape(-1), m.embed)
        mh = cfg.hc_mult
        x = x[:, None, :].expand(-1, mh, -1).contiguous()
        pre = torch.zeros(x.shape[0], mh, dtype=torch.float32, device=dev)
        pre[:, 0] = 1.0
        for k, blk in enumerate(self.w.blocks):
            eps = cfg.rms_norm_eps
            pre_a, post, comb = m._hc(blk.hc_attn, x)
            a_in = ops.rms_norm(ops.hc_collapse(x, pre), blk.attn_norm, eps)
            a = self._attention(blk.attn, self.layer0 + k, a_in, pos, ctx_idx, blk_idx)
            x = ops.hc_expand(a, x, post, comb)
            pre_f, post, comb = m._hc(blk.hc_ffn, x)
            f = self._moe(blk.ffn, ops.rms_norm(ops.hc_collapse(x, pre_a), blk.ffn_norm, eps))
            x, pre = ops.hc_expand(f, x, post, comb), pre_f
        h = ops.hc_collapse(x, pre)  # [C*b, D]; the streams are in m.dtype: no second cast
        U = ops.linear(ops.rms_norm(h, self.w.norm, cfg.rms_norm_eps), m.head).float()
        return h.view(C, b, -1), U.view(C, b, -1)

    def markov(self, prev: torch.Tensor, h: torch.Tensor):
        """(bias float32 [C, V], confidence logit float32 [C]) of the draft after token `prev` [C]."""
        ops = self.m.ops
        e = ops.embedding(prev, self.w.markov_w1)  # [C, r]
        bias = ops.linear(e, self.w.markov_w2).float()
        c = ops.linear(torch.cat([h.float(), e.float()], dim=-1), self.w.confidence).float()[:, 0]
        return bias, c

    # ------------------------------------------------------------------ pieces
    def _attention(self, p, layer: int, x: torch.Tensor, pos: torch.Tensor, ctx_idx: torch.Tensor,
                   blk_idx: torch.Tensor) -> torch.Tensor:
        m, ops, cfg = self.m, self.m.ops, self.cfg
        T, H, d, r = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        cos, sin = m.rope[False]
        qr = ops.rms_norm(ops.linear(x, p.q_a), p.q_a_norm, cfg.rms_norm_eps)
        q = ops.rope(ops.linear(qr, p.q_b).view(T, H, d), pos, cos, sin, r, may_overwrite=True)
        kv = ops.rms_norm_rope(ops.linear(x, p.kv_proj).view(T, 1, d), p.kv_norm, cfg.rms_norm_eps, pos, cos,
                               sin, r)
        kv = m._fake_quant(kv.reshape(T, d), "mxfp8")  # the block's rows, unstored
        kvs = [m.caches["swa_kv"][layer], kv]
        o = ops.sparse_attention(q, kvs, [ctx_idx, blk_idx], d ** -0.5, p.sinks, [cfg.window_kv_format, "none"])
        o = ops.rope(o, pos, cos, sin, r, inverse=True, may_overwrite=True)
        return ops.linear(ops.block_diagonal_linear(o.reshape(T, H * d), p.o_a), p.o_b)

    def _moe(self, p, x: torch.Tensor) -> torch.Tensor:
        ops, cfg = self.m.ops, self.dcfg
        logits = ops.linear(x.float(), p.gate).float()
        if cfg.gate_temp != 1.0:
            logits = logits / cfg.gate_temp
        w, idx = ops.moe_route_topk(logits, p.bias, cfg.num_experts_per_tok, cfg.scoring_func,
                                    cfg.norm_topk_prob, cfg.routed_scaling_factor)
        y = ops.moe_experts(x, idx, w, p.w13, p.w2, cfg.swiglu_limit)
        if p.shared_gate_up is not None:
            y = y + shared_expert(ops, x, p.shared_gate_up, p.shared_down, cfg.swiglu_limit)
        return y
