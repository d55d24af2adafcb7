"""GGUF dequantization: bit-exact against an element-by-element transcription of llama.cpp's
`dequantize_row_*` and against `gguf.quants.dequantize` (what transformers' loader uses)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from shuili.core.models import gguf_loader as gl

QTYPES = [gl.Q4_0, gl.Q4_1, gl.Q5_0, gl.Q5_1, gl.Q8_0]


def random_blocks(ggml_type: int, n_blocks: int, seed: int) -> np.ndarray:
    """Random quant bytes with finite float16 scales (d, and m where the format has one)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n_blocks, gl.BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    n_scales = 2 if ggml_type in (gl.Q4_1, gl.Q5_1) else 1
    scales = (rng.standard_normal((n_blocks, n_scales)) * 0.05).astype(np.float16)
    b[:, :2 * n_scales] = scales.view(np.uint8).reshape(n_blocks, 2 * n_scales)
    return b


def spec_dequantize(b: np.ndarray, ggml_type: int) -> np.ndarray:
    """llama.cpp ggml-quants.c, one element at a time (float32 products, then + m)."""
    f32 = np.float32
    out = np.zeros((b.shape[0], gl.QK), dtype=np.float32)
    for i, blk in enumerate(b):
        d = f32(blk[0:2].view(np.float16)[0])
        if ggml_type == gl.Q8_0:
            for j in range(32):
                out[i, j] = f32(np.int8(blk[2 + j].view(np.int8))) * d
            continue
        m = f32(blk[2:4].view(np.float16)[0]) if ggml_type in (gl.Q4_1, gl.Q5_1) else None
        qh_at = {gl.Q5_0: 2, gl.Q5_1: 4}.get(ggml_type)
        qs_at = {gl.Q4_0: 2, gl.Q4_1: 4, gl.Q5_0: 6, gl.Q5_1: 8}[ggml_type]
        qh = int(blk[qh_at:qh_at + 4].view("<u4")[0]) if qh_at is not None else 0
        for j in range(16):
            x0, x1 = int(blk[qs_at + j]) & 0x0F, int(blk[qs_at + j]) >> 4
            if qh_at is not None:
                x0 |= ((qh >> j) & 1) << 4
                x1 |= ((qh >> (j + 16)) & 1) << 4
            offset = {gl.Q4_0: 8, gl.Q5_0: 16}.get(ggml_type, 0)
            v0, v1 = f32(x0 - offset) * d, f32(x1 - offset) * d
            if m is not None:
                v0, v1 = f32(v0 + m), f32(v1 + m)
            out[i, j], out[i, j + 16] = v0, v1
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("ggml_type", QTYPES, ids=[gl.TYPE_NAMES[t] for t in QTYPES])
def test_blocks_match_llama_cpp_spec_and_gguf(ggml_type):
    rows, blocks_per_row = 6, 4
    b = random_blocks(ggml_type, rows * blocks_per_row, seed=ggml_type)
    shape = (rows, blocks_per_row * gl.QK)
    ours = gl.dequantize(b.reshape(rows, -1), ggml_type, shape)
    spec = torch.from_numpy(spec_dequantize(b, ggml_type).reshape(shape))
    lib = torch.from_numpy(np.asarray(gguf_dequantize(b.reshape(rows, -1), ggml_type)).reshape(shape).copy())
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(bits(ours), bits(spec))
    assert torch.equal(bits(ours), bits(lib))


def test_q4_1_hand_computed_block():
    # d = 0.5, m = -1: value = 0.5 * q - 1 with q the nibbles, low nibbles first
    qs = np.arange(16, dtype=np.uint8) | (np.uint8(15) - np.arange(16, dtype=np.uint8)) << 4
    blk = np.concatenate([np.array([0.5, -1.0], dtype=np.float16).view(np.uint8), qs])
    got = gl.dequantize(blk, gl.Q4_1, (32,))
    want = torch.tensor([0.5 * q - 1 for q in range(16)] + [0.5 * (15 - q) - 1 for q in range(16)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("name, ggml_type, np_dtype", [("F32", gl.F32, np.float32), ("F16", gl.F16, np.float16)])
def test_float_formats(name, ggml_type, np_dtype):
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np_dtype)
    got = gl.dequantize(x, ggml_type, (3, 8))
    assert torch.equal(got, torch.from_numpy(x.astype(np.float32)))


def test_bf16_is_the_top_half_of_float32():
    x = torch.randn(5, 16).to(torch.bfloat16)
    raw = x.view(torch.int16).numpy()
    got = gl.dequantize(raw, gl.BF16, (5, 16))
    assert torch.equal(got, x.float())
    assert torch.equal(got, torch.from_numpy(gguf_dequantize(raw.view(np.uint8), gl.BF16).reshape(5, 16).copy()))


def test_truncated_tensor_is_a_clear_error():
    b = random_blocks(gl.Q4_1, 3, seed=0)
    with pytest.raises(ValueError, match="do not hold"):
        gl.dequantize(b.reshape(-1)[:-1], gl.Q4_1, (3 * gl.QK,))


def test_smollm2_file_tensors_match_gguf(smollm2_path):
    # one layer and the embedding cover the file's formats; test_llama_smollm2 compares all
    # weights with transformers' state dict
    f = gl.read_gguf(smollm2_path)
    picked = [t for n, t in f.tensors.items() if n.startswith("blk.0.") or n == "token_embd.weight"]
    assert {t.ggml_type for t in picked} == {t.ggml_type for t in f.tensors.values()} >= {gl.Q4_1, gl.Q8_0}
    for t in picked:
        ours = t.dequantize()
        lib = np.asarray(gguf_dequantize(t.raw, t.ggml_type)).reshape(t.shape)
        assert torch.equal(bits(ours), bits(torch.from_numpy(lib.copy()))), t.name


@pytest.fixture(scope="module")
def smollm2_path():
    from shuili.core.models.llama import resolve_named

    try:
        return resolve_named("smollm2-135m")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
