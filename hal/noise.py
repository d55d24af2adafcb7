"""Counter-based sampling noise: u = uniform(seed, position, token_id), strictly inside (0, 1).

The noise of a token depends only on (request seed, absolute position, vocabulary id), never on
batch slot, step or generator state, so a sample survives batching, chunking and preemption.
Hash: MurmurHash3_x86_32 over the five little-endian 32-bit words (seed lo, seed hi, position
lo, position hi, token id) with hash seed 0x5348554C ("SHUL"), the 20-byte length, and fmix32.
Integer-only, so every platform can reproduce it bit for bit. u = (h + 0.5) / 2**32 in float64:
h in [0, 2**32) gives u in [2**-33, 1 - 2**-33], never 0 or 1, so -log(-log u) stays finite.

Tensor code keeps every intermediate below 2**63 (32-bit products are split into 16-bit halves),
so there is no reliance on signed overflow.
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF
HASH_SEED = 0x5348554C
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35


# ----------------------------------------------------------------------------- scalar (the spec)
def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * _F1) & M32
    h ^= h >> 13
    h = (h * _F2) & M32
    return h ^ (h >> 16)


def hash32(seed: int, position: int, token_id: int) -> int:
    """The spec, in plain Python integers. seed and position are taken modulo 2**64."""
    s, p = seed & M64, position & M64
    h = HASH_SEED
    for k in (s & M32, s >> 32, p & M32, p >> 32, token_id & M32):
        k = (k * _C1) & M32
        k = _rotl(k, 15)
        k = (k * _C2) & M32
        h ^= k
        h = _rotl(h, 13)
        h = (h * 5 + 0xE6546B64) & M32
    return _fmix(h ^ 20)


def uniform_scalar(seed: int, position: int, token_id: int) -> float:
    return (hash32(seed, position, token_id) + 0.5) / 2**32


# --------------------------------------------------------------------------------- tensor version
def _mul(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x in [0, 2**32): each partial product stays below 2**49
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def _trotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & M32


def _tfmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul(h, _F1)
    h = h ^ (h >> 13)
    h = _mul(h, _F2)
    return h ^ (h >> 16)


def hash32_tensor(seed, position, token_id) -> torch.Tensor:
    """Elementwise `hash32` over broadcast int64 tensors (or ints); returns int64 in [0, 2**32)."""
    seed, position, token_id = (torch.as_tensor(v, dtype=torch.int64) for v in (seed, position, token_id))
    # arithmetic shift then mask gives the high word of the two's-complement value
    words = (seed & M32, (seed >> 32) & M32, position & M32, (position >> 32) & M32, token_id & M32)
    h = torch.full((), HASH_SEED, dtype=torch.int64)
    for k in words:
        k = _mul(k, _C1)
        k = _trotl(k, 15)
        k = _mul(k, _C2)
        h = h ^ k
        h = _trotl(h, 13)
        h = (h * 5 + 0xE6546B64) & M32
    return _tfmix(h ^ 20)


def uniform(seed, position, token_id) -> torch.Tensor:
    """float64 u in (0, 1), broadcast over (seed, position, token_id)."""
    return (hash32_tensor(seed, position, token_id).to(torch.float64) + 0.5) / 2.0**32


def gumbel(seed, position, token_id) -> torch.Tensor:
    """float64 -log(-log(u)); finite because u never reaches 0 or 1."""
    return -torch.log(-torch.log(uniform(seed, position, token_id)))
