"""Sizes and durations as people write them on a command line: `8G`, `512MiB`, `72h`, `30m`."""
from __future__ import annotations

import re

_BYTES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
          "tib": 1 << 40}
_SECONDS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_NUM = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(v: int | str) -> int:
    """An int, or a number with a binary unit (K, M, G, T; KiB/KB alike): '8G' -> 8 * 2**30."""
    if isinstance(v, bool):
        raise ValueError(f"expected a byte count, got {v!r}")
    if isinstance(v, int):
        return v
    m = _NUM.match(str(v))
    if not m or m.group(2).lower() not in _BYTES:
        raise ValueError(f"{v!r} is not a size; write bytes or a number with K, M, G or T (e.g. 8G)")
    return int(float(m.group(1)) * _BYTES[m.group(2).lower()])


def parse_duration(v: float | int | str) -> float:
    """Seconds, or a number with s, m, h or d: '72h' -> 259200.0."""
    if isinstance(v, bool):
        raise ValueError(f"expected a duration, got {v!r}")
    if isinstance(v, (int, float)):
        return float(v)
    m = _NUM.match(str(v))
    if not m or m.group(2).lower() not in _SECONDS:
        raise ValueError(f"{v!r} is not a duration; write seconds or a number with s, m, h or d (e.g. 72h)")
    return float(m.group(1)) * _SECONDS[m.group(2).lower()]
