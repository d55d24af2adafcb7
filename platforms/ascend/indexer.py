"""indexer_topk through npu_lightning_indexer.

The operator's causal mode assumes a key per query position, but V4 compresses keys (entry e is
visible to position p when e < (p + 1) // ratio). So every query is passed as its own batch entry
(TND with actual_seq_lengths_query = 1, 2, ..., T), with key length (p + 1) // ratio and its
sequence's block-table row: with one query per batch, sparse_mode 3 sees exactly those keys.
Outside the documented envelope (D = 128, N1 in 8/16/24/32/64 on 950, fp16/bf16, block_size a
multiple of 16 up to 1024, unpacked keys) the host torch path runs.
"""
from __future__ import annotations

import torch

from shuili.platforms.ascend.host import on_host, took

SPARSE_COUNTS = set(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}


def indexer_fits(q, k_cache, k_format, topk, batch_invariant) -> str:
    if batch_invariant:
        return "batch-invariant mode"
    if k_format != "none":
        return f"k_format {k_format} (the operator reads unpacked fp16/bf16 keys)"
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype:
        return f"dtype {q.dtype}/{k_cache.dtype}"
    if q.shape[2] != 128 or k_cache.dim() != 3 or k_cache.shape[2] != 128:
        return "head dim must be 128"
    if q.shape[1] not in (8, 16, 24, 32, 64):
        return f"{q.shape[1]} heads (950 supports 8/16/24/32/64)"
    bs = k_cache.shape[1]
    if bs % 16 or bs > 1024:
        return f"block_size {bs}"
    if topk not in SPARSE_COUNTS:
        return f"topk {topk} is not a valid sparse_count"
    return ""


def build(api, mode) -> dict:
    npu = api.ops
    host = on_host("indexer_topk")

    def indexer_topk(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, topk,
                     k_format="none"):
        if indexer_fits(q, k_cache, k_format, topk, mode.batch_invariant) or q.shape[0] == 0:
            return host(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, topk,
                        k_format)
        took("indexer_topk:npu_lightning_indexer")
        t = q.shape[0]
        dev = q.device
        qsl = query_start_loc.to(torch.int64)
        seq_of = torch.repeat_interleave(torch.arange(qsl.numel() - 1, device=dev), qsl.diff())
        nb, bs, dk = k_cache.shape
        idx, _ = npu.npu_lightning_indexer(
            query=q.contiguous(), key=k_cache.view(nb, bs, 1, dk), weights=weights.to(q.dtype),
            actual_seq_lengths_query=torch.arange(1, t + 1, dtype=torch.int32, device=dev),
            actual_seq_lengths_key=((positions.to(torch.int64) + 1) // ratio).to(torch.int32),
            block_table=block_tables.to(torch.int32)[seq_of].contiguous(), layout_query="TND",
            layout_key="PA_BSND", sparse_count=topk, sparse_mode=3)
        return idx[:, 0, :]

    # no torch_npu operator scores against a candidate pool or selects candidate blocks
    # (npu_lightning_indexer has neither), so the V4.1 two-level selection runs on the host
    select = on_host("indexer_select")

    def indexer_select(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, topk,
                       k_format="none", candidates=None, candidate_topk=0, candidate_block_size=1):
        return select(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, topk, k_format,
                      candidates, candidate_topk, candidate_block_size)

    return {"indexer_topk": indexer_topk, "indexer_select": indexer_select}
