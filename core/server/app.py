"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health,
/metrics and /debug/engine (KV-block accounting and integrity, for load tests)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shuili.core.errors import FieldErrors
from shuili.core.sampling_params import MAX_SEED, SamplingParams
from shuili.core.server import openai_format as fmt
from shuili.core.server.engine_loop import EngineLoop, Overloaded, Snapshot
from shuili.core.server.metrics import ServerMetrics
from shuili.core.server.protocol import APIError, ChatRequest, CompletionRequest, SamplingFields, parse

log = logging.getLogger("shuili.serve")

DISCONNECT_POLL_S = 0.5


def system_fingerprint(engine) -> str:
    """Platform + HAL version + the stack fingerprint conformance baselines are keyed by: two
    answers with the same fingerprint and seed are the same bits."""
    from shuili.conformance.baselines import stack_fingerprint
    from shuili.hal.version import HAL_API_VERSION

    return f"{engine.platform.name}-hal{HAL_API_VERSION}-{stack_fingerprint(engine.platform)['sha256']}"


class Server:
    """What the routes share: the engine loop, metrics and the names a response carries."""

    def __init__(self, engine, model_name: str, max_waiting: int | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = ServerMetrics(model_name)
        self.loop = EngineLoop(engine, max_waiting, self.metrics)
        self.fingerprint = system_fingerprint(engine)
        self.pieces = fmt.Pieces(engine.tokenizer)
        self.created = int(time.time())
        self.draining = False

    # ----------------------------------------------------------------------------- requests
    def check_open(self) -> None:
        if self.draining:
            raise APIError("the server is shutting down; retry on another replica", None, 503,
                           "service_unavailable", {"Retry-After": "5"})

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"model {name!r} is not served here; this server serves {self.model_name!r} "
                           "(see GET /v1/models)", "model", 400, "invalid_request_error")

    def tokenize(self, prompt, param: str) -> list[int]:
        try:
            return self.engine.tokenize(prompt)
        except ValueError as exc:
            raise APIError(f"{param}: {exc}", param) from None

    def check_length(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        limit = self.engine.max_model_len
        if not ids:
            raise APIError(f"{param}: it tokenized to no tokens; give a non-empty {param}", param)
        want = len(ids) + (max_tokens or 1)
        if want > limit:
            raise APIError(f"{param} has {len(ids)} tokens and max_tokens asks for {max_tokens or 1} more, "
                           f"{want} in all, but this model's context length is {limit}; shorten the "
                           f"{param} or lower max_tokens", param)

    @staticmethod
    def params(req: SamplingFields, max_tokens: int | None, top: int, seed: int) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, stop=req.stop, stop_token_ids=req.stop_token_ids,
                max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, seed=seed,
                top_logprobs=top)
        except FieldErrors as exc:  # "field: rule, got value" per line; the first names the param
            field = re.match(r"(\w+): ", exc.problems[0])
            raise APIError("; ".join(exc.problems), field and field.group(1)) from None
        except ValueError as exc:
            raise APIError(str(exc), None) from None

    async def submit(self, rid: str, prompts: list[list[int]], req: SamplingFields, max_tokens: int | None,
                     top: int) -> tuple[asyncio.Queue, int]:
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        per_sample = [self.params(req, max_tokens, top, (seed + j) % (MAX_SEED + 1)) for j in range(req.n)]
        items = [(ids, p) for ids in prompts for p in per_sample]
        try:
            return await self.loop.submit(rid, items), seed
        except Overloaded as exc:
            raise APIError(str(exc), None, 503, "service_unavailable", {"Retry-After": "1"}) from None
        except ValueError as exc:
            raise APIError(str(exc), None) from None

    def headers(self, rid: str, seed: int) -> dict[str, str]:
        return {"x-request-id": rid, "x-shuili-seed": str(seed)}

    # ------------------------------------------------------------------------- collecting
    async def collect(self, request: Request, rid: str, queue: asyncio.Queue, n: int) -> list[Snapshot] | None:
        """Final snapshots in choice order, or None when the client went away (then aborted)."""
        finals: list[Snapshot | None] = [None] * n
        left = n
        getter = asyncio.ensure_future(queue.get())
        try:
            while left:
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if not done:
                    if await request.is_disconnected():
                        return None
                    continue
                i, snap = getter.result()
                getter = asyncio.ensure_future(queue.get())
                if snap.finished:
                    finals[i] = snap
                    left -= 1
            return finals
        finally:
            getter.cancel()
            if left:
                self.loop.abort_soon([f"{rid}-{i}" for i in range(n) if finals[i] is None])

    @staticmethod
    def engine_error(finals: list[Snapshot]) -> None:
        bad = [s for s in finals if s.finish_reason == "error"]
        if bad:
            raise APIError(bad[0].error or "the engine failed this request", None, 500, "internal_error")

    # ---------------------------------------------------------------------------- engine state
    def state(self, integrity: bool = False) -> dict:
        """Read on the event loop between two steps (call it through self.loop.call)."""
        eng = self.engine
        scheds = eng.schedulers  # one per data-parallel group, each with its own KV manager
        kv: dict = {}
        for sched in scheds:
            for g, c in sched.kv.usage().items():
                tot = kv.setdefault(g, {"total": 0})
                tot["total"] += sched.kv.pools[g].num_blocks
                for k, v in c.items():
                    tot[k] = tot.get(k, 0) + v
        out = {"running": sum(len(s.running) for s in scheds), "waiting": self.loop.num_waiting(),
               "in_flight": self.loop.num_in_flight(), "num_steps": eng.num_steps, "kv": kv,
               "prefix_queried_tokens": sum(s.kv.num_queried_tokens for s in scheds),
               "prefix_hit_tokens": sum(s.kv.num_hit_tokens for s in scheds)}
        tiers = eng.kv_tiers
        out["kv_tier_hit_tokens"] = dict(tiers.hit_tokens) if tiers else {"device": eng.kv.num_hit_tokens}
        out["kv_tier_bytes"] = dict(tiers.bytes) if tiers else {}
        if integrity:
            try:
                for sched in eng.schedulers:
                    sched.check()
                out["integrity"] = "ok"
            except AssertionError as exc:
                out["integrity"] = f"failed: {exc}"
        return out


