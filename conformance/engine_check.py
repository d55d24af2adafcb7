"""Engine-level checks on a named workload: same request, same bits, whatever else happens.

Every workload prompt is submitted twice in one batch, once greedy and once with a seeded sampler,
so both modes share each run. The anchor run R0 (all requests together, cold prefix cache) is
compared, request by request, token id then raw float32 logprob bits, with:
  run_to_run         R0 again on a fresh engine
  prefix_cache       the same requests again on R0's engine: prefix-cache hits instead of compute
  batch_invariance   some requests alone (bs=1), and one needle request at a random position in
                     batches of random fillers (sizes across tile / graph-bucket edges)
  chunking           a small token budget per step: chunked prefill, mixed prefill/decode steps
  preemption         every running request preempted twice mid-decode, then recomputed
  decode_vs_prefill  each decoded token's logprob equals its logprob when the sequence so far is
                     prefilled as a prompt (prompt_logprobs)
  cross_platform     (platform != reference) R0 on the reference: bitwise when every op declares
                     portable_bitwise, else teacher-forced logprobs within `MODEL_TOLERANCE`
The engine's promise is batch invariance, so these are held bitwise (fail) by default; with
`engine_level="run_to_run"` everything but run_to_run and cross_platform is reported as info.
"""
from __future__ import annotations

import math
import random
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shuili.conformance import baselines
from shuili.conformance.compare import Divergence, f32_bits
from shuili.conformance.report import CheckResult
from shuili.conformance.workloads import MODES, Workload
from shuili.hal import DeterminismLevel, PlatformConfig, resolve_platform

L = DeterminismLevel
# teacher-forced logprob tolerance for platforms below portable_bitwise: |a - b| <= atol + rtol|b|
MODEL_TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}


@dataclass
class Seq:
    token_ids: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float] | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Req:
    label: str  # "prompt 3 (seeded)"
    prompt: list[int]
    params: Any  # SamplingParams


# ------------------------------------------------------------------------------------ comparing
def _bits_equal(a: float, b: float) -> bool:
    return struct.pack("<f", a) == struct.pack("<f", b)


def compare_seqs(expected: list[Seq], got: list[Seq], labels: list[str], mode: str = "bitwise",
                 field_name: str = "logprobs", tokens: bool = True) -> Divergence | None:
    """First divergence: token ids first (when `tokens`), then the logprobs in `field_name`
    ("logprobs" or "prompt_logprobs"): raw float32 bits (mode bitwise) or within tolerance."""
    for i, (e, g) in enumerate(zip(expected, got)):
        if g.error:
            return Divergence(where={"request": labels[i]}, expected="a finished request", got=g.error,
                              note="request failed")
        if tokens:
            for step, (te, tg) in enumerate(zip(e.token_ids, g.token_ids)):
                if te != tg:
                    return Divergence(where={"request": labels[i], "step": step}, expected=te, got=tg,
                                      note="token id differs")
            if len(e.token_ids) != len(g.token_ids):
                return Divergence(where={"request": labels[i]}, expected=len(e.token_ids),
                                  got=len(g.token_ids), note="number of tokens differs")
        lp_e = getattr(e, field_name) or []
        lp_g = getattr(g, field_name) or []
        for step, (a, b) in enumerate(zip(lp_e, lp_g)):
            if a is None or b is None:
                continue
            if math.isnan(b):
                return _lp_div(labels[i], step, e, a, b, "NaN logprob", field_name)
            if mode == "bitwise" and not _bits_equal(a, b):
                return _lp_div(labels[i], step, e, a, b, "logprob bits differ", field_name)
            if mode == "tolerance" and not abs(a - b) <= MODEL_TOLERANCE["atol"] + MODEL_TOLERANCE["rtol"] * abs(a):
                return _lp_div(labels[i], step, e, a, b,
                               f"beyond rtol={MODEL_TOLERANCE['rtol']} atol={MODEL_TOLERANCE['atol']}",
                               field_name)
        if len(lp_e) != len(lp_g):
            return Divergence(where={"request": labels[i]}, expected=len(lp_e), got=len(lp_g),
                              note=f"number of {field_name} differs")
    if len(expected) != len(got):
        return Divergence(where={}, expected=len(expected), got=len(got), note="number of requests")
    return None


