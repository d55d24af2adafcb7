"""The NVIDIA op table: every op of `shuili.hal.ops`, bound once to the platform config."""
from __future__ import annotations

import functools

from shuili.platforms.nvidia import (
    attention, compress, gemm, indexer, mhc, misc, moe, norm_rope, quant, sampling,
)
from shuili.platforms.reference.public import OPS as REFERENCE_OPS

# ops whose kernels take the batch-invariant switch (fixed tiles / fixed KV split)
MODE_OPS = {
    "linear": gemm.linear,
    "grouped_linear": gemm.grouped_linear,
    "block_diagonal_linear": gemm.block_diagonal_linear,
    "moe_experts": gemm.moe_experts,
    "paged_attention": attention.paged_attention,
    "hc_mix": mhc.hc_mix,
    "sparse_attention": attention.sparse_attention,
    "indexer_topk": indexer.indexer_topk,
    "indexer_select": indexer.indexer_select,
}

PLAIN_OPS = {
    "rms_norm": norm_rope.rms_norm,
    "add_rms_norm": norm_rope.add_rms_norm,
    "rope": norm_rope.rope,
    "rms_norm_rope": norm_rope.rms_norm_rope,
    "swiglu": misc.swiglu,
    "embedding": misc.embedding,
    "hc_split_sinkhorn": mhc.hc_split_sinkhorn,
    "hc_collapse": mhc.hc_collapse,
    "hc_expand": mhc.hc_expand,
    "engram_gate": REFERENCE_OPS["engram_gate"],  # exact numerics, row-local, runs on the GPU
    "moe_route_topk": moe.moe_route_topk,
    "moe_route_hash": moe.moe_route_hash,
    "kv_quantize": quant.kv_quantize,
    "kv_dequantize": quant.kv_dequantize,
    "cache_write": misc.cache_write,
    "kv_write": misc.kv_write,
    "paged_slots": misc.paged_slots,
    "compress_pool": compress.compress_pool,
    "log_softmax": sampling.log_softmax,
    "apply_penalties": sampling.apply_penalties,
    "sample": sampling.sample,
    "all_reduce": misc.all_reduce,
    "all_gather": misc.all_gather,
    "all_to_all": misc.all_to_all,
}


def make_ops(batch_invariant: bool = False) -> dict:
    table = dict(PLAIN_OPS)
    for name, fn in MODE_OPS.items():
        table[name] = functools.partial(fn, batch_invariant=batch_invariant)
    return table
