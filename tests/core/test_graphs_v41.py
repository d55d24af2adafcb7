"""Decode graphs (core/graphs.py) on tiny-v41: the static-decode path (deepseek_v41_static.py, Engram
through `Engram.static_rows`) must give the eager bits.

As in test_graphs_v4.py the "graph" is the recorded function re-run (`ReplayByRerun`): it reads the
static buffers `DecodeGraphs` refills each step, so everything but the device recording is exercised
(buckets, padding rows, table widths, placeholder tokens in overlap mode, the model's static
metadata and its Engram rows). On top of that, replays run under a guard that fails on any host read
of a tensor in model code (`.tolist()`, `.item()`, `.cpu()`, `.numpy()`, `int()`, `bool()`, ...; the
reference ops, which are not capture-safe and not under test here, run unguarded) and record every
op call's tensor shapes, which must depend only on the (batch, width) bucket.
"""
from __future__ import annotations

import pytest
import torch
from core_helpers import PLATFORM, bits
from static_guard import ReplayByRerun, guarded, install

import shuili.core.graphs as graphs_mod
from shuili import LLM, SamplingParams
from shuili.core.graphs import DecodeGraphs

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PLATFORM != "reference", reason="the device-free capture stand-in")]


def make(graphs: bool, capture=None, **kw):
    base = dict(model="tiny-v41", platform=PLATFORM, tokens_per_block=16, max_num_seqs=8,
                max_num_batched_tokens=64, enforce_eager=not graphs)
    base.update(kw)
    llm = LLM(**base)
    eng = llm.engine
    if graphs:
        assert eng.model.supports_static_decode and eng.model.engram is not None
        install(capture, eng)  # guarded captures record every op call the static forward makes
        capture.caches = eng.runner.caches
        eng.runner.graphs = DecodeGraphs(eng.model, capture, eng.runner.groups, eng.config.max_num_seqs,
                                         -(-eng.max_model_len // eng.kv.P), eng.kv.P, eng.device)
    assert (eng.runner.graphs is not None) == graphs
    return llm


def workload():
    # lengths straddle ratio 2, the candidate block (4 entries), the window (8) and block edges
    # (16); decode crosses them too, and the batch shrinks as requests finish
    lens = [1, 2, 7, 16, 17, 33, 46]
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=100 + i, max_tokens=6 + 3 * i,
                             ignore_eos=True, logprobs=1) for i in range(len(lens))]
    return prompts, params


@pytest.fixture(scope="module")
def eager():
    prompts, params = workload()
    return [bits(o) for o in make(False).generate(prompts, params)]


def test_v41_graph_decode_matches_eager_bits(eager):
    cap = guarded()
    llm = make(True, cap)
    prompts, params = workload()
    assert [bits(o) for o in llm.generate(prompts, params)] == eager
    g = llm.engine.runner.graphs
    assert g.disabled is None
    # the batch shrinks as requests finish and tables widen as they grow: several graphs
    assert len({b for b, _ in g.graphs}) >= 3 and len({w for _, w in g.graphs}) >= 2
    assert sum(x.replays for x in g.graphs.values()) >= 20
    assert cap.captured == len(g.graphs) and not cap.guard.caught
    # Engram rows of every replayed step came through the static (mapped, device-hashed) path
    assert llm.engine.model.engram.stats["static_gathers"] >= sum(x.replays for x in g.graphs.values())
    # every replay of one graph made the same op calls with the same shapes: shapes depend on the
    # bucket only, not on positions, lengths or tables
    replayed = [s for s in cap.signatures.values() if s]
    assert len(replayed) == len(g.graphs)
    assert all(len(s) == 1 for s in replayed), [len(s) for s in replayed]
    assert any(len(next(iter(s))) > 50 for s in replayed)  # the recording saw the model's ops
    llm.engine.scheduler.check()


def test_v41_graph_decode_with_overlap_matches_eager(eager):
    cap = guarded()
    llm = make(True, cap, overlap=True)
    prompts, params = workload()
    assert [bits(o) for o in llm.generate(prompts, params)] == eager
    assert sum(x.replays for x in llm.engine.runner.graphs.graphs.values()) > 0
    assert all(len(s) <= 1 for s in cap.signatures.values()) and not cap.guard.caught
    llm.engine.scheduler.check()


