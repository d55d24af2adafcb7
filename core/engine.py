"""Engine: add_request / step / abort / has_unfinished; a step is schedule -> run -> update.

The scheduler owns requests, the KV manager and every result (`Scheduler.update`); the runner
owns the device. The engine only loops and never applies a result itself.
step(), synchronous: schedule N, run N, update N.
step(), overlap: schedule N+1 and launch it (its placeholders are filled on the device from N's
samples), then read back and update N. On an asynchronous device the host work of N+1 hides
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
from shuili.core.kv_sizing import pool_sizes
from shuili.core.kv_tiers import build_tiers
from shuili.core.model_api import default_tokens_per_block
from shuili.core.outputs import CompletionOutput, RequestOutput
from shuili.core.request import Request
from shuili.core.runner import ModelRunner, StepResult
from shuili.core.sampling_params import SamplingParams
from shuili.core.scheduler import Scheduler, SchedulerOutput
from shuili.hal import resolve_platform

log = logging.getLogger("shuili.engine")


class Engine:
    def __init__(self, config: EngineConfig, model=None):
        self.config = config
        self.platform = resolve_platform(config.platform)
        model_given = model is not None
        self.ops = self.platform.ops
        self.device = self.platform.device
        if model is None:
            from shuili.core.models import load_model

            spec = config.speculative
            from shuili.core.models.deepseek_v41_loader import gemm_weight_formats

            model = load_model(config.model, self.ops, self.device, config.dtype, config.seed,
                               with_mtp=spec is not None and spec.method == "mtp",
                               with_dspark=spec is not None and spec.method == "dspark",
                               weight_formats=gemm_weight_formats(self.platform.capabilities))
        elif not hasattr(model, "forward"):  # a factory (ops, device, dtype, seed) -> Model
            model = model(self.ops, self.device, config.dtype, config.seed)
        self.model = model
        if hasattr(model, "attach_transfer"):  # before _graphs: static decode may need map_host
            model.attach_transfer(self.platform.transfer)
        self.tokenizer = model.tokenizer
        self.max_model_len = self._max_len(config, model)
        groups = model.cache_groups()
        P = self.P = config.tokens_per_block or default_tokens_per_block(groups)
        # an explicit num_blocks sizes every pool alike; a byte budget sizes sliding pools by their window
        self.pool_blocks = config.num_blocks or pool_sizes(
            groups, P, config.kv_cache_bytes, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.eos = tuple(self.tokenizer.eos_token_ids)
        self.kv = KVCacheManager(groups, self.pool_blocks, P, config.enable_prefix_caching)
        self.num_blocks = self.kv.num_blocks
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.policy, self.eos, self.tokenizer.decode)
        self.schedulers = [self.scheduler]  # one per data-parallel group (core/parallel/engine.py)
        self.runner = ModelRunner(model, self.ops, groups, self.pool_blocks, P, self.device,
                                  self._graphs(model, groups, P), self.platform.transfer)
        self.drafter = self._drafter(config, model)
        if self.drafter is not None and self.drafter.on_device:
            self.runner.drafter = self.drafter
            if self.runner.graphs is not None:
                self.runner.graphs.keep_hidden = self.drafter.needs_hidden
        if self.runner.graphs is not None and config.graph_capture == "startup":
            self.runner.graphs.capture_all()
        self.kv_tiers = build_tiers(config, model, groups, P, self.runner.caches, self.platform, model_given)
        if self.kv_tiers is not None:
            self.kv_tiers.attach(self.kv)
        self._inflight: tuple[SchedulerOutput, StepResult] | None = None
        self._ids = itertools.count()
        self.num_steps = 0
        self.schedule_seconds = 0.0  # thread CPU time inside Scheduler.schedule (bench reports it per step)

    def _graphs(self, model, groups, P: int):
        capture = self.platform.capture_graph
        if self.config.enforce_eager or capture is None or not getattr(model, "supports_static_decode", False):
            return None
        from shuili.core.graphs import DecodeGraphs

        return DecodeGraphs(model, capture, groups, self.config.max_num_seqs,
                            -(-self.max_model_len // P), P, self.device)

    def _drafter(self, config: EngineConfig, model):
        if config.speculative is None:
            return None
        from shuili.core.spec.base import make_drafter

        return make_drafter(config.speculative, model, self.max_model_len)

    @staticmethod
    def _max_len(config: EngineConfig, model) -> int:
        limit = int(model.max_model_len)
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit {limit}; "
                             f"use max_model_len <= {limit}")
        return config.max_model_len

    # ----------------------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int], apply_chat_template: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: give at least one character (or one token id)")
            text = self.model.apply_chat_template(prompt) if apply_chat_template else prompt
            return self._encode(text)
        ids = list(prompt)
        V = self.model.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are not ids in [0, {V}); pass a string or "
                             "valid ids for this model's vocabulary")
        return ids

    def _encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text))
        V = self.model.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"the tokenizer produced ids {bad[:5]} outside the model's vocabulary [0, {V}): "
                             "it does not match the model; load the checkpoint's own tokenizer")
        return ids

    def _check_fits(self, req: Request) -> None:
        ids = req.prompt_token_ids
        if not ids:
            raise ValueError("empty prompt: it tokenized to no tokens; give a non-empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                             "(prompt + at least one generated token must fit); shorten the prompt or "
                             "raise max_model_len")
        need = -(-req.token_limit(self.max_model_len) // self.kv.P)
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
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = Request("", ids, params, seed, 0, priority, prompt if isinstance(prompt, str) else None)
        self._check_fits(req)  # before an id or an arrival number is used up
        req.request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        req.arrival = self.scheduler.next_arrival()
        req.t_arrival = time.perf_counter()
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        for sched in self.schedulers:  # the request lives in one data-parallel group's scheduler
            req = sched.abort(request_id)
            if req is not None:
                return self.output(req)
        return None

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
        if self.drafter is not None and not self.drafter.on_device:
            self.drafter.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        self.schedule_seconds += time.thread_time() - t0
        prev = self._inflight[1] if self._inflight else None
        res = self._run(out, prev) if out else None
        if not self.config.overlap:
            return self._update(out, res)
        done, self._inflight = self._inflight, (out, res) if res is not None else None
        return self._update(*done) if done else []

    def _run(self, out: SchedulerOutput, prev: StepResult | None) -> StepResult | None:
        try:
            return self.runner.execute(out, prev)
        except Exception as exc:  # a model fault fails this step's requests, not the engine
            log.exception("model step failed")
            self.scheduler.fail(out, f"model forward failed: {type(exc).__name__}: {exc}")
            return None

    def _update(self, out: SchedulerOutput, res: StepResult | None) -> list[Request]:
        return [] if res is None else self.scheduler.update(out, res.to_host())

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
        completion = CompletionOutput(
            token_ids=list(req.output_token_ids), text=self.text(req), logprobs=list(req.logprobs),
            seed=req.seed, finish_reason=req.finish_reason, error=req.error,
            num_preemptions=req.num_preemptions,
            metrics={"arrival": req.t_arrival, "first_token": req.t_first_token, "finish": req.t_finish,
                     "draft_tokens_proposed": req.num_draft_proposed,
                     "draft_tokens_accepted": req.num_draft_accepted, "sample_steps": req.num_sample_steps})
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs else None,
            outputs=[completion], finished=done)
