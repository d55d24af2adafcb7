"""V4.1 Engram: hash vs the transformers oracle, mapped tables, step gathers, never on the device."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from models_helpers import InlineExecutor, TensorWatch

from shuili.core.models.engram import Engram, EngramTable
from shuili.core.models.engram_hash import (EngramHasher, EngramSpec, build_compressed_token_map,
                                           engram_history, windows_from)
from shuili.hal import PlatformConfig, resolve_platform

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "engram" / "hash_golden.json").read_text())
OPS = resolve_platform(PlatformConfig(platform="reference")).ops


def _spec(c: dict, **over) -> EngramSpec:
    kw = dict(layer_ids=tuple(c["engram_layer_ids"]), max_ngram_size=c["engram_max_ngram_size"],
              n_heads=c["engram_n_heads"], head_dim=256, vocab_size=c["engram_vocab_size"],
              pad_id=c["engram_pad_id"], compressed_vocab_size=c["engram_compressed_vocab_size"],
              num_embeddings=tuple(c["engram_num_embeddings"]))
    kw.update(over)
    return EngramSpec(**kw)


def _token_map(c: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(c["token_map_seed"])
    return torch.randint(0, c["engram_compressed_vocab_size"], (c["tokenizer_vocab"],), generator=g)


def _hash_request(hasher: EngramHasher, toks: list[int], start: int, end: int) -> torch.Tensor:
    lb = hasher.spec.lookback
    hist = torch.tensor(engram_history(lambda a, b: toks[a:b], start, end, lb)).view(end - start, lb)
    return hasher(windows_from(torch.tensor(toks[start:end]), hist))


# ------------------------------------------------------------------------------------ the hash
@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_hash_constants_match_the_oracle(case):
    spec = _spec(case)
    assert spec.multipliers == case["multipliers"]
    assert spec.primes == case["primes"]
    assert spec.offsets == case["offsets"]
    assert spec.table_rows == case["engram_num_embeddings"]


def test_released_table_sizes_follow_from_the_hash():
    # the released config's engram_num_embeddings are exactly the sums of each layer's 24 primes
    assert _spec(GOLDEN["cases"][0]).table_rows == [384006168, 384016682]


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_row_ids_match_the_oracle_bit_for_bit(case):
    hasher = EngramHasher(_spec(case), _token_map(case))
    for toks, want in zip(case["input_ids"], case["row_ids"]):
        got = _hash_request(hasher, toks, 0, len(toks))
        assert got.dtype == torch.int64 and got.tolist() == want


def test_a_wrong_multiplier_seed_is_caught():  # negative control for the golden comparison
    case = GOLDEN["cases"][0]
    spec = _spec(case, layer_ids=(2, 14))
    hasher = EngramHasher(spec, _token_map(case))
    toks = case["input_ids"][0]
    assert _hash_request(hasher, toks, 0, len(toks)).tolist() != case["row_ids"][0]


@pytest.mark.parametrize("cuts", [[7, 8], [1, 2, 3, 4], [20], [39]])
def test_chunked_hash_is_the_one_shot_hash(cuts):
    """The look-back is rebuilt from the request's tokens: any chunking, a prefix-cache hit (a first
    chunk starting mid-prompt) or a preemption (recompute from token 0) gives the same row ids."""
    case = GOLDEN["cases"][0]
    hasher = EngramHasher(_spec(case), _token_map(case))
    toks = case["input_ids"][1]
    bounds = [0, *cuts, len(toks)]
    parts = [_hash_request(hasher, toks, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    assert torch.cat(parts).tolist() == case["row_ids"][1]


def test_history_marks_the_sequence_start():
    toks = [10, 11, 12, 13, 14]
    assert engram_history(lambda a, b: toks[a:b], 0, 2, 3) == [-1, -1, -1, 10, -1, -1]
    assert engram_history(lambda a, b: toks[a:b], 4, 5, 3) == [13, 12, 11]


def test_compressed_token_map_matches_the_oracle():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(GOLDEN["toy_tokenizer"]))
    got, size = build_compressed_token_map(tok)
    assert (got, size) == (GOLDEN["compressed_map"], GOLDEN["compressed_size"])
    assert got[3] == got[4] == got[5] == got[6]  # "The" "the" " the" "THE" share one id


def test_spec_rejects_tables_smaller_than_the_hash():
    with pytest.raises(ValueError, match="engram_num_embeddings for layer 1"):
        _spec(GOLDEN["cases"][1], num_embeddings=(100, GOLDEN["cases"][1]["engram_num_embeddings"][1]))


def test_hasher_rejects_a_map_from_another_tokenizer():
    case = GOLDEN["cases"][1]
    with pytest.raises(ValueError, match="another tokenizer"):
        EngramHasher(_spec(case), torch.full((96,), case["engram_compressed_vocab_size"]))


# ------------------------------------------------------------------------------------- tables
def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A minimal safetensors writer (dtype string, shape, raw bytes), so F8_E8M0 needs no support."""
    header, blobs, off = {}, [], 0
    for name, (dt, shape, raw) in tensors.items():
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def tiny_setup(tmp_path: Path, fmt: str = "fp8"):
    case = GOLDEN["cases"][1]
    spec = _spec(case, head_dim=64)
    rng = np.random.default_rng(0)
    tensors, direct = {}, {}
    for lid, n in zip(spec.layer_ids, spec.num_embeddings):
        if fmt == "fp8":
            vals = torch.from_numpy(rng.standard_normal((n, 64)).astype(np.float32)).to(torch.float8_e4m3fn)
            exps = rng.integers(118, 130, (n, 2)).astype(np.uint8)
            tensors[f"engram.{lid}.weight"] = ("F8_E4M3", [n, 64], vals.view(torch.uint8).numpy().tobytes())
            tensors[f"engram.{lid}.scale"] = ("F8_E8M0", [n, 2], exps.tobytes())
            scale = torch.from_numpy(np.exp2(exps.astype(np.float64) - 127)).float()
            direct[lid] = (vals.float().view(n, 2, 32) * scale[:, :, None]).view(n, 64)
        else:
            vals = rng.standard_normal((n, 64)).astype(np.float32)
            tensors[f"engram.{lid}.weight"] = ("F32", [n, 64], vals.tobytes())
            direct[lid] = torch.from_numpy(vals)
    path = tmp_path / "engram.safetensors"
    write_safetensors(path, tensors)
    tables = {lid: EngramTable.from_safetensors(str(path), f"engram.{lid}.weight",
                                                f"engram.{lid}.scale" if fmt == "fp8" else None)
              for lid in spec.layer_ids}
    return spec, _token_map(case), tables, direct


