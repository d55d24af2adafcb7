"""The on-disk form of one KV block: self-describing, self-checking, and readable by section.

  b"SHUILIKV" | u32 version | u32 header length | header (JSON) | sha256(header) | section ... section
One section per cache group, each with its own sha256 in the header, so a reader that needs only
some groups (a hit needs a sliding group's block only inside the last window, docs/kv-tiers.md)
reads the header and those sections and nothing else. The header names the content address, the
fingerprint, the chained block hash, each section's (group, dtype, shape, offset, bytes, sha256),
the payload's total length (a file of another length is truncated or corrupt, checked from its size
alone), and who wrote it when. Sections start at multiples of ALIGN; a section's checksum covers its
zero padding, so every payload byte is under exactly one checksum. `read` accepts a section only if
all of that checks out, and reads each run of adjacent sections with one read into one buffer that
the returned tensors share (no copy after the read).
"""
from __future__ import annotations

import hashlib
import json
import struct

import torch

MAGIC = b"SHUILIKV"
VERSION = 2
_FIXED = struct.Struct("<8sII")
ALIGN = 64  # section offsets in the payload
HEAD_READ = 4096  # the first read: the fixed part and the header (about 150 bytes a group), more if needed


class BlockFileError(Exception):
    """kind: 'truncated', 'corrupt' (checksum, header, shapes) or 'foreign' (another fingerprint)."""

    def __init__(self, kind: str, why: str):
        super().__init__(f"{kind}: {why}")
        self.kind = kind


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def encode(key: str, fingerprint: str, chain_hash: bytes, blocks: dict[str, torch.Tensor],
           created: float, writer: str) -> bytes:
    """Sections in the order of `blocks` (the caller puts groups read together next to each other),
    each at a multiple of ALIGN in the payload, so a run of them read into one buffer gives every
    group's tensor in place (a dtype view needs an aligned offset)."""
    parts, sections, off = [], [], 0
    for name, t in blocks.items():
        t = t.contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        pad = bytes(-len(raw) % ALIGN)  # covered by the section's checksum: every payload byte is
        sections.append([name, _dtype_name(t.dtype), list(t.shape), off, len(raw),
                         hashlib.sha256(raw + pad).hexdigest()])
        parts += [raw, pad]
        off += len(raw) + len(pad)
    header = json.dumps({"key": key, "fingerprint": fingerprint, "chain_hash": chain_hash.hex(),
                         "sections": sections, "payload_bytes": off, "created": created, "writer": writer},
                        sort_keys=True).encode()
    return _FIXED.pack(MAGIC, VERSION, len(header)) + header + hashlib.sha256(header).digest() + b"".join(parts)


def read_header(head: bytes) -> tuple[dict, int]:
    """(header, offset of the payload) from the file's first bytes; BlockFileError('truncated') when
    `head` ends inside the header (the caller reads more if the file is longer)."""
    if len(head) < _FIXED.size:
        raise BlockFileError("truncated", f"{len(head)} bytes, shorter than the fixed header")
    magic, version, hlen = _FIXED.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise BlockFileError("corrupt", f"not a version-{VERSION} shuili KV block file")
    end = _FIXED.size + hlen
    if len(head) < end + 32:
        raise BlockFileError("truncated", "the file ends inside its header")
    header = head[_FIXED.size:end]
    if hashlib.sha256(header).digest() != head[end:end + 32]:
        raise BlockFileError("corrupt", "header checksum mismatch")
    try:
        meta = json.loads(header)
    except ValueError:
        raise BlockFileError("corrupt", "header is not JSON") from None
    if not isinstance(meta, dict):
        raise BlockFileError("corrupt", "header is not a JSON object")
    return meta, end + 32


def _header_len(head: bytes) -> int:
    return _FIXED.size + _FIXED.unpack_from(head)[2] + 32 if len(head) >= _FIXED.size else 0


