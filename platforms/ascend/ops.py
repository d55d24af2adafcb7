"""The Ascend op table: every HAL op bound to one NpuApi (real torch_npu or the simulator)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from shuili.hal.ops import OP_NAMES
from shuili.platforms.ascend import attention, collectives, gemm, indexer, kv, norm_rope
from shuili.platforms.ascend.host import on_host
from shuili.platforms.reference.public import (composed_block_diagonal_linear, composed_hc_mix,
                                               composed_kv_write, composed_rms_norm_rope)

# no torch_npu op covers these (vllm-ascend samples with plain torch on 950, too)
HOST_OPS = ("log_softmax", "apply_penalties", "sample")


# opt-in: fp8_block128 / fp8_block32 linears as MXFP8 x MXFP8 GEMMs (quantizes activations, which the HAL
# contract does not: results leave the conformance tolerance; for throughput experiments only)
MX_GEMM_ENV = "SHUILI_ASCEND_MX_GEMM"


@dataclass(frozen=True)
class Mode:
    batch_invariant: bool = False
    deterministic: bool = False
    family: str = "950"
    mx_gemm: bool = False

    @property
    def is_950(self) -> bool:
        return self.family == "950"


def mode_for(config, family: str = "950") -> Mode:
    return Mode(batch_invariant=config.batch_invariant, deterministic=config.deterministic,
                family=family, mx_gemm=os.environ.get(MX_GEMM_ENV) == "1")


def build_ops(api, mode: Mode) -> dict:
    table: dict = {}
    for module in (norm_rope, gemm, attention, indexer, kv, collectives):
        table.update(module.build(api, mode))
    for name in HOST_OPS:
        table[name] = on_host(name)
    # no torch_npu op fuses the mHC norm, mixing linear and Sinkhorn: the three of this table, so the
    # norm and the linear stay on the NPU (the linear's tiling decides the determinism: kind "split")
    table["hc_mix"] = composed_hc_mix(table["rms_norm"], table["linear"], table["hc_split_sinkhorn"])
    # npu_scatter_pa_kv_cache stores rows as they are: they are packed first, by this table's kv_quantize
    table["kv_write"] = composed_kv_write(table["kv_quantize"], table["cache_write"])
    # npu_rms_norm, then npu_rotary_mul: no torch_npu op does both
    table["rms_norm_rope"] = composed_rms_norm_rope(table["rms_norm"], table["rope"])
    # npu_grouped_matmul takes rows grouped by block: regrouped there and back around it
    table["block_diagonal_linear"] = composed_block_diagonal_linear(table["grouped_linear"])
    missing = [n for n in OP_NAMES if n not in table]
    if missing:
        raise RuntimeError(f"the Ascend op table lacks {missing}")
    return table
