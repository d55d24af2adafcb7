"""Reading a GGUF file: its metadata as plain Python values, its tensors dequantized to float32.

The container (header, key/values, tensor infos) is parsed here with `struct` over a memory map:
`gguf.GGUFReader` gives the same values (tests/models/test_gguf_reader.py) but takes seconds on a
vocabulary's 100k strings, and a first `shuili generate` should not. The `gguf` package supplies
the type tables. Dequantization of the common llama.cpp block formats is done here, bit for bit as
llama.cpp's reference `dequantize_row_*` (float32 `d * q` then `+ m`, never fused), so the weights
equal those of `gguf.quants.dequantize` and of transformers' GGUF loader exactly
(tests/models/test_gguf_dequant.py checks it). Other block formats (K-quants, IQ*) are handed to
`gguf.quants.dequantize`, whose numpy code is not re-verified here.

Shapes: GGUF lists dimensions fastest-first (ne0 = columns); `GGUFTensor.shape` is torch order,
so a linear weight is [out_features, in_features], as in a transformers state dict.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

# ggml type ids (ggml.h); only the ones decoded here are named
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 0, 1, 2, 3, 6, 7, 8, 30
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
              Q8_0: "Q8_0", BF16: "BF16"}
QK = 32  # elements per block of the legacy quant formats
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # torch order: [..., rows, cols]
    raw: np.ndarray  # uint8 view of the tensor's bytes in the memory-mapped file

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.ggml_type) or _gguf_type_name(self.ggml_type)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.raw, self.ggml_type, self.shape)


@dataclass
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return self.require("general.architecture")

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing; the file is not a "
                             "complete llama.cpp model export (re-convert it with convert_hf_to_gguf.py)")
        return self.metadata[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> torch.Tensor:
        """The named tensor dequantized to float32, in torch order."""
        if name not in self.tensors:
            raise ValueError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        return self.tensors[name].dequantize()


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the container and memory-map the tensor data (nothing is dequantized yet)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    if os.path.getsize(path) == 0:  # np.memmap's own error names neither the file nor the fix
        raise ValueError(f"{path} is empty (0 bytes); expected a GGUF file (re-download it)")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    r = _Cursor(buf.data, path)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    r.pos = 4
    version = r.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian "
                         "file reads as a huge version)")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    metadata = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
        infos.append((name, dims, r.scalar("<I"), r.scalar("<Q")))
    align = int(metadata.get("general.alignment", 32))
    start = -(-r.pos // align) * align
    tensors = {}
    for name, dims, ggml_type, offset in infos:
        shape = tuple(int(n) for n in reversed(dims))
        nbytes = _nbytes(ggml_type, int(np.prod(shape)) if shape else 1, name)
        lo = start + offset
        if lo + nbytes > buf.size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated download?)")
        tensors[name] = GGUFTensor(name, ggml_type, shape, buf[lo:lo + nbytes])
    return GGUFFile(path, metadata, tensors)


def _nbytes(ggml_type: int, numel: int, name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {name!r} has ggml type {ggml_type}, unknown to the installed gguf "
                         "package (pip install -U gguf)") from None
    if numel % block:
        raise ValueError(f"tensor {name!r}: {numel} values are not whole blocks of {block}")
    return numel // block * size


# GGUF value types (gguf.GGUFValueType): struct formats of the fixed-size ones
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, data, path: str):
        self.data, self.pos, self.path = data, 0, path

    def scalar(self, fmt: str):
        try:
            (v,) = struct.unpack_from(fmt, self.data, self.pos)
        except struct.error:
            raise ValueError(f"{self.path}: GGUF header ends early (truncated file?)") from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.data[self.pos:self.pos + n])
        if len(s) != n:
            raise ValueError(f"{self.path}: GGUF header ends early (truncated file?)")
        self.pos += n
        return s.decode("utf-8")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub, n = self.scalar("<I"), self.scalar("<Q")
            if sub in _SCALARS:  # one unpack for the whole array
                fmt = _SCALARS[sub]
                vals = list(struct.unpack_from(f"<{n}{fmt[1]}", self.data, self.pos))
                self.pos += n * struct.calcsize(fmt)
                return vals
            return [self.value(sub) for _ in range(n)]
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


def _gguf_type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type{ggml_type}"


# ------------------------------------------------------------------------------ dequantization
def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor's values as float32 of `shape` (torch order)."""
    numel = int(np.prod(shape)) if shape else 1
    data = np.ascontiguousarray(raw)
    if ggml_type in _DECODERS:
        out = _DECODERS[ggml_type](data.view(np.uint8).reshape(-1), numel)
    else:
        from gguf.quants import dequantize as gguf_dequantize

        out = np.asarray(gguf_dequantize(data, ggml_type), dtype=np.float32)
    if out.size != numel:
        raise ValueError(f"GGUF tensor of type {_gguf_type_name(ggml_type)} decodes to {out.size} "
                         f"values, but its shape {shape} has {numel}: the file is truncated or corrupt")
    # numpy, not torch: torch's CPU kernels are far slower on these narrow strided byte slices
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(shape).copy())


def _blocks(data: np.ndarray, numel: int, ggml_type: int) -> np.ndarray:
    nbytes = BLOCK_BYTES[ggml_type]
    if numel % QK or data.size != numel // QK * nbytes:
        raise ValueError(f"{TYPE_NAMES[ggml_type]} tensor: {data.size} bytes do not hold "
                         f"{numel} values in blocks of {QK}")
    return data.reshape(-1, nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] little-endian bytes -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: the 16 low nibbles, then the 16 high nibbles (llama.cpp order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] uint8, bit j of it at column j."""
    word = np.ascontiguousarray(qh).view("<u4")  # [n, 1]
    return ((word >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)


# each is float32 arithmetic in llama.cpp's order: d * q, then + m (two roundings, no FMA)
def _q4_0(data: np.ndarray, numel: int) -> np.ndarray:
    b = _blocks(data, numel, Q4_0)
    q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return _f16(b[:, :2]) * q.astype(np.float32)


def _q4_1(data: np.ndarray, numel: int) -> np.ndarray:
    b = _blocks(data, numel, Q4_1)
    q = _nibbles(b[:, 4:]).astype(np.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q5_0(data: np.ndarray, numel: int) -> np.ndarray:
    b = _blocks(data, numel, Q5_0)
    q = (_nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)).astype(np.int8) - np.int8(16)
    return _f16(b[:, :2]) * q.astype(np.float32)


def _q5_1(data: np.ndarray, numel: int) -> np.ndarray:
    b = _blocks(data, numel, Q5_1)
    q = (_nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)).astype(np.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q8_0(data: np.ndarray, numel: int) -> np.ndarray:
    b = _blocks(data, numel, Q8_0)
    return _f16(b[:, :2]) * np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)


def _f32(data: np.ndarray, numel: int) -> np.ndarray:
    return data.view("<f4")


def _f16_tensor(data: np.ndarray, numel: int) -> np.ndarray:
    return data.view("<f2").astype(np.float32)


def _bf16(data: np.ndarray, numel: int) -> np.ndarray:
    """bfloat16 is the top half of a float32."""
    return (data.view("<u2").astype(np.uint32) << 16).view(np.float32)


_DECODERS: dict[int, Callable[[np.ndarray, int], np.ndarray]] = {
    F32: _f32, F16: _f16_tensor, BF16: _bf16,
    Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0,
}