def read(readinto, size: int, key: str, fingerprint: str,
         expect: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[dict[str, torch.Tensor], int]:
    """The sections `expect` names (group -> (shape, dtype) it must hold), verified, and the number
    of bytes read; BlockFileError otherwise. `readinto(buffer, offset) -> bytes read` reads the file
    (or object) of `size` bytes: a file descriptor's preadv, or a ranged GET of a remote store.
    Sections not in `expect` are neither read nor checked."""
    head = _read(readinto, min(size, HEAD_READ), 0)
    need = _header_len(head)
    if len(head) < need <= size:
        head += _read(readinto, need - len(head), len(head))
    nread = len(head)
    meta, at = read_header(bytes(head))
    if meta.get("fingerprint") != fingerprint:
        raise BlockFileError("foreign", f"written under fingerprint {meta.get('fingerprint')!r}")
    if meta.get("key") != key:
        raise BlockFileError("corrupt", f"holds key {meta.get('key')!r}, stored under {key!r}")
    try:
        whole = at + int(meta["payload_bytes"])
        sections = {s[0]: s for s in meta["sections"] if _well_formed(s)}
        if len(sections) != len(meta["sections"]):
            raise ValueError
    except (KeyError, TypeError, ValueError, IndexError):
        raise BlockFileError("corrupt", "header lacks its sections or has malformed ones") from None
    if size != whole:  # atomic renames never leave a partial file: this one was damaged in place
        raise BlockFileError("truncated" if size < whole else "corrupt",
                             f"file is {size} bytes, its header says {whole}")
    missing = set(expect) - set(sections)
    if missing:
        raise BlockFileError("corrupt", f"groups {sorted(missing)} missing")
    want = sorted((sections[name] for name in expect), key=lambda s: s[3])
    for name, dt, shape, off, n, _ in want:
        want_shape, want_dt = expect[name]
        if tuple(shape) != tuple(want_shape) or dt != _dtype_name(want_dt):
            raise BlockFileError("corrupt", f"group {name}: {dt}{shape}, expected {_dtype_name(want_dt)}"
                                 f"{list(want_shape)}")
        if n != _numel(shape) * want_dt.itemsize or off % ALIGN or off < 0 or off + _padded(n) > whole - at:
            raise BlockFileError("corrupt", f"group {name}: section [{off}, {off + n}) does not fit")
    out = {}
    for run in _runs(want):
        lo, hi = at + run[0][3], at + run[-1][3] + _padded(run[-1][4])
        buf = bytearray(hi - lo)  # one read per run of adjacent sections, into the tensors' memory
        have = min(max(len(head) - lo, 0), hi - lo)  # the first read may hold the run's start
        buf[:have] = head[lo:lo + have]
        if have < hi - lo:
            got = _fill(readinto, memoryview(buf)[have:], lo + have)
            nread += got
            if got != hi - lo - have:
                raise BlockFileError("truncated", f"read {got} of {hi - lo - have} bytes at {lo + have}")
        view = memoryview(buf)
        for name, _, shape, off, n, sha in run:
            o = off - run[0][3]
            if hashlib.sha256(view[o:o + _padded(n)]).hexdigest() != sha:
                raise BlockFileError("corrupt", f"section {name}: checksum mismatch")
            dt = expect[name][1]
            out[name] = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=o).view(dt).view(tuple(shape)) \
                if n else torch.empty(tuple(shape), dtype=dt)
    return out, nread


def _fill(readinto, view: memoryview, offset: int) -> int:
    """Read until `view` is full or the file ends (a read may return less than asked)."""
    done = 0
    while done < len(view):
        n = readinto(view[done:], offset + done)
        if n <= 0:
            break
        done += n
    return done


def _read(readinto, n: int, offset: int) -> bytearray:
    buf = bytearray(n)
    return buf[:_fill(readinto, memoryview(buf), offset)]


def _well_formed(s) -> bool:
    """[group, dtype, shape, offset, bytes, sha256 hex]"""
    return (isinstance(s, list) and len(s) == 6 and isinstance(s[0], str) and isinstance(s[1], str)
            and isinstance(s[2], list) and all(type(d) is int and d >= 0 for d in s[2])
            and type(s[3]) is int and type(s[4]) is int and s[4] >= 0 and isinstance(s[5], str))


def _padded(n: int) -> int:
    return n + (-n % ALIGN)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _runs(sections: list[list]) -> list[list[list]]:
    """Sections sorted by offset -> runs of adjacent ones (each run is one read)."""
    runs: list[list[list]] = []
    for s in sections:
        if runs and runs[-1][-1][3] + _padded(runs[-1][-1][4]) == s[3]:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def decode(data: bytes, key: str, fingerprint: str,
           expect: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """`read` over a whole file in memory."""
    def readinto(view: memoryview, off: int) -> int:
        chunk = data[off:off + len(view)]
        view[:len(chunk)] = chunk
        return len(chunk)

    return read(readinto, len(data), key, fingerprint, expect)[0]
