"""Storage formats of the contract: KV rows and linear weights, their constants and sizes.

The row-size formula lives here once; models size their caches with it, platforms check packed
tensors with it, the conformance fuzzer builds cases with it. Element and scale encodings are
spelled out in `hal/ops.py` (`kv_quantize`, `linear`) and implemented bit-exactly by the
reference platform (`platforms/reference/quant.py`).
"""
from __future__ import annotations

KV_FORMATS = ("mxfp8", "fp4_e4m3", "mxfp4")
WEIGHT_FORMATS = ("dense", "fp8_block128", "fp8_block32", "mxfp4")

E4M3_MAX = 448.0
E2M1_MAX = 6.0
WEIGHT_FP8_BLOCK = 128  # fp8_block128: one scale per 128 x 128 block
WEIGHT_FP8_BLOCK32 = 32  # fp8_block32 (DeepSeek-V4.1's dense linears): one scale per 32 x 32 block
# fp8 weight format -> its square scale block (rows and columns)
FP8_WEIGHT_BLOCKS = {"fp8_block128": WEIGHT_FP8_BLOCK, "fp8_block32": WEIGHT_FP8_BLOCK32}
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



def fp8_weight_block(fmt: str) -> int:
    """The square scale block of an fp8 weight format (128 or 32)."""
    if fmt not in FP8_WEIGHT_BLOCKS:
        raise ValueError(f"{fmt!r} is not an fp8 weight format; use one of {tuple(FP8_WEIGHT_BLOCKS)}")
    return FP8_WEIGHT_BLOCKS[fmt]


def weight_scale_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of logical `shape` ([N, K] or [E, N, K]):
    fp8_block128 / fp8_block32 [..., ceil(N/b), ceil(K/b)] (fp8_block32 also needs K % 32 == 0),
    mxfp4 [..., N, K/32]; () for dense (no scale)."""
    *lead, n, k = shape
    if fmt == "dense":
        return ()
    if fmt == "mxfp4":
        if k % MX_BLOCK:
            raise ValueError(f"mxfp4 weights need K % {MX_BLOCK} == 0, got K={k}")
        return (*lead, n, k // MX_BLOCK)
    b = fp8_weight_block(fmt)
    if fmt == "fp8_block32" and k % b:
        raise ValueError(f"fp8_block32 weights need K (in_features) % 32 == 0, got K={k}: one ue8m0 "
                         "scale covers 32 whole columns (pad K, or keep the weight dense)")
    return (*lead, -(-n // b), -(-k // b))


def weight_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of a weight of logical `shape` as a checkpoint stores it: elements (bf16 2, e4m3 1,
    e2m1 1/2) plus one byte per e8m0 scale (platforms may widen fp8 scales to float32 in memory)."""
    numel = 1
    for d in shape:
        numel *= d
    scales = 1
    for d in weight_scale_shape(fmt, shape):
        scales *= d
    if fmt == "dense":
        return 2 * numel
    if fmt == "mxfp4":
        return numel // 2 + scales
    return numel + scales


def check_weight(fmt: str, data_shape: tuple[int, ...], scale_shape: tuple[int, ...] | None,
                 shape: tuple[int, ...]) -> None:
    """Raise ValueError naming the problem when stored data / scale shapes do not fit the logical
    `shape` in `fmt` (dtypes are the platform's to check: torch is not imported here)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; use one of {WEIGHT_FORMATS}")
    if len(shape) not in (2, 3):
        raise ValueError(f"{fmt} weights are [N, K] or [E, N, K], got logical shape {tuple(shape)}")
    want_data = (*shape[:-1], shape[-1] // 2) if fmt == "mxfp4" else tuple(shape)
    if tuple(data_shape) != want_data:
        raise ValueError(f"{fmt} data for logical {tuple(shape)} must be {want_data}, got {tuple(data_shape)}")
    want_scale = weight_scale_shape(fmt, tuple(shape))
    if fmt == "dense":
        return
    if scale_shape is None or tuple(scale_shape) != want_scale:
        raise ValueError(f"{fmt} scale for logical {tuple(shape)} must be {want_scale}, got "
                         f"{None if scale_shape is None else tuple(scale_shape)}")
