"""The GGUF container parser against `gguf.GGUFReader`, on a file written by `gguf.GGUFWriter`
(every value type, odd alignment) and on the shipped SmolLM2 file."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from shuili.core.models.gguf_loader import read_gguf


def assert_same_as_gguf_reader(path: str, max_tensor_bytes: int | None = None) -> None:
    """Metadata and tensor infos all equal; tensor bytes compared for the first tensors, up to
    `max_tensor_bytes` in all (None: every tensor)."""
    ours = read_gguf(path)
    ref = GGUFReader(path, "r")
    assert set(ours.metadata) == set(ref.fields)
    for name, field in ref.fields.items():
        assert ours.metadata[name] == field.contents(), name
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    budget = max_tensor_bytes
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type)
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert mine.raw.nbytes == t.n_bytes
        if budget is not None:
            if budget < t.n_bytes:
                continue
            budget -= t.n_bytes
        assert np.array_equal(np.asarray(mine.raw).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


@pytest.fixture()
def synthetic_gguf(tmp_path):
    path = str(tmp_path / "synthetic.gguf")
    w = GGUFWriter(path, "llama")
    w.add_uint32("general.alignment", 64)
    w.add_key_value("t.u8", 7, GGUFValueType.UINT8)
    w.add_key_value("t.i8", -7, GGUFValueType.INT8)
    w.add_key_value("t.u16", 65000, GGUFValueType.UINT16)
    w.add_key_value("t.i16", -3000, GGUFValueType.INT16)
    w.add_key_value("t.i32", -70000, GGUFValueType.INT32)
    w.add_key_value("t.u64", 2**40 + 3, GGUFValueType.UINT64)
    w.add_key_value("t.i64", -(2**40), GGUFValueType.INT64)
    w.add_key_value("t.f32", 0.1, GGUFValueType.FLOAT32)
    w.add_key_value("t.f64", 0.1, GGUFValueType.FLOAT64)
    w.add_key_value("t.bool", True, GGUFValueType.BOOL)
    w.add_string("t.str", "héllo wörld ☃")
    w.add_array("t.strs", ["a", "", "Ġthe", "<|im_end|>"])
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -2.25])
    rng = np.random.default_rng(0)
    w.add_tensor("a.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.f16", rng.standard_normal((2, 7)).astype(np.float16))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("c.q8_0", quantize(q, GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("d.q4_1", quantize(q, GGMLQuantizationType.Q4_1),
                 raw_dtype=GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_synthetic_file_reads_like_gguf_reader(synthetic_gguf):
    assert_same_as_gguf_reader(synthetic_gguf)
    f = read_gguf(synthetic_gguf)
    assert f.metadata["t.str"] == "héllo wörld ☃" and f.metadata["t.bool"] is True
    assert f.tensors["c.q8_0"].shape == (4, 64) and f.tensors["a.f32"].shape == (3, 5)
    assert f.tensor("a.f32").shape == (3, 5)


def test_truncated_and_foreign_files_are_clear_errors(synthetic_gguf, tmp_path):
    data = open(synthetic_gguf, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="past the end of the file"):
        read_gguf(str(cut))
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    with pytest.raises(ValueError, match="ends early|past the end"):
        read_gguf(str(header_only))
    other = tmp_path / "model.bin"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(other))
    with pytest.raises(FileNotFoundError):
        read_gguf(str(tmp_path / "missing.gguf"))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=f"^{empty} is empty \\(0 bytes\\); expected a GGUF file"):
        read_gguf(str(empty))
    with pytest.raises(ValueError, match="tensor 'nope' is missing"):
        read_gguf(synthetic_gguf).tensor("nope")


def test_smollm2_file_reads_like_gguf_reader():
    from shuili.core.models.llama import resolve_named

    try:
        path = resolve_named("smollm2-135m")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert_same_as_gguf_reader(path, max_tensor_bytes=8 << 20)
