"""`shuili generate`, `shuili bench` (and `shuili perplexity` from cli_perplexity), registered by
shuili/cli.py through add_parser."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

# SamplingParams fields that are `generate` flags (vLLM's names); defaults and help come from the
# model so the two cannot drift. temperature is the exception: greedy here, so printed answers replay.
SAMPLING_FLAGS = ("n", "max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "min_tokens", "seed")
CLI_DEFAULTS = {"temperature": 0.0}

GENERATE_EPILOG = """\
--input: one JSON value per line, a string or {"prompt": ..., "id": ..., <SamplingParams fields>};
a line's fields override the flags. Results are written as each line finishes (not in input
order), one JSON object per line, flushed: {"line", "id", "prompt", "error", "outputs": [{"index",
"text", "token_ids", "logprobs", "finish_reason", "seed", "error"}]}; "line" is the 1-based input
line number, so sort by it to restore input order. A bad line gets an error record naming
FILE:LINE and the run goes on; the exit code is 1 if any line failed. Ctrl-C / SIGTERM stops the
run, keeping every finished result; rerun with --resume to answer only the remaining lines
(exit 130 / 143)."""


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one or more prompts", epilog=GENERATE_EPILOG)
    _engine_args(g)
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    g.add_argument("--input", metavar="FILE", help="JSONL batch job: one prompt per line (see below)")
    g.add_argument("--output", metavar="FILE",
                   help="with --input: write results here as they finish (default: stdout)")
    g.add_argument("--resume", action="store_true",
                   help="with --output: skip input lines that already have a record in it")
    _sampling_args(g)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable; not included in the text)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    g.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="auto: on for instruct models (the model says so), off otherwise")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="offline throughput and latency (TTFT, TPOT, tokens/s)")
    _engine_args(b)
    b.add_argument("--num-prompts", type=int, default=16, help="random-token prompts, all queued at once")
    b.add_argument("--input-len", type=int, default=32, help="tokens per prompt")
    b.add_argument("--output-len", type=int, default=16, help="tokens generated per prompt (EOS ignored)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    b.add_argument("--seed", type=int, default=0, help="seed of the prompts and the sampler")
    b.add_argument("--json", action="store_true", help="print the result as one JSON object")
    b.set_defaults(func=cmd_bench)

    if "perplexity" in sub.choices:
        return
    try:  # `shuili perplexity` lives beside the perplexity code (core/cli_perplexity.py)
        from shuili.core import cli_perplexity
    except ImportError:
        return
    cli_perplexity.add_parser(sub)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    from shuili.core.sampling_params import SamplingParams

    for name in SAMPLING_FLAGS:
        info = SamplingParams.model_fields[name]
        kind = float if info.annotation is float else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=CLI_DEFAULTS.get(name, info.default),
                       help=info.description or name.replace("_", " "))


def _engine_args(p: argparse.ArgumentParser) -> None:
    from shuili.core.config import EngineConfig

    def default(name: str) -> str:  # the flag's default is None: "not given", so --config can set it
        return f"(unset: --config's value, else {EngineConfig.model_fields[name].default})"

    p.add_argument("--platform", default=None, help="reference | nvidia | ascend | auto | a plugin's name "
                   "(unset: --config's value, else auto)")
    p.add_argument("--model", default=None, help="model name, checkpoint directory or .gguf file " + default("model"))
    p.add_argument("--config", default=None, metavar="FILE", help="EngineConfig fields as a .json or .toml file")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once " + default("max_num_seqs"))
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step " + default("max_num_batched_tokens"))
    p.add_argument("--max-model-len", type=int, default=None, help="context length (unset: the model's limit)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block, a multiple of every compression ratio " + default("tokens_per_block"))
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per cache group (unset: from the KV memory budget)")
    p.add_argument("--overlap", action="store_true", default=None,
                   help="prepare step N+1 on the host while step N runs")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="never replay decode steps as device graphs")
    p.add_argument("--graph-capture", choices=("startup", "lazy"), default=None,
                   help="record every decode graph bucket at start-up, or each on first use "
                        + default("graph_capture"))
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="ranks splitting attention heads and the vocabulary head " + default("tensor_parallel_size"))
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="schedulers, each over its own TP group " + default("data_parallel_size"))
    p.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="place routed experts over all TP x DP ranks (docs/parallel.md)")
    p.add_argument("--enable-eplb", action="store_true", default=None,
                   help="rebalance expert placement from routing load (with --enable-expert-parallel)")
    p.add_argument("--num-redundant-experts", type=int, default=None,
                   help="EPLB: extra expert slots in total " + default("num_redundant_experts"))
    p.add_argument("--kv-host-bytes", default=None, metavar="BYTES",
                   help="host-memory KV tier for evicted device blocks, e.g. 8G (unset: off)")
    p.add_argument("--kv-store", default=None, metavar="DIR",
                   help="shared KV block store directory; blocks survive restarts (unset: off)")
    p.add_argument("--kv-store-ttl", default=None, metavar="DURATION",
                   help="how long a stored block lives after its last use, e.g. 72h (unset: 72h)")
    p.add_argument("--kv-store-bytes", default=None, metavar="BYTES",
                   help="size cap of the store directory, e.g. 500G; least recently used first (unset: none)")
    p.add_argument("--speculative-method", choices=("ngram", "mtp", "dspark"), default=None,
                   help="speculative decoding: ngram (prompt lookup), mtp (DeepSeek-V4's MTP block), "
                        "dspark (V4.1); outputs are bit-identical to decoding without it")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="with --speculative-method: draft tokens one step verifies, over all requests")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (results do not depend on it; 1 is fastest for the "
                        "reference platform's small tiled GEMMs on a busy machine; unset: torch's choice)")


def _config(args):
    from shuili.core.config import EngineConfig

    over = {"platform": args.platform, "model": args.model, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
            "tokens_per_block": args.block_size, "num_blocks": args.num_blocks, "overlap": args.overlap,
            "enforce_eager": args.enforce_eager, "graph_capture": args.graph_capture,
            "kv_host_bytes": args.kv_host_bytes, "kv_store": args.kv_store,
            "kv_store_ttl": args.kv_store_ttl, "kv_store_bytes": args.kv_store_bytes,
            "speculative": _speculative(args)}
    for name in ("tensor_parallel_size", "data_parallel_size", "enable_expert_parallel", "enable_eplb",
                 "num_redundant_experts"):
        over[name] = getattr(args, name, None)
    if args.config:
        return EngineConfig.from_file(args.config, **over)
    return EngineConfig(**{k: v for k, v in over.items() if v is not None})


def _speculative(args) -> dict | None:
    method, k = getattr(args, "speculative_method", None), getattr(args, "num_speculative_tokens", None)
    if method is None and k is None:
        return None
    if method is None or k is None:
        raise ValueError("give --speculative-method and --num-speculative-tokens together, e.g. "
                         "--speculative-method ngram --num-speculative-tokens 4")
    return {"method": method, "num_speculative_tokens": k}


def _llm(args):
    from shuili.core.api import LLM

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    return LLM(config=_config(args))


def _is_instruct(model) -> bool:
    flag = getattr(model, "is_instruct", None)
    if flag is not None:
        return bool(flag)
    return bool(getattr(getattr(model, "tokenizer", None), "chat_template", None))


def _sampling_defaults(args) -> dict:
    flags = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    return {**flags, "stop": args.stop, "ignore_eos": args.ignore_eos}


def _chat(args, llm) -> bool:
    return args.chat_template == "on" or (args.chat_template == "auto" and _is_instruct(llm.engine.model))


def cmd_generate(args) -> int:
    from shuili.core.batch import completion_record
    from shuili.core.sampling_params import SamplingParams

    if args.input:
        return _generate_batch(args)
    if not args.prompt:
        raise ValueError("give --prompt TEXT (repeatable) or --input prompts.jsonl")
    if args.output or args.resume:
        raise ValueError("--output and --resume go with --input FILE (a batch job)")
    params = SamplingParams(**_sampling_defaults(args))
    llm = _llm(args)
    outs = llm.generate(args.prompt, params, apply_chat_template=_chat(args, llm))
    for o in outs:
        if args.json:
            print(json.dumps({"request_id": o.request_id, "prompt": o.prompt,
                              "outputs": [completion_record(c) for c in o.outputs]}))
            continue
        for c in o.outputs:
            print(c.text if c.error is None else f"[error] {c.error}")
    return 1 if any(c.finish_reason == "error" for o in outs for c in o.outputs) else 0


def _generate_batch(args) -> int:
    from tqdm import tqdm

    from shuili.core import batch

    if args.resume and not args.output:
        raise ValueError("--resume needs --output FILE (the file to continue)")
    lines = batch.read_input(args.input, _sampling_defaults(args))
    fd, done = batch.open_output(args.output, args.resume) if args.output else (None, {})
    if done:
        try:
            batch.check_unchanged(args.input, lines, done)
        except ValueError:
            os.close(fd)
            raise
    sink = batch.Sink(fd)
    todo = [x for x in lines if x.number not in done]
    bar = tqdm(total=len(todo), desc="generate", unit="line", file=sys.stderr, disable=not todo)
    try:
        summary = batch.Summary(pending=0)
        if todo:
            llm = _llm(args)
            summary = batch.run(llm, todo, sink, _chat(args, llm), lambda n: bar.update(n - bar.n))
    finally:
        bar.close()
        sink.close()
    _report(args, summary, len(done))
    if summary.signum is not None:
        return batch.INTERRUPT_EXIT[summary.signum]
    return 1 if summary.failed else 0


def _report(args, summary, skipped: int) -> None:
    dest = args.output or "stdout"
    said = f"shuili: {summary.written} of {summary.pending} lines written to {dest} ({summary.failed} failed"
    said += f"; {skipped} already there were skipped)" if skipped else ")"
    print(said, file=sys.stderr)
    if summary.signum is not None:
        how = ("rerun the same command with --resume to answer only those" if args.output
               else "rerun with --output FILE to make the job resumable")
        print(f"shuili: interrupted: {summary.remaining} lines were not answered; {how}", file=sys.stderr)


def run_bench(llm, num_prompts: int, input_len: int, output_len: int, temperature: float = 0.0,
              seed: int = 0) -> dict:
    """Offline benchmark: all prompts queued at t=0; random token prompts, EOS ignored."""
    from shuili.core.sampling_params import SamplingParams

    rng = random.Random(seed)
    V = llm.engine.model.vocab_size
    prompts = [[rng.randrange(V) for _ in range(input_len)] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=temperature, seed=seed, ignore_eos=True)
    eng = llm.engine
    steps0, sched0 = eng.num_steps, eng.schedule_seconds
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    ok = [o for o in outs if o.error is None]
    ttft = [o.metrics["first_token"] - o.metrics["arrival"] for o in ok]
    tpot = [(o.metrics["finish"] - o.metrics["first_token"]) / (len(o.token_ids) - 1)
            for o in ok if len(o.token_ids) > 1]
    n_out = sum(len(o.token_ids) for o in ok)
    steps = eng.num_steps - steps0
    proposed = sum(o.metrics.get("draft_tokens_proposed", 0) for o in ok)
    accepted = sum(o.metrics.get("draft_tokens_accepted", 0) for o in ok)
    sample_steps = sum(o.metrics.get("sample_steps", 0) for o in ok)

    def pct(xs, q):
        return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)

    return {
        "platform": eng.platform.name, "model": eng.config.model, "num_prompts": num_prompts,
        "input_len": input_len, "output_len": output_len, "errors": len(outs) - len(ok),
        "wall_s": wall, "output_tokens": n_out, "output_tokens_per_s": n_out / wall,
        "total_tokens_per_s": (n_out + input_len * len(ok)) / wall,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0, "ttft_p99_s": pct(ttft, 99),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else 0.0, "tpot_p99_s": pct(tpot, 99),
        "steps": steps, "scheduler_us_per_step": 1e6 * (eng.schedule_seconds - sched0) / max(steps, 1),
        "draft_tokens_proposed": proposed, "draft_tokens_accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_tokens_per_step": n_out / sample_steps if sample_steps else 0.0,  # per request, per step
        "_outputs": [(o.token_ids, o.logprobs) for o in outs],
        **tier_stats(eng),
    }


def _same_bits(a, b) -> bool:
    import struct

    def key(outs):
        return [(list(t), [struct.pack("<f", x) for x in lp]) for t, lp in outs]

    return key(a) == key(b)


def tier_stats(eng) -> dict:
    """Prefix-cache hit tokens per tier (device, host, disk) and bytes moved, since the engine started."""
    if eng.kv_tiers is None:
        return {"kv_hit_tokens_device": eng.kv.num_hit_tokens}
    eng.kv_tiers.flush()
    if len(getattr(eng, "dp_tiers", ())) > 1:  # a parallel engine: every DP group's tiers
        from shuili.core.parallel.kv_tiers_dp import merged_stats

        return merged_stats(eng.dp_tiers)
    return eng.kv_tiers.stats()


def cmd_bench(args) -> int:
    llm = _llm(args)
    res = run_bench(llm, args.num_prompts, args.input_len, args.output_len, args.temperature, args.seed)
    if llm.engine.config.speculative is not None:  # the same run without speculation, for the speedup
        from shuili.core.api import LLM

        cfg = llm.engine.config.model_copy(update={"speculative": None})
        del llm
        base = run_bench(LLM(config=cfg), args.num_prompts, args.input_len, args.output_len,
                         args.temperature, args.seed)
        res["baseline_wall_s"] = base["wall_s"]
        res["speedup"] = base["wall_s"] / res["wall_s"]
        res["identical_outputs"] = _same_bits(base["_outputs"], res["_outputs"])
    res.pop("_outputs")
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>24}: {v:.6g}" if isinstance(v, float) else f"{k:>24}: {v}")
    return 0
