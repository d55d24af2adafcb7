"""The interface of a shared KV block store (the disk tier today; 3FS, Mooncake, LMCache later).

A store maps a content address (`key`: hex of sha256(fingerprint || chained block hash)) to the
KV of one logical block in every cache group: {group name: tensor [layers, entries, *entry_shape]},
written together and read by group.
It never raises into the engine: a store that cannot read or write answers a miss and logs.
`get` returns only data it verified (checksum, fingerprint, shapes); anything else is a miss, so
the engine recomputes and a wrong answer is impossible.
"""
from __future__ import annotations

from typing import Protocol

import torch


class BlockStore(Protocol):
    name: str

    def contains(self, key: str) -> bool:
        """Cheap existence probe (may say True for a block `get` then rejects)."""

    def get(self, key: str, expect: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor] | None:
        """The tensors of the groups `expect` names (group -> shape, dtype), verified; None = miss.
        Only those groups need be read: a hit asks a block for the groups it uses (a sliding group
        only inside the last window), so a store should fetch them by range, not whole blocks."""

    def put(self, key: str, chain_hash: bytes, blocks: dict[str, torch.Tensor], ready=None) -> None:
        """Store a block (may return before it is written). `ready`: an event to wait on before
        reading `blocks` on the host (a device -> host copy in flight), or None."""

    def flush(self) -> None:
        """Block until every `put` so far is written (or has failed)."""

    def close(self) -> None: ...

    def stats(self) -> dict[str, int]: ...
