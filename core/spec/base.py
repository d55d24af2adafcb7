"""The drafter interface and the factory that picks one for a model.

A drafter proposes provisional tokens; the engine verifies them by exact match (verify.py), so a
drafter can only change how many steps a request takes, never a token or a logprob bit.
Two places a drafter can work, chosen by where its data is:
  host   (`on_device = False`): `propose` runs before each schedule and sets
         `req.draft_token_ids` of the requests it picks (ngram: the request's own tokens); in
         overlap mode it drafts past a token still in flight (see `draftable`).
  device (`on_device = True`): `draft` runs inside the runner right after the target step's
         sampling, reads the step's hidden states, sampled tokens and acceptance on the device,
         and returns the next step's drafts [C, k] (-1 padded, per sampling chunk); they come back
         with the step's results and `Scheduler.update` installs them (mtp, and dspark later).
Either way the per-request lengths are chosen where the data is (match length on the host,
confidence on the device) under one budget, `num_speculative_tokens` per step in total; a
request expected to gain nothing gets no drafts.
"""
from __future__ import annotations

from typing import ClassVar

from shuili.core.request import Request, Status
from shuili.core.spec.config import METHODS, SpeculativeConfig


class Drafter:
    name: ClassVar[str] = ""
    on_device: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False  # the runner keeps the target's hidden states for `draft`

    def __init__(self, config: SpeculativeConfig, model, max_model_len: int):
        self.config = config
        self.model = model
        self.max_model_len = max_model_len

    @classmethod
    def unsupported(cls, model) -> str | None:
        """Why this drafter cannot serve `model` (None: it can)."""
        return None

    def propose(self, requests: list[Request]) -> None:
        """Host drafters: set draft_token_ids of the requests worth drafting (all are draftable)."""

    def draft(self, runner, out, step, res):
        """Device drafters: int64 [C, k] next drafts per sampling chunk of `out`, -1 padded."""
        raise NotImplementedError


def draftable(req: Request, max_model_len: int) -> bool:
    """A decoding request (only its last token is uncomputed) that may grow by two or more. In
    overlap mode that last token may still be in flight (one placeholder): drafts then follow it,
    and a host drafter guesses it (ngram: the match's first token) without waiting for it."""
    return (req.status is Status.RUNNING and not req.verifying and req.num_placeholders <= 1
            and req.num_computed_tokens == req.num_tokens - 1
            and req.num_tokens + 1 < req.token_limit(max_model_len))


def drafter_classes() -> dict[str, type[Drafter]]:
    from shuili.core.spec.dspark import DSparkDrafter
    from shuili.core.spec.mtp import MtpDrafter
    from shuili.core.spec.ngram import NgramDrafter

    return {c.name: c for c in (NgramDrafter, MtpDrafter, DSparkDrafter)}


def make_drafter(config: SpeculativeConfig, model, max_model_len: int) -> Drafter:
    classes = drafter_classes()
    assert tuple(classes) == METHODS
    cls = classes[config.method]
    why = cls.unsupported(model)
    if why is not None:
        fit = [n for n, c in classes.items() if c.unsupported(model) is None]
        raise ValueError(f"speculative method {config.method!r} cannot serve this model: {why}. Methods "
                         f"that fit it: {', '.join(fit) or 'none'} (--speculative-method)")
    return cls(config, model, max_model_len)
