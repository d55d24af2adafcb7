"""DeepSeek-V4.1 Engram hashing: token ids -> row ids of each Engram layer's table.

A position p is hashed from the raw token ids at p, p-1, ..., p-(N-1) (N = `max_ngram_size`):
1. each id goes through the compressed-token map (tokenizer-derived, `build_compressed_token_map`);
2. look-back stops at the sequence start (id -1, "DEAD"): that slot and every older one use the
   compressed id of `pad_id`;
3. per Engram layer, token j of the window is multiplied by the layer's odd int64 multiplier j
   (`np.random.default_rng(10007 * layer_id)`), and the products are XOR-ed in order; after XOR-ing
   token i the running value hashes the (i+1)-gram: `rolling % prime + offset` for each of the
   `n_heads` primes of that n-gram size, giving (N-1) * n_heads = 24 row ids per token per layer.
Primes are distinct, drawn in order above `vocab_size - 1`; offsets are cumulative per layer.

Everything is int64 integer arithmetic without overflow (multiplier < int64max / compressed vocab),
so `hash_rows` gives the same bits on the host and on any device, and the row ids are a pure
function of the token ids: no per-request state beyond the request's tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, model_validator

DEAD = -1  # a window slot before the sequence start
SEED_PRIME = 10007


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


class EngramSpec(BaseModel):
    """The Engram fields of a V4.1 text config (same names) and the hash constants they imply."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    vocab_size: int  # engram_vocab_size: the primes start above it
    pad_id: int  # engram_pad_id (a tokenizer id)
    compressed_vocab_size: int
    num_embeddings: tuple[int, ...]  # rows of each layer's table

    @model_validator(mode="after")
    def _check(self) -> "EngramSpec":
        if len(self.num_embeddings) != len(self.layer_ids):
            raise ValueError(f"engram_num_embeddings has {len(self.num_embeddings)} entries but "
                             f"engram_layer_ids has {len(self.layer_ids)}; give one table size per Engram layer")
        if self.max_ngram_size < 2:
            raise ValueError(f"engram_max_ngram_size must be at least 2, got {self.max_ngram_size}")
        if self.head_dim % 32:
            raise ValueError(f"engram_head_dim must be a multiple of 32 (one ue8m0 scale per 32), got {self.head_dim}")
        for lid, n, need in zip(self.layer_ids, self.num_embeddings, self.table_rows):
            if n < need:
                raise ValueError(f"engram_num_embeddings for layer {lid} is {n}, but its hash buckets "
                                 f"need {need} rows (sum of its primes); the config does not match the hash")
        return self

    @classmethod
    def from_config(cls, cfg) -> "EngramSpec":
        """From a V4.1 text config (object or dict); accepts `engram_pad_token_id` as the pad key."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        pad = get("engram_pad_id", get("engram_pad_token_id"))
        return cls(layer_ids=tuple(get("engram_layer_ids")), max_ngram_size=get("engram_max_ngram_size"),
                   n_heads=get("engram_n_heads"), head_dim=get("engram_head_dim"),
                   vocab_size=get("engram_vocab_size"), pad_id=pad,
                   compressed_vocab_size=get("engram_compressed_vocab_size"),
                   num_embeddings=tuple(get("engram_num_embeddings")))

    @property
    def lookback(self) -> int:
        """Previous tokens each position hashes with (the request state: N - 1 ids)."""
        return self.max_ngram_size - 1

    @property
    def n_cols(self) -> int:
        """Rows per token per Engram layer: (N - 1) n-gram sizes x n_heads."""
        return self.lookback * self.n_heads

    @cached_property
    def primes(self) -> list[list[list[int]]]:
        """[layer][n-gram size - 2][head]: distinct primes, each n-gram size restarting its search
        above vocab_size - 1 and skipping every prime already taken."""
        taken: set[int] = set()
        out = []
        for _ in self.layer_ids:
            per_layer = []
            for _ in range(self.lookback):
                row, p = [], self.vocab_size - 1
                for _ in range(self.n_heads):
                    p += 1
                    while p in taken or not _is_prime(p):
                        p += 1
                    taken.add(p)
                    row.append(p)
                per_layer.append(row)
            out.append(per_layer)
        return out

    @cached_property
    def offsets(self) -> list[list[int]]:
        """[layer][col]: start row of each (n-gram, head) bucket inside that layer's table."""
        out = []
        for layer in self.primes:
            flat = [p for row in layer for p in row]
            out.append([sum(flat[:i]) for i in range(len(flat))])
        return out

    @property
    def table_rows(self) -> list[int]:
        return [sum(p for row in layer for p in row) for layer in self.primes]

    @cached_property
    def multipliers(self) -> list[list[int]]:
        """[layer][N]: odd multipliers 2 * U[0, bound) + 1, bound = (int64max // vocab) // 2."""
        bound = max(1, (np.iinfo(np.int64).max // self.compressed_vocab_size) // 2)
        out = []
        for lid in self.layer_ids:
            draw = np.random.default_rng(SEED_PRIME * lid).integers(0, bound, size=(self.max_ngram_size,),
                                                                   dtype=np.int64)
            out.append([int(v) * 2 + 1 for v in draw])
        return out


class EngramHasher:
    """The hash constants of one spec and token map as int64 tensors on one device."""

    def __init__(self, spec: EngramSpec, token_map: Sequence[int] | torch.Tensor, device="cpu"):
        tm = torch.as_tensor(token_map, dtype=torch.int64)
        if tm.ndim != 1 or tm.numel() <= spec.pad_id:
            raise ValueError(f"the compressed-token map must be 1-D and cover engram_pad_id {spec.pad_id}; "
                             f"got shape {tuple(tm.shape)}")
        hi = int(tm.max()) if tm.numel() else -1
        if int(tm.min()) < 0 or hi >= spec.compressed_vocab_size:
            raise ValueError(f"compressed ids must lie in [0, {spec.compressed_vocab_size}); the map holds "
                             f"[{int(tm.min())}, {hi}]: it was built from another tokenizer")
        self.spec = spec
        self.device = torch.device(device)
        self.token_map = tm.to(self.device)
        self.pad = int(tm[spec.pad_id])
        self.multipliers = torch.tensor(spec.multipliers, dtype=torch.int64, device=self.device)  # [L, N]
        self.primes = torch.tensor(spec.primes, dtype=torch.int64, device=self.device)  # [L, N-1, H]
        self.offsets = torch.tensor(spec.offsets, dtype=torch.int64, device=self.device)  # [L, C]

    def to(self, device) -> "EngramHasher":
        return self if torch.device(device) == self.device else EngramHasher(self.spec, self.token_map.cpu(), device)

    def __call__(self, windows: torch.Tensor, check: bool = True) -> torch.Tensor:
        """windows int64 [T, N]: raw token ids of positions p, p-1, ..., p-N+1 (DEAD = -1 before the
        sequence start) -> row ids int64 [T, L, C] (C = (N-1) * n_heads), on windows' device.
        check=False skips the host-side id check (a static decode step reads no value on the host)."""
        n = self.spec.max_ngram_size
        if windows.ndim != 2 or windows.shape[1] != n:
            raise ValueError(f"windows must be [T, {n}] (a token and its {n - 1} predecessors), "
                             f"got {tuple(windows.shape)}")
        # checked on the host only: reading a device tensor's max would sync (a device index out of
        # range still fails, in the gather)
        if check and windows.device.type == "cpu" and windows.numel() and int(windows.max()) >= self.token_map.numel():
            raise ValueError(f"token id {int(windows.max())} is outside the compressed-token map "
                             f"({self.token_map.numel()} ids)")
        dead = windows < 0
        comp = self.token_map[windows.clamp_min(0)]
        blocked = torch.cummax(dead.to(torch.int64), dim=1).values.bool()  # once DEAD, older slots too
        toks = torch.where(blocked, torch.full_like(comp, self.pad), comp)
        prods = toks[:, None, :] * self.multipliers[None]  # [T, L, N]
        rolling, out = prods[..., 0], []
        for i in range(1, n):
            rolling = torch.bitwise_xor(rolling, prods[..., i])
            out.append(rolling[..., None] % self.primes[None, :, i - 1, :])  # [T, L, H]
        return torch.cat(out, dim=-1) + self.offsets[None]


def engram_history(tokens: Callable[[int, int], list[int]], start: int, end: int, lookback: int) -> list[int]:
    """Host look-back of positions [start, end): for each p the ids at p-1 .. p-lookback (DEAD before
    position 0), flattened [(end - start) * lookback]. `tokens(a, b)` returns the request's ids of
    positions [a, b) (`Request.tokens`); the look-back is a pure function of them, so chunked prefill,
    prefix-cache hits and preemption need no saved state."""
    lo = max(start - lookback, 0)
    ids = [DEAD] * (lo - start + lookback) + tokens(lo, max(end - 1, lo))  # ids[k]: position start-lookback+k
    return [ids[i + lookback - j] for i in range(end - start) for j in range(1, lookback + 1)]


def windows_from(input_ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """[T] current ids and [T, N-1] look-back -> [T, N] hash windows."""
    return torch.cat([input_ids.to(torch.int64)[:, None], history.to(torch.int64)], dim=1)


def build_compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Token id -> compressed id, in first-seen order of the normalised key, and the compressed size.

    Each id is decoded alone (specials kept) and normalised: NFKC, NFD, strip accents, lowercase,
    runs of space / tab / CR / LF -> one space, strip; a token that is exactly one space keeps it.
    A decode with U+FFFD (a partial UTF-8 byte token) is keyed by the raw token string instead.
    `tokenizer`: a `tokenizers.Tokenizer`, an HF tokenizer (`.backend_tokenizer`) or shuili's
    `HFTokenizer`. Must give `engram_compressed_vocab_size` for the checkpoint's own tokenizer.
    """
    from tokenizers import Regex, normalizers

    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tok", None) or tokenizer
    size = len(tokenizer) if hasattr(tokenizer, "backend_tokenizer") else backend.get_vocab_size(with_added_tokens=True)
    keep = "\ue000"  # private use: survives Strip, so " " does not collapse into ""
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep),
        normalizers.Strip(), normalizers.Replace(keep, " "),
    ])
    ids: dict[str, int] = {}
    out = []
    for t in range(size):
        text = backend.decode([t], skip_special_tokens=False)
        key = backend.id_to_token(t) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(ids.setdefault(key, len(ids)))
    return out, len(ids)
