"""The on-disk form of one KV block: self-describing and self-checking.

  b"SHUILIKV" | u32 version | u32 header length | header (JSON) | sha256(header) | payload
The header names the content address, the fingerprint, the chained block hash, each group's
(dtype, shape, offset, bytes) inside the payload, the payload's length and sha256, and who wrote it
when. `decode` accepts a file only if every one of those checks out.
"""
from __future__ import annotations

import hashlib
import json
import struct

import torch

MAGIC = b"SHUILIKV"
VERSION = 1
_FIXED = struct.Struct("<8sII")


class BlockFileError(Exception):
    """kind: 'truncated', 'corrupt' (checksum, header, shapes) or 'foreign' (another fingerprint)."""

    def __init__(self, kind: str, why: str):
        super().__init__(f"{kind}: {why}")
        self.kind = kind


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def encode(key: str, fingerprint: str, chain_hash: bytes, blocks: dict[str, torch.Tensor],
           created: float, writer: str) -> bytes:
    parts, groups, off = [], [], 0
    for name in sorted(blocks):
        t = blocks[name].contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        groups.append([name, _dtype_name(t.dtype), list(t.shape), off, len(raw)])
        parts.append(raw)
        off += len(raw)
    payload = b"".join(parts)
    header = json.dumps({"key": key, "fingerprint": fingerprint, "chain_hash": chain_hash.hex(),
                         "groups": groups, "payload_bytes": len(payload),
                         "payload_sha256": hashlib.sha256(payload).hexdigest(), "created": created,
                         "writer": writer}, sort_keys=True).encode()
    return _FIXED.pack(MAGIC, VERSION, len(header)) + header + hashlib.sha256(header).digest() + payload


def read_header(data: bytes) -> dict:
    if len(data) < _FIXED.size:
        raise BlockFileError("truncated", f"{len(data)} bytes, shorter than the fixed header")
    magic, version, hlen = _FIXED.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise BlockFileError("corrupt", f"not a version-{VERSION} shuili KV block file")
    end = _FIXED.size + hlen
    if len(data) < end + 32:
        raise BlockFileError("truncated", "the file ends inside its header")
    header = data[_FIXED.size:end]
    if hashlib.sha256(header).digest() != data[end:end + 32]:
        raise BlockFileError("corrupt", "header checksum mismatch")
    try:
        meta = json.loads(header)
    except ValueError:
        raise BlockFileError("corrupt", "header is not JSON") from None
    meta["_payload_at"] = end + 32
    return meta


def decode(data: bytes, key: str, fingerprint: str,
           expect: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """The block's tensors, or BlockFileError. `expect`: group -> (shape, dtype) it must hold."""
    meta = read_header(data)
    if meta.get("fingerprint") != fingerprint:
        raise BlockFileError("foreign", f"written under fingerprint {meta.get('fingerprint')!r}")
    if meta.get("key") != key:
        raise BlockFileError("corrupt", f"holds key {meta.get('key')!r}, stored under {key!r}")
    payload = data[meta["_payload_at"]:]
    if len(payload) != meta["payload_bytes"]:
        kind = "truncated" if len(payload) < meta["payload_bytes"] else "corrupt"
        raise BlockFileError(kind, f"payload is {len(payload)} bytes, header says {meta['payload_bytes']}")
    if hashlib.sha256(payload).hexdigest() != meta["payload_sha256"]:
        raise BlockFileError("corrupt", "payload checksum mismatch")
    out = {}
    for name, dt, shape, off, n in meta["groups"]:
        if name not in expect:
            continue
        want_shape, want_dt = expect[name]
        if tuple(shape) != tuple(want_shape) or dt != _dtype_name(want_dt):
            raise BlockFileError("corrupt", f"group {name}: {dt}{shape}, expected {_dtype_name(want_dt)}"
                                 f"{list(want_shape)}")
        buf = bytearray(payload[off:off + n])
        out[name] = torch.frombuffer(buf, dtype=torch.uint8).view(want_dt).view(tuple(shape)) if n else \
            torch.empty(tuple(shape), dtype=want_dt)
    missing = set(expect) - set(out)
    if missing:
        raise BlockFileError("corrupt", f"groups {sorted(missing)} missing")
    return out
