"""Engram rows through the engine: a toy model that writes each token's gathered Engram rows into its
hidden state gives the same bits whatever the chunking, prefix-cache state, preemption or overlap
mode, because the runner rebuilds every token's look-back from the request's tokens. The negative
control drops the look-back at chunk starts (state lost between chunks) and must be caught."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from core_helpers import PLATFORM, bits, workload
from core_toy_model import ToyModel

from shuili import LLM
from shuili.core.models.engram import Engram, EngramTable
from shuili.core.models.engram_hash import EngramSpec
from shuili.hal import Weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_engram import write_safetensors  # noqa: E402

SPEC = EngramSpec.model_construct(layer_ids=(0, 1), max_ngram_size=4, n_heads=2, head_dim=32, vocab_size=50,
                                  pad_id=2, compressed_vocab_size=64, num_embeddings=(0, 0))
SPEC = EngramSpec(**{k: getattr(SPEC, k) for k in EngramSpec.model_fields} | {"num_embeddings": tuple(SPEC.table_rows)})
PROMPTS, PARAMS = workload(12, seed=3)


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    rng = np.random.default_rng(5)
    tensors = {}
    for lid, n in zip(SPEC.layer_ids, SPEC.num_embeddings):
        vals = torch.from_numpy(rng.standard_normal((n, 32)).astype(np.float32)).to(torch.float8_e4m3fn)
        tensors[f"e.{lid}.w"] = ("F8_E4M3", [n, 32], vals.view(torch.uint8).numpy().tobytes())
        tensors[f"e.{lid}.s"] = ("F8_E8M0", [n, 1], rng.integers(124, 129, (n, 1)).astype(np.uint8).tobytes())
    path = tmp_path_factory.mktemp("engram") / "tables.safetensors"
    write_safetensors(path, tensors)
    return str(path)


class _LosesHistory(Engram):
    """Negative control: the look-back stops at each chunk's first token (state not carried over)."""

    def step(self, batch):
        lb, qsl = self.spec.lookback, batch.query_start_loc_cpu
        hist = list(batch.engram_history_cpu)
        for a, b in zip(qsl[:-1], qsl[1:]):
            for j in range(b - a):
                for k in range(j, lb):  # slot k is position p - k - 1: before the chunk when k >= j
                    hist[(a + j) * lb + k] = -1
        batch.engram_history_cpu = hist
        batch.engram_history = torch.tensor(hist, device=batch.input_ids.device).view(-1, lb)
        return super().step(batch)


class EngramToy(ToyModel):
    def __init__(self, ops, device, dtype, seed, path: str, cls=Engram):
        super().__init__(ops, device, dtype, seed)
        tables = {lid: EngramTable.from_safetensors(path, f"e.{lid}.w", f"e.{lid}.s") for lid in SPEC.layer_ids}
        tmap = torch.randint(0, 64, (self.vocab_size,), generator=torch.Generator().manual_seed(9))
        self.engram = cls(SPEC, tmap, tables, ops, device=device)
        self.engram_lookback = SPEC.lookback
        g = torch.Generator().manual_seed(seed + 1)
        self.we = [Weight.dense((torch.rand(32, SPEC.n_cols * 32, generator=g) - 0.5).to(device))
                   for _ in SPEC.layer_ids]

    def engram_prefetch(self, ids, history):
        self.engram.prefetch(ids, history)

    def forward(self, batch):
        ops = self.ops
        rows = self.engram.step(batch)
        x = ops.embedding(batch.input_ids, self.embed)
        for i, L in enumerate(self.layers):
            x = x + ops.linear(rows.get(i), self.we[i])  # the Engram write, before the layer
            x = x + self._attention(i, ops.rms_norm(x, L["norm1"], 1e-6), batch)
            m = ops.swiglu(ops.linear(ops.rms_norm(x, L["norm2"], 1e-6), L["w13"]))
            x = x + ops.linear(m, L["w2"])
        x = ops.rms_norm(x[batch.logits_indices], self.final_norm, 1e-6)
        return ops.linear(x, self.lm_head)


def llm_for(path: str, cls=Engram, **kw) -> LLM:
    def make(ops, device, dtype, seed):
        return EngramToy(ops, device, dtype, seed, path, cls)

    make.name = "engram-toy"
    args = dict(tokens_per_block=4, num_blocks=256, max_num_batched_tokens=64, max_num_seqs=32)
    args.update(kw)
    return LLM(model=make, platform=PLATFORM, **args)


def run(llm: LLM, idx) -> list:
    outs = llm.generate([PROMPTS[i] for i in idx], [PARAMS[i] for i in idx])
    llm.engine.scheduler.check()
    return [bits(o) for o in outs]


@pytest.fixture(scope="module")
def solo(table_file):
    llm = llm_for(table_file, enable_prefix_caching=False)
    return [run(llm, [i])[0] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=3), dict(max_num_batched_tokens=7),
                                dict(overlap=True, max_num_batched_tokens=5), dict(overlap=True)],
                         ids=["budget3", "budget7", "overlap-budget5", "overlap"])
def test_engram_rows_do_not_depend_on_chunking_or_overlap(table_file, solo, kw):
    llm = llm_for(table_file, **kw)
    assert run(llm, range(len(PROMPTS))) == solo
    st = llm.engine.runner.model.engram.stats
    if kw.get("overlap"):
        assert st["device_gathers"] > 0  # decode steps with placeholders hashed on the device
    if kw.get("max_num_batched_tokens") == 3:
        assert st["prefetch_hits"] > 0  # the runner's next-chunk prefetch was used


def test_engram_rows_with_prefix_cache_and_preemption(table_file, solo):
    llm = llm_for(table_file, num_blocks=14, max_num_batched_tokens=16)
    cold = run(llm, range(len(PROMPTS)))
    hot = run(llm, range(len(PROMPTS)))
    assert cold == solo and hot == solo
    eng = llm_for(table_file).engine
    reqs = [eng.add_request(PROMPTS[i], PARAMS[i]) for i in range(len(PROMPTS))]
    step = 0
    while eng.has_unfinished():
        eng.step()
        step += 1
        if step in (2, 4, 5):
            for r in list(eng.scheduler.running)[::2]:
                eng.scheduler.preempt(r.request_id)
    assert sum(r.num_preemptions for r in reqs) >= 3
    assert [bits(eng.output(r)) for r in reqs] == solo


def test_negative_control_lost_history_is_caught(table_file):
    solo_bad = [run(llm_for(table_file, _LosesHistory, enable_prefix_caching=False), [i])[0]
                for i in range(4)]
    chunked = run(llm_for(table_file, _LosesHistory, max_num_batched_tokens=3), range(4))
    assert chunked != solo_bad
