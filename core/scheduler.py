"""Continuous-batching scheduler: one rule, `num_computed_tokens` catches up with `num_tokens`.

Each step hands out a token budget: running requests first (decode and unfinished prefill
chunks alike, in admission order), then waiting requests in policy order (FCFS or priority),
with a prefix-cache lookup on admission. When a running request cannot get blocks, the
lowest-priority running request is preempted by recompute (blocks freed, computed
tokens reset, back to the front of the queue); no request is admitted in a step that preempted.
The victim may already hold a chunk in this step: the chunk is withdrawn and its budget returned.
A scheduled chunk that reaches the end of the known tokens samples one token, which is counted
as a placeholder until its value is on the host (that is what lets overlap mode schedule step
N+1 before step N's samples are read back).

Speculative decoding (core/spec) is the same rule: a decode chunk may carry the request's draft
tokens after its last real token; it computes them too and samples at every position. `update`
keeps the drafts that equal the target's own samples (core/spec/verify.py) plus the target's
token at the first mismatch, then moves `num_computed_tokens` back to the verified tokens; the
KV written for rejected drafts lies past that point, so the next step overwrites it before any
query can read it, and blocks past the last real token are released (`KVCacheManager.trim`).

`update` is the only place a step's results land: prompt logprobs, published KV blocks, sampled
tokens, and every finish (stop, length, NaN, model fault, unschedulable); the engine only loops.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from shuili.core.kv_cache import KVCacheManager
from shuili.core.request import Request, Status, check_stop
from shuili.core.spec.verify import num_accepted

NAN_ERROR = ("the model produced NaN (or all -inf) logits for this request (a numerical fault in the model, its "
             "weights or its dtype); it was stopped and its KV blocks freed. Check the checkpoint and "
             "dtype; other requests are unaffected")


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # first position computed this step (= context length)
    num_tokens: int
    sample: bool  # the chunk ends at the last known token: sample the next one
    epoch: int
    drafts: list[int] = field(default_factory=list)  # provisional tokens after the last real one

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def current(self) -> bool:
        """Still the request's live work (not preempted, aborted or finished since scheduled)."""
        return self.req.epoch == self.epoch and self.req.status is Status.RUNNING


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass
class SampleRow:
    """Where a sampled token goes: the request, the token's absolute position, the logits row."""
    req: Request
    position: int
    logits_row: int
    epoch: int = 0  # the request's epoch when scheduled; a stale row is dropped
    offset: int = 0  # j: the row samples the token after the chunk's j-th draft (0: after the real ones)
    drafts: list[int] = field(default_factory=list)  # the chunk's drafts (rows 0..len(drafts) share them)


@dataclass
class StepOutput:
    """One step's results on the host, as the scheduler consumes them (rows in sample order)."""
    rows: list[SampleRow] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    bad: list[bool] = field(default_factory=list)  # the row's logits held NaN
    prompt_rows: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt position)
    prompt_logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] | None = None  # per row: the k most likely (id, logprob)
    drafts: list[list[int]] | None = None  # per sampling chunk: a device drafter's next drafts


