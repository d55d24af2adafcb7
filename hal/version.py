"""The HAL API version a platform plugin declares in `PlatformInfo.hal_api_version`.

Major: a plugin built for another major is refused (ops were renamed or changed meaning).
Minor: ops were added; a plugin for an older minor resolves, missing the new ops (which then need
a declared fallback).
"""
# 1.1: optional graph capture hook; 1.2: sample host hints; 1.3: optional transfer hook;
# 1.4: indexer_select and engram_gate (DeepSeek-V4.1), all_to_all (expert dispatch/combine);
# 1.5: weight format fp8_block32 (V4.1's FP8 32x32 linears); 1.6: compress_pool (the compressor's
# pooling, so a decode step reads only the entries it completes), hc_collapse and hc_expand (the
# mHC stream collapse and expand, so a platform can fuse what was per-layer elementwise glue);
# 1.7: hc_mix (norm, mixing linear and Sinkhorn of a layer's mHC coefficients as one op);
# 1.8: paged_slots (the block-table lookups of a step's window, compressed and state entries,
# which were 14 torch kernels each); 1.9: kv_write (kv_quantize + cache_write, so new KV rows are
# packed where they are stored) and rms_norm_rope (rms_norm + rope of a step's q / KV rows);
# 1.10: block_diagonal_linear (V4's grouped output projection on its rows as they lie);
# 1.11: rope's may_overwrite hint (rotate in place), hal.checks (a caller's range-checked inputs)
HAL_API_VERSION = "1.11"
HAL_API_MAJOR = int(HAL_API_VERSION.split(".")[0])
HAL_API_MINOR = int(HAL_API_VERSION.split(".")[1])
