"""NVIDIA platform plugin: registration, probe, capabilities and the op table (Triton kernels in
this package; see docs/platforms/nvidia.md). Module import touches neither triton nor CUDA."""
from __future__ import annotations

import os

from shuili.hal import (
    HAL_API_VERSION, Availability, DeterminismLevel, DtypeSupport, OpCapability,
    PlatformCapabilities, PlatformInfo,
)
from shuili.hal.hookspecs import hookimpl

NAME = "nvidia"
# batch-invariant mode comes from `platform.batch_invariant`; this variable forces it for callers
# that resolve the platform with a default config (e.g. the conformance engine checks)
BI_ENV = "SHUILI_NVIDIA_BATCH_INVARIANT"
L = DeterminismLevel

# float16 runs through the same kernels but is not in the measured conformance set
_ACT = tuple(DtypeSupport(name=n) for n in ("bfloat16", "float32"))
_F32 = (DtypeSupport(name="float32"),)
# weights and KV codes: SM90 has no FP4 tensor cores, so mxfp4 / fp4 codes are expanded in
# registers ("emulated"); fp8 e4m3 converts natively on SM89+
_WEIGHTS = (DtypeSupport(name="dense"), DtypeSupport(name="fp8_block128"), DtypeSupport(name="fp8_block32"),
            DtypeSupport(name="mxfp4", support="emulated"))
_KV = (DtypeSupport(name="mxfp8"), DtypeSupport(name="fp4_e4m3", support="emulated"),
       DtypeSupport(name="mxfp4", support="emulated"))
_KV_READ = (DtypeSupport(name="none"),) + _KV
# indexer.GROUP_MIN_TOKENS (read here from its variable: this module imports no kernel): with the
# grouped score on, a token's scores depend on its neighbours in the batch
_INDEXER_GROUPS = int(os.environ.get("SHUILI_INDEXER_GROUP_MIN_TOKENS", "0")) > 0
_INDEXER_DEFAULT = L.run_to_run if _INDEXER_GROUPS else L.batch_invariant

# (dtypes, formats, level in default mode, level in batch-invariant mode, notes)
_CAPS = {
    "linear": (_ACT, _WEIGHTS, L.run_to_run, L.batch_invariant,
               "default: cuBLAS (dense, and quantized from 256 rows on a dense copy) / M-sized Triton "
               "tiles (quantized); batch-invariant mode: "
               "one fixed-tile Triton kernel; float32 with at most 64 columns: split-K over fixed "
               "chunks of K (in default mode below 256 rows)"),
    "grouped_linear": (_ACT, _WEIGHTS, L.run_to_run, L.batch_invariant, "Triton grouped GEMM"),
    "block_diagonal_linear": (_ACT, _WEIGHTS, L.run_to_run, L.batch_invariant,
                              "qgemm formats: the grouped GEMM on the blocks where they lie, "
                              "grouped_linear's bits; others: grouped_linear on regrouped copies; "
                              "default mode from 256 rows: cuBLAS batched GEMM on a dense copy"),
    "moe_experts": (_ACT, _WEIGHTS, L.run_to_run, L.batch_invariant,
                    "stable sort by expert, two grouped GEMMs, fixed-order sum over k; default mode "
                    "from 160 rows an expert: dense expert copies"),
    "rms_norm": (_ACT, (), L.batch_invariant, L.batch_invariant, "one program per row"),
    "add_rms_norm": (_ACT, (), L.batch_invariant, L.batch_invariant, "one program per row"),
    "rope": (_ACT, (), L.batch_invariant, L.batch_invariant, "elementwise per token"),
    "rms_norm_rope": (_ACT, (), L.batch_invariant, L.batch_invariant,
                      "one program per head row: rms_norm's reduction and rope's rotation, their bits"),
    "swiglu": (_ACT, (), L.batch_invariant, L.batch_invariant, "elementwise"),
    "embedding": (_ACT, (), L.portable_bitwise, L.portable_bitwise, "row gather"),
    "hc_split_sinkhorn": (_F32, (), L.batch_invariant, L.batch_invariant, "one program per token"),
    "hc_mix": (_ACT, (), L.run_to_run, L.batch_invariant,
               "float32 split-K partials over fixed K chunks (skinny.py), then one program per token: "
               "their sum, the norm's scale and the Sinkhorn; default mode from 256 rows of bf16: "
               "the partials on tensor cores, the weight in three bf16 pieces"),
    "hc_collapse": (_ACT, (), L.batch_invariant, L.batch_invariant,
                    "one program per (token, D tile); the reference's float32 tree over the streams"),
    "hc_expand": (_ACT, (), L.batch_invariant, L.batch_invariant,
                  "one program per (token, D tile); float32, streams added in order"),
    "engram_gate": (_F32, (), L.batch_invariant, L.batch_invariant,
                    "the reference torch code on the GPU: exact float64 dots, fixed-tree sums"),
    "moe_route_topk": (_F32, (), L.batch_invariant, L.batch_invariant, "float64 scores, exact top-k"),
    "moe_route_hash": (_F32, (), L.batch_invariant, L.batch_invariant, "table lookup"),
    "kv_quantize": (_ACT, _KV, L.portable_bitwise, L.portable_bitwise,
                    "integer/bit arithmetic; 16-bit rows widened in registers"),
    "kv_dequantize": (_F32, _KV, L.portable_bitwise, L.portable_bitwise, "exact decode"),
    "cache_write": (_ACT, (), L.portable_bitwise, L.portable_bitwise, "byte copy"),
    "kv_write": (_ACT, _KV_READ, L.portable_bitwise, L.portable_bitwise,
                 "kv_quantize's kernel storing each row at its slot: one launch, skipped rows not read"),
    "paged_slots": (_F32, (), L.portable_bitwise, L.portable_bitwise, "integer arithmetic, one launch"),
    "compress_pool": (_F32, (), L.batch_invariant, L.batch_invariant,
                      "one program per (entry, channel block); an entry not completed reads nothing"),
    "paged_attention": (_ACT, (), L.run_to_run, L.batch_invariant,
                        "default: KV split sized to fill the GPU for decode; batch-invariant "
                        "mode: fixed 1024-position splits for prefill and decode alike"),
    "sparse_attention": (_ACT, _KV_READ, L.run_to_run, L.batch_invariant,
                         "one program per (token, head block, chunk); chunks merged in order; "
                         "default mode from 4 waves of (token, head block) programs: one program "
                         "over all chunks, no merge; from 256 queries reading each packed row 4 "
                         "times on average: the packed caches decoded once, whole; with "
                         "SHUILI_SPARSE_GROUP_MIN_TOKENS (off by default), 4 neighbouring tokens a "
                         "program over the columns they share"),
    "indexer_topk": (_ACT, (DtypeSupport(name="none"), DtypeSupport(name="mxfp4", support="emulated")),
                     _INDEXER_DEFAULT, L.batch_invariant, "per-token scores (with SHUILI_INDEXER_GROUP_MIN_TOKENS, "
                     "off by default: 4 tokens of one sequence a program, one product), exact top-k"),
    "indexer_select": (_ACT, (DtypeSupport(name="none"), DtypeSupport(name="mxfp4", support="emulated")),
                       _INDEXER_DEFAULT, L.batch_invariant,
                       "indexer_topk's score kernel; candidate mask, block max and exact top-k in torch"),
    "log_softmax": (_ACT, (), L.batch_invariant, L.batch_invariant, "one program per row"),
    "apply_penalties": (_F32, (), L.batch_invariant, L.batch_invariant, "elementwise"),
    "sample": (_F32, (), L.batch_invariant, L.batch_invariant,
               "counter-based noise from shuili.hal.noise; exact rank keys"),
    "all_reduce": (_ACT, (), L.batch_invariant, L.batch_invariant, "fixed rank order"),
    "all_gather": (_ACT, (), L.batch_invariant, L.batch_invariant, "rank order"),
    "all_to_all": (_ACT, (), L.batch_invariant, L.batch_invariant, "rows copied (NCCL all_to_all_single)"),
}


