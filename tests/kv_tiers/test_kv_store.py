"""The disk block store alone: file format checks, retention (TTL, size cap, LRU by use), broken
directories, and two processes sharing one directory."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shuili.core.kv_tiers import parse_bytes, parse_duration
from shuili.core.kv_tiers.block_file import HEAD_READ, BlockFileError, decode, encode
from shuili.core.kv_tiers.disk_store import SUFFIX, DiskStore
from shuili.core.kv_tiers.host_pool import HostPool

ROOT = Path(__file__).resolve().parents[2]
EXPECT = {"a": ((2, 3), torch.float32), "b": ((4,), torch.uint8)}


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def blk(v: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((2, 3), v), "b": torch.arange(4, dtype=torch.uint8)}


def store(tmp_path, **kw) -> DiskStore:
    kw.setdefault("clock", Clock())
    return DiskStore(str(tmp_path / "store"), "fp-A", background=False, **kw)


def key(i: int) -> str:
    return f"{i:064x}"


def test_units():
    assert parse_bytes("8G") == 8 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes(7) == 7
    assert parse_duration("72h") == 259200.0 and parse_duration("30m") == 1800.0 and parse_duration(5) == 5.0
    for bad in ("8X", "h72", ""):
        with pytest.raises(ValueError):
            parse_bytes(bad)
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_block_file_round_trip_and_every_rejection():
    data = encode("k", "fp-A", b"\x01" * 32, blk(2.5), 0.0, "me")
    got = decode(data, "k", "fp-A", EXPECT)
    assert torch.equal(got["a"], blk(2.5)["a"]) and torch.equal(got["b"], blk(2.5)["b"])
    cases = {"truncated": data[:-3], "foreign": None, "corrupt": bytearray(data)}
    cases["corrupt"][-5] ^= 0x10  # one payload bit
    for kind, bad in cases.items():
        with pytest.raises(BlockFileError) as e:
            if kind == "foreign":
                decode(data, "k", "fp-B", EXPECT)
            else:
                decode(bytes(bad), "k", "fp-A", EXPECT)
        assert e.value.kind == kind
    with pytest.raises(BlockFileError, match="corrupt"):  # right bytes, another address
        decode(data, "other", "fp-A", EXPECT)
    with pytest.raises(BlockFileError, match="corrupt"):  # right bytes, other shapes than the engine's
        decode(data, "k", "fp-A", {"a": ((3, 2), torch.float32), "b": ((4,), torch.uint8)})
    header_hit = bytearray(data)
    header_hit[20] ^= 1
    with pytest.raises(BlockFileError, match="corrupt"):
        decode(bytes(header_hit), "k", "fp-A", EXPECT)


def test_put_get_is_atomic_and_leaves_no_temp_files(tmp_path):
    s = store(tmp_path)
    s.put(key(1), b"h", blk(1.0))
    assert s.contains(key(1)) and not s.contains(key(2))
    assert torch.equal(s.get(key(1), EXPECT)["a"], blk(1.0)["a"])
    assert s.get(key(2), EXPECT) is None
    names = [p.name for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert names == [key(1) + SUFFIX]
    assert s.stats()["hits"] == 1 and s.stats()["misses"] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_file_is_rejected_and_deleted(tmp_path, damage):
    s = store(tmp_path)
    s.put(key(1), b"h", blk(1.0))
    p = Path(s.path(key(1)))
    raw = bytearray(p.read_bytes())
    if damage == "flip":
        raw[-1] ^= 0xFF
    raw = raw[: len(raw) // 2] if damage == "truncate" else raw[:0] if damage == "empty" else raw
    p.write_bytes(bytes(raw))
    assert s.get(key(1), EXPECT) is None
    assert not p.exists(), "a damaged file at our address must be deleted"
    st = s.stats()
    assert st["rejected_corrupt" if damage == "flip" else "rejected_truncated"] == 1


def test_foreign_file_is_rejected_and_kept(tmp_path):
    other = DiskStore(str(tmp_path / "store"), "fp-B", background=False, clock=Clock())
    other.put(key(1), b"h", blk(1.0))
    s = store(tmp_path)
    Path(s.path(key(1))).parent.mkdir(parents=True, exist_ok=True)
    os.replace(other.path(key(1)), s.path(key(1)))  # fp-B's bytes at an fp-A address
    assert s.get(key(1), EXPECT) is None
    assert Path(s.path(key(1))).exists() and s.stats()["rejected_foreign"] == 1


def test_ttl_expires_by_last_use(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock=clock, ttl_s=100.0)
    s.put(key(1), b"h", blk(1.0))
    s.put(key(2), b"h", blk(2.0))
    clock.t += 60
    assert s.get(key(1), EXPECT) is not None  # a use renews key 1
    clock.t += 60  # key 2: 120 s since written; key 1: 60 s since used
    assert not s.contains(key(2)) and s.get(key(2), EXPECT) is None
    assert s.gc() == {"ttl": 1, "size": 0, "tmp": 0}
    assert s.contains(key(1)) and not Path(s.path(key(2))).exists()
    clock.t += 101
    assert s.gc()["ttl"] == 1 and s.size_bytes() == 0


def test_size_cap_evicts_least_recently_used(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock=clock)
    for i in range(4):
        s.put(key(i), b"h", blk(float(i)))
        clock.t += 1
    one = s.size_bytes() // 4
    assert s.get(key(0), EXPECT) is not None  # key 0 is now the most recently used
    s.max_bytes = 2 * one
    assert s.gc() == {"ttl": 0, "size": 2, "tmp": 0}
    assert [s.contains(key(i)) for i in range(4)] == [True, False, False, True]
    assert s.size_bytes() <= s.max_bytes


def test_writes_sweep_the_cap_by_themselves(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock=clock)
    s.put(key(0), b"h", blk(0.0))
    one = s.size_bytes()
    s.max_bytes = 3 * one
    for i in range(1, 40):
        clock.t += 1
        s.put(key(i), b"h", blk(float(i)))
    assert s.size_bytes() <= s.max_bytes + one * 3 // 8 + one  # at most one sweep interval over
    assert s.contains(key(39)) and not s.contains(key(0)) and s.stats()["evicted_size"] > 0


def test_stale_temp_files_are_swept(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock=clock)
    s.put(key(1), b"h", blk(1.0))
    tmp = Path(s.path(key(1))).parent / ".tmp-dead"
    tmp.write_bytes(b"half a block")
    os.utime(tmp, (clock.t, clock.t))
    assert s.gc()["tmp"] == 0  # might be a live writer
    clock.t += 7200
    assert s.gc()["tmp"] == 1 and not tmp.exists()


def test_unusable_directory_degrades_to_misses(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    s = DiskStore(str(blocker / "store"), "fp-A", background=False)
    assert not s.usable and "cannot use the directory" in caplog.text
    s.put(key(1), b"h", blk(1.0))
    assert s.get(key(1), EXPECT) is None and not s.contains(key(1)) and s.gc()["ttl"] == 0


def test_full_disk_degrades_to_a_warning(tmp_path, monkeypatch, caplog):
    s = store(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    s.put(key(1), b"h", blk(1.0))
    s.put(key(2), b"h", blk(2.0))
    monkeypatch.undo()
    assert s.stats()["write_failures"] == 2 and caplog.text.count("the disk is full") == 1
    assert not list((tmp_path / "store").rglob(".tmp-*")), "a failed write must not leave its temp file"
    s.put(key(1), b"h", blk(1.0))  # space again: writes work again
    assert s.get(key(1), EXPECT) is not None


def test_background_writer_flushes(tmp_path):
    s = DiskStore(str(tmp_path / "store"), "fp-A", clock=Clock())
    for i in range(20):
        s.put(key(i), b"h", blk(float(i)))
    s.flush()
    assert all(s.contains(key(i)) for i in range(20)) and s.stats()["writes"] == 20


def test_host_pool_lru_under_budget():
    t = torch.zeros(4)  # 16 bytes
    p = HostPool(40)
    for i in range(3):
        assert p.put(("g", bytes([i])), t.clone())
    assert ("g", b"\x00") not in p and p.bytes == 32 and p.num_evicted == 1
    p.get(("g", b"\x01"))  # used: survives the next eviction
    p.put(("g", b"\x03"), t.clone())
    assert ("g", b"\x01") in p and ("g", b"\x02") not in p
    assert not p.put(("g", b"big"), torch.zeros(11))  # larger than the whole budget
    p.check()


def test_two_processes_share_one_store(tmp_path):
    """Both write overlapping keys and read whatever they see, at once: nothing lost, no torn reads."""
    root = str(tmp_path / "store")
    n = 60
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    child = str(Path(__file__).with_name("kv_store_child.py"))
    procs = [subprocess.Popen([sys.executable, child, root, order, str(n), str(seed)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for order, seed in (("up", 1), ("down", 2))]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for o in outs:
        assert o["bad"] == 0 and o["reads"] > 0
        assert o["rejected_corrupt"] == o["rejected_truncated"] == o["rejected_foreign"] == 0
    assert sum(o["writes"] for o in outs) >= n  # both may write a key; none is skipped by both
    sys.path.insert(0, str(Path(child).parent))
    from kv_store_child import EXPECT as E, block
    s = DiskStore(root, "fp-test", background=False)
    for i in range(n):
        got = s.get(f"{i:064x}", E)
        assert got is not None and all(torch.equal(got[k], block(i)[k]) for k in E), i
    assert not list(Path(root).rglob(".tmp-*"))


def test_every_cache_dtype_round_trips_bit_exactly():
    blocks = {"bf16": torch.linspace(-3, 3, 24).to(torch.bfloat16).view(2, 3, 4),
              "f16": torch.linspace(-3, 3, 8).to(torch.float16).view(2, 4),
              "u8": torch.arange(10, dtype=torch.uint8).view(1, 10),
              "f32": torch.tensor([[float("nan"), -0.0, 1e-40]])}
    expect = {k: (tuple(t.shape), t.dtype) for k, t in blocks.items()}
    got = decode(encode("k", "fp", b"h", blocks, 0.0, "me"), "k", "fp", expect)
    for k, t in blocks.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k


def test_a_writer_that_falls_behind_drops_blocks_instead_of_memory(tmp_path, monkeypatch, caplog):
    import threading

    from shuili.core.kv_tiers import disk_store

    monkeypatch.setattr(disk_store, "QUEUE_BYTES", 40)  # one 28-byte block fits, two do not

    class Gate:  # stands in for a device copy still in flight: the writer waits on it
        def __init__(self):
            self.open = threading.Event()

        def synchronize(self):
            self.open.wait(60)

    gate = Gate()
    s = DiskStore(str(tmp_path / "store"), "fp-A", clock=Clock())
    s.put(key(0), b"h", blk(0.0), ready=gate)
    s.put(key(1), b"h", blk(1.0))
    assert "writer is behind" in caplog.text
    gate.open.set()
    s.flush()
    assert s.contains(key(0)) and not s.contains(key(1)) and s._queued_bytes == 0


# --------------------------------------------------------------------- reads by section
BIG = {"a": ((2, 3), torch.float32), "b": ((1 << 15,), torch.float32)}  # b: 128 KiB, past the first read


def big(v: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((2, 3), v), "b": torch.linspace(0, v, 1 << 15)}


def section(path: Path, name: str) -> tuple[int, int]:
    """(file offset, bytes) of group `name`'s section."""
    from shuili.core.kv_tiers.block_file import read_header

    meta, at = read_header(path.read_bytes())
    _, _, _, off, n, _ = next(s for s in meta["sections"] if s[0] == name)
    return at + off, n


