"""What the Ascend platform claims per op, under which settings. Nothing here has been measured on
an NPU: every claim is what the mapping should give if the kernels behave as documented, and is
what `shuili conformance run --platform ascend` on a 950 host must confirm."""
from __future__ import annotations

from shuili.hal.capabilities import DeterminismLevel as L, DtypeSupport, OpCapability, PlatformCapabilities

_FLOAT = tuple(DtypeSupport(name=n) for n in ("bfloat16", "float16", "float32"))
# fp8 weights are emulated (decoded once to the activation dtype): no torch_npu schema multiplies
# unquantized activations by e4m3 weights with block scales (npu_weight_quant_batchmatmul documents
# int8/int4 weights; npu_quant_matmul's MXFP8 form quantizes the activations, opt-in below)
_WEIGHTS = (DtypeSupport(name="dense"), DtypeSupport(name="fp8_block128", support="emulated"),
            DtypeSupport(name="fp8_block32", support="emulated"),
            DtypeSupport(name="mxfp4", support="emulated"))
_KV = (DtypeSupport(name="mxfp8"), DtypeSupport(name="fp4_e4m3", support="emulated"),
       DtypeSupport(name="mxfp4", support="emulated"))
_KV_READ = (DtypeSupport(name="none"),) + _KV

# op -> (kernel, how it behaves): "row" kernels compute each row alone (norm, gating, elementwise,
# per-query host code); "split" kernels tile across rows / KV in batch-dependent ways and are
# replaced by fixed-tile torch paths in batch-invariant mode; "host" runs the reference on the CPU.
KERNELS = {
    "linear": ("torch matmul; 16-row tiles in batch-invariant mode", "split"),
    "grouped_linear": ("npu_grouped_matmul; per-expert 16-row tiles in batch-invariant mode", "split"),
    "block_diagonal_linear": ("this table's grouped_linear on the rows regrouped by block", "split"),
    "moe_experts": ("npu_moe_init_routing_v2 + npu_grouped_matmul + npu_moe_token_unpermute", "split"),
    "rms_norm": ("npu_rms_norm", "row"),
    "add_rms_norm": ("npu_add_rms_norm; add + npu_rms_norm in batch-invariant mode", "split"),
    "rope": ("npu_rotary_mul (half / interleave)", "elementwise"),
    "rms_norm_rope": ("this table's rms_norm, then its rope (no torch_npu op fuses them)", "row"),
    "swiglu": ("npu_swiglu; torch with a limit", "elementwise"),
    "embedding": ("torch embedding", "elementwise"),
    "hc_split_sinkhorn": ("host torch (reference numerics)", "host"),
    "hc_mix": ("this table's rms_norm, linear and hc_split_sinkhorn composed (no fused torch_npu op)",
               "split"),
    "engram_gate": ("host torch (reference numerics)", "host"),
    "hc_collapse": ("torch on device (the reference's code: float32 products, fixed-tree sum)", "elementwise"),
    "hc_expand": ("torch on device (the reference's code: float32, streams added in order)", "elementwise"),
    "moe_route_topk": ("npu_moe_gating_top_k (sigmoid/softmax), renorm in Python; host torch for sqrtsoftplus", "row"),
    "moe_route_hash": ("npu_moe_gating_top_k hash mode (sigmoid/softmax); host torch for sqrtsoftplus", "row"),
    "kv_quantize": ("npu_dynamic_mx_quant scale_alg=1 (mxfp8, 950); host torch for fp4", "row"),
    "kv_dequantize": ("torch, exact, on device", "elementwise"),
    "cache_write": ("npu_scatter_pa_kv_cache cache_mode=Norm", "elementwise"),
    "kv_write": ("this table's kv_quantize, then its cache_write (no torch_npu op packs and scatters)",
                 "row"),
    "compress_pool": ("torch on device (the reference's code: float64 exp, fixed-tree sums)", "elementwise"),
    "paged_slots": ("torch on device (the reference's code: integer gather and arithmetic)", "elementwise"),
    "paged_attention": ("npu_fused_infer_attention_score(_v2) TND paged, sparse_mode 3/4", "split"),
    "sparse_attention": ("torch on device, masked softmax over the listed entries (no torch_npu "
                         "op for V4's compressed attention); host torch in batch-invariant mode", "split"),
    "indexer_topk": ("npu_lightning_indexer, one batch entry per query", "split"),
    "indexer_select": ("host torch (no torch_npu op has candidate pools or block selection)", "host"),
    "log_softmax": ("host torch", "host"),
    "apply_penalties": ("host torch", "host"),
    "sample": ("host torch", "host"),
    "all_reduce": ("HCCL; rank-ordered sum when deterministic", "collective"),
    "all_gather": ("HCCL all_gather", "collective"),
    "all_to_all": ("HCCL all_to_all_single (rows copied)", "collective"),
}
_FORMATS = {"linear": _WEIGHTS, "grouped_linear": _WEIGHTS, "block_diagonal_linear": _WEIGHTS,
            "moe_experts": _WEIGHTS,
            "kv_quantize": _KV, "kv_dequantize": _KV, "kv_write": _KV_READ, "sparse_attention": _KV_READ,
            "indexer_topk": _KV_READ, "indexer_select": _KV_READ}


def _level(kind: str, config) -> tuple[L, str | None]:
    det = config.deterministic or config.batch_invariant
    if kind == "host":  # the reference implementation itself, on the CPU, on copied inputs
        return L.portable_bitwise, None
    if kind == "elementwise":  # no reduction across rows
        return L.batch_invariant, None
    if not det:
        return L.none, None
    if kind == "row":
        return L.batch_invariant, "deterministic"
    if kind == "split":
        if config.batch_invariant:
            return L.batch_invariant, "batch_invariant"
        return L.run_to_run, "deterministic"
    return L.run_to_run, "deterministic"  # collectives: HCCL_DETERMINISTIC / rank-ordered sum


def capabilities(config, family: str = "950") -> PlatformCapabilities:
    import os

    from shuili.platforms.ascend.ops import MX_GEMM_ENV

    ops = {}
    for name, (kernel, kind) in KERNELS.items():
        level, needs = _level(kind, config)
        if name == "linear" and os.environ.get(MX_GEMM_ENV) == "1" and not config.batch_invariant:
            level, needs = L.none, None
            kernel += (f"; {MX_GEMM_ENV}=1: fp8_block128 / fp8_block32 via MXFP8 npu_quant_matmul "
                       "(activations quantized)")
        dtypes = _FLOAT  # paged_attention / indexer_topk reach the NPU kernel only for fp16/bf16
        ops[name] = OpCapability(dtypes=dtypes, formats=_FORMATS.get(name, ()), determinism=level,
                                 determinism_requires=needs,
                                 notes=f"{kernel}; unverified on NPU hardware")
    return PlatformCapabilities(ops=ops, compute_dtypes=("bfloat16", "float16"), graph_capture=True,
                                collectives_backend="hccl", device_type="npu")