@hookimpl
def shuili_platform_info():
    return PlatformInfo(name=NAME, vendor="NVIDIA", priority=100, hal_api_version=HAL_API_VERSION,
                        description="CUDA GPUs via torch + Triton (SM90 measured; FP4 decoded in registers "
                                    "on every SM, see docs/platforms/nvidia.md)")


def probe() -> Availability:
    import torch

    if not torch.cuda.is_available():
        build = "CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
        return Availability.no(f"no CUDA device visible (torch {torch.__version__}, {build})")
    try:
        import triton  # noqa: F401
    except ImportError:
        return Availability.no("triton is not installed: pip install 'shuili[nvidia]'")
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return Availability.no(f"{torch.cuda.get_device_name()} is sm{major}{minor}; the kernels need "
                               "sm80 or newer (bf16 tensor cores)")
    return Availability.yes(f"{torch.cuda.get_device_name()} (sm{major}{minor})", sm=major * 10 + minor)


@hookimpl
def shuili_platform_probe(platform):
    return probe() if platform == NAME else None


def capabilities(batch_invariant: bool) -> PlatformCapabilities:
    ops = {}
    for name, (dtypes, formats, default, bi, notes) in _CAPS.items():
        level = bi if batch_invariant else default
        mode_only = bi > default
        ops[name] = OpCapability(dtypes=dtypes, formats=formats, determinism=level,
                                 determinism_requires="batch_invariant" if mode_only and batch_invariant
                                 else None,
                                 notes=notes if batch_invariant or not mode_only
                                 else f"{notes} ({bi.name} with platform.batch_invariant: true)")
    return PlatformCapabilities(ops=ops, compute_dtypes=("bfloat16", "float16", "float32"),
                                graph_capture=True, collectives_backend="nccl (fixed rank order)",
                                device_type="cuda")


def batch_invariant(config) -> bool:
    return bool(getattr(config, "batch_invariant", False)) or os.environ.get(BI_ENV, "0") == "1"


@hookimpl
def shuili_platform_capabilities(platform, config):
    if platform != NAME:
        return None
    return capabilities(batch_invariant(config))


@hookimpl
def shuili_platform_ops(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.nvidia.ops import make_ops

    return make_ops(batch_invariant(config))


@hookimpl
def shuili_platform_graph_capture(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.nvidia.graphs import Capturer

    return Capturer()


@hookimpl
def shuili_platform_transfer(platform, config):
    if platform != NAME:
        return None
    from shuili.platforms.nvidia.transfer import CudaTransfer

    return CudaTransfer()