def _lp_div(label, step, seq: Seq, a: float, b: float, note: str, field_name: str) -> Divergence:
    where = {"request": label, "step": step}
    if field_name == "logprobs" and step < len(seq.token_ids):
        where["token"] = seq.token_ids[step]
    if field_name == "prompt_logprobs":
        where = {"request": label, "position": step + 1}
    return Divergence(where=where, expected=a, got=b, expected_bits=f32_bits(a), got_bits=f32_bits(b),
                      max_abs_diff=abs(a - b) if math.isfinite(a - b) else None, note=note)


# -------------------------------------------------------------------------------------- running
class Session:
    """Builds engines for one (workload, platform), reusing loaded models between them.

    A model object is bound to one engine's caches at a time, so engines are used one after
    another, never interleaved."""

    def __init__(self, workload: Workload, platform: str, model_ops=None, batch_invariant: bool = False):
        self.w, self.platform = workload, platform
        self.batch_invariant = batch_invariant  # resolve the platform in its batch-invariant mode
        self.model_ops = model_ops  # a DispatchTable that replaces the platform's ops in the model
        self._models: dict[int, Any] = {}
        self.tokenizer = None
        self.engines_built = 0

    def _factory(self) -> Callable:
        from shuili.core.models import load_model

        def build(ops, device, dtype, seed):
            ops = self.model_ops or ops
            key = id(ops.get("linear")), id(ops.get("rms_norm"))
            if key not in self._models:
                self._models[key] = load_model(self.w.model, ops, device, dtype, seed)
            return self._models[key]

        return build

    def llm(self, **fields):
        from shuili.core.api import LLM

        fields.setdefault("max_num_seqs", self.w.max_num_seqs)
        fields.setdefault("num_blocks", self.w.num_blocks)
        fields.setdefault("enable_prefix_caching", False)
        llm = LLM(model=self._factory(), **fields,
                  platform=PlatformConfig(platform=self.platform, batch_invariant=self.batch_invariant))
        self.tokenizer = llm.tokenizer
        self.engines_built += 1
        return llm

    def requests(self, tok) -> list[Req]:
        from shuili.core.api import SamplingParams

        out = []
        w = self.w
        for i, text in enumerate(w.prompts):
            ids = list(tok.encode(text))
            out.append(Req(f"prompt {i} (greedy)", ids,
                           SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)))
            out.append(Req(f"prompt {i} (seeded)", ids,
                           SamplingParams(temperature=w.temperature, top_p=w.top_p, top_k=w.top_k,
                                          seed=w.seed + i, max_tokens=w.max_tokens, ignore_eos=True)))
        return out


def run(llm, reqs: list[Req], preempt_at: tuple[int, ...] = ()) -> list[Seq]:
    """Submit all, step to completion; at the given step numbers preempt every running request."""
    eng = llm.engine
    handles = [eng.add_request(r.prompt, r.params) for r in reqs]
    step = 0
    while eng.has_unfinished():
        if step in preempt_at:
            for h in handles:
                if h.status.name == "RUNNING":
                    eng.scheduler.preempt(h.request_id)
        eng.step()
        step += 1
    outs = [eng.output(h) for h in handles]
    return [Seq(o.token_ids, o.logprobs, o.prompt_logprobs, o.num_preemptions, o.finish_reason, o.error)
            for o in outs]


# ------------------------------------------------------------------------------------ the checks
def _result(name: str, held: bool, div: Divergence | None, ok: str, bad: str, level: str,
            **details) -> CheckResult:
    if div is None:
        return CheckResult(name=name, kind="engine", status="pass", level=level, message=ok, details=details)
    return CheckResult(name=name, kind="engine", status="fail" if held else "info", level=level,
                       message=bad if held else f"(not claimed) {bad}", divergence=div, details=details)


def _weak_ops(resolved, below: DeterminismLevel) -> list[str]:
    return sorted(f"{n} ({c.determinism.name})" for n, c in resolved.capabilities.ops.items()
                  if c.determinism < below)


@dataclass
class EngineRun:
    """What engine checks produced beyond results: R0 per mode, for baselines."""

    anchor: list[Seq] = field(default_factory=list)
    reqs: list[Req] = field(default_factory=list)


