"""The acceptance rule of shuili's speculative decoding: exact match with the target's own sample.

Sampling noise is a pure function of (seed, absolute position, token id) (hal/noise.py) and the
target's logits at a position do not depend on how the step was chunked, so the token the target
samples at a verified position is the token plain decoding would sample there. A draft is kept iff
it equals that token; at the first mismatch the target's token is emitted instead. Every token id
and logprob bit is then the one plain decoding gives, for any temperature, seed or penalty.
(vLLM's rejection sampler keeps the target's distribution, not its samples.)
"""
from __future__ import annotations


def num_accepted(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's samples. targets[j] is the target's token at
    the position of drafts[j] (targets has len(drafts) + 1 entries: the last is the bonus token)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n