def test_v41_capture_all_writes_no_cache_and_replays_match(eager):
    cap = ReplayByRerun()
    llm = make(True, cap, max_model_len=96)
    g = llm.engine.runner.graphs
    n = g.capture_all()  # every capture runs on all-padding inputs and checks nothing was written
    assert n == len(g.buckets) * len(g.widths()) == cap.captured
    prompts, params = workload()
    assert [bits(o) for o in llm.generate(prompts, params)] == eager
    assert cap.captured == n


def test_guard_catches_a_host_read():
    """Negative control of the guard: a `.tolist()` of a batch tensor in the static path is caught."""
    cap = guarded()
    llm = make(True, cap)
    import shuili.core.models.deepseek_v41_static as static

    real = static.StaticMeta.__init__

    def leaky(self, m, b):
        real(self, m, b)
        self.sl = b.seq_lens.tolist()  # what the eager _Meta does

    static.StaticMeta.__init__ = leaky
    try:
        prompts, params = workload()
        try:
            llm.generate(prompts[:2], params[:2])
        except Exception:  # noqa: BLE001 - the engine may re-raise the failed step
            pass
    finally:
        static.StaticMeta.__init__ = real
    assert cap.guard.caught and cap.guard.caught[0] == "tolist"


def test_wrong_padding_is_caught(eager, monkeypatch):
    """Negative control: padding rows that alias the first live row's slots and tables (instead of
    -1) write into its cache; the replayed tokens / logprobs must then differ from eager."""
    real = graphs_mod._fill

    def bad_fill(static, batch):
        real(static, batch)
        T = batch.num_tokens
        for dst in list(static.slot_mapping.values()) + list(static.block_tables.values()):
            dst[T:] = dst[0]
        static.positions[T:] = static.positions[0]

    monkeypatch.setattr(graphs_mod, "_fill", bad_fill)
    llm = make(True, ReplayByRerun())
    prompts, params = workload()
    got = [bits(o) for o in llm.generate(prompts, params)]
    g = llm.engine.runner.graphs
    assert any(B > 1 for B, _ in g.graphs)  # padding rows existed
    assert got != eager


def test_padding_rows_see_no_index_entry():
    """Padding rows (block tables -1) must reach `indexer_select` with no visible entry: at ratio 1
    position 0 would see one, and a kernel would read its key through block -1 (StaticMeta passes
    index_pos -1 there). Captures run on all-padding inputs, so every indexer call is checked."""
    cap = ReplayByRerun()
    llm = make(True, cap, max_model_len=64)
    m = llm.engine.model
    seen = []

    class Spy:
        def __init__(self, ops):
            self._ops = ops

        def __getattr__(self, name):
            fn = getattr(self._ops, name)
            if name != "indexer_select":
                return fn

            def call(q, w, k, bt, qsl, pos, ratio, *a, **kw):
                dead = (bt < 0).all(1)
                seen.append((ratio, int((torch.div(pos[dead] + 1, ratio, rounding_mode="floor")).max())))
                return fn(q, w, k, bt, qsl, pos, ratio, *a, **kw)
            return call

    m.ops = Spy(m.ops)
    assert llm.engine.runner.graphs.capture_all() > 0
    assert {r for r, _ in seen} == {1, 2}  # both KV-source ratios were indexed
    assert max(n for _, n in seen) == 0


def test_engine_hands_its_transfer_to_engram_so_static_decode_can_map_host_pages():
    """On an accelerator a V4.1 model with Engram captures decode graphs only if Engram can map the
    tables' host pages through the platform's transfer service; the H200 run found it never got one
    (no graphs, silently eager). A device-typed Engram with the engine's transfer is static-capable;
    without it, it is not (the negative control)."""
    llm = LLM(model="tiny-v41", enforce_eager=True)
    model, transfer = llm.engine.model, llm.engine.platform.transfer
    assert model.engram.transfer is transfer

    class Mapping:  # what an accelerator's transfer service offers
        def map_host(self, array, device):
            raise AssertionError("not called by static_capable")

    engram = model.engram
    engram.device = torch.device("meta")  # any non-CPU device: the host pages must be mapped
    engram.transfer = None
    assert not engram.static_capable and not model.supports_static_decode
    model.attach_transfer(Mapping())
    assert engram.static_capable and model.supports_static_decode
