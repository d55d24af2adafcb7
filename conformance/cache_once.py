"""The cache-once equivalence check (DeepSeek-V4.1): compressed KV is computed once per KV-source
group and shared; only each layer's window is per layer.

One prompt (longer than two windows) is prefilled in chunks that do not align with the KV blocks,
twice, through the engine on one platform:
  full       every block of every pool kept
  truncated  each layer's window pool keeps only the last window (out-of-window blocks freed between
             chunks, so the window state is what the last `sliding_window` tokens rebuilt), the
             per-source compressed-KV / indexer-key pools kept and read by every layer of the group
The two must agree elementwise: every attention call's index lists in logical entries, which pools
each layer read (a layer after a source reads the source's pool, never its own), prompt logprobs,
tokens and logprob bits. A negative control runs the truncated mode with a cache manager that also
frees the shared pools' out-of-window blocks; the check must fail on it, or it tests nothing.
"""
from __future__ import annotations

import random
import time

from shuili.conformance.engine_check import Req, Seq, compare_seqs, run
from shuili.conformance.replay import Recorder, _compare_meta
from shuili.conformance.report import CheckResult
from shuili.conformance.workloads import Workload
from shuili.hal import PlatformConfig

CHUNK = 13  # prefill budget: chunk starts fall inside KV blocks and inside ratio-2 groups


def _engine(w: Workload, platform: str, mode: str, batch_invariant: bool = False):
    from shuili.core.api import LLM

    llm = LLM(model=w.model, enable_prefix_caching=False, enforce_eager=True,
              platform=PlatformConfig(platform=platform, batch_invariant=batch_invariant),
              max_num_batched_tokens=CHUNK, max_num_seqs=2, num_blocks=w.num_blocks)
    kv = llm.engine.kv
    release = kv.release_out_of_window
    freed = {"window": 0, "shared": 0}

    def counted(req):
        if mode == "full":
            return 0
        n = release(req)
        freed["window"] += n
        if mode == "broken":  # the negative control: the shared pools treated as windowed
            for g in kv.groups:
                if g.kind != "compressed":
                    continue
                table = req.block_ids.get(g.name, [])
                first = max(0, req.num_computed_tokens - llm.engine.model.cfg.sliding_window + 1) // kv.P
                for i in range(min(first, len(table))):
                    if table[i] >= 0:
                        kv.pools[g.name].release(table[i])
                        table[i] = -1
                        freed["shared"] += 1
        return n

    kv.release_out_of_window = counted  # the scheduler calls it before each chunk
    if mode == "broken":
        kv.check_integrity = lambda: None  # the control's tables hold -1 outside sliding groups
    return llm, Recorder(llm.engine.model), freed


def _reads(calls) -> dict[int, list[str]]:
    """call index (= layer) -> the pools its first step's attention read."""
    out: dict[int, list[str]] = {}
    for step, call, group, _ in calls:
        if step == 0:
            out.setdefault(call, []).append(group)
    return out


def _run(w: Workload, platform: str, mode: str, req, batch_invariant: bool):
    llm, rec, freed = _engine(w, platform, mode, batch_invariant)
    out = run(llm, req)
    return out, rec, freed, llm.engine.model.cfg


def check_cache_once(w: Workload, platform: str, seed: int, batch_invariant: bool = False,
                     control: bool = True) -> list[CheckResult]:
    from shuili.core.api import SamplingParams

    name = f"cache_once.{w.name}"
    t0 = time.perf_counter()
    rng = random.Random(seed)
    probe, _, _ = _engine(w, platform, "full", batch_invariant)
    cfg = probe.engine.model.cfg
    if not getattr(cfg, "kv_source_layer_ids", None):
        return [CheckResult(name=name, kind="replay", status="skip",
                            message=f"{w.model} shares no compressed KV across layers")]
    n = max(w.replay_prompt_tokens, 2 * cfg.sliding_window + 3)
    vocab = probe.engine.model.vocab_size
    del probe
    prompt = [rng.randrange(3, vocab) for _ in range(n)]
    req = [Req("cache-once prompt", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                            prompt_logprobs=True))]
    a, rec_full, _, _ = _run(w, platform, "full", req, batch_invariant)
    b, rec_trunc, freed, _ = _run(w, platform, "truncated", req, batch_invariant)
    details = {"prompt_tokens": n, "window": cfg.sliding_window, "chunk": CHUNK, "seed": seed,
               "window_blocks_freed": freed["window"]}
    res = _verdict(name, cfg, a, b, rec_full, rec_trunc, freed, details)
    res.details["seconds"] = round(time.perf_counter() - t0, 2)  # the check itself, without the control
    out = [res]
    if control:
        c, rec_broken, freed_b, _ = _run(w, platform, "broken", req, batch_invariant)
        bad = _verdict(name, cfg, a, c, rec_full, rec_broken, freed_b, dict(details))
        held = bad.status == "fail"
        out.append(CheckResult(
            name=f"{name}.negative_control", kind="control", status="pass" if held else "fail",
            details={"freed_shared_blocks": freed_b["shared"], "control_verdict": bad.message},
            message="freeing the shared compressed pools' old blocks is caught: " + bad.message if held else
            "the check passed a cache manager that frees shared compressed entries: it tests nothing"))
    return out


def _verdict(name, cfg, a, b, rec_full, rec_trunc, freed, details) -> CheckResult:
    if freed["window"] == 0:
        return CheckResult(name=name, kind="replay", status="error", details=details,
                           message="the truncated run freed no window block: nothing was tested")
    reads = _reads(rec_trunc.calls)
    for layer, groups in reads.items():
        src = cfg.kv_source_of(layer) if cfg.ratio(layer) > 0 else None
        want = ["swa_kv"] + ([f"kv_src{src}"] if src is not None else [])
        if groups[:1] != ["swa_kv"] or any(g not in want for g in groups):
            return CheckResult(name=name, kind="replay", status="fail", details=details,
                               message=f"layer {layer} read pools {groups}; expected its window and "
                                       f"{want[1:] or 'no compressed pool'} (the group's shared entries)")
    meta = _compare_meta(rec_full.calls, rec_trunc.calls)
    if meta is not None:
        return CheckResult(name=name, kind="replay", status="fail", level="exact", divergence=meta,
                           details=details, message="attention index lists differ between full retention "
                                                    "(expected) and last-window-only with shared entries (got)")
    div = (compare_seqs([Seq(a[0].token_ids, a[0].prompt_logprobs or [])],
                        [Seq(b[0].token_ids, b[0].prompt_logprobs or [])], ["cache-once prompt"], tokens=False)
           or compare_seqs(a, b, ["cache-once prompt"]))
    if div is not None:
        return CheckResult(name=name, kind="replay", status="fail", level="bitwise", divergence=div,
                           details=details, message="outputs differ between full retention (expected) and "
                                                    "last-window-only with shared entries (got)")
    return CheckResult(name=name, kind="replay", status="pass", level="bitwise", details=details,
                       message=f"{len(rec_trunc.calls)} attention reads identical in logical entries, each layer "
                               f"on its own window and its group's shared pool, {freed['window']} window blocks "
                               "freed; prompt logprobs, tokens and logprob bits identical")
