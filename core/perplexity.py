"""Per-sample perplexity of a fixed text set: the conformance suite locks these numbers per platform.

A text is tokenized by the model's tokenizer (a BOS only where the tokenizer adds one); tokens
1 .. n-1 are scored by their logprob given the tokens before them, so ppl = exp(-sum(lp) / (n - 1)).
The logprobs come from the engine (`SamplingParams(prompt_logprobs=True, max_tokens=1)`), i.e.
the same batched, chunked, prefix-cached path that serves requests; `direct_logprobs` computes
them with one plain forward per text, and the two agree bit for bit on a batch-invariant
platform (tests/models/test_llama_smollm2.py).
"""
from __future__ import annotations

import importlib.resources
import json
import math
import os

import torch
from pydantic import BaseModel

DEFAULT_TEXTS = "data/ppl_texts.jsonl"  # inside the shuili.conformance package


class TextSample(BaseModel):
    id: str
    text: str


class PerplexityResult(BaseModel):
    id: str
    num_tokens: int  # tokens scored (prompt length - 1)
    nll: float  # -sum of the scored tokens' float32 logprobs, summed in float64 in order
    ppl: float
    token_ids: list[int]
    logprobs: list[float]


class PerplexityReport(BaseModel):
    model: str
    platform: str
    texts: str
    samples: list[PerplexityResult]

    @property
    def corpus_ppl(self) -> float:
        tokens = sum(s.num_tokens for s in self.samples)
        return math.exp(sum(s.nll for s in self.samples) / tokens)


def default_texts_path() -> str:
    return str(importlib.resources.files("shuili.conformance").joinpath(DEFAULT_TEXTS))


def load_texts(path: str | None = None) -> list[TextSample]:
    """JSON lines {"id": ..., "text": ...}; blank lines are skipped."""
    path = path or default_texts_path()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text set {path!r} does not exist")
    samples = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                samples.append(TextSample.model_validate_json(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not a {{\"id\": str, \"text\": str}} JSON line ({exc})") from None
    ids = [s.id for s in samples]
    if len(set(ids)) != len(ids) or not samples:
        raise ValueError(f"{path}: needs at least one text and unique ids")
    return samples


def _result(sample_id: str, ids: list[int], lps: list[float]) -> PerplexityResult:
    if len(lps) != len(ids) - 1 or any(lp is None for lp in lps):
        raise RuntimeError(f"text {sample_id!r}: got {len(lps)} prompt logprobs for {len(ids)} tokens")
    nll = -math.fsum(float(lp) for lp in lps)
    return PerplexityResult(id=sample_id, num_tokens=len(lps), nll=nll, ppl=math.exp(nll / len(lps)),
                            token_ids=ids, logprobs=[float(lp) for lp in lps])


def tokenize(tokenizer, samples: list[TextSample]) -> list[list[int]]:
    out = []
    for s in samples:
        ids = tokenizer.encode(s.text)
        if len(ids) < 2:
            raise ValueError(f"text {s.id!r} has {len(ids)} tokens; perplexity needs at least 2")
        out.append(ids)
    return out


def engine_perplexity(llm, samples: list[TextSample]) -> list[PerplexityResult]:
    """Through `shuili.core.api.LLM`: all texts in one generate call (batched by the scheduler)."""
    from shuili.core.sampling_params import SamplingParams

    token_ids = tokenize(llm.tokenizer, samples)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=True, logprobs=False, seed=0)
    outs = llm.generate(token_ids, params)
    results = []
    for s, ids, out in zip(samples, token_ids, outs):
        if out.error:
            raise ValueError(f"text {s.id!r}: {out.error}")
        results.append(_result(s.id, ids, list(out.prompt_logprobs or [])))
    return results


def direct_logprobs(model, ops, ids: list[int], tokens_per_block: int | None = None) -> list[float]:
    """Prompt logprobs of one text from a single forward of the whole text (no engine, any model)."""
    from shuili.core.models.driver import CacheDriver

    cache = CacheDriver(model, 1, len(ids), tokens_per_block)
    logits = model.forward(cache.batch([(0, ids, 0)], logits="all"))[:-1]
    lp = ops.log_softmax(logits)
    target = torch.tensor(ids[1:], dtype=torch.int64, device=lp.device)
    return lp.gather(1, target[:, None])[:, 0].tolist()


def direct_perplexity(model, ops, samples: list[TextSample]) -> list[PerplexityResult]:
    return [_result(s.id, ids, direct_logprobs(model, ops, ids))
            for s, ids in zip(samples, tokenize(model.tokenizer, samples))]


def run(model: str, platform: str = "reference", texts: str | None = None, **engine_fields) -> PerplexityReport:
    from shuili.core.api import LLM

    samples = load_texts(texts)
    llm = LLM(model=model, platform=platform, **engine_fields)
    return PerplexityReport(model=model, platform=platform, texts=texts or default_texts_path(),
                            samples=engine_perplexity(llm, samples))


def format_report(report: PerplexityReport) -> str:
    width = max(len(s.id) for s in report.samples)
    lines = [f"{'id':<{width}}  tokens        nll        ppl"]
    lines += [f"{s.id:<{width}}  {s.num_tokens:6d}  {s.nll:9.4f}  {s.ppl:9.4f}" for s in report.samples]
    lines.append(f"{'corpus':<{width}}  {sum(s.num_tokens for s in report.samples):6d}  "
                 f"{sum(s.nll for s in report.samples):9.4f}  {report.corpus_ppl:9.4f}")
    return "\n".join(lines)


def to_json(report: PerplexityReport, with_tokens: bool = False) -> str:
    exclude = None if with_tokens else {"samples": {"__all__": {"token_ids", "logprobs"}}}
    data = report.model_dump(exclude=exclude)
    data["corpus_ppl"] = report.corpus_ppl
    return json.dumps(data, indent=2)
