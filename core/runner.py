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
from shuili.core.staging import Download, upload


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
    download: Download | None = None  # started when the step is launched
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, logprobs) [S, k] when a row asks

    def top_to_host(self) -> list[list[tuple[int, float]]] | None:
        if self.top is None:
            return None
        ids, lps = self.top
        return [list(zip(i, v)) for i, v in zip(ids.tolist(), lps.tolist())]

    def to_host(self):
        """(tokens, logprobs, bad, prompt logprobs) as lists; waits for this step only."""
        if self.download is None:
            self.start_download()
        return tuple(self.download.wait())

    def start_download(self) -> None:
        self.download = Download([self.sampled, self.logprobs, self.bad, self.prompt_logprobs])


@dataclass
class Step:
    """One step's device inputs and the host bookkeeping that maps logits rows back to requests."""
    batch: ForwardBatch
    sample_rows: list[SampleRow]
    prompt_rows: list[tuple]  # (request, position, logits row)
    holes: list[tuple[int, str]]  # (input row, request id) of tokens the in-flight step samples
    sample_idx: torch.Tensor  # int64 [S]: logits row of each sample row
    prompt_idx: torch.Tensor  # int64 [len(prompt_rows)]
    prompt_targets: torch.Tensor  # int64 [len(prompt_rows)]: the next prompt token
    hole_rows: torch.Tensor  # int64 [len(holes)]
    hole_src: torch.Tensor  # int64 [len(holes)]: row of prev.sampled that fills it


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

    def build_batch(self, out: SchedulerOutput, prev: StepResult | None = None) -> Step:
        """ForwardBatch plus which logits rows are samples / prompt logprobs; one upload."""
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
        i64, i32 = torch.int64, torch.int32
        names, snames = list(tables), list(slots)
        padded = [[b for t in tables[n] for b in t + [-1] * (width - len(t))] for n in names]
        sample_idx = [s.logits_row for s in sample_rows]
        prompt_idx = [i for _, _, i in prompt_rows]
        targets = [req.prompt_token_ids[p + 1] for req, p, _ in prompt_rows]
        if holes and (prev is None or prev.sampled is None):
            raise RuntimeError("a placeholder token has no step in flight to fill it")
        hole_src = [prev.index[rid] for _, rid in holes]
        dev = upload([(ids, i64), (positions, i64), (qsl, i32), (seq_lens, i32), (ctx, i32),
                      (logits_rows, i64), (sample_idx, i64), (prompt_idx, i64), (targets, i64),
                      ([r for r, _ in holes], i64), (hole_src, i64)]
                     + [(t, i32) for t in padded] + [(slots[n], i64) for n in snames], self.device)
        batch = ForwardBatch(
            input_ids=dev[0], positions=dev[1], query_start_loc=dev[2], seq_lens=dev[3],
            context_lens=dev[4],
            block_tables={n: t.view(len(out.chunks), width) for n, t in zip(names, dev[11:])},
            slot_mapping=dict(zip(snames, dev[11 + len(names):])),
            logits_indices=dev[5], tokens_per_block=P,
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, context_lens_cpu=ctx)
        return Step(batch, sample_rows, prompt_rows, holes, *dev[6:11])

    def execute(self, out: SchedulerOutput, prev: StepResult | None = None) -> StepResult:
        step = self.build_batch(out, prev)
        batch, sample_rows, prompt_rows = step.batch, step.sample_rows, step.prompt_rows
        if step.holes:
            batch.input_ids[step.hole_rows] = prev.sampled[step.hole_src]
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
            res.sampled, res.logprobs, res.bad = self.sampler(logits[step.sample_idx], sample_rows, prev,
                                                            eos=tuple(self.model.tokenizer.eos_token_ids))
            res.index = {s.req.request_id: i for i, s in enumerate(sample_rows)}
            res.top = self.sampler.top_logprobs(logits[step.sample_idx], sample_rows)
        if prompt_rows:
            lp = self.ops.log_softmax(logits[step.prompt_idx])
            res.prompt_logprobs = lp.gather(1, step.prompt_targets[:, None])[:, 0]
        res.start_download()
        return res
