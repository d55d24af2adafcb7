"""CacheDriver: caches and ForwardBatches for running any model without the engine (tests, tools,
the direct perplexity path, benchmarks). One driver for every model family: it works from the
model's CacheGroupSpecs alone, whatever their kinds.

Sequence s owns physical blocks [s * n, (s + 1) * n) of every group, n = ceil(max_len / P); nothing
is freed, so sliding groups simply keep every block.
"""
from __future__ import annotations


import torch

from shuili.core.model_api import ForwardBatch, default_tokens_per_block


class CacheDriver:
    def __init__(self, model, max_seqs: int, max_len: int, tokens_per_block: int | None = None,
                 device: str | None = None):
        self.groups = model.cache_groups()
        P = tokens_per_block or default_tokens_per_block(self.groups)
        for g in self.groups:
            g.entries_per_block(P)
        self.P, self.max_len = P, max_len
        self.device = device or getattr(model, "device", "cpu")
        self.per_seq = -(-max_len // P)
        n = max_seqs * self.per_seq
        self.caches = {g.name: [torch.zeros(n, P // g.ratio, *g.entry_shape, dtype=getattr(torch, g.dtype),
                                            device=self.device) for _ in g.layers]
                       for g in self.groups}
        self.lens: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}  # per sequence, for models that hash look-back ids (Engram)
        self.lookback = int(getattr(model, "engram_lookback", 0) or 0)
        model.bind_caches(self.caches, P)

    def batch(self, chunks: list[tuple], logits: str = "last") -> ForwardBatch:
        """chunks: (seq, new token ids) or (seq, new token ids, start position), in scheduling order;
        without a start the tokens follow the sequence's previous chunk. logits: 'last' token of each
        chunk or 'all' tokens."""
        ids, pos, qsl, lens, ctx, rows, tables, slots, hist = [], [], [0], [], [], [], [], [], []
        for seq, toks, *start in chunks:
            begin = start[0] if start else self.lens.get(seq, 0)
            end = begin + len(toks)
            if not toks or end > self.max_len:
                raise ValueError(f"chunk of {len(toks)} tokens at {begin} does not fit max_len {self.max_len}")
            base = seq * self.per_seq
            rows += range(len(ids), len(ids) + len(toks)) if logits == "all" else [len(ids) + len(toks) - 1]
            ids += toks
            pos += range(begin, end)
            slots += [base * self.P + p for p in range(begin, end)]
            qsl.append(len(ids))
            lens.append(end)
            ctx.append(begin)
            tables.append(list(range(base, base + self.per_seq)))
            self.lens[seq] = end
            if self.lookback:
                from shuili.core.models.engram_hash import engram_history

                known = self.tokens.setdefault(seq, [])
                del known[begin:]
                if len(known) < begin:
                    raise ValueError(f"sequence {seq}: tokens before position {begin} are unknown to the driver")
                known += list(toks)
                hist += engram_history(lambda a, b: known[a:b], begin, end, self.lookback)

        def t(v, dt):
            return torch.tensor(v, dtype=dt, device=self.device)

        fb = ForwardBatch(
            input_ids=t(ids, torch.int64), positions=t(pos, torch.int64), query_start_loc=t(qsl, torch.int32),
            seq_lens=t(lens, torch.int32), context_lens=t(ctx, torch.int32),
            block_tables={g.name: t(tables, torch.int32) for g in self.groups},
            slot_mapping={g.name: t(slots, torch.int64) for g in self.groups if g.kind != "compressed"},
            logits_indices=t(rows, torch.int64), tokens_per_block=self.P,
            query_start_loc_cpu=qsl, seq_lens_cpu=lens, context_lens_cpu=ctx)
        if self.lookback:
            fb.engram_history = t(hist, torch.int64).view(-1, self.lookback)
            fb.engram_history_cpu, fb.input_ids_cpu = hist, list(ids)
        return fb