def check_workload(workload: Workload, platform: str, seed: int, engine_level: str = "batch_invariant",
                   checks: tuple[str, ...] | None = None, model_ops=None,
                   batch_invariant: bool = False) -> tuple[list[CheckResult], EngineRun]:
    """All engine checks of one workload on `platform`. `checks` restricts which run."""
    level = L.parse(engine_level)
    held = level >= L.batch_invariant
    resolved = resolve_platform(PlatformConfig(platform=platform, batch_invariant=batch_invariant))
    weak = _weak_ops(resolved, L.batch_invariant)
    hint = f" Ops declared below batch_invariant: {', '.join(weak)}." if weak else ""
    want = set(checks) if checks else None
    sess = Session(workload, platform, model_ops, batch_invariant)
    llm = sess.llm(enable_prefix_caching=True)
    reqs = sess.requests(llm.tokenizer)
    labels = [r.label for r in reqs]
    rng = random.Random(seed)
    prefix = f"engine.{workload.name}"
    out: list[CheckResult] = []
    lvl_name = f"bitwise ({level.name})"

    anchor = run(llm, reqs)
    bad = [(labels[i], s.error) for i, s in enumerate(anchor) if s.error]
    if bad:
        out.append(CheckResult(name=f"{prefix}.anchor", kind="engine", status="fail",
                               message=f"requests failed on {platform}: {bad[:3]}"))
        return out, EngineRun(anchor, reqs)

    out.append(_output_consistency(reqs, anchor, labels, prefix))

    def prefix_cache():  # first: it reuses the anchor's engine, whose cache is now hot
        return [_result(f"{prefix}.prefix_cache", held, compare_seqs(anchor, run(llm, reqs), labels),
                        "a rerun served from the prefix cache gives identical tokens and logprob bits",
                        "prefix-cache hits change the result." + hint, lvl_name)]

    def run_to_run():
        return [_result(f"{prefix}.run_to_run", True, compare_seqs(anchor, run(sess.llm(), reqs), labels),
                        "a fresh engine gives identical tokens and logprob bits",
                        "the same requests on a fresh engine give other results", lvl_name)]

    def chunking():
        return [_result(f"{prefix}.chunking.budget_{b}", held,
                        compare_seqs(anchor, run(sess.llm(max_num_batched_tokens=b), reqs), labels),
                        f"a {b}-token step budget (chunked prefill) gives identical results",
                        f"a {b}-token step budget changes the result." + hint, lvl_name, budget=b)
                for b in workload.chunk_budgets]

    steps = [
        ("prefix_cache", prefix_cache),
        ("run_to_run", run_to_run),
        ("batch_invariance", lambda: [_batch_invariance(sess, reqs, anchor, labels, rng, held, hint, prefix,
                                                        lvl_name)]),
        ("chunking", chunking),
        ("preemption", lambda: [_preemption(sess, reqs, anchor, labels, held, hint, prefix, lvl_name)]),
        ("decode_vs_prefill", lambda: [_decode_vs_prefill(sess, reqs, anchor, labels, rng, held, hint, prefix,
                                                          lvl_name)]),
        ("cross_platform", lambda: [_cross_platform(workload, resolved, reqs, anchor, labels, prefix)]
         if platform != "reference" else []),
        ("negative_control", lambda: [_negative_control(workload, resolved, reqs, anchor, labels, prefix)]),
    ]
    for name, check in steps:
        if want is not None and name not in want:
            continue
        t0 = time.perf_counter()
        results = check()
        for r in results:
            r.details["seconds"] = round(time.perf_counter() - t0, 2)
        out += results
    return out, EngineRun(anchor, reqs)


def _output_consistency(reqs, anchor, labels, prefix) -> CheckResult:
    """MLPerf TEST06-style accounting on the anchor: as many tokens as asked (ignore_eos), one
    logprob per token, every logprob finite and <= 0, finish reason "length"."""
    for i, (r, s) in enumerate(zip(reqs, anchor)):
        want = r.params.max_tokens
        problem = None
        if len(s.token_ids) != want or len(s.logprobs) != len(s.token_ids):
            problem = f"{len(s.token_ids)} tokens and {len(s.logprobs)} logprobs for max_tokens={want}"
        elif s.finish_reason != "length":
            problem = f"finish_reason {s.finish_reason!r}, expected 'length' (ignore_eos)"
        else:
            bad = [k for k, lp in enumerate(s.logprobs) if not (math.isfinite(lp) and lp <= 0.0)]
            if bad:
                k = bad[0]
                return CheckResult(
                    name=f"{prefix}.output_consistency", kind="engine", status="fail", level="exact",
                    message=f"{labels[i]}: logprob {s.logprobs[k]!r} at step {k} is not a finite value <= 0",
                    divergence=Divergence(where={"request": labels[i], "step": k}, expected="finite <= 0",
                                          got=s.logprobs[k], got_bits=f32_bits(s.logprobs[k])))
        if problem:
            return CheckResult(name=f"{prefix}.output_consistency", kind="engine", status="fail",
                               level="exact", message=f"{labels[i]}: {problem}")
    return CheckResult(name=f"{prefix}.output_consistency", kind="engine", status="pass", level="exact",
                       message=f"{len(reqs)} requests: token counts, logprob counts, finish reasons and "
                               "logprob ranges consistent")


