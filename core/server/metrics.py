"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self, model: str):
        r = self.registry = CollectorRegistry()
        lab = {"model_name": model}
        self.running = Gauge("shuili_num_requests_running", "requests in the running batch", ["model_name"],
                             registry=r).labels(**lab)
        self.waiting = Gauge("shuili_num_requests_waiting", "requests queued for admission", ["model_name"],
                             registry=r).labels(**lab)
        self.kv_used = Gauge("shuili_kv_blocks_used", "KV blocks referenced by requests", ["group"], registry=r)
        self.kv_total = Gauge("shuili_kv_blocks_total", "KV blocks in the pool", ["group"], registry=r)
        self.hit_rate = Gauge("shuili_prefix_cache_hit_rate", "prefix-cache hit tokens / queried tokens "
                              "since start", ["model_name"], registry=r).labels(**lab)
        self.queried = Counter("shuili_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                               ["model_name"], registry=r).labels(**lab)
        self.hits = Counter("shuili_prefix_cache_hits", "prompt tokens found in the prefix cache",
                            ["model_name"], registry=r).labels(**lab)
        self.ttft = Histogram("shuili_time_to_first_token_seconds", "arrival to first token", ["model_name"],
                              buckets=LATENCY_BUCKETS, registry=r).labels(**lab)
        self.tpot = Histogram("shuili_time_per_output_token_seconds", "mean time between output tokens of a "
                              "request", ["model_name"], buckets=TOKEN_BUCKETS, registry=r).labels(**lab)
        self.e2e = Histogram("shuili_e2e_request_latency_seconds", "arrival to finish", ["model_name"],
                             buckets=LATENCY_BUCKETS, registry=r).labels(**lab)
        self.prompt_tokens = Counter("shuili_prompt_tokens", "prompt tokens of admitted requests",
                                     ["model_name"], registry=r).labels(**lab)
        self.generation_tokens = Counter("shuili_generation_tokens", "tokens generated", ["model_name"],
                                         registry=r).labels(**lab)
        self.preemptions = Counter("shuili_num_preemptions", "preemptions (recompute) of finished requests",
                                   ["model_name"], registry=r).labels(**lab)
        self.finished = Counter("shuili_request_success", "finished engine requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.errors = Counter("shuili_request_errors", "requests answered with an error, by kind "
                              "(bad_request, overloaded, engine, ...)", ["model_name", "kind"], registry=r)
        self.tier_hits = Counter("shuili_kv_tier_hit_tokens", "prefix-cache hit tokens by the lowest tier "
                                 "a block came from (device, host, disk)", ["model_name", "tier"], registry=r)
        self.tier_bytes = Counter("shuili_kv_tier_bytes", "KV bytes moved between tiers", ["model_name",
                                  "direction"], registry=r)
        self._seen_tier: dict[tuple[str, str], int] = {}
        self._model = model
        self._seen_queries = 0
        self._seen_hits = 0

    # called by the engine loop on the event loop
    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, n: int) -> None:
        if n > 0:
            self.generation_tokens.inc(n)

    def on_finished(self, snap, now: float) -> None:
        t = snap.times
        self.finished.labels(self._model, snap.finish_reason or "unknown").inc()
        if snap.finish_reason == "error":
            self.error("engine")
        if snap.num_preemptions:
            self.preemptions.inc(snap.num_preemptions)
        if not t.get("arrival"):
            return
        self.e2e.observe(max((t.get("finish") or now) - t["arrival"], 0.0))
        if t.get("first_token"):
            self.ttft.observe(max(t["first_token"] - t["arrival"], 0.0))
            if len(snap.token_ids) > 1 and t.get("finish"):
                self.tpot.observe(max(t["finish"] - t["first_token"], 0.0) / (len(snap.token_ids) - 1))

    def error(self, kind: str) -> None:
        self.errors.labels(self._model, kind).inc()

    def render(self, state: dict) -> bytes:
        """The exposition text, gauges set from `state` (read by the engine loop between steps)."""
        self.running.set(state["running"])
        self.waiting.set(state["waiting"])
        for group, c in state["kv"].items():
            self.kv_used.labels(group).set(c["used"])
            self.kv_total.labels(group).set(c["total"])
        q, h = state["prefix_queried_tokens"], state["prefix_hit_tokens"]
        self.queried.inc(q - self._seen_queries)
        self.hits.inc(h - self._seen_hits)
        self._seen_queries, self._seen_hits = q, h
        self.hit_rate.set(h / q if q else 0.0)
        for kind, metric in (("tier", self.tier_hits), ("direction", self.tier_bytes)):
            src = state.get("kv_tier_hit_tokens" if kind == "tier" else "kv_tier_bytes", {})
            for label, n in src.items():
                seen = self._seen_tier.get((kind, label), 0)
                if n > seen:
                    metric.labels(self._model, label).inc(n - seen)
                self._seen_tier[(kind, label)] = n
        return generate_latest(self.registry)
