"""The contract between the engine (scheduler, KV-cache manager, runner) and a model.

One `ForwardBatch` flows from the runner into `Model.forward` each step. A model declares its
cache needs as `CacheGroupSpec`s; the KV-cache manager keeps one paged block pool per group and one
block table per (group, sequence). Every group's logical block i covers the same token span
[i * P, (i + 1) * P), P = `tokens_per_block`, so one chain of token-block hashes serves prefix
caching for all groups: a group with `ratio` r holds P / r entries per block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, model_validator


class CacheGroupSpec(BaseModel):
    """One layer-type group of cache state.

    kind "full": an entry per token (ratio 1), all kept. "sliding": an entry per token, only the
    last `window` tokens are needed (older blocks are freed). "compressed": an entry per `ratio`
    tokens, all kept; entry e summarises tokens [e * ratio, (e + 1) * ratio) and exists once the
    last of them is computed.
    Each layer in `layers` owns one tensor [num_blocks, P // ratio, *entry_shape] of `dtype`;
    all share the group's block ids.
    """

    model_config = ConfigDict(frozen=True)
    name: str
    kind: Literal["full", "sliding", "compressed"]
    layers: tuple[int, ...]
    entry_shape: tuple[int, ...]
    dtype: str = "float32"
    ratio: int = 1
    window: int = 0

    @model_validator(mode="after")
    def _check(self):
        if self.kind != "compressed" and self.ratio != 1:
            raise ValueError(f"cache group {self.name}: only compressed groups have ratio > 1")
        if self.kind == "sliding" and self.window <= 0:
            raise ValueError(f"cache group {self.name}: a sliding group needs window > 0")
        if not self.layers:
            raise ValueError(f"cache group {self.name}: no layers")
        return self

    def entries_per_block(self, tokens_per_block: int) -> int:
        if tokens_per_block % self.ratio:
            raise ValueError(
                f"tokens_per_block {tokens_per_block} is not a multiple of group {self.name}'s "
                f"ratio {self.ratio}; use a multiple of {self.ratio}, or leave tokens_per_block unset "
                "to take the smallest block that fits the model")
        return tokens_per_block // self.ratio

    def bytes_per_block(self, tokens_per_block: int) -> int:
        n = self.entries_per_block(tokens_per_block)
        for s in self.entry_shape:
            n *= s
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size() * len(self.layers)


def default_tokens_per_block(groups: list[CacheGroupSpec], at_least: int = 16) -> int:
    """The block size when the user sets none: the smallest multiple of `at_least` that every group's ratio
    divides (one block then holds a whole number of entries of every group; V4's 128-token HCA entries
    make it 128, V4.1's ratios 1 and 2 leave it 16)."""
    return math.lcm(at_least, *(g.ratio for g in groups))


@dataclass
class ForwardBatch:
    """One step's inputs. T = scheduled tokens, B = sequences, in scheduling order.

    Sequence b's new tokens are rows [query_start_loc[b], query_start_loc[b + 1]) and have
    positions context_lens[b] .. seq_lens[b] - 1 (context = tokens already in the cache).
    block_tables[group] int32 [B, max_blocks]: physical block of each logical block, -1 where a
    sliding group freed it or none is allocated. slot_mapping[group] int64 [T]: where each new
    token's entry goes (full and sliding groups only; -1 = do not write). Compressed groups compute
    entry slots from block_tables (entry e -> block_tables[b, e // (P // ratio)]).
    logits_indices int64 [N]: rows of the T tokens whose next-token logits are wanted.

    static_decode: the batch is a graph-capturable decode step: T = B, one token per sequence,
    every row's logits wanted, shapes padded to a bucket (padding rows: position 0, block tables and
    slots -1), the host lists empty and the values unknown at capture time. A model that accepts it
    sets `supports_static_decode = True` and must then derive everything from the device tensors,
    with shapes that depend only on the tensors' shapes (no host sync, no data-dependent sizes).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: dict[str, torch.Tensor]
    slot_mapping: dict[str, torch.Tensor]
    logits_indices: torch.Tensor
    tokens_per_block: int
    # host copies of the small index tensors, so models need no device->host sync
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    context_lens_cpu: list[int] = field(default_factory=list)
    static_decode: bool = False
    # Engram models only (`engram_lookback` > 0): ids of positions p-1 .. p-lookback of each token
    # (-1 before the sequence start), int64 [T, lookback] on the device and flat on the host, and the
    # host ids of this step (-1 = placeholder filled on the device)
    engram_history: torch.Tensor | None = None
    engram_history_cpu: list[int] = field(default_factory=list)
    input_ids_cpu: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Model(Protocol):
    """What the engine needs of a model. `forward` returns float32 logits [N, vocab].

    Optional: `supports_static_decode = True` lets the runner capture decode steps as device graphs
    (see `ForwardBatch.static_decode`).
    """

    vocab_size: int
    max_model_len: int
    tokenizer: Tokenizer

    def cache_groups(self) -> list[CacheGroupSpec]: ...

    def bind_caches(self, caches: dict[str, list[torch.Tensor]], tokens_per_block: int) -> None: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...

    def apply_chat_template(self, prompt: str) -> str: ...


def bind_group_caches(groups: list[CacheGroupSpec], caches: dict[str, list[torch.Tensor]],
                      tokens_per_block: int) -> dict[str, dict[int, torch.Tensor]]:
    """Each group's cache tensors by layer, checked against the group's spec: one tensor per layer,
    each [*, tokens_per_block // ratio, *entry_shape] of the group's dtype."""
    out = {}
    for g in groups:
        if g.name not in caches:
            raise ValueError(f"bind_caches: no tensors for cache group {g.name!r}")
        ts = caches[g.name]
        if len(ts) != len(g.layers):
            raise ValueError(f"bind_caches: group {g.name} has {len(g.layers)} layers, got {len(ts)} tensors")
        want = (tokens_per_block // g.ratio, *g.entry_shape)
        for t in ts:
            if tuple(t.shape[1:]) != want or t.dtype != getattr(torch, g.dtype):
                raise ValueError(f"bind_caches: group {g.name} wants [*, {', '.join(map(str, want))}] "
                                 f"{g.dtype}, got {list(t.shape)} {t.dtype}")
        out[g.name] = dict(zip(g.layers, ts))
    return out
