"""The engine behind the server: one background loop, fed by the asyncio front end.

The Engine is not thread-safe, so exactly one place touches it at a time: engine steps run on a
single worker thread, and everything else (adding, aborting, reading state) runs as a "call"
on the event loop between two steps, while the worker is idle. Each step's touched requests
are copied into Snapshots on the worker, so the front end never reads a Request the engine is
changing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from shuili.core.sampling_params import SamplingParams

log = logging.getLogger("shuili.serve")


class Overloaded(Exception):
    pass


@dataclass
class Snapshot:
    """One request's cumulative state after a step (what the client has been promised so far)."""
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int
    hidden_tail: int = 0  # tokens kept in token_ids but not in text (a final EOS / stop id)
    times: dict[str, float] = field(default_factory=dict)
    num_preemptions: int = 0


def snapshot(engine, req) -> Snapshot:
    hidden = int(req.finish_reason == "stop" and req.stop_text_len is None and bool(req.output_token_ids))
    return Snapshot(list(req.output_token_ids), list(req.logprobs), list(req.top_logprobs),
                    engine.text(req), req.finished, req.finish_reason, req.error, req.num_prompt_tokens,
                    hidden, {"arrival": req.t_arrival, "first_token": req.t_first_token,
                             "finish": req.t_finish}, req.num_preemptions)


class EngineLoop:
    def __init__(self, engine, max_waiting: int | None = None, observer=None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.observer = observer  # ServerMetrics, told of adds, tokens and finishes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shuili-engine")
        self._calls: list[tuple[Callable, asyncio.Future]] = []
        self._aborts: list[str] = []
        self._routes: dict[str, tuple[asyncio.Queue, int]] = {}  # request id -> (its HTTP queue, choice)
        self._seen: dict[str, int] = {}  # request id -> tokens already counted
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.fault: str | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                log.warning("engine loop did not stop within %.0f s", timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and self.fault is None

    # -------------------------------------------------------------------------------- front end
    async def call(self, fn: Callable):
        """Run fn() on the event loop between two engine steps; its result or exception."""
        if not self.alive:
            raise RuntimeError(f"the engine loop is not running{': ' + self.fault if self.fault else ''}")
        fut = asyncio.get_running_loop().create_future()
        self._calls.append((fn, fut))
        self._wake.set()
        return await fut

    def num_waiting(self) -> int:
        return sum(len(s.requests) - len(s.running) for s in self.engine.schedulers)

    def would_wait(self, n: int) -> int:
        """Requests left waiting once n more arrive and the free running slots of every
        data-parallel group take their share."""
        free = sum(max(s.max_num_seqs - len(s.running), 0) for s in self.engine.schedulers)
        return self.num_waiting() + n - free

    async def submit(self, rid: str, items: list[tuple[list[int], SamplingParams]]) -> asyncio.Queue:
        """Queue all items or none (ValueError / Overloaded). The queue gets (choice, Snapshot)."""
        queue: asyncio.Queue = asyncio.Queue()

        def add():
            if self.max_waiting is not None and self.would_wait(len(items)) > self.max_waiting:
                raise Overloaded(f"{self.num_waiting()} requests are waiting for admission and this one "
                                 f"would exceed --max-waiting {self.max_waiting}; retry later")
            added = []
            try:
                for i, (ids, params) in enumerate(items):
                    self.engine.add_request(ids, params, request_id=f"{rid}-{i}")
                    added.append(f"{rid}-{i}")
            except ValueError:
                for a in added:
                    self.engine.abort(a)
                raise
            for i, a in enumerate(added):
                self._routes[a] = (queue, i)
                self._seen[a] = 0
                if self.observer is not None:
                    self.observer.on_added(len(items[i][0]))
            return queue

        return await self.call(add)

    def abort_soon(self, request_ids: list[str]) -> None:
        """For a client that went away: abort at the next step boundary (blocks freed then)."""
        self._aborts.extend(request_ids)
        if self._wake is not None:
            self._wake.set()

    async def abort_all(self) -> int:
        """Abort every request; each client gets a final snapshot with finish_reason "abort"."""
        def run():
            rids = list(self._routes)
            for r in rids:
                self._abort(r)
            return len(rids)

        return await self.call(run)

    def num_in_flight(self) -> int:
        return len(self._routes)

    # ------------------------------------------------------------------------------- the loop
    def _abort(self, rid: str) -> None:
        req = next((s.requests[rid] for s in self.engine.schedulers if rid in s.requests), None)
        if req is None:
            self._routes.pop(rid, None)
            return
        self.engine.abort(rid)
        self._deliver([(rid, snapshot(self.engine, req))])

    def _run_calls(self) -> None:
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            self._abort(rid)
        calls, self._calls = self._calls, []
        for fn, fut in calls:
            if fut.cancelled():
                continue
            try:
                fut.set_result(fn())
            except Exception as exc:  # the caller answers it (a 400, a 503, ...)
                fut.set_exception(exc)

    def _step(self) -> list[tuple[str, Snapshot]]:
        return [(r.request_id, snapshot(self.engine, r)) for r in self.engine.step_requests()]

    def _deliver(self, updates: list[tuple[str, Snapshot]]) -> None:
        now = time.perf_counter()
        for rid, snap in updates:
            route = self._routes.get(rid)
            if self.observer is not None:
                self.observer.on_tokens(len(snap.token_ids) - self._seen.get(rid, 0))
                self._seen[rid] = len(snap.token_ids)
                if snap.finished:
                    self.observer.on_finished(snap, now)
            if snap.finished:
                self._routes.pop(rid, None)
                self._seen.pop(rid, None)
            if route is not None:
                route[0].put_nowait((route[1], snap))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                self._run_calls()
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    if not self._calls and not self._aborts and not self._stopping:
                        await self._wake.wait()
                    continue
                self._deliver(await loop.run_in_executor(self._pool, self._step))
        except Exception as exc:  # the engine itself broke: fail every client, /health says so
            log.exception("engine loop failed")
            self.fault = f"{type(exc).__name__}: {exc}"
            self._fail_all()
        finally:
            self._fail_calls()

    def _fail_all(self) -> None:
        for rid, (queue, i) in list(self._routes.items()):
            queue.put_nowait((i, Snapshot([], [], [], "", True, "error", f"engine failed: {self.fault}", 0)))
        self._routes.clear()

    def _fail_calls(self) -> None:
        for _, fut in self._calls:
            if not fut.done():
                fut.set_exception(RuntimeError("the engine loop stopped"))
        self._calls.clear()
