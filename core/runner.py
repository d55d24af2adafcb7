"""Model runner: cache tensors from the model's CacheGroupSpecs, ForwardBatch building, forward + sample.

`execute` launches one step and returns a `StepResult` whose tensors stay on the device; the
engine reads them back (`StepResult.to_host`) when it processes the step. In overlap mode the
inputs of step N+1 may hold placeholders for tokens step N samples: they are filled on the
device from step N's sampled-token tensor, so preparing N+1 never waits for N.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shuili.core.kv_memory import kv_zeros
from shuili.core.model_api import CacheGroupSpec, ForwardBatch
from shuili.core.models.engram_hash import engram_history
from shuili.core.request import Request, stop_ids
from shuili.core.sampler import Penalties, Sampler, SamplingBatch
from shuili.core.scheduler import SampleRow, SchedulerOutput, StepOutput
from shuili.hal.checks import INPUTS_CHECKED
from shuili.hal.transfer import HostTransfer, Pending, Transfer


def allocate_caches(groups: list[CacheGroupSpec], num_blocks: int | dict[str, int], tokens_per_block: int,
                    device: str) -> dict[str, list[torch.Tensor]]:
    caches = {}
    for g in groups:
        n = num_blocks[g.name] if isinstance(num_blocks, dict) else num_blocks
        shape = (n, g.entries_per_block(tokens_per_block), *g.entry_shape)
        caches[g.name] = [kv_zeros(shape, getattr(torch, g.dtype), device) for _ in g.layers]
    return caches


@dataclass
class StepResult:
    """A launched step: device tensors (on the way to the host) and the rows they belong to."""
    sample_rows: list[SampleRow] = field(default_factory=list)
    sampled: torch.Tensor | None = None  # int64 [S] on the device
    logprobs: torch.Tensor | None = None  # float32 [S]
    bad: torch.Tensor | None = None  # bool [S]: the row's logits held NaN
    prompt_rows: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt position)
    prompt_logprobs: torch.Tensor | None = None  # float32 [len(prompt_rows)]
    index: dict[str, int] = field(default_factory=dict)  # request id -> sample row
    download: Pending | None = None  # started when the step is launched
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, logprobs) [S, k] when a row asks
    drafts: torch.Tensor | None = None  # int64 [C, k]: a device drafter's next drafts per sampling chunk, -1 pad
    hidden: torch.Tensor | None = None  # the model's per-token hidden state, when a drafter reads it

    def to_host(self) -> StepOutput:
        """The step's results as host lists; waits for this step only."""
        tokens, logprobs, bad, prompt_logprobs, drafts = self.download.wait()
        top = None
        if self.top is not None:
            top = [list(zip(i, v)) for i, v in zip(self.top[0].tolist(), self.top[1].tolist())]
        return StepOutput(rows=self.sample_rows, tokens=tokens, logprobs=logprobs, bad=bad,
                          prompt_rows=self.prompt_rows, prompt_logprobs=prompt_logprobs, top=top,
                          drafts=[[t for t in d if t >= 0] for d in drafts] if self.drafts is not None else None)


@dataclass
class HostStep:
    """A step's inputs as host lists, gathered chunk by chunk (T tokens, B sequences)."""
    input_ids: list[int] = field(default_factory=list)  # [T], -1 = placeholder
    positions: list[int] = field(default_factory=list)  # [T]
    query_start_loc: list[int] = field(default_factory=lambda: [0])  # [B + 1]
    seq_lens: list[int] = field(default_factory=list)  # [B]
    context_lens: list[int] = field(default_factory=list)  # [B]
    logits_indices: list[int] = field(default_factory=list)  # [N]: rows whose logits are wanted
    sample_rows: list[SampleRow] = field(default_factory=list)
    prompt_rows: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt position)
    prompt_logits: list[int] = field(default_factory=list)  # logits row of each prompt row
    holes: list[tuple[int, str]] = field(default_factory=list)  # (input row, request id) filled from prev
    tables: dict[str, list[list[int]]] = field(default_factory=dict)  # group -> [B] block tables
    slots: dict[str, list[int]] = field(default_factory=dict)  # group -> [T] cache slots
    engram_history: list[int] = field(default_factory=list)  # [T * lookback] (Engram models)
    engram_holes: list[tuple[int, str]] = field(default_factory=list)  # (history index, request id) from prev


