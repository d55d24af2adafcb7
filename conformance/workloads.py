"""Named engine workloads: a model, fixed prompts, generation lengths and two sampling modes.

Prompts are fixed text (so baselines stay valid), of mixed lengths: one shorter than a KV block,
some across several blocks and, for tiny-v4, longer than its sliding window. Fillers for the
needle check are drawn from a seed at run time (recorded in the report).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

_TEXTS = (
    "Water",
    "The river rose in the night and by morning the old stone bridge was gone.",
    "List three uses of a sluice gate: ",
    "In 1931 the floods on the Yangtze displaced millions of people; engineers afterwards argued for "
    "decades about levees, reservoirs and the diversion channels that might have spared the plain.",
    "def reservoir_volume(depth, area):\n    return",
    "Q: Why does a dam have a spillway?\nA:",
)


class Workload(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    model: str
    prompts: tuple[str, ...]
    max_tokens: int = 16
    seed: int = 1234  # sampling seed of request i in seeded mode: seed + i
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    # small knobs: scheduling that crosses block/chunk edges with few tokens
    max_num_seqs: int = 32
    num_blocks: int = 256  # KV blocks per group: ample for the batches here, cheap to allocate
    chunk_budgets: tuple[int, ...] = (7, 33)
    needle_batch_sizes: tuple[int, ...] = (3, 9, 17)
    bounded_replay: bool = False  # the model has a sliding window: run the truncated-vs-full check
    replay_prompt_tokens: int = 0  # prompt length of the bounded-replay check (> the window)
    cache_once: bool = False  # the model shares compressed KV across layers: run the cache-once check
    ppl_texts: bool = False  # also lock per-text perplexity of conformance/data/ppl_texts.jsonl


WORKLOADS: dict[str, Workload] = {
    "tiny-v4": Workload(name="tiny-v4", model="tiny-v4", prompts=_TEXTS, max_tokens=20,
                        bounded_replay=True, replay_prompt_tokens=70),
    # the CI-sized variant: same checks, two prompts, eight tokens
    "tiny-v4-quick": Workload(name="tiny-v4-quick", model="tiny-v4", prompts=(_TEXTS[0], _TEXTS[2]),
                              max_tokens=8, chunk_budgets=(11,), needle_batch_sizes=(3,),
                              bounded_replay=True, replay_prompt_tokens=40),
    # DeepSeek-V4.1: every CED layer role, Engram; the cache-once check replaces the generic replay
    "tiny-v41": Workload(name="tiny-v41", model="tiny-v41", prompts=_TEXTS, max_tokens=12, chunk_budgets=(7, 29),
                         cache_once=True, replay_prompt_tokens=40),
    "smollm2-135m": Workload(name="smollm2-135m", model="smollm2-135m", prompts=_TEXTS[:4],
                             max_tokens=16, chunk_budgets=(13,), needle_batch_sizes=(3, 9), ppl_texts=True),
}
DEFAULT_WORKLOADS = ("tiny-v4",)
MODES = ("greedy", "seeded")


def get(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; use one of {sorted(WORKLOADS)}")
    return WORKLOADS[name]
