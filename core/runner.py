"""Model runner: cache tensors from the model's CacheGroupSpecs, ForwardBatch building, forward + sample.

`execute` launches one step and returns a `StepResult` whose tensors stay on the device; the
engine reads them back (`StepResult.to_host`) when it processes the step. In overlap mode the
inputs of step N+1 may hold placeholders for tokens step N samples: they are filled on the
device from step N's sampled-token tensor, so preparing N+1 never waits for N.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shuili.core.model_api import CacheGroupSpec, ForwardBatch
from shuili.core.sampler import Sampler, SampleRow
from shuili.core.scheduler import SchedulerOutput


def allocate_caches(groups: list[CacheGroupSpec], num_blocks: int, tokens_per_block: int,
                    device: str) -> dict[str, list[torch.Tensor]]:
    caches = {}
    for g in groups:
        shape = (num_blocks, g.entries_per_block(tokens_per_block), *g.entry_shape)
        caches[g.name] = [torch.zeros(shape, dtype=getattr(torch, g.dtype), device=device)
                          for _ in g.layers]
    return caches


@dataclass
class StepResult:
    sample_rows: list[SampleRow]
    sampled: torch.Tensor | None  # int64 [S] on the device
    logprobs: torch.Tensor | None  # float32 [S]
    bad: torch.Tensor | None  # bool [S]: the row's logits held NaN
    prompt_rows: list[tuple] = field(default_factory=list)  # (request, position, logits row)
    prompt_logprobs: torch.Tensor | None = None  # float32 [len(prompt_rows)]
    index: dict[str, int] = field(default_factory=dict)  # request id -> sample row

    def to_host(self):
        tok = self.sampled.tolist() if self.sampled is not None else []
        lps = self.logprobs.tolist() if self.logprobs is not None else []
        bad = self.bad.tolist() if self.bad is not None else []
        plp = self.prompt_logprobs.tolist() if self.prompt_logprobs is not None else []
        return tok, lps, bad, plp


class ModelRunner:
    def __init__(self, model, ops, groups: list[CacheGroupSpec], num_blocks: int,
                 tokens_per_block: int, device: str = "cpu", graphs=None):
        self.model = model
        self.graphs = graphs  # DecodeGraphs or None (eager)
        self.ops = ops
        self.groups = groups
        self.P = tokens_per_block
        self.device = device
        self.caches = allocate_caches(groups, num_blocks, tokens_per_block, device)
        model.bind_caches(self.caches, tokens_per_block)
        self.sampler = Sampler(ops, model.vocab_size, device)

    def build_batch(self, out: SchedulerOutput):
        """ForwardBatch plus the bookkeeping of which logits rows are samples / prompt logprobs."""
        P = self.P
        ids, positions, qsl, seq_lens, ctx = [], [], [0], [], []
        logits_rows, sample_rows, prompt_rows, holes = [], [], [], []
        tables = {g.name: [] for g in self.groups}
        slots = {g.name: [] for g in self.groups if g.kind != "compressed"}
        for c in out.chunks:
            req = c.req
            toks = req.tokens(c.start, c.end)
            row0 = len(ids)
            holes += [(row0 + j, req.request_id) for j, t in enumerate(toks) if t < 0]
            ids += toks
            positions += range(c.start, c.end)
            qsl.append(len(ids))
            seq_lens.append(c.end)
            ctx.append(c.start)
            if req.params.prompt_logprobs:
                for p in range(c.start, min(c.end, req.num_prompt_tokens - 1)):
                    if req.prompt_logprobs[p] is None:
                        logits_rows.append(row0 + p - c.start)
                        prompt_rows.append((req, p, len(logits_rows) - 1))
            if c.sample:
                logits_rows.append(len(ids) - 1)
                sample_rows.append(SampleRow(req, c.end, len(logits_rows) - 1, c.epoch))
            for name, table in tables.items():
                table.append(req.block_ids[name])
            for name, slot in slots.items():
                blocks = req.block_ids[name]
                slot += [blocks[p // P] * P + p % P if blocks[p // P] >= 0 else -1
                         for p in range(c.start, c.end)]
        width = max(max((len(t) for t in tab), default=0) for tab in tables.values()) or 1
        dev = self.device
        block_tables = {
            n: torch.tensor([t + [-1] * (width - len(t)) for t in tab], dtype=torch.int32, device=dev)
            for n, tab in tables.items()}
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
            block_tables=block_tables,
            slot_mapping={n: torch.tensor(s, dtype=torch.int64, device=dev) for n, s in slots.items()},
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            tokens_per_block=P,
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, context_lens_cpu=ctx)
        return batch, sample_rows, prompt_rows, holes

    def execute(self, out: SchedulerOutput, prev: StepResult | None = None) -> StepResult:
        batch, sample_rows, prompt_rows, holes = self.build_batch(out)
        if holes:
            if prev is None or prev.sampled is None:
                raise RuntimeError("a placeholder token has no step in flight to fill it")
            rows = torch.tensor([r for r, _ in holes], dtype=torch.int64, device=self.device)
            src = torch.tensor([prev.index[rid] for _, rid in holes], dtype=torch.int64, device=self.device)
            batch.input_ids[rows] = prev.sampled[src]
        if batch.logits_indices.numel() == 0:
            self.model.forward(batch)
            return StepResult(sample_rows, None, None, None)
        logits = None
        decode = not prompt_rows and len(sample_rows) == len(out.chunks) == batch.num_tokens
        if self.graphs is not None and decode and self.graphs.accepts(batch):
            logits = self.graphs.run(batch)
        if logits is None:
            logits = self.model.forward(batch)
        if logits.shape[0] != batch.logits_indices.shape[0]:
            raise RuntimeError(f"model returned {logits.shape[0]} logits rows, expected "
                               f"{batch.logits_indices.shape[0]} (one per logits_indices entry)")
        res = StepResult(sample_rows, None, None, None, prompt_rows)
        if sample_rows:
            idx = torch.tensor([s.logits_row for s in sample_rows], dtype=torch.int64, device=self.device)
            res.sampled, res.logprobs, res.bad = self.sampler(logits[idx], sample_rows, prev,
                                                            eos=tuple(self.model.tokenizer.eos_token_ids))
            res.index = {s.req.request_id: i for i, s in enumerate(sample_rows)}
        if prompt_rows:
            rows = torch.tensor([i for _, _, i in prompt_rows], dtype=torch.int64, device=self.device)
            lp = self.ops.log_softmax(logits[rows])
            targets = torch.tensor([req.prompt_token_ids[p + 1] for req, p, _ in prompt_rows],
                                   dtype=torch.int64, device=self.device)
            res.prompt_logprobs = lp.gather(1, targets[:, None])[:, 0]
        return res