def _batch(chunks: list[list[int]], hasher_lb: int, starts=None, holes=()):
    """A ForwardBatch-like step of whole-request chunks [start, len) (tokens, look-back, host ids)."""
    ids, hist, qsl = [], [], [0]
    starts = starts or [0] * len(chunks)
    for toks, s in zip(chunks, starts):
        ids += toks[s:]
        hist += engram_history(lambda a, b, t=toks: t[a:b], s, len(toks), hasher_lb)
        qsl.append(len(ids))
    dev_ids = torch.tensor(ids)
    host_ids = [(-1 if i in holes else x) for i, x in enumerate(ids)]
    return SimpleNamespace(input_ids=dev_ids, num_tokens=len(ids), static_decode=False,
                           engram_history=torch.tensor(hist).view(-1, hasher_lb), engram_history_cpu=hist,
                           input_ids_cpu=host_ids, query_start_loc_cpu=qsl)


@pytest.mark.parametrize("fmt", ["fp8", "f32"])
def test_gathered_rows_equal_a_direct_read(tmp_path, fmt):
    spec, tmap, tables, direct = tiny_setup(tmp_path, fmt)
    eng = Engram(spec, tmap, tables, OPS)
    toks = [5, 9, 1, 0, 77, 31, 5, 9]
    rows = eng.step(_batch([toks], spec.lookback))
    rid = EngramHasher(spec, tmap)(windows_from(torch.tensor(toks), torch.tensor(
        engram_history(lambda a, b: toks[a:b], 0, len(toks), spec.lookback)).view(-1, spec.lookback)))
    for k, lid in enumerate(spec.layer_ids):
        want = direct[lid][rid[:, k].reshape(-1)].reshape(len(toks), -1)
        assert torch.equal(rows.get(lid), want)
    eng.close()


