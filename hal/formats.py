"""Storage formats of the contract: KV rows and linear weights, their constants and sizes.

The row-size formula lives here once; models size their caches with it, platforms check packed
tensors with it, the conformance fuzzer builds cases with it. Element and scale encodings are
spelled out in `hal/ops.py` (`kv_quantize`, `linear`) and implemented bit-exactly by the
reference platform (`platforms/reference/quant.py`).
"""
from __future__ import annotations

KV_FORMATS = ("mxfp8", "fp4_e4m3", "mxfp4")
WEIGHT_FORMATS = ("dense", "fp8_block128", "mxfp4")

E4M3_MAX = 448.0
E2M1_MAX = 6.0
WEIGHT_FP8_BLOCK = 128  # fp8_block128: one scale per 128 x 128 block
MX_BLOCK = 32  # MX formats: one e8m0 scale per 32 elements
FP4_E4M3_BLOCK = 16  # fp4_e4m3: one e4m3 scale per 16 elements

# KV format -> (element bits, elements per scale, scale kind); scale kind 0 = e8m0, 1 = e4m3
KV_SPECS = {"mxfp8": (8, MX_BLOCK, 0), "fp4_e4m3": (4, FP4_E4M3_BLOCK, 1), "mxfp4": (4, MX_BLOCK, 0)}


def kv_spec(fmt: str) -> tuple[int, int, int]:
    if fmt not in KV_SPECS:
        raise ValueError(f"unknown KV format {fmt!r}; use one of {KV_FORMATS} ('none' rows are "
                         "unpacked floats)")
    return KV_SPECS[fmt]


def bytes_per_row(fmt: str, dim: int) -> int:
    """Packed bytes per KV row of `dim` values: element bytes, then one scale byte per group
    (mxfp8 dim + dim/32, fp4_e4m3 dim/2 + dim/16, mxfp4 dim/2 + dim/32: 528, 288 for dim 512)."""
    bits, group, _ = kv_spec(fmt)
    if dim <= 0 or dim % group:
        raise ValueError(f"{fmt} rows need a dim that is a positive multiple of {group}, got {dim}")
    return dim * bits // 8 + dim // group