class WaitingQueue:
    """FCFS: a deque (preempted requests go to the front). Priority: a heap on (priority, arrival)."""

    def __init__(self, policy: str):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}: use 'fcfs' or 'priority'")
        self.policy = policy
        self._dq: deque[Request] = deque()
        self._heap: list[tuple[int, int, int, Request]] = []
        self._tie = itertools.count()

    def push(self, req: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (req.priority, req.arrival, next(self._tie), req))
        elif front:
            self._dq.appendleft(req)
        else:
            self._dq.append(req)

    def _drop_finished(self) -> None:
        # aborted requests are removed lazily, so abort stays O(1)
        if self.policy == "priority":
            while self._heap and self._heap[0][3].status is not Status.WAITING:
                heapq.heappop(self._heap)
        else:
            while self._dq and self._dq[0].status is not Status.WAITING:
                self._dq.popleft()

    def peek(self) -> Request | None:
        self._drop_finished()
        if self.policy == "priority":
            return self._heap[0][3] if self._heap else None
        return self._dq[0] if self._dq else None

    def pop(self) -> Request:
        self._drop_finished()
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._dq.popleft()


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", eos: tuple[int, ...] = (),
                 decode: Callable[[list[int]], str] | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.eos = tuple(eos)
        self.decode = decode  # token ids -> text, for stop strings
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrival = itertools.count()
        self._forced: list[str] = []

    # --------------------------------------------------------------------------------- queue
    def next_arrival(self) -> int:
        return next(self._arrival)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use; pick a unique id")
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.waiting.peek() is not None

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Finish at any time (stop, length, abort, error): blocks are freed, results in flight dropped."""
        if req.finished:
            return
        was_running = req.status is Status.RUNNING
        req.status = Status.FINISHED
        req.t_finish = time.perf_counter()
        req.finish_reason = reason
        req.error = error
        req.epoch += 1
        req.num_placeholders = 0
        req.verifying, req.draft_token_ids = 0, []
        self.kv.free(req)
        if was_running:
            self.running.remove(req)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def preempt(self, request_id: str) -> None:
        """Preempt a running request at the next step (tests use this to force recompute)."""
        req = self.requests.get(request_id)
        if req is None or req.status is not Status.RUNNING:
            raise ValueError(f"request {request_id!r} is not running, so it cannot be preempted")
        self._forced.append(request_id)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_placeholders = 0  # an in-flight sample is dropped and recomputed, same value
        req.verifying, req.draft_token_ids = 0, []
        req.epoch += 1
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.push(req, front=True)

    def _victim(self, candidates: list[Request]) -> Request:
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival))
        return candidates[-1]

    # ------------------------------------------------------------------------------ schedule
    def _chunk(self, req: Request, budget: int) -> tuple[int, bool, list[int]]:
        """(tokens to compute, whether to sample, drafts verified among those tokens)."""
        if req.verifying:
            return 0, False, []  # where its next token goes is known once the verify step lands
        if req.num_computed_tokens >= req.num_prompt_tokens and not req.wants_more(self.max_model_len):
            # overlap mode: the in-flight token is its last; its KV would never be read
            return 0, False, []
        remaining = req.num_tokens - req.num_computed_tokens
        n = min(remaining, budget)
        sample = n == remaining and req.wants_more(self.max_model_len)
        drafts = self._drafts(req, budget - n) if sample else []
        return n + len(drafts), sample, drafts

    def _drafts(self, req: Request, room: int) -> list[int]:
        """The drafts this step verifies: a verify step emits up to len + 1 tokens, so never more
        than the request may still produce, nor more than the step's token budget has room for."""
        if not req.draft_token_ids or req.num_placeholders > 1:
            return []
        k = min(len(req.draft_token_ids), room, req.token_limit(self.max_model_len) - req.num_tokens - 1)
        return list(req.draft_token_ids[:max(k, 0)])

    def _commit(self, out: SchedulerOutput, req: Request, n: int, sample: bool,
                drafts: list[int] | None = None) -> None:
        out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n, sample, req.epoch, drafts or []))
        req.num_computed_tokens += n
        req.draft_token_ids = []  # consumed: the chunk holds the ones it verifies
        if sample:
            req.num_placeholders += 1
        req.verifying = len(drafts or ())

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for rid in self._forced:
            req = self.requests.get(rid)
            if req is not None and req.status is Status.RUNNING:
                self._preempt(req)
                out.preempted.append(req)
        self._forced.clear()
        budget = self.max_num_batched_tokens
        for req in self.running:  # every sequence, also those the budget leaves out (core/kv_sizing.py)
            if not req.verifying:  # a verify step in flight may still roll its computed count back
                self.kv.release_out_of_window(req)
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            if req.verifying:
                continue  # its computed count drops to the accepted drafts when the step lands
            n, sample, drafts = self._chunk(req, budget)
            if n <= 0:
                continue  # all known tokens computed; waiting for a sample or a finish
            if drafts and not self.kv.allocate(req, n):
                n, drafts = n - len(drafts), []  # drafts are optional: never preempt for them
            while not self.kv.allocate(req, n):
                victim = self._victim(self.running)
                budget += self._unschedule(out, victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                self._commit(out, req, n, sample, drafts)
                budget -= n
        if not out.preempted:
            self._admit(out, budget)
        if not out and not out.preempted and not self.running:
            self._refuse_head()
        return out

    def _refuse_head(self) -> None:
        # nothing runs and the head of the queue still cannot get blocks: it never will
        req = self.waiting.peek()
        if req is not None:
            self.finish(req, "error", f"the request cannot get KV blocks even with an empty engine "
                        f"({self.kv.num_blocks} per group); raise num_blocks / kv_cache_bytes")

    @staticmethod
    def _unschedule(out: SchedulerOutput, req: Request) -> int:
        """Drop req's chunk from this step (it is about to be preempted); returns its tokens."""
        for k, c in enumerate(out.chunks):
            if c.req is req:
                del out.chunks[k]
                return c.num_tokens
        return 0

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            if req is None:
                return
            hit_tokens, hits = self.kv.find_cached(req)
            req.num_computed_tokens = hit_tokens
            n, sample, drafts = self._chunk(req, budget)
            if not self.kv.allocate(req, n, hits):
                req.num_computed_tokens = 0
                return  # admission never preempts: wait for blocks to come back
            self.waiting.pop()
            req.status = Status.RUNNING
            self.running.append(req)
            self._commit(out, req, n, sample, drafts)
            budget -= n

    # -------------------------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, result: StepOutput) -> list[Request]:
        """Apply one step's results; returns the requests that got a token or finished."""
        for (req, p), v in zip(result.prompt_rows, result.prompt_logprobs):
            req.prompt_logprobs[p] = v
        for c in out.chunks:
            if c.current:
                self.kv.publish(c.req, c.end)
        touched = []
        i, g = 0, 0
        while i < len(result.rows):  # one group per sampling chunk: 1 + len(drafts) rows
            row = result.rows[i]
            n = 1 + len(row.drafts)
            req = row.req
            if req.epoch == row.epoch and req.status is Status.RUNNING:  # else preempted/aborted/finished
                keep = 1 + num_accepted(row.drafts, result.tokens[i:i + n]) if row.drafts else 1
                self._land(req, result, i, keep, row.drafts)
                if result.drafts is not None and not req.finished and not req.verifying:
                    self._install(req, result.drafts[g])
                touched.append(req)
            i, g = i + n, g + 1
        return touched

    @staticmethod
    def _install(req: Request, drafts: list[int]) -> None:
        """A device drafter's drafts follow this step's sample. With the next step's token in
        flight (overlap mode) the first draft is the guess for that token and the rest follow it."""
        if req.num_placeholders <= 1:
            req.draft_token_ids = list(drafts[req.num_placeholders:])

    def _land(self, req: Request, result: StepOutput, i: int, keep: int, drafts: list[int]) -> None:
        """Append rows i .. i + keep - 1 (the accepted drafts' tokens and the target's next one)."""
        req.num_placeholders -= 1
        req.num_sample_steps += 1
        if drafts:
            req.verifying = 0
        req.num_draft_proposed += len(drafts)
        req.num_draft_accepted += keep - 1
        for j in range(i, i + keep):
            if result.bad[j]:
                self.finish(req, "error", NAN_ERROR)
                return
            if result.top is not None and req.params.top_logprobs:
                req.top_logprobs.append(result.top[j][:req.params.top_logprobs])
            self._append(req, result.tokens[j], result.logprobs[j])
            if req.finished:
                return
        if drafts:
            # KV is valid up to the last accepted draft; the last real token is computed next step
            req.num_computed_tokens = req.num_real_tokens - 1
            self.kv.trim(req, req.num_real_tokens)

    def fail(self, out: SchedulerOutput, error: str) -> None:
        """The step could not run (a model fault): its requests finish with the error."""
        for c in out.chunks:
            if not c.req.finished:
                self.finish(c.req, "error", error)

    def _append(self, req: Request, token: int, logprob: float) -> None:
        if not req.output_token_ids:
            req.t_first_token = time.perf_counter()
        req.output_token_ids.append(token)
        if req.params.logprobs:
            req.logprobs.append(logprob)
        reason, cut = check_stop(req, self.eos, self.max_model_len, self.decode)
        if reason is not None:
            req.stop_text_len = cut
            self.finish(req, reason)

    def check(self) -> None:
        """Scheduler-level invariants (tests call this with kv.check_integrity after each step)."""
        assert len(self.running) <= self.max_num_seqs, "more running requests than max_num_seqs"
        assert len(set(map(id, self.running))) == len(self.running), "a request runs twice"
        for req in self.running:
            assert req.status is Status.RUNNING
            assert 0 <= req.num_computed_tokens <= req.num_tokens + req.verifying, (
                f"{req.request_id}: {req.num_computed_tokens} computed, {req.num_tokens} tokens, "
                f"{req.verifying} drafts in flight")
            assert not (req.verifying and req.draft_token_ids), "new drafts while a verify step is in flight"
        self.kv.check_integrity()
