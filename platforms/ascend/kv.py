"""KV cache writes (npu_scatter_pa_kv_cache, cache_mode "Norm") and KV formats (MXFP8 through
npu_dynamic_mx_quant; the FP4 formats through the host torch path)."""
from __future__ import annotations

import torch

from shuili.platforms.ascend.host import on_device, on_host, took

SCATTER_DTYPES = (torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.float8_e4m3fn)
MXFP8_AMAX_FLOOR = 1e-4
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LAYOUT = {"mxfp8": (32, 1), "mxfp4": (32, 2), "fp4_e4m3": (16, 2)}  # block, elements per byte


def _e8m0(b: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes -> float32 2^(b-127) built from the bits (0 -> 2^-127, 255 -> NaN)."""
    b = b.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def dequant_rows(packed: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """uint8 rows [N, bytes] of a kv_quantize format -> float32 [N, dim], exact, on any device."""
    if fmt not in _LAYOUT:
        raise ValueError(f"unknown KV format {fmt!r}; use one of {sorted(_LAYOUT)}")
    block, per_byte = _LAYOUT[fmt]
    data = dim // per_byte
    if dim <= 0 or dim % block or packed.dim() != 2 or packed.shape[1] != data + dim // block:
        raise ValueError(f"{fmt} rows of dim {dim} are uint8 [N, {data + dim // block}], got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    p = packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)
    n = p.shape[0]
    if fmt == "mxfp8":
        vals = p[:, :dim].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    else:
        lut = torch.tensor(_E2M1, dtype=torch.float32, device=p.device)
        codes = torch.stack((p[:, :data] & 0xF, p[:, :data] >> 4), dim=-1).reshape(n, dim)
        vals = lut[codes.to(torch.int64)]
    tail = p[:, data:].contiguous()
    scale = tail.view(torch.float8_e4m3fn).to(torch.float32) if fmt == "fp4_e4m3" else _e8m0(tail)
    return (vals.view(n, dim // block, block) * scale[..., None]).view(n, dim)


def build(api, mode) -> dict:
    npu = api.ops
    host_quant = on_host("kv_quantize")

    def cache_write(cache, slot_mapping, values):
        if values.dtype != cache.dtype:
            raise TypeError(f"cache_write: values {values.dtype} must be the cache's {cache.dtype}")
        if tuple(cache.shape[2:]) != tuple(values.shape[1:]):
            raise ValueError(f"cache_write: values rows {tuple(values.shape[1:])} do not match cache "
                             f"{tuple(cache.shape)} ([num_blocks, block_size, ...])")
        keep = slot_mapping >= 0
        if not bool(keep.all()):  # the kernel does not document skipping negative slots
            values, slot_mapping = values[keep], slot_mapping[keep]
        if values.shape[0] == 0:
            return None
        if cache.dtype not in SCATTER_DTYPES or cache.dim() not in (3, 4):
            took("cache_write:torch")
            cache.view(-1, *values.shape[1:])[slot_mapping.to(torch.int64)] = values
            return None
        c, v = cache, values
        if c.dim() == 3:  # packed rows [nb, bs, row] -> one "head" of width row
            c, v = c.unsqueeze(2), v.unsqueeze(1)
        if c.dtype == torch.uint8:
            c, v = c.view(torch.int8), v.view(torch.int8)
        # one cache (V4 keeps K = V): both halves of the K/V op target it with the same rows
        took("cache_write:npu_scatter_pa_kv_cache")
        npu.npu_scatter_pa_kv_cache(key=v, value=v, key_cache=c, value_cache=c,
                                    slot_mapping=slot_mapping, cache_mode="Norm")
        return None

    def kv_quantize(x, fmt):
        # the contract packs 16-bit rows as their float32 values; the NPU op's bf16 path is unverified
        x = x.float()
        if fmt == "mxfp8" and mode.is_950 and x.dim() == 2 and x.shape[1] % 32 == 0 and x.shape[1]:
            took("kv_quantize:npu_dynamic_mx_quant")
            # scale_alg 1: 2^ceil(log2(max(amax, low_bound) / 448)) from the fp32 bits, as the contract
            y, scale = npu.npu_dynamic_mx_quant(
                input=x, axis=-1, round_mode="rint", dst_type=api.code("float8_e4m3fn"),
                block_size=32, scale_alg=1, max_low_bound=MXFP8_AMAX_FLOOR)
            n, d = x.shape
            return torch.cat((y.view(torch.uint8), scale.reshape(n, -1)[:, : d // 32]), dim=1)
        return host_quant(x, fmt)

    def kv_dequantize(packed, fmt, dim):
        took("kv_dequantize:torch")
        return dequant_rows(packed, fmt, dim)

    # no torch_npu op pools V4's compressor state: the reference's torch code, on the device (what
    # the model ran inline before the op existed; the state cache never leaves the NPU)
    compress_pool = on_device("compress_pool")

    # no torch_npu op looks up block tables for arbitrary entries: the reference's torch code on the
    # device (integer ops, elementwise; what the models ran inline before HAL 1.8)
    paged_slots = on_device("paged_slots")

    return {"cache_write": cache_write, "kv_quantize": kv_quantize, "kv_dequantize": kv_dequantize,
            "compress_pool": compress_pool, "paged_slots": paged_slots}
