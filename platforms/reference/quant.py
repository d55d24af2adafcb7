"""Quantization formats, bit-exact: e2m1 / e4m3fn / e8m0 elements, MX and e4m3-scaled FP4 KV rows,
and the fp8_block128 / fp8_block32 / mxfp4 weight formats (shuili/reference v4_arch.md sections 3.2 and 4).

Conventions everywhere:
* e2m1 codes: bit 3 sign, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} for codes 0..7; packed two per
  byte, element 2i in the low nibble.
* e8m0 byte b is 2^(b - 127); 255 is NaN.
* ue8m0 "ceil" scale of a float32 t > 0: exponent_field(t) + (mantissa(t) != 0) as the e8m0 byte,
  i.e. the smallest power of two >= t, read exactly from the bits (no log2).
* elements: q = clamp(x / scale, -max, max) in float32, then round to nearest, ties to even.
"""
from __future__ import annotations

import torch

from shuili.hal.formats import (E2M1_MAX, E4M3_MAX, FP4_E4M3_BLOCK, KV_FORMATS,  # noqa: F401
                                 MX_BLOCK, WEIGHT_FP8_BLOCK, WEIGHT_FP8_BLOCK32, bytes_per_row,
                                 check_weight, fp8_weight_block)
from shuili.hal.types import Weight

MXFP8_AMAX_FLOOR = 1e-4
MXFP4_AMAX_FLOOR = 6.0 * 2.0 ** -126
FP4_E4M3_SCALE_MIN = 2.0 ** -9

_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