# --------------------------------------------------------------------------------- completions
async def completions(srv: Server, request: Request) -> Response:
    srv.check_open()
    req = parse(CompletionRequest, await request.body())
    srv.check_model(req.model)
    prompts = [srv.tokenize(p, "prompt") for p in req.prompt]
    for ids in prompts:
        srv.check_length(ids, req.max_tokens, "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    k = req.logprobs or 0
    queue, seed = await srv.submit(rid, prompts, req, req.max_tokens, k)
    n = len(prompts) * req.n
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": srv.model_name,
            "system_fingerprint": srv.fingerprint}
    if req.stream:
        gen = stream(srv, rid, queue, n, req, head, _completion_delta(srv, req, k))
        return StreamingResponse(gen, media_type="text/event-stream", headers=srv.headers(rid, seed))
    finals = await srv.collect(request, rid, queue, n)
    if finals is None:
        return Response(status_code=499)
    srv.engine_error(finals)
    choices = []
    for i, s in enumerate(finals):
        vis = len(s.token_ids) - s.hidden_tail
        c = {"index": i, "text": s.text, "finish_reason": fmt.FINISH.get(s.finish_reason, s.finish_reason),
             "logprobs": fmt.completion_logprobs(srv.pieces, s, 0, vis, k, 0) if req.logprobs is not None else None,
             "stop_reason": None}
        if req.return_token_ids:
            c["token_ids"] = s.token_ids
        choices.append(c)
    body = {**head, "choices": choices, "seed": seed,
            "usage": fmt.usage(sum(map(len, prompts)), sum(len(s.token_ids) for s in finals))}
    return JSONResponse(body, headers=srv.headers(rid, seed))


def _completion_delta(srv: Server, req: CompletionRequest, k: int):
    offsets: dict[int, int] = {}

    def delta(i: int, snap: Snapshot, text: str, a: int, b: int) -> dict:
        c = {"index": i, "text": text, "finish_reason": None, "logprobs": None}
        if req.logprobs is not None:
            c["logprobs"] = fmt.completion_logprobs(srv.pieces, snap, a, b, k, offsets.get(i, 0))
            offsets[i] = offsets.get(i, 0) + sum(len(t) for t in c["logprobs"]["tokens"])
        if req.return_token_ids:
            c["token_ids"] = snap.token_ids[a:b]
        return c

    return delta


