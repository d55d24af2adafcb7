"""DeepSeek-V4.1 metadata of a static (graph-capturable) decode step, derived on the device.

`ForwardBatch.static_decode`: one token per sequence, shapes padded to a (batch B, table width W)
bucket, host lists empty, values unknown at capture time (core/graphs.py). Everything here is built
from the batch's device tensors with shapes fixed by B, W and the config: no host list, no
`.tolist()` / `.item()`, no size that depends on a value.

* Each token may complete one compressed entry per KV source: every token for ratio 1, the token
  that closes a pair for ratio 2. Rows that complete none keep their row (fixed shape) with out slot
  -1 and `done` False; the model pools zeros there and the cache write skips them.
* Padding rows (position 0, block tables and slots -1) write nothing: their window slot is -1, their
  block tables resolve every entry to -1, and `index_pos` (-1 on padding rows, whose window slot
  is -1; a live decode token always writes its window entry) makes the indexer see no entry for
  them, so an op never reads a key through a -1 block (position 0 would otherwise see one entry at
  ratio 1).
The eager `_Meta` (deepseek_v41.py) stays the path for every other batch; both give a live token
the same slots, positions and entries, so the ops, which are row-wise, give it the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shuili.core.model_api import ForwardBatch
from shuili.core.models.deepseek_v41_cache import kv_group, state_group


@dataclass
class StaticEntries:
    """The compressed entries one KV source may complete this step: one row per token (T rows)."""

    src: torch.Tensor  # int64 [T, r] state slots of the pair's tokens (r > 1) or [T] token rows (r = 1)
    out_slots: torch.Tensor  # int64 [T] slots in the source's kv / idx groups, -1: no entry completed
    positions: torch.Tensor  # int64 [T] rope position = the entry's first token
    done: torch.Tensor  # bool [T]: the row completes an entry (out_slots >= 0)


class StaticMeta:
    """`_Meta`'s fields for a static decode batch (same names, fixed shapes)."""

    def __init__(self, m, b: ForwardBatch):
        cfg, dev, P = m.cfg, b.input_ids.device, b.tokens_per_block
        if P != m.tokens_per_block:
            raise ValueError(f"batch tokens_per_block {P} != the {m.tokens_per_block} the caches were bound with")
        if not b.static_decode:
            raise ValueError("StaticMeta takes static decode batches only (eager batches use _Meta)")
        T = b.num_tokens
        if b.num_seqs != T:
            raise ValueError(f"a static decode batch has one token per sequence: {T} tokens, {b.num_seqs} sequences")
        self.batch, self.P = b, P
        self.pos = b.positions.long()
        self.qsl = b.query_start_loc
        self.tok_seq = torch.arange(T, device=dev)
        live = b.slot_mapping["swa_kv"] >= 0
        self.index_pos = torch.where(live, self.pos, torch.full_like(self.pos, -1))
        W = cfg.sliding_window
        win_pos = self.pos[:, None] - (W - 1) + torch.arange(W, device=dev)[None]
        self.slots = m.ops.paged_slots
        self.win_idx = self.slots(b.block_tables["swa_kv"], self.tok_seq[:, None], win_pos, P).int()
        self.new = {src: self._entries(b, src, cfg.ratio(src)) for src in cfg.kv_source_layer_ids}

    def _entries(self, b: ForwardBatch, src: int, r: int) -> StaticEntries:
        P, pos, seq = self.P, self.pos, self.tok_seq
        if r == 1:  # every token is an entry (padding rows: block -1, slot -1)
            out = self.slots(b.block_tables[kv_group(src)], seq, pos, P)
            return StaticEntries(seq, out, pos, out >= 0)
        nxt = pos + 1
        ent = torch.div(nxt, r, rounding_mode="floor") - 1
        done = (nxt % r == 0) & (ent >= 0)
        ent = ent.clamp(min=0)
        toks = ent[:, None] * r + torch.arange(r, device=pos.device)[None]
        src_slots = self.slots(b.block_tables[state_group(src)], seq[:, None], toks, P)
        out = self.slots(b.block_tables[kv_group(src)], seq, ent, P // r)
        out = torch.where(done, out, torch.full_like(out, -1))
        return StaticEntries(src_slots, out, ent * r, done & (out >= 0))