# --------------------------------------------------------------------------------- element types
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 e2m1 codes (0..15), round to nearest, ties to even, saturating at +-6.
    Magnitude boundaries 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: ties at 0.25, 1.25, 2.5, 5 go down,
    at 0.75, 1.75, 3.5 up (to the even code). The sign bit follows the input's sign bit, so
    negative values that round to zero give -0 (code 8). NaN is rejected.
    """
    xf = x.to(torch.float32)
    if torch.isnan(xf).any():
        raise ValueError("e2m1_encode got NaN; e2m1 has no NaN encoding")
    a = xf.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
            + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
            + (a > 5.0).to(torch.uint8))
    return code | (torch.signbit(xf).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (0..15) -> float32 values."""
    return _E2M1_VALUES[(codes.to(torch.int64) & 0xF)]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] -> uint8 [..., n]: byte i = codes[2i] | codes[2i + 1] << 4."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dim, got {codes.shape[-1]}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(u8: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> codes [..., 2n], the low nibble first."""
    b = u8.view(torch.uint8) if u8.dtype == torch.int8 else u8.to(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> e4m3fn bytes (uint8): clamp to +-448 (saturate; the cast alone would give NaN),
    then torch's float8_e4m3fn cast, which rounds to nearest even.
    """
    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(u8: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (uint8) -> float32."""
    return u8.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t
    if t.dtype in (torch.int8, getattr(torch, "float8_e8m0fnu", torch.int8)):
        return t.view(torch.uint8)
    raise TypeError(f"expected uint8 e8m0 bytes, got {t.dtype}")


def e8m0_to_float(u8: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes -> float32 2^(b - 127), built from the bits (b = 0 is the subnormal 2^-127;
    b = 255 is NaN). Accepts uint8, int8 or torch.float8_e8m0fnu storage.
    """
    b = _as_u8(u8).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def float_to_e8m0_ceil(x: torch.Tensor) -> torch.Tensor:
    """float32 t -> e8m0 byte of the smallest power of two >= t: exponent_field + (mantissa != 0),
    exactly from the bits. Zero and subnormals follow the same formula (0 -> byte 0, subnormal ->
    byte 1 = 2^-126); values above 2^127 saturate to 254; inf and NaN give 255 (NaN).
    """
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    byte = exp_field + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    byte = torch.where(exp_field == 255, torch.full_like(byte, 255), byte.clamp_max(254))
    return byte.to(torch.uint8)


def _blocks(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"{what} needs the last dim to be a multiple of {block}, got {x.shape[-1]}")
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _mx_quantize(x: torch.Tensor, elem_max: float, floor: float, what: str):
    """Blocks of 32 along the last dim -> (scaled float32 elements [..., n, 32], e8m0 bytes [..., n])."""
    xb = _blocks(x, MX_BLOCK, what)
    amax = xb.abs().amax(-1)
    scale_byte = float_to_e8m0_ceil(amax.clamp_min(floor) / elem_max)
    scaled = (xb / e8m0_to_float(scale_byte)[..., None]).clamp(-elem_max, elem_max)
    return scaled, scale_byte


# ------------------------------------------------------------------------------------ KV formats
def kv_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows float [N, D] -> uint8 [N, bytes_per_row(fmt, D)], data bytes then scale bytes.
    mxfp8: e4m3 of x / 2^ceil(log2(max(amax32, 1e-4) / 448)).
    fp4_e4m3: scale = e4m3(clamp(amax16 / 6, 2^-9, 448)) (RNE), codes e2m1(clamp(x / scale, +-6)).
    mxfp4: e2m1 of x / 2^ceil(log2(max(amax32, 6 * 2^-126) / 6)).
    """
    if x.dim() != 2:
        raise ValueError(f"kv_quantize takes rows [N, D], got shape {tuple(x.shape)}")
    bytes_per_row(fmt, x.shape[1])
    n = x.shape[0]
    if fmt == "mxfp8":
        scaled, sb = _mx_quantize(x, E4M3_MAX, MXFP8_AMAX_FLOOR, "mxfp8")
        return torch.cat((e4m3_encode(scaled).reshape(n, -1), sb), dim=1)
    if fmt == "mxfp4":
        scaled, sb = _mx_quantize(x, E2M1_MAX, MXFP4_AMAX_FLOOR, "mxfp4")
        return torch.cat((pack_nibbles(e2m1_encode(scaled).reshape(n, -1)), sb), dim=1)
    xb = _blocks(x, FP4_E4M3_BLOCK, "fp4_e4m3")
    amax = xb.abs().amax(-1)
    sb = e4m3_encode((amax / E2M1_MAX).clamp(FP4_E4M3_SCALE_MIN, E4M3_MAX))
    scaled = (xb / e4m3_decode(sb)[..., None]).clamp(-E2M1_MAX, E2M1_MAX)
    return torch.cat((pack_nibbles(e2m1_encode(scaled).reshape(n, -1)), sb), dim=1)


def kv_dequantize(packed: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """uint8 [N, bytes_per_row(fmt, dim)] -> float32 [N, dim]: element times its scale (exact)."""
    width = bytes_per_row(fmt, dim)
    if packed.dim() != 2 or packed.shape[1] != width:
        raise ValueError(f"{fmt} rows of dim {dim} are uint8 [N, {width}], got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    p = _as_u8(packed)
    n = p.shape[0]
    if fmt == "mxfp8":
        vals = e4m3_decode(p[:, :dim]).reshape(n, dim // MX_BLOCK, MX_BLOCK)
        return (vals * e8m0_to_float(p[:, dim:])[..., None]).reshape(n, dim)
    half = dim // 2
    block = MX_BLOCK if fmt == "mxfp4" else FP4_E4M3_BLOCK
    vals = e2m1_decode(unpack_nibbles(p[:, :half])).reshape(n, dim // block, block)
    scale = e8m0_to_float(p[:, half:]) if fmt == "mxfp4" else e4m3_decode(p[:, half:])
    return (vals * scale[..., None]).reshape(n, dim)


# ------------------------------------------------------------------------------------- weights
def _expand_blocks(scale: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    return scale.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]


def dequantize_weight(w: Weight) -> torch.Tensor:
    """Logical float32 weight ([N, K] or [E, N, K]); exact (every product fits in float32)."""
    if w.format == "dense":
        return w.data.to(torch.float32)
    if w.format in ("fp8_block128", "fp8_block32"):
        if w.data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{w.format} data must be float8_e4m3fn, got {w.data.dtype}")
        b = fp8_weight_block(w.format)
        n, k = w.data.shape[-2:]
        if w.format == "fp8_block32":  # the contract's shape rules (K % 32, scale blocks), from hal
            check_weight(w.format, tuple(w.data.shape), tuple(w.scale.shape), tuple(w.data.shape))
        blocks = (-(-n // b), -(-k // b))
        if tuple(w.scale.shape[-2:]) != blocks:
            raise ValueError(f"{w.format} scale for [{n}, {k}] must be {blocks}, got "
                             f"{tuple(w.scale.shape)}")
        scale = w.scale
        if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
            scale = e8m0_to_float(scale)
        return w.data.to(torch.float32) * _expand_blocks(scale.to(torch.float32), n, k, b)
    if w.format == "mxfp4":
        data = _as_u8(w.data)
        n, half = data.shape[-2:]
        if tuple(w.scale.shape[-2:]) != (n, 2 * half // MX_BLOCK):
            raise ValueError(f"mxfp4 scale for data [{n}, {half}] must be [{n}, "
                             f"{2 * half // MX_BLOCK}], got {tuple(w.scale.shape)}")
        vals = e2m1_decode(unpack_nibbles(data))
        scale = e8m0_to_float(w.scale).repeat_interleave(MX_BLOCK, dim=-1)
        return vals * scale
    raise ValueError(f"unknown weight format {w.format!r}; use dense, fp8_block128, fp8_block32 or mxfp4")


def _quantize_fp8_blocks(w: torch.Tensor, fmt: str) -> Weight:
    """float [N, K] or [E, N, K] -> an fp8 block Weight: per b x b block (edge blocks partial)
    scale = ue8m0 ceil(max(amax, 448 * 2^-126) / 448) as float32, data = e4m3(w / scale)."""
    if w.dim() not in (2, 3):
        raise ValueError(f"weights are [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    b = fp8_weight_block(fmt)
    wf = w.to(torch.float32)
    n, k = wf.shape[-2:]
    bn, bk = -(-n // b), -(-k // b)
    padded = torch.zeros(*wf.shape[:-2], bn * b, bk * b, device=wf.device)
    padded[..., :n, :k] = wf.abs()
    amax = padded.reshape(*wf.shape[:-2], bn, b, bk, b).amax((-3, -1))
    scale = e8m0_to_float(float_to_e8m0_ceil(amax.clamp_min(E4M3_MAX * 2.0 ** -126) / E4M3_MAX))
    data = (wf / _expand_blocks(scale, n, k, b)).clamp(-E4M3_MAX, E4M3_MAX)
    return Weight(fmt, data.to(torch.float8_e4m3fn), scale, tuple(w.shape))


def quantize_weight_fp8_block128(w: torch.Tensor) -> Weight:
    """float [N, K] or [E, N, K] -> fp8_block128 Weight: per 128x128 block (edge blocks partial)
    scale = ue8m0 ceil(max(amax, 448 * 2^-126) / 448) as float32, data = e4m3(w / scale).
    """
    return _quantize_fp8_blocks(w, "fp8_block128")


def quantize_weight_fp8_block32(w: torch.Tensor) -> Weight:
    """float [N, K] or [E, N, K] (K % 32 == 0) -> fp8_block32 Weight: as fp8_block128 with 32x32
    blocks (the rows' edge block may be partial), DeepSeek-V4.1's dense-linear storage."""
    if w.dim() in (2, 3):
        from shuili.hal.formats import weight_scale_shape

        weight_scale_shape("fp8_block32", tuple(w.shape))  # K % 32, named
    return _quantize_fp8_blocks(w, "fp8_block32")


def quantize_weight_mxfp4(w: torch.Tensor) -> Weight:
    """float [N, K] or [E, N, K] (K % 32 == 0) -> mxfp4 Weight: per 32 along K, scale byte =
    ue8m0 ceil(max(amax, 6 * 2^-126) / 6), codes e2m1(w / scale) packed low nibble first.
    """
    if w.dim() not in (2, 3):
        raise ValueError(f"weights are [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    scaled, sb = _mx_quantize(w, E2M1_MAX, MXFP4_AMAX_FLOOR, "mxfp4 weights")
    codes = e2m1_encode(scaled).reshape(*w.shape[:-1], w.shape[-1])
    return Weight("mxfp4", pack_nibbles(codes), sb, tuple(w.shape))