# ---------------------------------------------------------------------------------------- chat
async def chat(srv: Server, request: Request) -> Response:
    srv.check_open()
    req = parse(ChatRequest, await request.body())
    srv.check_model(req.model)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = fmt.render_chat(srv.engine.model, messages)
    except Exception as exc:  # a template that fails to render is the request's problem
        raise APIError(f"messages: the chat template could not render them: {exc}", "messages") from None
    ids = srv.tokenize(text, "messages")
    srv.check_length(ids, req.limit, "messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    k = (req.top_logprobs or 0) if req.logprobs else 0
    queue, seed = await srv.submit(rid, [ids], req, req.limit, k)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": srv.model_name,
            "system_fingerprint": srv.fingerprint}
    if req.stream:
        head["object"] = "chat.completion.chunk"
        gen = stream(srv, rid, queue, req.n, req, head, _chat_delta(srv, req, k), _chat_first)
        return StreamingResponse(gen, media_type="text/event-stream", headers=srv.headers(rid, seed))
    finals = await srv.collect(request, rid, queue, req.n)
    if finals is None:
        return Response(status_code=499)
    srv.engine_error(finals)
    choices = []
    for i, s in enumerate(finals):
        vis = len(s.token_ids) - s.hidden_tail
        c = {"index": i, "message": {"role": "assistant", "content": s.text},
             "logprobs": fmt.chat_logprobs(srv.pieces, s, 0, vis, k) if req.logprobs else None,
             "finish_reason": fmt.FINISH.get(s.finish_reason, s.finish_reason), "stop_reason": None}
        if req.return_token_ids:
            c["token_ids"] = s.token_ids
        choices.append(c)
    body = {**head, "choices": choices, "seed": seed,
            "usage": fmt.usage(len(ids), sum(len(s.token_ids) for s in finals))}
    return JSONResponse(body, headers=srv.headers(rid, seed))


def _chat_first(i: int) -> dict:
    return {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def _chat_delta(srv: Server, req: ChatRequest, k: int):
    def delta(i: int, snap: Snapshot, text: str, a: int, b: int) -> dict:
        c = {"index": i, "delta": {"content": text} if text else {}, "finish_reason": None, "logprobs": None}
        if req.logprobs:
            c["logprobs"] = fmt.chat_logprobs(srv.pieces, snap, a, b, k)
        if req.return_token_ids:
            c["token_ids"] = snap.token_ids[a:b]
        return c

    return delta


# -------------------------------------------------------------------------------------- stream
async def stream(srv: Server, rid: str, queue: asyncio.Queue, n: int, req: SamplingFields, head: dict,
                 delta, first=None):
    """SSE: a chunk per choice per step with news, the finish, usage if asked, `data: [DONE]`.
    A client that goes away cancels this generator; its unfinished requests are aborted."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    states = [fmt.ChoiceStream(req.stop) for _ in range(n)]
    done = [False] * n
    prompt_tokens: dict[int, int] = {}
    completion_tokens = [0] * n
    try:
        if first is not None:
            for i in range(n):
                yield fmt.sse({**head, "choices": [first(i)], **extra})
        while not all(done):
            i, snap = await queue.get()
            if done[i]:
                continue
            text, a, b = states[i].advance(snap)
            completion_tokens[i] = len(snap.token_ids)
            prompt_tokens[i // req.n] = snap.num_prompt_tokens
            if snap.finish_reason == "error":
                done[i] = True
                yield fmt.sse(APIError(snap.error or "the engine failed this request", None, 500,
                                       "internal_error").body())
                continue
            if not text and a == b and not snap.finished:
                continue
            c = delta(i, snap, text, a, b)
            if snap.finished:
                c["finish_reason"] = fmt.FINISH.get(snap.finish_reason, snap.finish_reason)
                done[i] = True
            yield fmt.sse({**head, "choices": [c], **extra})
        if include_usage:
            yield fmt.sse({**head, "choices": [],
                           "usage": fmt.usage(sum(prompt_tokens.values()), sum(completion_tokens))})
        yield fmt.DONE
    finally:
        if not all(done):
            srv.loop.abort_soon([f"{rid}-{i}" for i in range(n) if not done[i]])


# ---------------------------------------------------------------------------------------- app
def build_app(srv: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.loop.start()
        yield
        await srv.loop.stop()

    app = FastAPI(title="shuili", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        srv.metrics.error({400: "bad_request", 503: "overloaded"}.get(exc.status, "server"))
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions(srv, request)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await chat(srv, request)

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [{
            "id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "shuili",
            "root": srv.engine.config.model, "max_model_len": srv.engine.max_model_len}]}

    @app.get("/health")
    async def _health():
        if not srv.loop.alive:
            return JSONResponse({"status": "engine loop stopped", "fault": srv.loop.fault}, status_code=503)
        return {"status": "draining" if srv.draining else "ok"}

    @app.get("/metrics")
    async def _metrics():
        state = await srv.loop.call(srv.state)
        return Response(srv.metrics.render(state), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/engine")
    async def _debug():
        return await srv.loop.call(lambda: srv.state(integrity=True))

    @app.get("/")
    async def _root():
        return PlainTextResponse("shuili: OpenAI-compatible server; see /v1/models\n")

    return app
