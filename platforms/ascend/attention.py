"""paged_attention through npu_fused_infer_attention_score (TND, paged KV), sparse_attention and
anything outside the fused kernel's documented envelope through the host torch path.

FIA mapping (vllm-ascend attention_v1 pattern): query [T, H, D]; key/value = the paged caches
viewed as [num_blocks, block_size, KVH * D]; actual_seq_lengths = cumulative query ends;
actual_seq_lengths_kv = per-sequence cached lengths; sparse_mode 3 (causal, bottom-right aligned)
with the optimized 2048x2048 triu mask, or 4 (band) with pre_tokens = window - 1, next_tokens = 0
for a sliding window that keeps kv positions j > p - window. Sinks need the v2 op (learnable_sink,
bfloat16 only).
"""
from __future__ import annotations

import torch

from shuili.platforms.ascend.host import on_host, took
from shuili.platforms.ascend.kv import dequant_rows

F16_BF16 = (torch.float16, torch.bfloat16)


def fia_fits(q, k_cache, v_cache, qlens, window, sinks, batch_invariant) -> str:
    """'' when the fused kernel covers this call, else why not (kept for the path trace)."""
    if batch_invariant:
        return "batch-invariant mode (FIA's split of long KV depends on the batch)"
    if q.dtype not in F16_BF16 or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return f"dtype {q.dtype}/{k_cache.dtype} (FIA takes fp16/bf16)"
    if v_cache.shape != k_cache.shape:
        return "v_cache shape differs from k_cache"
    nb, bs, kvh, d = k_cache.shape
    h = q.shape[1]
    if h % kvh or h // kvh > 64 or kvh * d > 65535:
        return f"heads {h}/{kvh}, KVH*D {kvh * d}"
    multi = max(qlens, default=0) > 1
    if multi and not (bs % 128 == 0 and 128 <= bs <= 512):
        return f"block_size {bs} (prefill needs a multiple of 128 in [128, 512])"
    if not multi and bs % 16:
        return f"block_size {bs} (decode needs a multiple of 16)"
    if window > 0 and min(qlens, default=0) < 2:
        return "sliding window with single-token queries (FIA ignores the band when Q_S = 1)"
    if sinks is not None and q.dtype != torch.bfloat16:
        return "sinks need bfloat16 (learnable_sink)"
    return ""


def build(api, mode) -> dict:
    npu = api.ops
    masks: dict = {}
    host_paged = on_host("paged_attention")

    def _mask(device):
        if device not in masks:
            masks[device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), 1)
        return masks[device]

    def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                        window=0, sinks=None):
        qsl = [int(v) for v in query_start_loc.tolist()]
        qlens = [b - a for a, b in zip(qsl, qsl[1:])]
        why = fia_fits(q, k_cache, v_cache, qlens, window, sinks, mode.batch_invariant)
        if why or not qlens:
            return host_paged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                              window, sinks)
        nb, bs, kvh, d = k_cache.shape
        h = q.shape[1]
        band = dict(sparse_mode=4, pre_tokens=window - 1, next_tokens=0) if window > 0 else \
            dict(sparse_mode=3)
        common = dict(query=q.contiguous(), key=k_cache.view(nb, bs, kvh * d),
                      value=v_cache.view(nb, bs, kvh * d), atten_mask=_mask(q.device),
                      block_table=block_tables.to(torch.int32), num_key_value_heads=kvh,
                      input_layout="TND", block_size=bs, **band)
        kv_lens = [int(v) for v in seq_lens.tolist()]
        if sinks is None:
            took("paged_attention:npu_fused_infer_attention_score")
            out = npu.npu_fused_infer_attention_score(
                actual_seq_lengths=qsl[1:], actual_seq_lengths_kv=kv_lens, num_heads=h,
                scale=float(scale), **common)[0]
        else:
            took("paged_attention:npu_fused_infer_attention_score_v2")
            out = npu.npu_fused_infer_attention_score_v2(
                actual_seq_qlen=qsl[1:], actual_seq_kvlen=kv_lens, num_query_heads=h,
                softmax_scale=float(scale), learnable_sink=sinks.to(torch.bfloat16), **common)[0]
        return out.view(q.shape)

    # DeepSeek-V4's compressed / shared-KV attention has no torch_npu op (vllm-ascend uses its own
    # AscendC kernels); npu_sparse_flash_attention indexes per-sequence positions through a block
    # table, not slot ids over several caches in one softmax, so it does not fit the contract.
    # On-device torch: gather + dequantize every listed entry ([T, L] with L fixed by the model's
    # topk + window, so a query's shapes do not depend on the batch), one masked softmax.
    host_sparse = on_host("sparse_attention")

    def sparse_attention(q, kv, indices, scale, sinks=None, kv_formats=None):
        fmts = list(kv_formats) if kv_formats is not None else ["none"] * len(kv)
        if mode.batch_invariant or len(kv) != len(indices) or len(fmts) != len(kv) or not kv:
            return host_sparse(q, kv, indices, scale, sinks, kv_formats)
        t, h, d = q.shape
        keys, valid = [], []
        for cache, idx, fmt in zip(kv, indices, fmts):
            flat = cache.reshape(-1, cache.shape[-1])
            ids = idx.to(torch.int64)
            if ids.numel() and int(ids.max()) >= flat.shape[0]:
                raise ValueError(f"slot id {int(ids.max())} is past the cache's {flat.shape[0]} slots")
            rows = flat[ids.clamp_min(0).reshape(-1)]
            if fmt == "none":
                if rows.shape[-1] != d:
                    raise ValueError(f"unpacked cache rows have {rows.shape[-1]} values, queries have {d}")
                rows = rows.to(torch.float32)
            else:
                rows = dequant_rows(rows, fmt, d)
            keys.append(rows.view(t, ids.shape[1], d))
            valid.append(ids >= 0)
        took("sparse_attention:torch")
        k = torch.cat(keys, dim=1)  # [T, L, D], K = V
        ok = torch.cat(valid, dim=1)[:, None, :]  # [T, 1, L]
        logits = torch.einsum("thd,tld->thl", q.to(torch.float32), k) * scale
        logits = logits.masked_fill(~ok, float("-inf"))
        if sinks is not None:
            sink = sinks.to(torch.float32).view(1, h, 1).expand(t, h, 1)
            logits = torch.cat((logits, sink), dim=-1)
        m = logits.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # no entry, no sink: zeros
        p = torch.exp(logits - m)
        denom = p.sum(-1, keepdim=True)
        p = p[..., : k.shape[1]] / torch.where(denom > 0, denom, torch.ones_like(denom))
        return torch.einsum("thl,tld->thd", p, k).to(q.dtype)

    return {"paged_attention": paged_attention, "sparse_attention": sparse_attention}
