"""Sampler: penalties, min-tokens masking, seeded sampling and logprobs, all through HAL ops.

Per-row inputs only (seed, absolute position, the request's own tokens), so a row's result
cannot depend on its batch. Logprobs are of the raw model distribution (before temperature,
penalties and filtering), float32. A row whose logits hold NaN (or are all -inf) is sampled from
zeros and flagged `bad`; the engine finishes that request with an error.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shuili.core.staging import upload
from shuili.hal.ops import accepts


@dataclass
class SampleRow:
    req: object  # Request
    position: int  # absolute position of the token being sampled
    logits_row: int
    epoch: int = 0  # the request's epoch when scheduled; a stale row is dropped


class Sampler:
    def __init__(self, ops, vocab_size: int, device: str = "cpu"):
        self.ops = ops
        self.V = vocab_size
        self.device = device
        self._hint_fn, self._hint_ok = None, False

    def _takes_hints(self) -> bool:
        fn = self.ops.sample  # looked up per call: tests and tools swap the ops object
        if fn != self._hint_fn:
            self._hint_fn, self._hint_ok = fn, accepts(fn, "all_greedy") and accepts(fn, "any_filter")
        return self._hint_ok

    def _in_flight_token(self, row: SampleRow, prev) -> torch.Tensor | None:
        # placeholders beyond this row's own sample belong to the previous (in-flight) step
        if row.req.num_placeholders > 1:
            return prev.sampled[prev.index[row.req.request_id]]
        return None

    def _penalize(self, logits: torch.Tensor, rows: list[SampleRow], prev) -> torch.Tensor:
        S, V, dev = logits.shape[0], self.V, self.device
        counts = torch.zeros(S, V, dtype=torch.int32, device=dev)
        prompt_mask = torch.zeros(S, V, dtype=torch.bool, device=dev)
        for i, r in enumerate(rows):
            out = torch.tensor(r.req.output_token_ids, dtype=torch.int64, device=dev)
            counts[i] += torch.bincount(out, minlength=V)[:V].to(torch.int32)
            extra = self._in_flight_token(r, prev)
            if extra is not None:
                counts[i, extra] += 1
            prompt_mask[i, torch.tensor(r.req.prompt_token_ids, dtype=torch.int64, device=dev)] = True
        rep = torch.tensor([r.req.params.repetition_penalty for r in rows], dtype=torch.float32, device=dev)
        pres = torch.tensor([r.req.params.presence_penalty for r in rows], dtype=torch.float32, device=dev)
        freq = torch.tensor([r.req.params.frequency_penalty for r in rows], dtype=torch.float32, device=dev)
        return self.ops.apply_penalties(logits, counts, prompt_mask, rep, pres, freq)

    def _mask_min_tokens(self, logits: torch.Tensor, rows: list[SampleRow], eos: tuple[int, ...]) -> torch.Tensor:
        for i, r in enumerate(rows):
            p = r.req.params
            if r.req.num_pending_output - 1 < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))
                banned = [t for t in banned if 0 <= t < self.V]
                if banned:
                    logits[i, banned] = float("-inf")
        return logits

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], prev=None, eos: tuple[int, ...] = ()):
        """logits float32 [S, V] -> (tokens int64 [S], logprobs float32 [S], bad bool [S])."""
        bad = torch.isnan(logits).any(dim=-1) | torch.isneginf(logits).all(dim=-1)
        logits = torch.where(bad[:, None], torch.zeros((), dtype=logits.dtype, device=logits.device), logits)
        raw_lp = self.ops.log_softmax(logits)
        proc = logits.to(torch.float32).clone()
        if any(r.req.params.min_tokens for r in rows):
            proc = self._mask_min_tokens(proc, rows, eos)
        if any(r.req.params.has_penalties for r in rows):
            proc = self._penalize(proc, rows, prev)
        ps = [r.req.params for r in rows]
        f32 = torch.float32
        hints = {}
        if self._takes_hints():  # known on the host: the op need not read its tensors back (a sync)
            hints = {"all_greedy": all(p.greedy for p in ps), "any_filter": any(p.has_filter for p in ps)}
        tokens = self.ops.sample(proc, *upload([
            ([p.temperature for p in ps], f32), ([p.top_k for p in ps], torch.int32),
            ([p.top_p for p in ps], f32), ([p.min_p for p in ps], f32),
            ([r.req.seed for r in rows], torch.int64), ([r.position for r in rows], torch.int64)],
            self.device), **hints)
        lps = raw_lp.gather(1, tokens[:, None])[:, 0]
        return tokens, lps, bad

    def top_logprobs(self, logits: torch.Tensor, rows: list[SampleRow]):
        """(ids int64 [S, k], logprobs float32 [S, k]) of the raw distribution, k the largest
        top_logprobs asked in this batch, or None when no row asks. The same log_softmax as the
        sampled token's logprob, so a sampled token listed here has the same bits."""
        k = max(r.req.params.top_logprobs for r in rows)
        if k == 0:
            return None
        lp = self.ops.log_softmax(logits)
        # a stable sort keeps equal logprobs in id order: ties go to the lowest token id
        vals, ids = torch.sort(lp.to(torch.float32), dim=-1, descending=True, stable=True)
        return ids[:, :k], vals[:, :k]