def _batch_invariance(sess, reqs, anchor, labels, rng, held, hint, prefix, lvl) -> CheckResult:
    from shuili.core.api import SamplingParams

    picks = sorted(rng.sample(range(len(reqs)), min(3, len(reqs))))
    llm = sess.llm()
    for i in picks:  # bs = 1
        alone = run(llm, [reqs[i]])
        div = compare_seqs([anchor[i]], alone, [labels[i] + " alone"])
        if div is not None:
            return _result(f"{prefix}.batch_invariance", held, div, "",
                           f"{labels[i]} run alone differs from the same request in the batch of "
                           f"{len(reqs)} (expected = in the batch)." + hint, lvl, alone=picks)
    vocab = llm.engine.model.vocab_size
    needles = []
    for size in sess.w.needle_batch_sizes:
        n = rng.randrange(len(reqs))
        batch = []
        for _ in range(size - 1):
            ids = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
            batch.append(Req("filler", ids, SamplingParams(temperature=rng.choice([0.0, 1.0]),
                                                           seed=rng.randrange(2 ** 31),
                                                           max_tokens=rng.randint(1, sess.w.max_tokens),
                                                           ignore_eos=True)))
        at = rng.randrange(size)
        batch.insert(at, reqs[n])
        needles.append({"request": labels[n], "batch": size, "position": at})
        got = run(llm, batch)[at]
        div = compare_seqs([anchor[n]], [got], [f"{labels[n]} at {at} of {size}"])
        if div is not None:
            return _result(f"{prefix}.batch_invariance", held, div, "",
                           f"{labels[n]} at position {at} in a batch of {size} random fillers differs "
                           "from the anchor batch (expected = anchor)." + hint, lvl,
                           alone=picks, needles=needles)
    return _result(f"{prefix}.batch_invariance", held, None,
                   f"{len(picks)} requests alone and a needle in batches of "
                   f"{list(sess.w.needle_batch_sizes)} equal the anchor batch", "", lvl,
                   alone=picks, needles=needles)