@dataclass
class Step:
    """One step's device inputs and the host bookkeeping that maps logits rows back to requests."""
    batch: ForwardBatch
    sample_rows: list[SampleRow]
    prompt_rows: list[tuple[Request, int]]
    holes: list[tuple[int, str]]
    sample_idx: torch.Tensor  # int64 [S]: logits row of each sample row
    prompt_idx: torch.Tensor  # int64 [len(prompt_rows)]
    prompt_targets: torch.Tensor  # int64 [len(prompt_rows)]: the next prompt token
    hole_rows: torch.Tensor  # int64 [len(holes)]
    hole_src: torch.Tensor  # int64 [len(holes)]: row of prev.sampled that fills it
    sampling: SamplingBatch | None  # None: nothing is sampled
    fill_at: torch.Tensor | None = None  # int64: in-flight tokens in sampling.penalties.output_ids
    fill_src: torch.Tensor | None = None  # int64: row of prev.sampled that fills each
    engram_fill_at: torch.Tensor | None = None  # int64: in-flight tokens in batch.engram_history (flat)
    engram_fill_src: torch.Tensor | None = None  # int64: row of prev.sampled that fills each


class ModelRunner:
    def __init__(self, model, ops, groups: list[CacheGroupSpec], num_blocks: int | dict[str, int],
                 tokens_per_block: int, device: str = "cpu", graphs=None, transfer: Transfer | None = None):
        self.model = model
        self.transfer = transfer or HostTransfer()  # the platform's host <-> device copies
        self.graphs = graphs  # DecodeGraphs or None (eager)
        self.ops = ops
        self.groups = groups
        self.P = tokens_per_block
        self.device = device
        self.caches = allocate_caches(groups, num_blocks, tokens_per_block, device)
        self.pool_blocks = {g.name: num_blocks[g.name] if isinstance(num_blocks, dict) else num_blocks for g in groups}
        model.bind_caches(self.caches, tokens_per_block)
        self.sampler = Sampler(ops, model.vocab_size)
        self.eos = tuple(model.tokenizer.eos_token_ids)
        self.engram_lookback = int(getattr(model, "engram_lookback", 0) or 0)
        self.drafter = None  # a core/spec drafter that drafts on the device (set by the engine)

    def build_batch(self, out: SchedulerOutput, prev: StepResult | None = None) -> Step:
        """ForwardBatch plus which logits rows are samples / prompt logprobs; one upload."""
        h, arrays, flags = self.host_inputs(out, prev)
        step = self.device_step(arrays, flags, len(out.chunks), h)
        if self.engram_lookback:
            self._engram_prefetch(out)
        return step

    def host_inputs(self, out: SchedulerOutput, prev: StepResult | None = None) -> tuple[HostStep, dict, dict]:
        """The step's inputs as host arrays (name -> (list, dtype)) and sampling flags: all a rank
        needs to run the step (core/parallel broadcasts them), plus the HostStep's request rows."""
        h = HostStep(tables={g.name: [] for g in self.groups},
                     slots={g.name: [] for g in self.groups if g.kind != "compressed"})
        for c in out.chunks:
            self._add_chunk(h, c)
        if h.holes and (prev is None or prev.sampled is None):
            raise RuntimeError("a placeholder token has no step in flight to fill it")
        check_host_inputs(h, self.sampler.V, self.pool_blocks)
        i64, i32 = torch.int64, torch.int32
        width = max(max((len(t) for t in tab), default=0) for tab in h.tables.values()) or 1
        arrays = {
            "input_ids": (h.input_ids, i64), "positions": (h.positions, i64),
            "query_start_loc": (h.query_start_loc, i32), "seq_lens": (h.seq_lens, i32),
            "context_lens": (h.context_lens, i32), "logits_indices": (h.logits_indices, i64),
            "sample_idx": ([r.logits_row for r in h.sample_rows], i64),
            "prompt_idx": (h.prompt_logits, i64),
            "prompt_targets": ([req.prompt_token_ids[p + 1] for req, p in h.prompt_rows], i64),
            "hole_rows": ([r for r, _ in h.holes], i64),
            "hole_src": ([prev.index[rid] for _, rid in h.holes], i64),
        }
        for name, tab in h.tables.items():
            arrays["table." + name] = ([b for t in tab for b in t + [-1] * (width - len(t))], i32)
        for name, slot in h.slots.items():
            arrays["slots." + name] = (slot, i64)
        if self.engram_lookback:
            arrays["engram_history"] = (h.engram_history, i64)
            arrays["engram_fill_at"] = ([i for i, _ in h.engram_holes], i64)
            arrays["engram_fill_src"] = ([prev.index[rid] for _, rid in h.engram_holes], i64)
        flags = self._sampling_arrays(arrays, h.sample_rows, prev)
        return h, arrays, flags

    def device_step(self, arrays: dict, flags: dict, num_chunks: int, h: HostStep | None = None) -> Step:
        """Upload `host_inputs`' arrays and build the Step (h None: a rank without the requests)."""
        dev = self.transfer.upload(arrays, self.device)
        tables = [k[len("table."):] for k in arrays if k.startswith("table.")]
        width = len(arrays["table." + tables[0]][0]) // num_chunks if num_chunks else 1
        batch = ForwardBatch(
            input_ids=dev["input_ids"], positions=dev["positions"],
            query_start_loc=dev["query_start_loc"], seq_lens=dev["seq_lens"],
            context_lens=dev["context_lens"],
            block_tables={n: dev["table." + n].view(num_chunks, width) for n in tables},
            slot_mapping={k[len("slots."):]: v for k, v in dev.items() if k.startswith("slots.")},
            logits_indices=dev["logits_indices"], tokens_per_block=self.P,
            query_start_loc_cpu=list(arrays["query_start_loc"][0]), seq_lens_cpu=list(arrays["seq_lens"][0]),
            context_lens_cpu=list(arrays["context_lens"][0]))
        if "engram_history" in arrays:
            batch.engram_history = dev["engram_history"].view(-1, self.engram_lookback)
            batch.engram_history_cpu, batch.input_ids_cpu = arrays["engram_history"][0], arrays["input_ids"][0]
        sampled = len(arrays["sample_idx"][0]) > 0
        return Step(batch=batch, sample_rows=h.sample_rows if h else [], prompt_rows=h.prompt_rows if h else [],
                    holes=h.holes if h else [],
                    sample_idx=dev["sample_idx"], prompt_idx=dev["prompt_idx"],
                    prompt_targets=dev["prompt_targets"], hole_rows=dev["hole_rows"], hole_src=dev["hole_src"],
                    sampling=_sampling_batch(dev, flags) if sampled else None,
                    fill_at=dev.get("pen.fill_at"), fill_src=dev.get("pen.fill_src"),
                    engram_fill_at=dev.get("engram_fill_at"), engram_fill_src=dev.get("engram_fill_src"))

    def _sampling_arrays(self, arrays: dict, rows: list[SampleRow], prev: StepResult | None) -> dict:
        """Adds the rows' sampling inputs to the step's upload; returns the host flags."""
        f32, i32, i64 = torch.float32, torch.int32, torch.int64
        ps = [r.req.params for r in rows]
        arrays.update({
            "s.temperature": ([p.temperature for p in ps], f32), "s.top_k": ([p.top_k for p in ps], i32),
            "s.top_p": ([p.top_p for p in ps], f32), "s.min_p": ([p.min_p for p in ps], f32),
            "s.seeds": ([r.req.seed for r in rows], i64), "s.positions": ([r.position for r in rows], i64)})
        flags = {"all_greedy": all(p.greedy for p in ps), "any_filter": any(p.has_filter for p in ps),
                 "penalties": any(p.has_penalties for p in ps), "banned": False}
        if flags["penalties"]:
            arrays.update(_penalty_arrays(rows, prev))
        if any(p.min_tokens for p in ps):
            pairs = [(i, t) for i, r in enumerate(rows)
                     if not r.req.may_stop(r.req.num_pending_output - 1 + r.offset)
                     for t in stop_ids(r.req.params, self.eos) if 0 <= t < self.sampler.V]
            flags["banned"] = bool(pairs)
            arrays["ban.rows"] = ([i for i, _ in pairs], i64)
            arrays["ban.ids"] = ([t for _, t in pairs], i64)
        return flags

    def _add_chunk(self, h: HostStep, c) -> None:
        req, P, K = c.req, self.P, len(c.drafts)
        toks = req.tokens(c.start, c.end - K) + c.drafts
        row0 = len(h.input_ids)
        h.holes += [(row0 + j, req.request_id) for j, t in enumerate(toks) if t < 0]
        h.input_ids += toks
        h.positions += range(c.start, c.end)
        if self.engram_lookback:  # the look-back of a draft position includes the drafts before it
            base = c.end - K

            def ids(a: int, b: int) -> list[int]:
                return req.tokens(a, max(min(b, base), a)) + c.drafts[max(a - base, 0):max(b - base, 0)]

            h.engram_history += engram_history(ids if K else req.tokens, c.start, c.end, self.engram_lookback)
            # a draft row's look-back may hold the in-flight token (overlap mode): filled like its row
            lb = self.engram_lookback
            h.engram_holes += [((row0 + r) * lb + r - j - 1, req.request_id) for j, t in enumerate(toks) if t < 0
                               for r in range(j + 1, min(len(toks), j + lb + 1))]
        h.query_start_loc.append(len(h.input_ids))
        h.seq_lens.append(c.end)
        h.context_lens.append(c.start)
        if req.params.prompt_logprobs:
            for p in range(c.start, min(c.end, req.num_prompt_tokens - 1)):
                if req.prompt_logprobs[p] is None:
                    h.prompt_logits.append(len(h.logits_indices))
                    h.logits_indices.append(row0 + p - c.start)
                    h.prompt_rows.append((req, p))
        if c.sample:  # rows after the last real token and after each draft (verify: exact match)
            for j in range(K + 1):
                h.sample_rows.append(SampleRow(req, c.end - K + j, len(h.logits_indices), c.epoch, j, c.drafts))
                h.logits_indices.append(len(h.input_ids) - 1 - K + j)
        for name, table in h.tables.items():
            table.append(req.block_ids[name])
        for name, slot in h.slots.items():
            blocks = req.block_ids[name]
            slot += [blocks[p // P] * P + p % P if blocks[p // P] >= 0 else -1 for p in range(c.start, c.end)]

    def _engram_prefetch(self, out: SchedulerOutput) -> None:
        """Start gathering the Engram rows of each prefill's likely next chunk (same length) now,
        while this step runs; the model's `engram_prefetch(ids, history)` keys them by content."""
        fn = getattr(self.model, "engram_prefetch", None)
        if fn is None:
            return
        for c in out.chunks:
            req, n = c.req, c.end - c.start
            end = min(c.end + n, req.num_prompt_tokens)
            if c.end < end:
                fn(req.tokens(c.end, end), engram_history(req.tokens, c.end, end, self.engram_lookback))

    def execute(self, out: SchedulerOutput, prev: StepResult | None = None) -> StepResult:
        # build_batch range-checks the step's ids and tables on the host, so the ops need not
        # check them again on the device (hal/checks.py; the variable is set here, not through
        # inputs_checked(), so the step's path does not cross one more module)
        token = INPUTS_CHECKED.set(True)
        try:
            return self._execute(out, prev)
        finally:
            INPUTS_CHECKED.reset(token)

    def _execute(self, out: SchedulerOutput, prev: StepResult | None) -> StepResult:
        step = self.build_batch(out, prev)
        batch, sample_rows, prompt_rows = step.batch, step.sample_rows, step.prompt_rows
        if step.holes:
            batch.input_ids[step.hole_rows] = prev.sampled[step.hole_src]
        if step.fill_at is not None and step.fill_at.numel():
            step.sampling.penalties.output_ids[step.fill_at] = prev.sampled[step.fill_src]
        if step.engram_fill_at is not None and step.engram_fill_at.numel():
            batch.engram_history.view(-1)[step.engram_fill_at] = prev.sampled[step.engram_fill_src]
        if batch.logits_indices.numel() == 0:
            self.model.forward(batch)
            return self._launched(StepResult(sample_rows=sample_rows))
        logits = None
        decode = not prompt_rows and len(sample_rows) == len(out.chunks) == batch.num_tokens
        hidden = self.drafter is not None and self.drafter.needs_hidden
        if self.graphs is not None and decode and self.graphs.accepts(batch):
            logits = self.graphs.run(batch)
        if logits is None:
            logits = self.model.forward(batch, keep_hidden=True) if hidden else self.model.forward(batch)
        if logits.shape[0] != batch.logits_indices.shape[0]:
            raise RuntimeError(f"model returned {logits.shape[0]} logits rows, expected "
                               f"{batch.logits_indices.shape[0]} (one per logits_indices entry)")
        res = StepResult(sample_rows=sample_rows, prompt_rows=prompt_rows)
        if sample_rows:
            sampled = self.sampler(logits[step.sample_idx], step.sampling)
            res.sampled, res.logprobs, res.bad = sampled.tokens, sampled.logprobs, sampled.bad
            res.index = {s.req.request_id: i for i, s in enumerate(sample_rows) if s.offset == 0}
            res.top = self.sampler.top_logprobs(logits[step.sample_idx],
                                                max(r.req.params.top_logprobs for r in sample_rows))
        if prompt_rows:
            lp = self.ops.log_softmax(logits[step.prompt_idx])
            res.prompt_logprobs = lp.gather(1, step.prompt_targets[:, None])[:, 0]
        if sample_rows and self.drafter is not None and self.drafter.on_device:
            res.hidden = self.model.last_hidden if hidden else None
            res.drafts = self.drafter.draft(self, out, step, res)
        return self._launched(res)

    def _launched(self, res: StepResult) -> StepResult:
        res.download = self.transfer.download([res.sampled, res.logprobs, res.bad, res.prompt_logprobs,
                                               res.drafts])
        res.hidden = None  # read by the drafter only; not kept alive past the step
        return res


def check_host_inputs(h: HostStep, vocab: int, pool: dict[str, int]) -> None:
    """Range checks of the step's token ids and block tables, on the host lists they are built
    from: a captured decode graph's ops leave their device checks out (platforms/nvidia/common.py
    says why), so this is where an id that would read a row past the embedding, or write KV past
    the pool, is stopped. Negative entries are placeholders (ids filled on the device from the
    sampler, in [0, vocab) by construction) or padding (blocks the kernels skip). A slot is
    block * P + offset (offset < P): in the pool whenever its block is, so tables cover slots."""
    top = max(h.input_ids, default=-1)
    if top >= vocab:
        raise ValueError(f"token id {top} is outside the vocabulary [0, {vocab}): the engine admits only "
                         "ids in range, so a drafter or the scheduler produced it; this is an engine bug")
    for name, tables in h.tables.items():
        top = max((max(t, default=-1) for t in tables), default=-1)
        if top >= pool[name]:
            raise ValueError(f"block id {top} of cache group {name!r} is outside the pool [0, {pool[name]}): "
                             "its cache slots would fall past the KV cache; the block allocator handed out "
                             "an id it does not own (an engine bug)")


def _penalty_arrays(rows: list[SampleRow], prev: StepResult | None) -> dict:
    """Each row's generated and prompt tokens as (row, id) pairs. A token the in-flight step is
    sampling (a second placeholder) is a 0 here, filled on the device from prev.sampled."""
    f32, i64 = torch.float32, torch.int64
    out_rows, out_ids, fill_at, fill_src, prompt_rows, prompt_ids = [], [], [], [], [], []
    for i, r in enumerate(rows):
        req = r.req
        # history of a verify row: the outputs and the drafts before it (kept only if all accepted)
        hist = req.output_token_ids + r.drafts[:r.offset]
        out_rows += [i] * len(hist)
        out_ids += hist
        if req.num_placeholders > 1:
            fill_at.append(len(out_ids))
            fill_src.append(prev.index[req.request_id])
            out_rows.append(i)
            out_ids.append(0)
        prompt_rows += [i] * req.num_prompt_tokens
        prompt_ids += req.prompt_token_ids
    ps = [r.req.params for r in rows]
    return {"pen.repetition": ([p.repetition_penalty for p in ps], f32),
            "pen.presence": ([p.presence_penalty for p in ps], f32),
            "pen.frequency": ([p.frequency_penalty for p in ps], f32),
            "pen.output_rows": (out_rows, i64), "pen.output_ids": (out_ids, i64),
            "pen.prompt_rows": (prompt_rows, i64), "pen.prompt_ids": (prompt_ids, i64),
            "pen.fill_at": (fill_at, i64), "pen.fill_src": (fill_src, i64)}


def _sampling_batch(dev: dict[str, torch.Tensor], flags: dict) -> SamplingBatch:
    penalties = None
    if flags["penalties"]:
        penalties = Penalties(
            repetition=dev["pen.repetition"], presence=dev["pen.presence"], frequency=dev["pen.frequency"],
            output_rows=dev["pen.output_rows"], output_ids=dev["pen.output_ids"],
            prompt_rows=dev["pen.prompt_rows"], prompt_ids=dev["pen.prompt_ids"])
    banned = flags["banned"]
    return SamplingBatch(
        temperature=dev["s.temperature"], top_k=dev["s.top_k"], top_p=dev["s.top_p"], min_p=dev["s.min_p"],
        seeds=dev["s.seeds"], positions=dev["s.positions"], all_greedy=flags["all_greedy"],
        any_filter=flags["any_filter"], penalties=penalties,
        banned_rows=dev["ban.rows"] if banned else None, banned_ids=dev["ban.ids"] if banned else None)