def test_host_prefetched_and_device_paths_agree(tmp_path):
    spec, tmap, tables, _ = tiny_setup(tmp_path)
    eng = Engram(spec, tmap, tables, OPS)
    reqs = [[3, 4, 5, 6, 7, 8, 9], [50, 51], [1, 2, 3]]
    host = eng.step(_batch(reqs, spec.lookback))
    placeholders = eng.step(_batch(reqs, spec.lookback, holes={8}))  # overlap decode: device hash
    b = _batch(reqs, spec.lookback)
    eng.prefetch(b.input_ids_cpu[:7], b.engram_history_cpu[:7 * spec.lookback])
    prefetched = eng.step(b)
    for lid in spec.layer_ids:
        assert torch.equal(host.get(lid), placeholders.get(lid))
        assert torch.equal(host.get(lid), prefetched.get(lid))
    assert eng.stats["device_gathers"] == 1 and eng.stats["prefetch_hits"] == 1
    eng.close()


def test_rows_of_a_chunk_do_not_depend_on_the_batch(tmp_path):
    spec, tmap, tables, _ = tiny_setup(tmp_path)
    eng = Engram(spec, tmap, tables, OPS)
    a, b = [7, 8, 9, 10, 11], [40, 41, 42]
    alone = eng.step(_batch([a], spec.lookback, starts=[2]))
    both = eng.step(_batch([b, a], spec.lookback, starts=[0, 2]))
    for lid in spec.layer_ids:
        assert torch.equal(alone.get(lid), both.get(lid)[3:])
    eng.close()


