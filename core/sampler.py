"""Sampler: penalties, min-tokens masking, seeded sampling and logprobs, all through HAL ops.

It sees tensors only (`SamplingBatch`, built by the runner, like vLLM's SamplingMetadata): per-row
inputs (seed, absolute position, the row's own token counts), so a row's result cannot depend on
its batch. Logprobs are of the raw model distribution (before temperature, penalties and
filtering), float32. A row whose logits hold NaN (or are all -inf) is sampled from zeros and
flagged `bad`; the scheduler finishes that request with an error.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Penalties:
    repetition: torch.Tensor  # float32 [S]
    presence: torch.Tensor  # float32 [S]
    frequency: torch.Tensor  # float32 [S]
    output_rows: torch.Tensor  # int64 [K]: row of each generated token (in-flight ones included)
    output_ids: torch.Tensor  # int64 [K]: the token
    prompt_rows: torch.Tensor  # int64 [M]: row of each prompt token
    prompt_ids: torch.Tensor  # int64 [M]


@dataclass
class SamplingBatch:
    """One step's sampling inputs for S rows, on the device; the two flags are host facts."""
    temperature: torch.Tensor  # float32 [S], 0 = greedy
    top_k: torch.Tensor  # int32 [S]
    top_p: torch.Tensor  # float32 [S]
    min_p: torch.Tensor  # float32 [S]
    seeds: torch.Tensor  # int64 [S]
    positions: torch.Tensor  # int64 [S]: absolute position of the token being sampled
    all_greedy: bool
    any_filter: bool
    penalties: Penalties | None = None  # None: no row has a penalty
    banned_rows: torch.Tensor | None = None  # int64 [N]: (row, id) pairs masked to -inf, the stop
    banned_ids: torch.Tensor | None = None  # tokens of rows still under min_tokens; None: no row is


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # int64 [S]
    logprobs: torch.Tensor  # float32 [S]
    bad: torch.Tensor  # bool [S]: the row's logits held NaN (or were all -inf)


class Sampler:
    def __init__(self, ops, vocab_size: int):
        self.ops = ops
        self.V = vocab_size

    def _penalize(self, logits: torch.Tensor, p: Penalties) -> torch.Tensor:
        S, V, dev = logits.shape[0], self.V, logits.device
        counts = torch.zeros(S, V, dtype=torch.int32, device=dev)
        ones = torch.ones(p.output_ids.shape, dtype=torch.int32, device=dev)
        counts.index_put_((p.output_rows, p.output_ids), ones, accumulate=True)
        prompt_mask = torch.zeros(S, V, dtype=torch.bool, device=dev)
        prompt_mask[p.prompt_rows, p.prompt_ids] = True
        return self.ops.apply_penalties(logits, counts, prompt_mask, p.repetition, p.presence, p.frequency)

    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
        """logits float32 [S, V] -> tokens, logprobs and bad flags of the S rows."""
        # the row max is NaN exactly when the row holds one, and -inf when every entry is: one
        # reduction instead of two boolean passes over [S, V]
        m = logits.amax(dim=-1)
        bad = torch.isnan(m) | (m == float("-inf"))
        # a host read is free on the CPU; on an accelerator it would sync the step, so there the
        # rows are always selected
        if logits.device.type != "cpu" or bool(bad.any()):
            logits = torch.where(bad[:, None], torch.zeros((), dtype=logits.dtype, device=logits.device), logits)
        raw_lp = self.ops.log_softmax(logits)
        proc = logits.to(torch.float32)
        if b.banned_rows is not None or b.penalties is not None:  # changed below: not the caller's rows
            proc = proc.clone()
        if b.banned_rows is not None:
            proc[b.banned_rows, b.banned_ids] = float("-inf")
        if b.penalties is not None:
            proc = self._penalize(proc, b.penalties)
        # the hints are known on the host, so the op need not read its tensors back (a sync)
        tokens = self.ops.sample(proc, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.positions,
                                 all_greedy=b.all_greedy, any_filter=b.any_filter)
        return SamplerOutput(tokens, raw_lp.gather(1, tokens[:, None])[:, 0], bad)

    def top_logprobs(self, logits: torch.Tensor, k: int):
        """(ids int64 [S, k], logprobs float32 [S, k]) of the raw distribution, or None for k = 0.
        The same log_softmax as the sampled token's logprob, so a sampled token listed here has
        the same bits."""
        if k == 0:
            return None
        lp = self.ops.log_softmax(logits)
        # a stable sort keeps equal logprobs in id order: ties go to the lowest token id
        vals, ids = torch.sort(lp.to(torch.float32), dim=-1, descending=True, stable=True)
        return ids[:, :k], vals[:, :k]
