"""`shuili perplexity`: per-sample perplexity of a text set (default: the conformance set)."""
from __future__ import annotations


def add_parser(sub) -> None:
    from shuili.core.models import DEFAULT_MODEL

    p = sub.add_parser("perplexity", help="per-sample perplexity of a fixed text set through the engine")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name, .gguf file or checkpoint (default {DEFAULT_MODEL})")
    p.add_argument("--platform", default="reference", help="platform name or auto (default reference)")
    p.add_argument("--texts", default=None,
                   help="JSON lines {\"id\", \"text\"} (default: shuili's conformance/data/ppl_texts.jsonl)")
    p.add_argument("--dtype", default="float32", help="compute dtype (default float32)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--with-tokens", action="store_true", help="include token ids and logprobs in --json")
    p.set_defaults(func=run)


def run(args) -> int:
    from shuili.core import perplexity

    report = perplexity.run(args.model, platform=args.platform, texts=args.texts, dtype=args.dtype)
    print(perplexity.to_json(report, args.with_tokens) if args.json else perplexity.format_report(report))
    return 0
