"""`shuili generate`, `shuili bench` (and `shuili perplexity` from cli_perplexity), registered by
shuili/cli.py through add_parser."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    _engine_args(g)
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    g.add_argument("--input", help="JSONL file: one {\"prompt\": ..., <SamplingParams fields>} or string per line")
    g.add_argument("--output", help="write one JSON result per line here (with --input)")
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (the default here, so answers are reproducible as printed)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="auto: on for instruct models (the model says so), off otherwise")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="offline throughput and latency (TTFT, TPOT, tokens/s)")
    _engine_args(b)
    b.add_argument("--num-prompts", type=int, default=16)
    b.add_argument("--input-len", type=int, default=32)
    b.add_argument("--output-len", type=int, default=16)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", action="store_true", help="print the result as one JSON object")
    b.set_defaults(func=cmd_bench)

    if "perplexity" in sub.choices:
        return
    try:  # `shuili perplexity` lives beside the perplexity code (core/cli_perplexity.py)
        from shuili.core import cli_perplexity
    except ImportError:
        return
    cli_perplexity.add_parser(sub)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--platform", default=None, help="reference | nvidia | ascend | auto")
    p.add_argument("--model", default=None, help="model name, checkpoint directory or .gguf file")
    p.add_argument("--config", default=None, help="EngineConfig as .json or .toml")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--overlap", action="store_true", default=None)
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="never replay decode steps as device graphs")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (results do not depend on it; 1 is fastest for the "
                        "reference platform's small tiled GEMMs on a busy machine)")


def _config(args):
    from shuili.core.config import EngineConfig

    over = {"platform": args.platform, "model": args.model, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
            "num_blocks": args.num_blocks, "overlap": args.overlap, "enforce_eager": args.enforce_eager}
    if args.config:
        return EngineConfig.from_file(args.config, **over)
    return EngineConfig(**{k: v for k, v in over.items() if v is not None})


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


def _read_jsonl(path: str, defaults: dict):
    from shuili.core.sampling_params import SamplingParams

    prompts, params = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            item = json.loads(line)
            if isinstance(item, str):
                item = {"prompt": item}
            if not isinstance(item, dict) or "prompt" not in item:
                raise ValueError(f"{path}:{n}: each line must be a string or an object with \"prompt\"")
            prompts.append(item.pop("prompt"))
            params.append(SamplingParams(**{**defaults, **item}))
    return prompts, params


def _record(o) -> dict:
    c = o.outputs[0]
    return {"request_id": o.request_id, "prompt": o.prompt, "text": c.text, "token_ids": c.token_ids,
            "logprobs": c.logprobs, "seed": c.seed, "finish_reason": c.finish_reason, "error": c.error}


def cmd_generate(args) -> int:
    from shuili.core.sampling_params import SamplingParams

    defaults = {k: v for k, v in {"max_tokens": args.max_tokens, "temperature": args.temperature,
                                  "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}.items()
                if v is not None}
    if args.ignore_eos:
        defaults["ignore_eos"] = True
    if args.input:
        prompts, params = _read_jsonl(args.input, defaults)
    elif args.prompt:
        prompts, params = args.prompt, [SamplingParams(**defaults)] * len(args.prompt)
    else:
        raise ValueError("give --prompt TEXT (repeatable) or --input prompts.jsonl")
    llm = _llm(args)
    chat = args.chat_template == "on" or (args.chat_template == "auto" and _is_instruct(llm.engine.model))
    progress = None
    bar = None
    if args.input:
        from tqdm import tqdm

        bar = tqdm(total=sum(p.n for p in params), desc="generate", unit="req", file=sys.stderr)
        progress = lambda done: bar.update(done - bar.n)  # noqa: E731
    outs = llm.generate(prompts, params, apply_chat_template=chat, progress=progress)
    if bar is not None:
        bar.close()
    sink = open(args.output, "w") if args.output else None
    try:
        for o in outs:
            rec = _record(o)
            if sink is not None:
                sink.write(json.dumps(rec) + "\n")
            if args.json:
                print(json.dumps(rec))
            elif sink is None:
                print(o.text if o.error is None else f"[error] {o.error}")
    finally:
        if sink is not None:
            sink.close()
    return 1 if any(o.finish_reason == "error" for o in outs) else 0


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
    }


def cmd_bench(args) -> int:
    llm = _llm(args)
    res = run_bench(llm, args.num_prompts, args.input_len, args.output_len, args.temperature, args.seed)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>24}: {v:.6g}" if isinstance(v, float) else f"{k:>24}: {v}")
    return 0
