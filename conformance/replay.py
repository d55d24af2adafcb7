"""Bounded replay: a sliding-window model must not care whether out-of-window KV was kept.

One prompt longer than the model's window is prefilled in small chunks twice: once with the
engine's normal policy (blocks of sliding groups that no later query can read are freed between
chunks: only the last window is kept) and once with every block retained. The two runs must
agree on
  metadata   every attention call's index lists, translated from physical slots to logical
             entries (block-table independent); an index into a freed block is a mismatch
  logprobs   prompt logprobs and decoded tokens / logprob bits
The truncated run must actually have freed blocks, or the check reports an error.
"""
from __future__ import annotations

import random
import time

import torch

from shuili.conformance.compare import Divergence
from shuili.conformance.engine_check import Req, Seq, compare_seqs, run
from shuili.conformance.report import CheckResult
from shuili.conformance.workloads import Workload
from shuili.hal import PlatformConfig
from shuili.hal.ops import DispatchTable


class Recorder:
    """Wraps a model's op table and forward to log sparse_attention indices in logical terms."""

    def __init__(self, model):
        self.model = model
        self.calls: list[tuple[int, int, str, torch.Tensor]] = []  # (step, call, group, logical idx)
        self._batch = None
        self._step = -1
        self._call = 0
        groups = {g.name: g for g in model.cache_groups()}
        self._group_of = {id(t): name for name, layers in model.caches.items() for t in layers.values()}
        self._ratio = {name: g.ratio for name, g in groups.items()}
        table = model.ops.as_dict()
        inner = table["sparse_attention"]

        def sparse_attention(q, kv, indices, scale, sinks=None, kv_formats=None):
            for cache, idx in zip(kv, indices):
                name = self._group_of.get(id(cache), "?")
                self.calls.append((self._step, self._call, name, self._logical(name, idx)))
            self._call += 1
            return inner(q, kv, indices, scale, sinks, kv_formats)

        table["sparse_attention"] = sparse_attention
        model.ops = DispatchTable(model.ops.platform, table, dict(model.ops.sources))
        forward = model.forward

        def recording_forward(batch, *a, **kw):
            self._batch, self._step, self._call = batch, self._step + 1, 0
            return forward(batch, *a, **kw)

        model.forward = recording_forward

    def _logical(self, group: str, idx: torch.Tensor) -> torch.Tensor:
        """Slots -> entry ids within the (single) sequence; -1 stays -1, -2 = not in its table."""
        b = self._batch
        if group not in b.block_tables:
            return idx.clone().long()
        epb = b.tokens_per_block // self._ratio.get(group, 1)
        table = b.block_tables[group][0].long().tolist()
        where = {pb: lb for lb, pb in enumerate(table) if pb >= 0}
        flat = idx.long().reshape(-1).tolist()
        out = [-1 if s < 0 else (where[s // epb] * epb + s % epb if s // epb in where else -2) for s in flat]
        return torch.tensor(out, dtype=torch.int64).view(idx.shape)


def _engine(workload: Workload, platform: str, budget: int, keep_all: bool, batch_invariant: bool = False):
    from shuili.core.api import LLM

    # eager: the recorder wraps Python-level op calls, which a replayed decode graph would bypass
    llm = LLM(model=workload.model, enable_prefix_caching=False, enforce_eager=True,
              platform=PlatformConfig(platform=platform, batch_invariant=batch_invariant),
              max_num_batched_tokens=budget, max_num_seqs=4, num_blocks=workload.num_blocks)
    kv = llm.engine.kv
    release = kv.release_out_of_window
    freed = [0]

    def counted(req):
        n = 0 if keep_all else release(req)
        freed[0] += n
        return n

    kv.release_out_of_window = counted  # the scheduler calls it before each chunk
    return llm, Recorder(llm.engine.model), freed


def check_bounded_replay(workload: Workload, platform: str, seed: int,
                         batch_invariant: bool = False) -> list[CheckResult]:
    from shuili.core.api import SamplingParams

    name = f"replay.{workload.name}"
    t0 = time.perf_counter()
    full, rec_full, _ = _engine(workload, platform, 16, keep_all=True, batch_invariant=batch_invariant)
    window = getattr(getattr(full.engine.model, "cfg", None), "sliding_window", 0)
    n = max(workload.replay_prompt_tokens, 2 * window + 3)
    if not window:
        return [CheckResult(name=f"{name}.metadata", kind="replay", status="skip",
                            message=f"{workload.model} has no sliding window")]
    rng = random.Random(seed)
    vocab = full.engine.model.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(n)]
    req = [Req("replay prompt", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                        prompt_logprobs=True))]
    a = run(full, req)
    del full
    trunc, rec_trunc, freed = _engine(workload, platform, 16, keep_all=False, batch_invariant=batch_invariant)
    b = run(trunc, req)
    details = {"prompt_tokens": n, "window": window, "chunk": 16, "blocks_freed": freed[0], "seed": seed}
    meta = _compare_meta(rec_full.calls, rec_trunc.calls)
    elapsed = time.perf_counter() - t0
    details["seconds"] = round(elapsed, 2)
    if freed[0] == 0:
        return [CheckResult(name=f"{name}.metadata", kind="replay", status="error", details=details,
                            message="the truncated run freed no sliding-window block: nothing was tested")]
    out = [CheckResult(
        name=f"{name}.metadata", kind="replay", status="pass" if meta is None else "fail",
        level="exact", divergence=meta, details=details,
        message=f"{len(rec_full.calls)} attention index lists identical in logical entries with "
                f"{freed[0]} window blocks freed" if meta is None else
        "attention metadata differs between full KV retention (expected) and last-window-only (got)")]
    div = (compare_seqs([Seq(a[0].token_ids, a[0].prompt_logprobs or [])],
                        [Seq(b[0].token_ids, b[0].prompt_logprobs or [])], ["replay prompt"], tokens=False)
           or compare_seqs(a, b, ["replay prompt"]))
    out.append(CheckResult(
        name=f"{name}.logprobs", kind="replay", status="pass" if div is None else "fail",
        level="bitwise", divergence=div, details=details,
        message="prompt logprobs, tokens and logprob bits identical with only the last window kept"
        if div is None else "keeping only the last window changes the logprobs (expected = full KV)"))
    return out


def _compare_meta(full, trunc) -> Divergence | None:
    if len(full) != len(trunc):
        return Divergence(where={}, expected=len(full), got=len(trunc), note="number of attention reads")
    for (s, c, g, e), (_, _, _, t) in zip(full, trunc):
        if e.shape != t.shape or not torch.equal(e, t):
            if e.shape != t.shape:
                return Divergence(where={"step": s, "call": c, "cache": g}, expected=list(e.shape),
                                  got=list(t.shape), note="index list shape")
            bad = (e != t).nonzero()[0].tolist()
            return Divergence(where={"step": s, "call": c, "cache": g, "index": bad},
                              expected=int(e[tuple(bad)]), got=int(t[tuple(bad)]),
                              note="logical entry (-2 = a freed block)")
    return None