def test_table_errors_name_the_tensor(tmp_path):
    spec, tmap, tables, _ = tiny_setup(tmp_path)
    path = str(tmp_path / "engram.safetensors")
    with pytest.raises(KeyError, match="engram.9.weight"):
        EngramTable.from_safetensors(path, "engram.9.weight", "engram.9.scale")
    with pytest.raises(ValueError, match="needs its scale"):
        EngramTable.from_safetensors(path, "engram.1.weight")
    raw = (tmp_path / "engram.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-100])
    with pytest.raises(ValueError, match="truncated"):
        EngramTable.from_safetensors(str(tmp_path / "cut.safetensors"), "engram.3.weight", "engram.3.scale")
    with pytest.raises(ValueError, match=r"\[1000, 64\]"):
        Engram(spec.model_copy(update={"num_embeddings": (1000, 1000)}), tmap, tables, OPS)


# ----------------------------------------------------------------- never on the model's device
class _TensorLog(TensorWatch):
    """Every tensor an aten op reads or makes: (device, bytes)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def saw(self, t):
        self.seen.append((t.device.type, t.numel() * t.element_size()))


class _TableOnDevice(EngramTable):
    """Negative control: a table that copies itself to the model device (then gathers as usual)."""

    device = "cpu"

    def gather(self, ids, out):
        torch.from_numpy(np.array(self.data)).to(self.device)  # the whole table on the device
        super().gather(ids, out)


def _largest_tensor_seen(tables, spec, tmap, steps, device) -> int:
    log = _TensorLog()
    with log:
        eng = Engram(spec, tmap, tables, OPS, device=device)
        eng._pool = InlineExecutor()
        for b in steps:
            rows = eng.step(b)
            for lid in spec.layer_ids:
                assert rows.get(lid).device.type == device
        eng.close()
    return max((n for d, n in log.seen if d == device), default=0)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("bad", [False, True], ids=["mapped", "negative-control-moved"])
def test_engram_tables_are_never_allocated_on_the_device(tmp_path, bad, device):
    """Every tensor an aten op reads or makes on the model's device while the Engram is built and
    runs steps is logged: none is as large as a table; the largest are the step's gathered rows.
    "meta" stands for an accelerator (a device distinct from the host, no memory used); "cpu" is the
    reference platform's device and also runs the device-side hash path (placeholder ids). The
    negative control copies a table to the device and must be caught."""
    spec, tmap, tables, _ = tiny_setup(tmp_path)
    if bad:
        tables = {k: _TableOnDevice(t.data, t.scale, t.kind, t.head_dim, t.source) for k, t in tables.items()}
        for t in tables.values():
            t.device = device
    reqs = [[3, 4, 5, 6, 7, 8, 9], [50, 51]]
    steps = [_batch(reqs, spec.lookback)]
    if device == "cpu":
        steps.append(_batch(reqs, spec.lookback, holes={8}))
    table_bytes = min(t.data.nbytes for t in tables.values())
    largest = _largest_tensor_seen(tables, spec, tmap, steps, device)
    if bad:
        assert largest >= table_bytes
    else:
        step_rows = 9 * len(spec.layer_ids) * spec.n_cols * spec.head_dim * 4  # float32 rows of a step
        assert 0 < largest <= max(step_rows, tmap.numel() * 8) < table_bytes


def test_table_is_a_file_mapping_not_a_copy(tmp_path):
    _, _, tables, _ = tiny_setup(tmp_path)
    for t in tables.values():
        assert isinstance(t.data, np.memmap) and t.data.mode == "r"


class _MappingTransfer:
    """A transfer service whose `map_host` hands back a CPU alias (stands in for CUDA's zero-copy)."""

    def __init__(self):
        self.mapped = 0

    def map_host(self, array, device):
        self.mapped += 1
        return torch.from_numpy(np.asarray(array))

    def upload_tensor(self, host, device):
        return host.to(device)


@pytest.mark.parametrize("mapping", [True, False], ids=["map_host", "fallback-round-trip"])
def test_mapped_table_reads_equal_the_host_gather(tmp_path, mapping, caplog):
    import warnings

    spec, tmap, tables, _ = tiny_setup(tmp_path)
    transfer = _MappingTransfer() if mapping else None
    eng = Engram(spec, tmap, tables, OPS, transfer=transfer)
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    host = eng.rows_for(toks, engram_history(lambda a, b: toks[a:b], 0, len(toks), spec.lookback))
    rid = EngramHasher(spec, tmap)(windows_from(torch.tensor(toks), torch.tensor(
        engram_history(lambda a, b: toks[a:b], 0, len(toks), spec.lookback)).view(-1, spec.lookback)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.from_numpy of a read-only map
        for k, lid in enumerate(spec.layer_ids):
            got = eng._uva_rows(lid, rid[:, k].reshape(-1)).view(len(toks), -1)
            assert torch.equal(got, host[lid])
    if mapping:
        assert transfer.mapped == 2 * len(spec.layer_ids)  # data + scale pages, mapped once per table
    else:
        assert "host round trip" in caplog.text
    eng.close()


def test_scale_in_another_shard(tmp_path):
    spec, tmap, tables, direct = tiny_setup(tmp_path)
    t = tables[1]
    write_safetensors(tmp_path / "a.safetensors", {"w": ("F8_E4M3", list(t.data.shape), t.data.tobytes())})
    write_safetensors(tmp_path / "b.safetensors", {"s": ("F8_E8M0", list(t.scale.shape), t.scale.tobytes())})
    split = EngramTable.from_safetensors(str(tmp_path / "a.safetensors"), "w", "s",
                                         scale_path=str(tmp_path / "b.safetensors"))
    ids = np.array([0, 5, t.num_rows - 1])
    out = np.empty(ids.size * split.packed_bytes, np.uint8)
    split.gather(ids, out)
    assert torch.equal(split.decode(torch.from_numpy(out), ids.size, OPS), direct[1][torch.from_numpy(ids)])


@pytest.mark.parametrize("fmt", ["fp8", "f32"])
def test_static_decode_rows_equal_the_host_gather(tmp_path, fmt):
    """A static (graph) decode step's rows (`Engram.static_rows`: device hash, index_select from
    views of the mapped pages; on the CPU aliases of the memmap) equal the host gather's bits."""
    spec, tmap, tables, direct = tiny_setup(tmp_path, fmt)
    eng = Engram(spec, tmap, tables, OPS)
    assert eng.static_capable
    reqs = [[3, 4, 5, 6, 7, 8, 9], [50, 51], [1, 2, 3]]
    host = eng.step(_batch(reqs, spec.lookback))
    b = _batch(reqs, spec.lookback)
    b.static_decode = True  # one row per token, ids only on the device
    static = eng.step(b)
    for lid in spec.layer_ids:
        assert torch.equal(host.get(lid), static.get(lid))
    assert eng.stats["static_gathers"] == 1 and eng.stats["device_gathers"] == 0
    eng.close()


def test_float32_scales_cannot_serve_static_decode(tmp_path):
    """Float32 scales become e8m0 bytes only in the host gather: such tables decline graphs."""
    spec, tmap, tables, _ = tiny_setup(tmp_path)
    t = tables[spec.layer_ids[0]]
    exps = t.scale.astype(np.uint32) << 23  # float32 powers of two, as their bits
    tables[spec.layer_ids[0]] = EngramTable(t.data, exps, "mxfp8", t.head_dim, t.source)
    eng = Engram(spec, tmap, tables, OPS)
    assert not eng.static_capable
    with pytest.raises(RuntimeError, match="float32 Engram scales"):
        eng.static_rows(torch.tensor([3, 4]), torch.full((2, spec.lookback), -1))
    eng.close()
