"""The public API: `from shuili import LLM, SamplingParams, RequestOutput`.

    llm = LLM(model="tiny-v4", platform="reference", max_num_seqs=8)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.8, seed=1, max_tokens=16))

A prompt whose request is invalid (bad params, empty, too long) gets an output with
finish_reason "error" and the reason in `error`; the other prompts run normally.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from shuili.core.config import EngineConfig
from shuili.core.engine import Engine
from shuili.core.outputs import RequestOutput
from shuili.core.sampling_params import MAX_SEED, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]

Prompt = str | list[int]


def _normalize_prompts(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


class LLM:
    """model: a name / path (loaded through the registry), or a Model object, or a factory
    (ops, device, dtype, seed) -> Model. Other keyword arguments are EngineConfig fields."""

    def __init__(self, model="tiny-v4", platform="reference", config: EngineConfig | None = None,
                 **fields):
        obj = None if isinstance(model, str) else model
        name = model if isinstance(model, str) else getattr(model, "name", type(model).__name__)
        if config is None:
            config = EngineConfig(model=name, platform=platform, **fields)
        self.engine = Engine(config, model=obj)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _submit(self, prompts, params, apply_chat_template: bool, priority) -> list:
        """Queue every (prompt, sample) pair; returns, in order, a Request or an error output."""
        prompts = _normalize_prompts(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                                 "pass one, or one per prompt")
            plist = list(params)
        else:
            plist = [params] * len(prompts)
        prios = priority if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        slots = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            p = p if p is not None else SamplingParams()
            seed = p.seed
            if seed is None and p.n > 1:
                import secrets

                seed = secrets.randbits(63)
            for j in range(p.n):
                child = p if p.n == 1 else p.model_copy(update={"n": 1, "seed": (seed + j) % (MAX_SEED + 1)})
                try:
                    slots.append(self.engine.add_request(prompt, child, priority=prios[i],
                                                         apply_chat_template=apply_chat_template))
                except ValueError as exc:
                    slots.append(RequestOutput(
                        request_id=f"rejected-{i}-{j}", prompt=prompt if isinstance(prompt, str) else None,
                        prompt_token_ids=[] if isinstance(prompt, str) else list(prompt),
                        finish_reason="error", error=str(exc), finished=True, seed=child.seed))
        return slots

    def generate(self, prompts: str | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 apply_chat_template: bool = False, priority: int | Sequence[int] = 0,
                 progress=None) -> list[RequestOutput]:
        """Outputs in input order (n outputs per prompt, consecutive). `progress(num_done)` is
        called as requests finish (the CLI passes a progress bar)."""
        slots = self._submit(prompts, params, apply_chat_template, priority)
        done = 0
        while self.engine.has_unfinished():
            for req in self.engine.step_requests():
                if req.finished and progress is not None:
                    done += 1
                    progress(done)
        return [s if isinstance(s, RequestOutput) else self.engine.output(s) for s in slots]

    def stream(self, prompts: str | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
               apply_chat_template: bool = False, priority: int | Sequence[int] = 0) -> Iterator[RequestOutput]:
        """Yields a cumulative RequestOutput whenever a request gets a token or finishes
        (rejected prompts are yielded first, already finished with their error)."""
        slots = self._submit(prompts, params, apply_chat_template, priority)
        for s in slots:
            if isinstance(s, RequestOutput):
                yield s
        while self.engine.has_unfinished():
            yield from self.engine.step()

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.engine.abort(request_id)