def _preemption(sess, reqs, anchor, labels, held, hint, prefix, lvl) -> CheckResult:
    at = (2, max(3, sess.w.max_tokens // 2))
    got = run(sess.llm(), reqs, preempt_at=at)
    count = sum(s.num_preemptions for s in got)
    if count == 0:
        return CheckResult(name=f"{prefix}.preemption", kind="engine", status="error", level=lvl,
                           message=f"preempting at steps {at} preempted nothing: the check did not run")
    return _result(f"{prefix}.preemption", held, compare_seqs(anchor, got, labels),
                   f"{count} forced preemptions (recompute) leave tokens and logprob bits unchanged",
                   f"recompute after {count} forced preemptions changes the result." + hint, lvl,
                   preempt_at_steps=list(at), preemptions=count)


def _decode_vs_prefill(sess, reqs, anchor, labels, rng, held, hint, prefix, lvl) -> CheckResult:
    from shuili.core.api import SamplingParams

    picks = sorted(rng.sample(range(len(reqs)), min(2, len(reqs))))
    llm = sess.llm()
    for i in picks:
        seq = anchor[i]
        ids = reqs[i].prompt + seq.token_ids[:-1]
        got = run(llm, [Req(labels[i], ids, SamplingParams(temperature=0.0, max_tokens=1,
                                                              prompt_logprobs=True, ignore_eos=True))])[0]
        n = len(reqs[i].prompt)
        teacher = (got.prompt_logprobs or [])[n - 1:]
        div = compare_seqs([Seq(seq.token_ids, seq.logprobs[:len(teacher)])],
                           [Seq(seq.token_ids, teacher)], [labels[i]], tokens=False)
        if div is not None:
            div.note += "; expected = decoded, got = prefilled"
            return _result(f"{prefix}.decode_vs_prefill", held, div, "",
                           f"{labels[i]}: a decoded token's logprob differs from the same token's "
                           "logprob when the sequence is prefilled." + hint, lvl, requests=picks)
    return _result(f"{prefix}.decode_vs_prefill", held, None,
                   f"decoded logprobs equal prefilled (prompt_logprobs) bits for {len(picks)} requests",
                   "", lvl, requests=picks)


def _cross_platform(workload, resolved, reqs, anchor, labels, prefix) -> CheckResult:
    from shuili.core.api import SamplingParams

    bitwise = all(c.determinism >= L.portable_bitwise for c in resolved.capabilities.ops.values())
    ref = Session(workload, "reference")
    ref_anchor = run(ref.llm(enable_prefix_caching=True), reqs)
    if bitwise:
        div = compare_seqs(ref_anchor, anchor, labels)
        return CheckResult(
            name=f"{prefix}.cross_platform", kind="engine", status="pass" if div is None else "fail",
            level="portable_bitwise", divergence=div,
            message="identical tokens and logprob bits to the reference" if div is None else
            "every op declares portable_bitwise, but the result differs from the reference "
            "(expected = reference)")
    weak = _weak_ops(resolved, L.portable_bitwise)
    # teacher forcing: both platforms score the reference's sequences, so a near-tie that flips a
    # token does not end the comparison
    forced = [Req(r.label, r.prompt + s.token_ids, SamplingParams(temperature=0.0, max_tokens=1,
                                                                  prompt_logprobs=True, ignore_eos=True))
              for r, s in zip(reqs, ref_anchor)]
    ref_scores = run(ref.llm(), forced)
    del ref
    plat_scores = run(Session(workload, resolved.name).llm(), forced)
    div = compare_seqs(ref_scores, plat_scores, labels, mode="tolerance", field_name="prompt_logprobs",
                       tokens=False)
    tokens_same = all(a.token_ids == b.token_ids for a, b in zip(ref_anchor, anchor))
    return CheckResult(
        name=f"{prefix}.cross_platform", kind="engine", status="pass" if div is None else "fail",
        level=f"tolerance rtol={MODEL_TOLERANCE['rtol']} atol={MODEL_TOLERANCE['atol']}", divergence=div,
        message=(f"teacher-forced logprobs within tolerance of the reference; generated tokens "
                 f"{'identical' if tokens_same else 'differ (allowed below portable_bitwise)'}; "
                 f"ops below portable_bitwise: {', '.join(weak)}") if div is None else
        "teacher-forced logprobs differ from the reference beyond tolerance (expected = reference)",
        details={"tokens_identical": tokens_same})


def _negative_control(workload, resolved, reqs, anchor, labels, prefix) -> CheckResult:
    """The model's rms_norm moved by one ulp must change the anchor's bits, or the engine
    comparisons are blind. Passing means the perturbation was caught."""
    import torch

    from shuili.hal.ops import DispatchTable

    table = resolved.ops.as_dict()
    inner = table["rms_norm"]

    def rms_norm_plus_ulp(x, weight, eps):
        y = inner(x, weight, eps)
        return torch.nextafter(y, torch.full_like(y, float("inf")))

    table["rms_norm"] = rms_norm_plus_ulp
    perturbed = DispatchTable(resolved.name, table, dict(resolved.ops.sources))
    got = run(Session(workload, resolved.name, model_ops=perturbed).llm(enable_prefix_caching=True), reqs)
    div = compare_seqs(anchor, got, labels)
    return CheckResult(
        name=f"control.{prefix}.perturbed_model", kind="control", status="pass" if div else "fail",
        level="must differ", divergence=div,
        message="caught: a 1-ulp perturbation of the model's rms_norm changes the anchor" if div else
        "NOT caught: the anchor is unchanged by a 1-ulp perturbation of rms_norm; the engine checks "
        "are not sensitive")


# ------------------------------------------------------------------------------------ baselines
def text_samples(workload: Workload, platform: str, batch_invariant: bool = False) -> list[dict]:
    """Per-text perplexity records of the fixed text set (empty unless the workload asks)."""
    if not workload.ppl_texts:
        return []
    from shuili.core import perplexity

    llm = Session(workload, platform, batch_invariant=batch_invariant).llm()
    return [baselines.sample_record(r.token_ids, [], r.logprobs)
            for r in perplexity.engine_perplexity(llm, perplexity.load_texts())]


def baseline_body(workload: Workload, platform: str, res: EngineRun, texts: list[dict] | None = None) -> dict:
    modes: dict[str, list[dict]] = {m: [] for m in MODES}
    for r, s in zip(res.reqs, res.anchor):
        mode = "greedy" if r.params.temperature == 0.0 else "seeded"
        modes[mode].append(baselines.sample_record(r.prompt, s.token_ids, s.logprobs))
    if texts:
        modes["ppl_texts"] = texts
    return {"platform": platform, "workload": workload.name,
            "modes": {m: {"samples": v} for m, v in modes.items()}}
