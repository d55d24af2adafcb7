"""The public API, shaped as vLLM's: `from shuili import LLM, SamplingParams, RequestOutput`.

    llm = LLM()                                   # the CLI's default model (SmolLM2-135M-Instruct)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.8, seed=1, max_tokens=16, n=2))
    outs[0].outputs[1].text                       # one RequestOutput per prompt, n completions each
    llm.chat([{"role": "user", "content": "Hi"}]) # the model's chat template, as `shuili generate`

A prompt whose request is invalid (bad token ids, empty, too long) gets completions with
finish_reason "error" and the reason in `error`; the other prompts run normally. A prompt of the
wrong type raises TypeError naming its index.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from shuili.core.config import EngineConfig
from shuili.core.engine import Engine
from shuili.core.outputs import CompletionOutput, RequestOutput
from shuili.core.request import Request
from shuili.core.sampling_params import MAX_SEED, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig",
           "apply_chat_template"]

Prompt = str | list[int]
Message = dict[str, str]


def _is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _one_prompt(p, i: int) -> Prompt:
    if isinstance(p, dict):  # vLLM's TextPrompt / TokensPrompt
        p = p.get("prompt", p.get("prompt_token_ids"))
    if isinstance(p, str):
        return p
    if _is_token_ids(p):
        return list(p)
    kind = type(p).__name__
    if isinstance(p, (list, tuple)):
        bad = next(t for t in p if not isinstance(t, int) or isinstance(t, bool))
        kind = f"a {kind} containing {type(bad).__name__} {repr(bad)[:40]}"
    raise TypeError(f"prompts[{i}] is {kind}; each prompt must be a str, a list of int token ids, "
                    "or a dict with 'prompt' or 'prompt_token_ids'")


def _normalize_prompts(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)) or (_is_token_ids(prompts) and prompts):
        return [_one_prompt(prompts, 0)]  # a single prompt
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts is a {type(prompts).__name__}; pass a str, a list of token ids, "
                        "or a list of those")
    return [_one_prompt(p, i) for i, p in enumerate(prompts)]


def apply_chat_template(model, messages: str | list[Message]) -> str:
    """Render one conversation (a str is one user message) with the model's chat template."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    render = getattr(model.tokenizer, "apply_chat_template", None)
    if render is not None:
        return render(messages)
    if len(messages) == 1 and messages[0].get("role") == "user":
        return model.apply_chat_template(messages[0]["content"])
    raise ValueError(f"model {getattr(model, 'name', type(model).__name__)} renders single user "
                     "messages only; pass one {'role': 'user', 'content': ...} message")


def _conversations(messages) -> list[list[Message]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("messages must be a list of {'role', 'content'} dicts, or a list of such lists")
    convs = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conv in enumerate(convs):
        if not isinstance(conv, (list, tuple)) or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in conv):
            raise TypeError(f"conversation {i} must be a list of {{'role': ..., 'content': str}} dicts")
    return convs


def _rejected(prompt: Prompt, i: int, j: int, seed: int | None, exc: ValueError) -> RequestOutput:
    done = CompletionOutput(index=j, finish_reason="error", error=str(exc), seed=seed)
    return RequestOutput(request_id=f"rejected-{i}-{j}", prompt=prompt if isinstance(prompt, str) else None,
                         prompt_token_ids=[] if isinstance(prompt, str) else list(prompt),
                         outputs=[done], finished=True)


def _group(parts: list[RequestOutput]) -> RequestOutput:
    """The n per-sample outputs of one prompt as one RequestOutput (completion j = sample j)."""
    first = parts[0]
    outs = [p.outputs[0].model_copy(update={"index": j}) for j, p in enumerate(parts)]
    return first.model_copy(update={"outputs": outs, "finished": all(p.finished for p in parts)})


