"""The reference helpers a vendor backend may import: the one declared public surface of
`shuili.platforms.reference`. Everything else in this package is internal and may change
between releases; a helper a backend needs is added here, not imported from its module.

  OPS                       every HAL op's reference implementation (fallbacks, delegation)
  capabilities(config)      the reference platform's declared capabilities
  tree_sum, silu            re-exported from shuili.hal.numerics (the contract's defined arithmetic,
                            which backends may also import directly)
  apply_penalties           the penalty op (elementwise, device-agnostic)
  check_rope_args           the rope op's argument checks, shared so errors read the same
  composed_rms_norm_rope    rms_norm_rope built from a table's rms_norm and rope
  check_hc_args             hc_collapse / hc_expand's shape checks, shared likewise
  check_hc_mix_args         hc_mix's argument checks, shared likewise
  composed_hc_mix           hc_mix built from a table's rms_norm, linear and hc_split_sinkhorn
  check_pool_args           compress_pool's shape checks, shared likewise
  check_slots_args          paged_slots' argument checks, shared likewise
  check_kv_write_args       kv_write's argument checks, shared likewise
  composed_kv_write         kv_write built from a table's kv_quantize and cache_write
  check_block_diagonal_args block_diagonal_linear's shape checks, shared likewise
  composed_block_diagonal_linear  block_diagonal_linear built from a table's grouped_linear
  check_counts              all_to_all's count checks (from shuili.hal.distributed, which also
                            holds the one all_to_all of every platform)
  dequantize_weight         any contract weight format -> float32 (exact)
  quantize_weight_*         test checkpoints in the fp8_block128 / fp8_block32 / mxfp4 weight formats
  kv_quantize, kv_dequantize  the KV row formats, bit-exact
"""
from __future__ import annotations

from shuili.hal.distributed import check_counts
from shuili.hal.numerics import silu, tree_sum
from shuili.platforms.reference.gemm import check_block_diagonal_args, composed_block_diagonal_linear
from shuili.platforms.reference.kvcache import (check_kv_write_args, check_pool_args, check_slots_args,
                                                composed_kv_write)
from shuili.platforms.reference.mhc import check_hc_args, check_hc_mix_args, composed_hc_mix
from shuili.platforms.reference.ops import OPS
from shuili.platforms.reference.quant import (dequantize_weight, kv_dequantize, kv_quantize,
                                              quantize_weight_fp8_block128, quantize_weight_fp8_block32,
                                              quantize_weight_mxfp4)
from shuili.platforms.reference.rope import check_rope_args, composed_rms_norm_rope
from shuili.platforms.reference.sampling import apply_penalties

__all__ = ["OPS", "capabilities", "tree_sum", "silu", "apply_penalties", "check_rope_args",
           "composed_rms_norm_rope", "check_hc_args",
           "check_hc_mix_args", "composed_hc_mix",
           "check_pool_args", "check_slots_args", "check_kv_write_args", "composed_kv_write", "check_counts",
           "check_block_diagonal_args", "composed_block_diagonal_linear",
           "dequantize_weight", "quantize_weight_fp8_block128", "quantize_weight_fp8_block32", "quantize_weight_mxfp4",
           "kv_quantize", "kv_dequantize"]


def capabilities(config):
    """The reference platform's PlatformCapabilities under `config`."""
    from shuili.platforms.reference.plugin import shuili_platform_capabilities

    return shuili_platform_capabilities(platform="reference", config=config)
