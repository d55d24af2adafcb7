"""Decode steps as device graphs: one captured forward per (batch bucket, block-table width bucket).

A decode step launches thousands of small kernels; replaying a recorded graph removes their host
cost. The platform records (`ResolvedPlatform.capture_graph`, from the HAL's optional
`shuili_platform_graph_capture` hook); this module owns the static input buffers, picks the bucket,
pads and copies the step's inputs in, and hands back the live rows' logits. A model opts in with
`supports_static_decode` (see `ForwardBatch.static_decode`).

Padding rows (position 0, block tables and slots -1) write nothing and change no live row's bits:
the model's ops are row-wise and skip -1 indices. Graphs are captured lazily, from all-padding
inputs, so capturing never writes the KV cache. The engine records every bucket at start-up
(EngineConfig.graph_capture "startup", as vLLM does before it serves): a capture mid-serving runs
the forward three times and, the first time, compiles kernels, stalling every running request.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from shuili.core.model_api import CacheGroupSpec, ForwardBatch

log = logging.getLogger("shuili.graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_bucket(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int | None:
    return next((b for b in buckets if b >= n), None)


def width_bucket(n: int, max_width: int) -> int:
    """Block-table width: the next power of two, at most the widest table a sequence can need."""
    w = 1
    while w < n:
        w *= 2
    return min(w, max_width)


@dataclass
class _Graph:
    batch: ForwardBatch  # the static buffers the graph reads
    replay: Callable[[], torch.Tensor] | None = None
    replays: int = 0
    hidden: torch.Tensor | None = None  # keep_hidden: the replay's per-token hidden states, static


@dataclass
class DecodeGraphs:
    model: object
    capture: Callable
    groups: list[CacheGroupSpec]
    max_batch: int
    max_width: int
    tokens_per_block: int
    device: str
    graphs: dict[tuple[int, int], _Graph] = field(default_factory=dict)
    disabled: str | None = None  # why graphs were turned off (a failed capture)
    keep_hidden: bool = False  # a drafter reads the step's hidden states (core/spec/mtp.py)

    def __post_init__(self):
        # batches past the largest bucket run eagerly
        top = batch_bucket(self.max_batch) or BATCH_BUCKETS[-1]
        self.buckets = tuple(b for b in BATCH_BUCKETS if b <= top)

    def accepts(self, batch: ForwardBatch) -> bool:
        """A pure decode step (one token and one logits row per sequence) that fits a bucket."""
        T, B = batch.num_tokens, batch.num_seqs
        return (self.disabled is None and T == B and T <= self.buckets[-1]
                and batch.logits_indices.shape[0] == T)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """float32 logits [T, V] of the live rows, or None (graphs off: run eagerly)."""
        T = batch.num_tokens
        width = max(t.shape[1] for t in batch.block_tables.values())
        key = (batch_bucket(T, self.buckets), width_bucket(width, self.max_width))
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(*key)
            if g is None:
                return None
        _fill(g.batch, batch)
        g.replays += 1
        logits = g.replay()[:T]
        if self.keep_hidden:
            self.model.last_hidden = g.hidden[:T]
        return logits

    def widths(self) -> tuple[int, ...]:
        """Every block-table width bucket a step can pick."""
        out, w = [], 1
        while True:
            out.append(min(w, self.max_width))
            if w >= self.max_width:
                return tuple(out)
            w *= 2

    def capture_all(self) -> int:
        """Record every (batch, width) bucket now, largest first (the platform's shared memory pool is
        sized by the first), so that no request waits on a capture later. Returns the graphs
        recorded; stops at the first failed capture (decode then runs eagerly)."""
        t0 = time.perf_counter()
        n = 0
        for B in reversed(self.buckets):
            for W in reversed(self.widths()):
                if (B, W) in self.graphs:
                    continue
                if self._capture(B, W) is None:
                    return n
                n += 1
        log.info("captured %d decode graphs (%d batch x %d width buckets) in %.1f s", n,
                 len(self.buckets), len(self.widths()), time.perf_counter() - t0)
        return n

    def _forward(self, g: _Graph) -> torch.Tensor:
        if not self.keep_hidden:
            return self.model.forward(g.batch)
        logits = self.model.forward(g.batch, keep_hidden=True)
        h = self.model.last_hidden
        if g.hidden is None:  # allocated on the first (warm-up or capturing) run, then rewritten
            g.hidden = torch.empty_like(h)
        g.hidden.copy_(h)
        return logits

    def _capture(self, B: int, W: int) -> _Graph | None:
        g = _Graph(_static_batch(self.groups, B, W, self.tokens_per_block, self.device,
                                 int(getattr(self.model, "engram_lookback", 0) or 0)))
        try:
            g.replay = self.capture(lambda: self._forward(g))
        except Exception as exc:  # a model or op that cannot be captured still runs, eagerly
            self.disabled = f"graph capture of batch {B} x {W} blocks failed: {type(exc).__name__}: {exc}"
            log.warning("%s; decode runs eagerly from now on", self.disabled)
            return None
        log.info("captured decode graph: batch %d, %d blocks per table", B, W)
        self.graphs[(B, W)] = g
        return g


def _static_batch(groups: list[CacheGroupSpec], B: int, W: int, P: int, dev: str,
                  engram_lookback: int = 0) -> ForwardBatch:
    """All-padding buffers: nothing a replay of them writes lands in the cache. Engram models also
    get the look-back ids [B, engram_lookback] (padding: -1, before any sequence)."""
    i64, i32 = torch.int64, torch.int32
    batch = ForwardBatch(
        input_ids=torch.zeros(B, dtype=i64, device=dev),
        positions=torch.zeros(B, dtype=i64, device=dev),
        query_start_loc=torch.arange(B + 1, dtype=i32, device=dev),
        seq_lens=torch.ones(B, dtype=i32, device=dev),
        context_lens=torch.zeros(B, dtype=i32, device=dev),
        block_tables={g.name: torch.full((B, W), -1, dtype=i32, device=dev) for g in groups},
        slot_mapping={g.name: torch.full((B,), -1, dtype=i64, device=dev)
                      for g in groups if g.kind != "compressed"},
        logits_indices=torch.arange(B, dtype=i64, device=dev),
        tokens_per_block=P, static_decode=True)
    if engram_lookback:
        batch.engram_history = torch.full((B, engram_lookback), -1, dtype=i64, device=dev)
    return batch


def _fill(static: ForwardBatch, batch: ForwardBatch) -> None:
    T = batch.num_tokens
    for name, pad in (("input_ids", 0), ("positions", 0), ("seq_lens", 1), ("context_lens", 0)):
        dst, src = getattr(static, name), getattr(batch, name)
        dst[T:].fill_(pad)
        dst[:T].copy_(src, non_blocking=True)
    for name, dst in static.block_tables.items():
        src = batch.block_tables[name]
        dst.fill_(-1)
        dst[:T, :src.shape[1]].copy_(src, non_blocking=True)
    for name, dst in static.slot_mapping.items():
        dst[T:].fill_(-1)
        dst[:T].copy_(batch.slot_mapping[name], non_blocking=True)
    if static.engram_history is not None:
        static.engram_history[T:].fill_(-1)
        static.engram_history[:T].copy_(batch.engram_history, non_blocking=True)