class LLM:
    """model: a name / path (loaded through the registry), or a Model object, or a factory
    (ops, device, dtype, seed) -> Model. Other keyword arguments are EngineConfig fields; unset
    ones take EngineConfig's defaults, which are also the CLI's (model smollm2-135m)."""

    def __init__(self, model: str | object | None = None, platform=None,
                 config: EngineConfig | None = None, **fields):
        obj = None if model is None or isinstance(model, str) else model
        if obj is not None:
            fields["model"] = getattr(obj, "name", type(obj).__name__)
        elif model is not None:
            fields["model"] = model
        if platform is not None:
            fields["platform"] = platform
        if config is None:
            config = EngineConfig(**fields)
        from shuili.core.parallel import engine_class

        self.engine = engine_class(config)(config, model=obj)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _submit(self, prompts, params, apply_chat_template: bool, priority) -> list[list]:
        """Queue every (prompt, sample) pair; per prompt, its samples' Requests or error outputs."""
        prompts = _normalize_prompts(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                                 "pass one, or one per prompt")
            plist = list(params)
        else:
            plist = [params] * len(prompts)
        for i, p in enumerate(plist):
            if p is not None and not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] is a {type(p).__name__}; pass SamplingParams(...)")
        prios = priority if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        return [self._expand(i, prompt, p if p is not None else SamplingParams(), prios[i], apply_chat_template)
                for i, (prompt, p) in enumerate(zip(prompts, plist))]

    def _expand(self, i: int, prompt: Prompt, p: SamplingParams, priority: int, chat: bool) -> list:
        """Prompt i's n samples (seeds seed, seed+1, ...) as queued Requests or rejected outputs."""
        seed = p.seed
        if seed is None and p.n > 1:
            import secrets

            seed = secrets.randbits(63)
        slots = []
        for j in range(p.n):
            child = p if p.n == 1 else p.model_copy(update={"n": 1, "seed": (seed + j) % (MAX_SEED + 1)})
            try:
                slots.append(self.engine.add_request(prompt, child, priority=priority, apply_chat_template=chat))
            except ValueError as exc:
                slots.append(_rejected(prompt, i, j, child.seed, exc))
        return slots

    def _output(self, slot) -> RequestOutput:
        return slot if isinstance(slot, RequestOutput) else self.engine.output(slot)

    def generate(self, prompts: str | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 apply_chat_template: bool = False, priority: int | Sequence[int] = 0,
                 progress=None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order, its n completions in `.outputs`.
        `progress(num_done)` is called as samples finish (the CLI passes a progress bar)."""
        groups = self._submit(prompts, params, apply_chat_template, priority)
        done = 0
        while self.engine.has_unfinished():
            for req in self.engine.step_requests():
                if req.finished and progress is not None:
                    done += 1
                    progress(done)
        return [_group([self._output(s) for s in slots]) for slots in groups]

    def chat(self, messages: list[Message] | list[list[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'} dicts) or a list of them, rendered with
        the model's chat template; one RequestOutput per conversation."""
        prompts = [apply_chat_template(self.engine.model, conv) for conv in _conversations(messages)]
        return self.generate(prompts, params, priority=priority)

    def stream(self, prompts: str | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
               apply_chat_template: bool = False, priority: int | Sequence[int] = 0) -> Iterator[RequestOutput]:
        """Yields a prompt's cumulative RequestOutput, all n completions in `.outputs` as in
        `generate`, whenever one of its samples gets a token or finishes; `.finished` once all
        have. Rejected prompts are yielded first, already finished with their error."""
        groups = self._submit(prompts, params, apply_chat_template, priority)
        owner = {s.request_id: g for g, slots in enumerate(groups) for s in slots if isinstance(s, Request)}
        for slots in groups:
            if not any(isinstance(s, Request) for s in slots):
                yield _group(slots)
        while self.engine.has_unfinished():
            touched = sorted({owner[r.request_id] for r in self.engine.step_requests() if r.request_id in owner})
            for g in touched:
                yield _group([self._output(s) for s in groups[g]])

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.engine.abort(request_id)
