"""The reference op table: every op of `shuili.hal.ops` mapped to its implementation here, and
the weight / KV formats each op accepts (all quantized formats are emulated on the CPU).
"""
from __future__ import annotations

from shuili.hal.capabilities import DtypeSupport
from shuili.platforms.reference import (
    attention, collectives, elementwise, engram, gemm, indexer, kvcache, mhc, moe, norm, rope,
)
from shuili.platforms.reference.sampling import SAMPLING_OPS

OPS: dict[str, object] = {
    "linear": gemm.linear,
    "grouped_linear": gemm.grouped_linear,
    "block_diagonal_linear": gemm.block_diagonal_linear,
    "moe_experts": gemm.moe_experts,
    "rms_norm": norm.rms_norm,
    "add_rms_norm": norm.add_rms_norm,
    "rope": rope.rope,
    "rms_norm_rope": rope.composed_rms_norm_rope(norm.rms_norm, rope.rope),
    "swiglu": elementwise.swiglu,
    "embedding": elementwise.embedding,
    "hc_split_sinkhorn": mhc.hc_split_sinkhorn,
    "hc_mix": mhc.hc_mix,
    "hc_collapse": mhc.hc_collapse,
    "hc_expand": mhc.hc_expand,
    "engram_gate": engram.engram_gate,
    "moe_route_topk": moe.moe_route_topk,
    "moe_route_hash": moe.moe_route_hash,
    "kv_quantize": kvcache.kv_quantize,
    "kv_dequantize": kvcache.kv_dequantize,
    "cache_write": kvcache.cache_write,
    "kv_write": kvcache.kv_write,
    "compress_pool": kvcache.compress_pool,
    "paged_slots": kvcache.paged_slots,
    "paged_attention": attention.paged_attention,
    "sparse_attention": attention.sparse_attention,
    "indexer_topk": indexer.indexer_topk,
    "indexer_select": indexer.indexer_select,
    "all_reduce": collectives.all_reduce,
    "all_gather": collectives.all_gather,
    "all_to_all": collectives.all_to_all,
}

OPS.update(SAMPLING_OPS)  # log_softmax, apply_penalties, sample (sampling.py, the core helper's)

_DENSE = DtypeSupport(name="dense", support="native")
_WEIGHTS = (_DENSE, DtypeSupport(name="fp8_block128", support="emulated"),
            DtypeSupport(name="fp8_block32", support="emulated"),
            DtypeSupport(name="mxfp4", support="emulated"))
_KV = tuple(DtypeSupport(name=f, support="emulated") for f in ("mxfp8", "fp4_e4m3", "mxfp4"))
_KV_READ = (DtypeSupport(name="none", support="native"),) + _KV

FORMATS: dict[str, tuple[DtypeSupport, ...]] = {
    "linear": _WEIGHTS,
    "grouped_linear": _WEIGHTS,
    "block_diagonal_linear": _WEIGHTS,
    "moe_experts": _WEIGHTS,
    "kv_quantize": _KV,
    "kv_dequantize": _KV,
    "kv_write": _KV_READ,
    "sparse_attention": _KV_READ,
    "indexer_topk": _KV_READ,
    "indexer_select": _KV_READ,
}
