"""Element codes (e4m3, e2m1, e8m0) as bit arithmetic, and the KV storage formats' pack/unpack kernels.

Codes are decoded and rounded with integer and exact float operations only, so one kernel source is
exact on SM90 (no FP4 instructions), on SM100 and under TRITON_INTERPRET; SM100's native e2m1
conversions are not used (see docs/platforms/nvidia.md). One decode is GPU-only: e2m1_bf16_x8 (PTX
inline assembly) gives e2m1_x8's values as bf16 for the weight GEMMs, bit for bit.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shuili.hal.formats import bytes_per_row, kv_spec  # noqa: F401 (bytes_per_row: for attention, indexer)
from shuili.platforms.nvidia.common import pow2

FORMAT_ID = {"none": 0, "mxfp8": 1, "fp4_e4m3": 2, "mxfp4": 3}  # the kernels' FMT constexpr

# split_rows may load rows whose byte width is a multiple of 4 as int32 words (else bytes);
# SHUILI_KV_WORD_LOADS=0 takes bytes everywhere (benchmarks/nvidia_sparse_decode.py times both)
WORD_LOADS = os.environ.get("SHUILI_KV_WORD_LOADS", "1") == "1"


def word_loads(row_bytes: int, rows: torch.Tensor) -> bool:
    """split_rows' WORDS for rows of row_bytes starting at rows' data pointer."""
    return WORD_LOADS and row_bytes % 4 == 0 and rows.data_ptr() % 4 == 0


# ------------------------------------------------------------------------------- element codes
@triton.jit
def rne_int(t):
    # |t| < 2^22: adding 1.5 * 2^23 lands where the float32 ulp is 1, so the add rounds to even
    return (t + 12582912.0) - 12582912.0


@triton.jit
def pow2_f32(e):
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_f32(s):
    """e8m0 bytes -> float32 2^(s - 127), as the reference decodes them (quant.e8m0_to_float): byte 0
    is the subnormal 2^-127, 255 is NaN. The shift alone would read them as 0 and inf."""
    b = s.to(tl.int32) & 255
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_f32(c):
    c = c.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    # Triton's unary minus is 0 - v, which loses -0: set the sign bit instead
    return (v.to(tl.int32, bitcast=True) | ((c & 128) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_f32(c):
    c = c.to(tl.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    v = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * pow2_f32(e - 1))
    return (v.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_e4m3(y):
    """RNE code of y, |y| <= 448 (callers clamp first); the sign survives rounding to zero."""
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)
    r = rne_int(a * pow2_f32(3 - e)) * pow2_f32(e - 3)
    rb = r.to(tl.int32, bitcast=True)
    re = ((rb >> 23) & 255) - 127
    code = tl.where(re >= -6, ((re + 7) << 3) | ((rb >> 20) & 7), (r * 512.0).to(tl.int32))
    return code | (sign << 7)


@triton.jit
def f32_to_e2m1(y):
    """RNE code of y, |y| <= 6; ties go to the even code (0.25 -> 0, 0.75 -> 1.0, 5 -> 4)."""
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.abs(y)
    q = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    r = rne_int(a * (1.0 / q)) * q
    code = tl.where(r < 2.0, r * 2.0, tl.where(r < 4.0, r + 2.0, r * 0.5 + 4.0)).to(tl.int32)
    return code | (sign << 3)


@triton.jit
def ue8m0_exponent(amax, floor, elem_max):
    """Biased exponent of 2^ceil(log2(max(amax, floor) / elem_max)), read off the float32 bits."""
    v = tl.math.div_rn(tl.maximum(amax, floor), elem_max)
    b = v.to(tl.int32, bitcast=True)
    return ((b >> 23) & 255) + ((b & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def e2m1_bits(x, SHIFT: tl.constexpr):
    """float32 e2m1 * 2^-126 of the nibble at bits 28 - SHIFT .. 31 - SHIFT of int32 x.

    A magnitude m = code & 7 placed as m << 22 is the float32 e2m1(m) * 2^-126 (code 1 lands on the
    subnormal 2^-127, codes 2..7 on exponent and mantissa), so a code needs two shifts and a mask:
    (x << SHIFT) >> 6 (arithmetic) brings the nibble's sign bit to bit 31 and its magnitude to bits
    22..24."""
    m = -0x7E400000  # 0x81C00000 written signed: Triton types the literal int32
    return (((x << SHIFT) >> 6) & m).to(tl.float32, bitcast=True)


@triton.jit
def mx_factors(sb):
    """(f1, f2), float32 with f1 * f2 = 2^126 * 2^(sb - 127) for e8m0 bytes sb (int32; 255 = NaN):
    the scale of e2m1_bits' values. Split so that neither overflows (2^253 does not fit a float32):
    f1 = 2^(min(sb, 128) - 1), f2 = 2^(max(sb, 128) - 128) or NaN. Every product is exact or
    overflows as the reference's does (to inf); small scales give subnormal results, which the
    multiplies keep (the kernels' FMULs are not flush-to-zero: benchmarks/qgemm_sass.py counts any
    FTZ op)."""
    f1 = ((tl.minimum(sb, 128) + 126) << 23).to(tl.float32, bitcast=True)
    f2 = tl.where(sb == 255, 0x7FC00000, (tl.maximum(sb, 128) - 1) << 23).to(tl.float32, bitcast=True)
    return f1, f2


@triton.jit
def e2m1_x8(word, sb):
    """The 8 e2m1 codes of int32 words (byte j: code 2j in the low nibble, 2j + 1 in the high one)
    times 2^(sb - 127) for e8m0 bytes sb (int32, broadcast against word; 255 = NaN), exact float32:
    (lo, hi), each [..., 4], lo[..., j] = element 2j, hi[..., j] = element 2j + 1. Used by qgemm's
    mxfp4 weight tiles and split_rows below."""
    f1, f2 = mx_factors(sb)
    l0 = e2m1_bits(word, 28) * f1 * f2
    h0 = e2m1_bits(word, 24) * f1 * f2
    l1 = e2m1_bits(word, 20) * f1 * f2
    h1 = e2m1_bits(word, 16) * f1 * f2
    l2 = e2m1_bits(word, 12) * f1 * f2
    h2 = e2m1_bits(word, 8) * f1 * f2
    l3 = e2m1_bits(word, 4) * f1 * f2
    h3 = e2m1_bits(word, 0) * f1 * f2
    # join(join(x0, x2), join(x1, x3))[..., p, q] = x_{2p + q}
    return tl.join(tl.join(l0, l2), tl.join(l1, l3)), tl.join(tl.join(h0, h2), tl.join(h1, h3))


@triton.jit
def e8m0_bf16_pair(sb):
    """e8m0 bytes (int32) -> int32 holding bfloat16 2^(sb - 127) twice (a bf16x2 operand): the high
    half of e8m0_to_f32's bits (exact: a power of two, or NaN), so byte 0 is the bf16 subnormal
    2^-127 and 255 NaN, as the reference decodes them."""
    bits = e8m0_to_f32(sb).to(tl.int32, bitcast=True) >> 16
    return bits | (bits << 16)


# An int32 word of mxfp4 codes (byte j: code 2j low nibble, 2j + 1 high) times a bf16x2 scale pair
# ($9) -> eight bf16, $i = code i. A code's magnitude (3 bits) picks the high and the low byte of its
# bf16 value out of two 8-byte tables with one prmt per four codes (high bytes 00 3F 3F 3F 40 40 40
# 40, low bytes 00 00 80 C0 00 40 80 C0: 0, 0.5, 1, 1.5, 2, 3, 4, 6). The signs need no table: a
# code's sign bit is the top bit of a byte of the word (odd codes) or of the word shifted left by 4
# (even codes), and prmt's sign-replicate selectors (nibble bit 3) copy it across the output byte.
# Byte permutes then pair the bytes into bf16 values, two a 32-bit register: K-adjacent codes (0, 1),
# (2, 3), ... (the pairs a bf16 MMA operand holds, so a tile in K order needs no register moves), or
# with EVEN_ODD (0, 2), (1, 3), ... The products with the scale are exact (two significant bits times
# a power of two), and PTX's bf16 multiply has no flush-to-zero form: subnormal results stay (2^-128
# at the least).
_E2M1_BF16_TEMPLATE = """{
.reg .b32 m, mh, w4, h0, l0, h1, l1, g0, g1, a, b, c, d;
and.b32 m, $8, 0x77777777;
shr.u32 mh, m, 16;
shl.b32 w4, $8, 4;
prmt.b32 h0, 0x3F3F3F00, 0x40404040, m;
prmt.b32 l0, 0xC0800000, 0xC0804000, m;
prmt.b32 h1, 0x3F3F3F00, 0x40404040, mh;
prmt.b32 l1, 0xC0800000, 0xC0804000, mh;
prmt.b32 g0, w4, $8, 0xD9C8;
prmt.b32 g1, w4, $8, 0xFBEA;
and.b32 g0, g0, 0x80808080;
and.b32 g1, g1, 0x80808080;
or.b32 h0, h0, g0;
or.b32 h1, h1, g1;
prmt.b32 a, l0, h0, PA;
prmt.b32 b, l0, h0, PB;
prmt.b32 c, l1, h1, PA;
prmt.b32 d, l1, h1, PB;
mul.rn.bf16x2 a, a, $9;
mul.rn.bf16x2 b, b, $9;
mul.rn.bf16x2 c, c, $9;
mul.rn.bf16x2 d, d, $9;
OUT
}"""
_E2M1_BF16_ASM = tl.constexpr(_E2M1_BF16_TEMPLATE.replace("PA", "0x5140").replace("PB", "0x7362").replace(
    "OUT", "mov.b32 {$0, $1}, a;\nmov.b32 {$2, $3}, b;\nmov.b32 {$4, $5}, c;\nmov.b32 {$6, $7}, d;"))
_E2M1_BF16_EO_ASM = tl.constexpr(_E2M1_BF16_TEMPLATE.replace("PA", "0x6240").replace("PB", "0x7351").replace(
    "OUT", "mov.b32 {$0, $2}, a;\nmov.b32 {$1, $3}, b;\nmov.b32 {$4, $6}, c;\nmov.b32 {$5, $7}, d;"))


@triton.jit
def e2m1_bf16_x8(word, pair, EVEN_ODD: tl.constexpr = False):
    """int32 words [...] of mxfp4 codes and the e8m0_bf16_pair of their scales -> the words' codes as
    bf16 (e2m1_x8's values, exact): EVEN_ODD, e2m1_x8's (lo, hi), [..., 2, 2] each; else (v, unused),
    v [..., 2, 2, 2] the eight codes in K order once the last three axes are flattened. GPU only (PTX
    inline assembly); the interpreter takes e2m1_x8."""
    if EVEN_ODD:
        c = tl.inline_asm_elementwise(_E2M1_BF16_EO_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [word, pair],
                                      dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        c = tl.inline_asm_elementwise(_E2M1_BF16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [word, pair],
                                      dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    # each join adds the fastest axis: [..., r, p, q] = c[4r + 2p + q]
    ev = tl.join(tl.join(c[0], c[4]), tl.join(c[2], c[6]))
    od = tl.join(tl.join(c[1], c[5]), tl.join(c[3], c[7]))
    if not EVEN_ODD:
        ev = tl.join(ev, od)
    # EVEN_ODD: ev[..., r, p] = c[2(2r + p)], od the next codes
    return ev, od


# ----------------------------------------------------------------------------------- row access
@triton.jit
def load_packed_rows(base, rows_ok, cols, D: tl.constexpr, FMT: tl.constexpr):
    """Dequantize packed rows in element order: a byte and a scale byte loaded per element. base is a
    uint8 pointer tensor [R], one per row; cols [C] element ids. Returns float32 [R, C]; rows not ok
    read as 0. kv_dequantize and the indexer's score kernel decode so. For the indexer's mxfp4 keys
    it is the faster decode: on an H100 (2026-12-06) the score kernel took 226 us for 64 tokens x
    16,384 keys, against 399 (bytes) and 452 us (int32 words) with split_rows' even/odd halves
    (benchmarks/nvidia_sparse_decode.py)."""
    ok = rows_ok[:, None] & (cols[None, :] < D)
    if FMT == 1:  # mxfp8: D e4m3 bytes, D/32 e8m0
        c = tl.load(base[:, None] + cols[None, :], mask=ok, other=0)
        s = tl.load(base[:, None] + D + cols[None, :] // 32, mask=ok, other=127)
        v = e4m3_to_f32(c) * e8m0_to_f32(s)
    else:
        byte = tl.load(base[:, None] + cols[None, :] // 2, mask=ok, other=0).to(tl.int32)
        nib = (byte >> ((cols[None, :] & 1) * 4)) & 15
        if FMT == 2:  # fp4_e4m3: D/2 bytes, D/16 e4m3 scales
            s = tl.load(base[:, None] + D // 2 + cols[None, :] // 16, mask=ok, other=0)
            v = e2m1_to_f32(nib) * e4m3_to_f32(s)
        else:  # mxfp4: D/2 bytes, D/32 e8m0 scales
            s = tl.load(base[:, None] + D // 2 + cols[None, :] // 32, mask=ok, other=127)
            v = e2m1_to_f32(nib) * e8m0_to_f32(s)
    return tl.where(ok, v, 0.0)


@triton.jit
def _e4m3(c, NATIVE: tl.constexpr):
    """e4m3 bytes (int32, 0..255) as float32: the hardware conversion, or the bit decode under the
    interpreter. The two agree on every code a quantizer writes (they differ on 0x7F / 0xFF, which
    the hardware reads as NaN, as the reference does)."""
    if NATIVE:
        return c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return e4m3_to_f32(c)


@triton.jit
def split_rows(base, ok, D: tl.constexpr, DP: tl.constexpr, FMT: tl.constexpr, WORDS: tl.constexpr,
               NATIVE: tl.constexpr):
    """Packed rows (FMT 1-3) dequantized as their even and odd elements, float32 (ev, od), each
    [R, DP // 2]: ev[:, i] = element 2i, od[:, i] = element 2i + 1; rows not ok and elements >= D
    read 0. base: uint8 pointer tensor [R], one per row.

    Why halves: an fp4 byte holds elements 2i (low nibble) and 2i + 1 (high), so the halves come
    out of whole-byte loads with two shifts and a mask each, and each scale group is an axis that its
    one scale byte broadcasts over. The caller dots the halves against its own even and odd columns.
    load_packed_rows loads a byte and a scale byte per element instead and takes about 3x the
    instructions, yet is the faster one in the indexer (see there). WORDS (row bytes a multiple of
    4, rows 4-byte aligned): the bytes load as int32 words; else as bytes. The values are the
    reference's (quant.kv_dequantize) exactly."""
    G: tl.constexpr = DP // (16 if FMT == 2 else 32)  # scale groups
    gi = tl.arange(0, G)
    gok = ok[:, None] & (gi[None, :] < D // (16 if FMT == 2 else 32))  # [R, G]
    if FMT == 1:  # mxfp8: D e4m3 bytes, then D/32 e8m0 scales
        s = e8m0_to_f32(tl.load(base[:, None] + D + gi[None, :], mask=gok, other=127))
        if WORDS:
            kk = tl.arange(0, 8)
            w = tl.load(base.to(tl.pointer_type(tl.int32))[:, None, None] + gi[None, :, None] * 8
                        + kk[None, None, :], mask=gok[:, :, None], other=0)  # [R, G, 8]
            ev = _e4m3(tl.join(w & 255, (w >> 16) & 255), NATIVE) * s[:, :, None, None]  # [R, G, 8, 2]
            od = _e4m3(tl.join((w >> 8) & 255, (w >> 24) & 255), NATIVE) * s[:, :, None, None]
        else:
            off = gi[None, :, None] * 32 + 2 * tl.arange(0, 16)[None, None, :]
            ce = tl.load(base[:, None, None] + off, mask=gok[:, :, None], other=0).to(tl.int32)
            co = tl.load(base[:, None, None] + off + 1, mask=gok[:, :, None], other=0).to(tl.int32)
            ev = _e4m3(ce, NATIVE) * s[:, :, None]
            od = _e4m3(co, NATIVE) * s[:, :, None]
    else:  # fp4_e4m3: D/2 bytes, D/16 e4m3 scales; mxfp4: D/2 bytes, D/32 e8m0 scales
        sb = tl.load(base[:, None] + D // 2 + gi[None, :], mask=gok, other=127 if FMT == 3 else 0)
        sb = sb.to(tl.int32)
        NB: tl.constexpr = 8 if FMT == 2 else 16  # bytes per scale group
        if WORDS:
            kk = tl.arange(0, NB // 4)
            w = tl.load(base.to(tl.pointer_type(tl.int32))[:, None, None] + gi[None, :, None] * (NB // 4)
                        + kk[None, None, :], mask=gok[:, :, None], other=0)  # [R, G, NB/4]
            if FMT == 2:  # the exact e2m1 values (scale byte 127 is 2^0), times the e4m3 scale
                ev, od = e2m1_x8(w, tl.full([1, 1, 1], 127, tl.int32))  # [R, G, 2, 2, 2]
                f = _e4m3(sb, NATIVE)[:, :, None, None, None]
                ev = ev * f
                od = od * f
            else:
                ev, od = e2m1_x8(w, sb[:, :, None])
        else:
            off = gi[None, :, None] * NB + tl.arange(0, NB)[None, None, :]
            b = tl.load(base[:, None, None] + off, mask=gok[:, :, None], other=0).to(tl.int32)
            ev = e2m1_bits(b, 28)  # e2m1 * 2^-126
            od = e2m1_bits(b, 24)
            if FMT == 2:
                f = _e4m3(sb, NATIVE)[:, :, None]
                ev = ev * 8.507059173023462e37 * f  # 2^126: exact e2m1, then the scale, both exact
                od = od * 8.507059173023462e37 * f
            else:
                f1, f2 = mx_factors(sb[:, :, None])
                ev = ev * f1 * f2
                od = od * f1 * f2
    ev = tl.reshape(ev, [ok.shape[0], DP // 2])
    od = tl.reshape(od, [ok.shape[0], DP // 2])
    rok = ok[:, None]
    return tl.where(rok, ev, 0.0), tl.where(rok, od, 0.0)


# -------------------------------------------------------------------------------------- kernels
@triton.jit
def _quantize_kernel(x_ptr, out_ptr, slot_ptr, N, s_xm, D: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr,
                     ROW_BYTES: tl.constexpr, ROWS: tl.constexpr, SLOTS: tl.constexpr):
    """Packs rows of x (row stride s_xm) into row r of out, or (SLOTS, kv_write) into row slot[r]
    of the cache out, skipping rows whose slot is negative (nothing read, nothing stored)."""
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    rok = r < N
    dst = r.to(tl.int64)
    if SLOTS:
        dst = tl.load(slot_ptr + r, mask=rok, other=-1).to(tl.int64)
        rok = rok & (dst >= 0)
    c = tl.arange(0, D)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * s_xm + c[None, :], mask=rok[:, None], other=0.0)
    x = x.to(tl.float32)
    xg = tl.reshape(x, (ROWS, D // G, G))
    amax = tl.max(tl.abs(xg), axis=2)  # [ROWS, D/G]
    out = out_ptr + dst * ROW_BYTES
    gid = tl.arange(0, D // G)
    if FMT == 2:
        s_code = f32_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(amax, 6.0), 0.001953125), 448.0))
        scale = e4m3_to_f32(s_code)
        y = tl.math.div_rn(xg, scale[:, :, None])
        s_byte = s_code
        s_off = D // 2
    else:
        if FMT == 1:
            e = ue8m0_exponent(amax, 1e-4, 448.0)
        else:
            e = ue8m0_exponent(amax, 6.0 * 1.1754943508222875e-38, 6.0)
        y = xg * ((254 - e) << 23).to(tl.float32, bitcast=True)[:, :, None]
        s_byte = e
        s_off = D if FMT == 1 else D // 2
    tl.store(out[:, None] + s_off + gid[None, :], s_byte.to(tl.uint8), mask=rok[:, None])
    y = tl.reshape(y, (ROWS, D))
    if FMT == 1:
        code = f32_to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
        tl.store(out[:, None] + c[None, :], code.to(tl.uint8), mask=rok[:, None])
    else:
        code = f32_to_e2m1(tl.minimum(tl.maximum(y, -6.0), 6.0))
        lo, hi = tl.split(tl.reshape(code, (ROWS, D // 2, 2)))
        h = tl.arange(0, D // 2)
        tl.store(out[:, None] + h[None, :], (lo | (hi << 4)).to(tl.uint8), mask=rok[:, None])


@triton.jit
def _dequantize_kernel(p_ptr, out_ptr, N, D: tl.constexpr, DP: tl.constexpr, FMT: tl.constexpr,
                       ROW_BYTES: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    rok = r < N
    c = tl.arange(0, DP)
    v = load_packed_rows(p_ptr + r.to(tl.int64) * ROW_BYTES, rok, c, D, FMT)
    tl.store(out_ptr + r[:, None].to(tl.int64) * D + c[None, :], v, mask=rok[:, None] & (c[None, :] < D))


def pack(x: torch.Tensor, fmt: str, out: torch.Tensor, slots: torch.Tensor | None) -> None:
    """Rows x [N, D] packed into out's rows (slots: into the cache rows they name)."""
    bits, group, _ = kv_spec(fmt)
    if x.dim() != 2:
        raise ValueError(f"kv_quantize takes rows [N, D], got shape {tuple(x.shape)}")
    n, d = x.shape
    if d % group or d != pow2(d):
        raise ValueError(f"kv format {fmt} needs a power-of-two row width divisible by {group}, got {d}")
    if n == 0:
        return
    rows = max(1, min(16, 4096 // d))
    # 16-bit rows are read as they are and widened in registers (exact): no float32 copy
    src = x if x.dtype in (torch.bfloat16, torch.float16) else x.float()
    if src.stride(-1) != 1:
        src = src.contiguous()
    _quantize_kernel[(triton.cdiv(n, rows),)](src, out, slots if slots is not None else out, n, src.stride(0),
                                              D=d, G=group, FMT=FORMAT_ID[fmt],
                                              ROW_BYTES=bytes_per_row(fmt, d), ROWS=rows,
                                              SLOTS=slots is not None)


def kv_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    out = torch.empty(x.shape[0], bytes_per_row(fmt, x.shape[-1]), dtype=torch.uint8, device=x.device)
    pack(x, fmt, out, None)
    return out


def kv_dequantize(packed: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    return dequantize_rows(packed, fmt, dim, torch.float32)


def dequantize_rows(packed: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """kv_dequantize's values stored as dtype: exact in bfloat16 too, since no format's element
    times its scale has more than 6 significand bits."""
    rb = bytes_per_row(fmt, dim)
    if packed.dim() != 2 or packed.shape[1] != rb or packed.dtype != torch.uint8:
        raise ValueError(f"kv_dequantize({fmt}, dim={dim}) takes uint8 [N, {rb}], got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    n = packed.shape[0]
    out = torch.empty(n, dim, dtype=dtype, device=packed.device)
    if n:
        rows = max(1, min(16, 4096 // pow2(dim)))
        _dequantize_kernel[(triton.cdiv(n, rows),)](packed.contiguous(), out, n, D=dim, DP=pow2(dim),
                                                    FMT=FORMAT_ID[fmt], ROW_BYTES=rb, ROWS=rows)
    return out