def test_a_read_takes_only_the_sections_asked_for(tmp_path):
    s = store(tmp_path)
    s.put(key(1), b"h", big(1.0))
    p = Path(s.path(key(1)))
    size = p.stat().st_size
    got = s.get(key(1), {"a": BIG["a"]})
    assert list(got) == ["a"] and torch.equal(got["a"], big(1.0)["a"])
    b_at, b_len = section(p, "b")
    one = s.stats()["bytes_read"]
    assert one <= HEAD_READ < b_len and one <= size - b_len + HEAD_READ  # the header and section a, not b
    both = s.get(key(1), BIG)
    assert torch.equal(both["b"], big(1.0)["b"]) and s.stats()["bytes_read"] == one + size


def test_a_damaged_section_that_is_read_rejects_the_file(tmp_path):
    s = store(tmp_path)
    s.put(key(1), b"h", big(1.0))
    p = Path(s.path(key(1)))
    at, n = section(p, "b")
    raw = bytearray(p.read_bytes())
    raw[at + n // 2] ^= 0x04
    p.write_bytes(bytes(raw))
    assert s.get(key(1), BIG) is None and not p.exists()
    assert s.stats()["rejected_corrupt"] == 1


def test_a_damaged_section_that_is_not_read_does_not_matter_until_it_is(tmp_path):
    """Every byte a hit uses is checked; the damage elsewhere in the file is found by the first read
    that needs it (checking it earlier would mean reading it, the cost this layout avoids)."""
    s = store(tmp_path)
    s.put(key(1), b"h", big(1.0))
    p = Path(s.path(key(1)))
    at, n = section(p, "b")
    raw = bytearray(p.read_bytes())
    raw[at + n - 1] ^= 0x80
    p.write_bytes(bytes(raw))
    got = s.get(key(1), {"a": BIG["a"]})
    assert got is not None and torch.equal(got["a"], big(1.0)["a"]) and p.exists()
    assert s.stats()["rejected_corrupt"] == 0
    assert s.get(key(1), BIG) is None and not p.exists() and s.stats()["rejected_corrupt"] == 1


@pytest.mark.parametrize("cut_in", ["a", "b"])
def test_a_truncated_file_is_rejected_whichever_section_is_cut(tmp_path, cut_in):
    """The size is checked against the header before any section: a file of the wrong length was
    damaged in place (writes are renamed in whole), so it is deleted even when the sections a read
    needs are intact; the next write-through puts a whole one back."""
    s = store(tmp_path)
    s.put(key(1), b"h", big(1.0))
    p = Path(s.path(key(1)))
    at, n = section(p, cut_in)
    p.write_bytes(p.read_bytes()[:at + n // 2])
    assert s.get(key(1), {"a": BIG["a"]}) is None and not p.exists()
    assert s.stats()["rejected_truncated"] == 1


def test_a_section_of_a_group_the_file_lacks_is_corrupt(tmp_path):
    s = store(tmp_path)
    s.put(key(1), b"h", {"a": big(1.0)["a"]})
    assert s.get(key(1), BIG) is None and s.stats()["rejected_corrupt"] == 1


def test_files_of_the_old_format_are_never_read_but_swept(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock=clock, ttl_s=100.0)
    old = Path(s.path(key(1))).with_suffix(".kv")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"SHUILIKV" + b"\x01" * 200)
    os.utime(old, (clock.t, clock.t))
    assert not s.contains(key(1)) and s.get(key(1), EXPECT) is None and old.exists()
    assert s.size_bytes() == old.stat().st_size
    clock.t += 101
    assert s.gc()["ttl"] == 1 and not old.exists()


@pytest.mark.parametrize("header", [[1, 2], {"key": "k", "fingerprint": "fp-A", "payload_bytes": 64,
                                              "sections": [["a", "float32", [2, 3]]]}])
def test_a_well_checksummed_header_of_the_wrong_shape_is_corrupt(header):
    """Another program's file that passes the header checksum still cannot crash the reader."""
    import hashlib
    import struct

    from shuili.core.kv_tiers.block_file import MAGIC, VERSION

    h = json.dumps(header).encode()
    data = struct.pack("<8sII", MAGIC, VERSION, len(h)) + h + hashlib.sha256(h).digest() + bytes(64)
    with pytest.raises(BlockFileError, match="corrupt"):
        decode(data, "k", "fp-A", EXPECT)
