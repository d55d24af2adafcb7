"""Engine: add_request / step / abort / has_unfinished over scheduler, KV manager and runner.

step(), synchronous: schedule N, run N, process N.
step(), overlap: schedule N+1 and launch it (its placeholders are filled on the device from N's
samples), then read back and process N. On an asynchronous device the host work of N+1 hides
behind N's compute; on the CPU reference platform it runs in the same order, so the two modes
must give identical bits (a test checks).
"""
from __future__ import annotations

import itertools
import logging
import secrets
import time

from shuili.core.config import EngineConfig
from shuili.core.kv_cache import KVCacheManager
from shuili.core.outputs import RequestOutput
from shuili.core.request import Request, Status
from shuili.core.runner import ModelRunner, StepResult
from shuili.core.sampling_params import SamplingParams
from shuili.core.scheduler import Scheduler, SchedulerOutput
from shuili.hal import resolve_platform

log = logging.getLogger("shuili.engine")

NAN_ERROR = ("the model produced NaN (or all -inf) logits for this request (a numerical fault in the model, its "
             "weights or its dtype); it was stopped and its KV blocks freed. Check the checkpoint and "
             "dtype; other requests are unaffected")


class Engine:
    def __init__(self, config: EngineConfig, model=None):
        self.config = config
        self.platform = resolve_platform(config.platform)
        self.ops = self.platform.ops
        self.device = self.platform.device
        if model is None:
            from shuili.core.models import load_model

            model = load_model(config.model, self.ops, self.device, config.dtype, config.seed)
        elif not hasattr(model, "forward"):  # a factory (ops, device, dtype, seed) -> Model
            model = model(self.ops, self.device, config.dtype, config.seed)
        self.model = model
        self.tokenizer = model.tokenizer
        self.max_model_len = self._max_len(config, model)
        groups = model.cache_groups()
        P = config.tokens_per_block
        self.num_blocks = config.num_blocks or self._blocks_from_budget(groups, P)
        self.kv = KVCacheManager(groups, self.num_blocks, P, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.policy)
        self.runner = ModelRunner(model, self.ops, groups, self.num_blocks, P, self.device,
                                  self._graphs(model, groups, P))
        self._inflight: tuple[SchedulerOutput, StepResult] | None = None
        self._ids = itertools.count()
        self.eos = tuple(self.tokenizer.eos_token_ids)
        self.num_steps = 0
        self.schedule_seconds = 0.0  # thread CPU time inside Scheduler.schedule (bench reports it per step)

    def _graphs(self, model, groups, P: int):
        capture = self.platform.capture_graph
        if self.config.enforce_eager or capture is None or not getattr(model, "supports_static_decode", False):
            return None
        from shuili.core.graphs import DecodeGraphs

        return DecodeGraphs(model, capture, groups, self.config.max_num_seqs,
                            -(-self.max_model_len // P), P, self.device)

    @staticmethod
    def _max_len(config: EngineConfig, model) -> int:
        limit = int(model.max_model_len)
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit {limit}; "
                             f"use max_model_len <= {limit}")
        return config.max_model_len

    def _blocks_from_budget(self, groups, P: int) -> int:
        per_block = sum(g.bytes_per_block(P) for g in groups)
        cap = self.config.max_num_seqs * -(-self.max_model_len // P) + 1
        n = min(self.config.kv_cache_bytes // per_block, cap)
        if n < 1:
            raise ValueError(f"kv_cache_bytes={self.config.kv_cache_bytes} holds no KV block "
                             f"({per_block} bytes each); raise kv_cache_bytes or set num_blocks")
        return n

    # ----------------------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int], apply_chat_template: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: give at least one character (or one token id)")
            text = self.model.apply_chat_template(prompt) if apply_chat_template else prompt
            return list(self.tokenizer.encode(text))
        ids = list(prompt)
        V = self.model.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are not ids in [0, {V}); pass a string or "
                             "valid ids for this model's vocabulary")
        return ids

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("empty prompt: it tokenized to no tokens; give a non-empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                             "(prompt + at least one generated token must fit); shorten the prompt or "
                             "raise max_model_len")
        total = len(ids) + (params.max_tokens or self.max_model_len)
        need = -(-min(total, self.max_model_len) // self.kv.P)
        if need > self.num_blocks:
            raise ValueError(f"the request needs up to {need} KV blocks but the cache has "
                             f"{self.num_blocks} per group; lower max_tokens or raise num_blocks / "
                             "kv_cache_bytes")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    apply_chat_template: bool = False) -> Request:
        """Queue one request (params.n must be 1; LLM.generate expands n). Bad input -> ValueError."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"Engine.add_request takes n=1 (got n={params.n}); LLM.generate "
                             "expands n into requests with seeds seed, seed+1, ...")
        ids = self.tokenize(prompt, apply_chat_template)
        self._check_fits(ids, params)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, params, seed, self.scheduler.next_arrival(), priority,
                      prompt if isinstance(prompt, str) else None)
        req.t_arrival = time.perf_counter()
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        req.t_finish = time.perf_counter()
        return self.output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # --------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One engine step; returns outputs of the requests that got a token or finished."""
        return [self.output(r) for r in self.step_requests()]

    def step_requests(self) -> list[Request]:
        """`step` without building outputs (text decoding is per call): the touched Requests."""
        self.num_steps += 1
        t0 = time.thread_time()
        out = self.scheduler.schedule()
        self.schedule_seconds += time.thread_time() - t0
        if not out and not out.preempted and not self._inflight and not self.scheduler.running:
            self._unblock()
        prev = self._inflight[1] if self._inflight else None
        res = self._launch(out, prev) if out else None
        if not self.config.overlap:
            touched = self._process(out, res) if res is not None else []
        else:
            touched = self._process(*self._inflight) if self._inflight else []
            self._inflight = (out, res) if res is not None else None
        return touched

    def _unblock(self) -> None:
        # nothing runs and the head of the queue still cannot get blocks: it never will
        req = self.scheduler.waiting.peek()
        if req is not None:
            self._finish(req, "error", f"the request cannot get KV blocks even with an empty engine "
                         f"({self.num_blocks} per group); raise num_blocks / kv_cache_bytes")

    def _launch(self, out: SchedulerOutput, prev: StepResult | None) -> StepResult | None:
        try:
            return self.runner.execute(out, prev)
        except Exception as exc:  # a model fault fails this step's requests, not the engine
            log.exception("model step failed")
            for c in out.chunks:
                if not c.req.finished:
                    self._finish(c.req, "error", f"model forward failed: {type(exc).__name__}: {exc}")
            return None

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.t_finish = time.perf_counter()
        self.scheduler.finish(req, reason, error)

    def _process(self, out: SchedulerOutput, res: StepResult) -> list[Request]:
        tok, lps, bad, plp = res.to_host()
        top = res.top_to_host()
        for (req, p, _), v in zip(res.prompt_rows, plp):
            req.prompt_logprobs[p] = v
        for c in out.chunks:
            if self.scheduler.chunk_is_current(c):
                self.kv.publish(c.req, c.end)
        touched = []
        for i, row in enumerate(res.sample_rows):
            req = row.req
            if req.epoch != row.epoch or req.status is not Status.RUNNING:
                continue  # preempted, aborted or finished since it was scheduled
            req.num_placeholders -= 1
            if bad[i]:
                self._finish(req, "error", NAN_ERROR)
            else:
                if top is not None and req.params.top_logprobs:
                    req.top_logprobs.append(top[i][:req.params.top_logprobs])
                self._append(req, tok[i], lps[i])
            touched.append(req)
        return touched

    def _append(self, req: Request, token: int, logprob: float) -> None:
        if not req.output_token_ids:
            req.t_first_token = time.perf_counter()
        req.output_token_ids.append(token)
        p = req.params
        if p.logprobs:
            req.logprobs.append(logprob)
        n = len(req.output_token_ids)
        if n >= p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos)):
            self._finish(req, "stop")
        elif p.stop and self._match_stop(req):
            self._finish(req, "stop")
        elif (p.max_tokens is not None and n >= p.max_tokens) or req.num_real_tokens >= self.max_model_len:
            self._finish(req, "length")

    def _match_stop(self, req: Request) -> bool:
        text = self.tokenizer.decode(req.output_token_ids)
        hits = [k for k in (text.find(s) for s in req.params.stop) if k >= 0]
        if hits:
            req.stop_text_len = min(hits)
        return bool(hits)

    # ------------------------------------------------------------------------------- output
    def text(self, req: Request) -> str:
        ids = req.output_token_ids
        if req.stop_text_len is not None:
            return self.tokenizer.decode(ids)[: req.stop_text_len]
        if req.finish_reason == "stop" and ids:
            ids = ids[:-1]  # the stop / EOS token is kept in token_ids, not in text
        return self.tokenizer.decode(ids)

    def output(self, req: Request) -> RequestOutput:
        done = req.finished
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=self.text(req), logprobs=list(req.logprobs),
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs else None,
            seed=req.seed, finish_reason=req.finish_reason, error=req.error, finished=done,
            num_preemptions=req.num_preemptions,
            metrics={"arrival": req.t_arrival, "first_token": req.t_first_token, "finish": req.t_finish})
