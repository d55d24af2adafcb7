"""Load test of `shuili serve`: N streaming clients with Poisson arrivals, a share disconnecting.

Starts a server on a free loopback port (or uses --url, which must be a loopback address),
sends --clients streaming /v1/completions requests whose start times are a Poisson process of
--rate requests/s, lets a --disconnect share of them hang up after a few tokens, and reports
TTFT / TPOT / end-to-end p50 and p99, throughput and errors. At the end it waits for the engine
to go idle and reads /debug/engine: every KV block must be back (0 used) and the block
accounting must pass its integrity check. Bounded: --clients requests, --timeout seconds.

    python benchmarks/serve_load.py --clients 64 --rate 4 --disconnect 0.2 --output-len 32 \
        --server-args "--threads 1 --max-model-len 512" --json out.json

Exit status 0 only with 0 errors beyond the intended disconnects and 0 leaked blocks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
import server_helpers as sh  # noqa: E402

WORDS = ("river water stone bridge light north summer field cloud garden silver morning road city "
         "music paper window forest ocean market letter station winter story").split()
LOOPBACK = ("127.0.0.1", "localhost", "::1")
IDLE_TIMEOUT_S = 60


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (loopback only); default: start one")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--platform", default="reference")
    p.add_argument("--server-args", default="--threads 1 --max-model-len 512",
                   help="more `shuili serve` flags, as one string")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--disconnect", type=float, default=0.2, help="share of clients that hang up mid-stream")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens (EOS ignored)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="bound on the whole run, seconds")
    p.add_argument("--json", help="write the result here as JSON")
    return p.parse_args(argv)


def plan(args) -> list[dict]:
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for i in range(args.clients):
        t += rng.expovariate(args.rate)
        quits = rng.random() < args.disconnect
        out.append({"i": i, "at": t, "quit_after": rng.randint(1, max(1, args.output_len // 2)) if quits else None,
                    "prompt": " ".join(rng.choice(WORDS) for _ in range(args.input_len))})
    return out


async def one(http: httpx.AsyncClient, args, c: dict, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + c["at"] - time.perf_counter()))
    body = {"model": args.model, "prompt": c["prompt"], "max_tokens": args.output_len, "ignore_eos": True,
            "temperature": 1.0, "seed": args.seed + c["i"], "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    rec = {"i": c["i"], "intended_quit": c["quit_after"] is not None, "tokens": 0, "error": None,
           "finish": None}
    start = time.perf_counter()
    stamps = []
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    rec["error"] = ev["error"]["message"]
                    break
                for ch in ev.get("choices", []):
                    n = len(ch.get("token_ids") or [])
                    if n:
                        stamps.append((time.perf_counter(), n))
                        rec["tokens"] += n
                    rec["finish"] = ch.get("finish_reason") or rec["finish"]
                if c["quit_after"] is not None and rec["tokens"] >= c["quit_after"]:
                    break  # hang up: leaving the block closes the connection
    except httpx.HTTPError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    if stamps:
        rec["ttft"] = stamps[0][0] - start
        if rec["tokens"] > 1:
            rec["tpot"] = (stamps[-1][0] - stamps[0][0]) / (rec["tokens"] - 1)
    rec["e2e"] = end - start
    return rec


def pct(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


async def engine_idle(http: httpx.AsyncClient) -> dict:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        st = (await http.get("/debug/engine")).json()
        busy = st["in_flight"] or st["running"] or any(g["used"] for g in st["kv"].values())
        if not busy or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.2)


async def drive(url: str, args) -> dict:
    clients = plan(args)
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=8)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as http:
        t0 = time.perf_counter()
        recs = await asyncio.wait_for(asyncio.gather(*(one(http, args, c, t0) for c in clients)), args.timeout)
        wall = time.perf_counter() - t0
        st = await engine_idle(http)
        metrics = (await http.get("/metrics")).text
    return summarize(args, recs, wall, st, metrics)


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def summarize(args, recs: list[dict], wall: float, st: dict, metrics: str) -> dict:
    done = [r for r in recs if not r["intended_quit"] and r["error"] is None]
    errors = [r for r in recs if r["error"] is not None
              or (not r["intended_quit"] and r["finish"] not in ("length", "stop"))]
    ttft = [r["ttft"] for r in recs if "ttft" in r and r["error"] is None]
    tpot = [r["tpot"] for r in done if "tpot" in r]
    e2e = [r["e2e"] for r in done]
    toks = sum(r["tokens"] for r in recs)
    used = sum(g["used"] for g in st["kv"].values())
    return {
        "clients": args.clients, "rate_per_s": args.rate, "disconnect_share": args.disconnect,
        "input_words": args.input_len, "output_len": args.output_len, "wall_s": round(wall, 3),
        "completed": len(done), "disconnected": sum(r["intended_quit"] for r in recs), "errors": len(errors),
        "error_samples": [r["error"] or f"finish_reason {r['finish']}" for r in errors[:5]],
        "output_tokens": toks, "output_tokens_per_s": round(toks / wall, 2),
        "requests_per_s": round(len(done) / wall, 3),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
        "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "server_aborted": _metric(metrics, 'shuili_request_success_total{finished_reason="abort"'),
        "kv_blocks_used_at_end": used, "kv_blocks_total": {g: c["total"] for g, c in st["kv"].items()},
        "kv_integrity": st.get("integrity"), "leaked_blocks": used, "in_flight_at_end": st["in_flight"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    server = None
    if args.url:
        if urlparse(args.url).hostname not in LOOPBACK:
            raise SystemExit(f"--url {args.url}: only loopback addresses are allowed")
        url = args.url
    else:
        log = Path(args.json or "serve_load").with_suffix(".server.log")
        server = sh.start("--model", args.model, "--platform", args.platform,
                          *shlex.split(args.server_args), log_path=log)
        url = server.url
    try:
        res = asyncio.run(drive(url, args))
    finally:
        rc = server.stop() if server is not None else 0
    res["server_exit_code"] = rc
    for k, v in res.items():
        print(f"{k:>24}: {round(v, 4) if isinstance(v, float) else v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    ok = res["errors"] == 0 and res["leaked_blocks"] == 0 and res["kv_integrity"] == "ok" and rc == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
