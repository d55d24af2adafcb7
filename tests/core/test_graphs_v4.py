"""Decode graphs (core/graphs.py) on tiny-v4: the static-decode path must give the eager bits.

Without a device the "graph" is the recorded function itself: `replay` re-runs `fn`, which reads
the static buffers `DecodeGraphs` refills each step, so everything but the device recording is
exercised (bucket choice, padding rows, block-table widths, placeholder tokens in overlap mode, the
model's static-decode metadata). On CUDA (SHUILI_TEST_PLATFORM=nvidia) the platform's own capture
is used instead.
"""
from __future__ import annotations

import pytest
from core_helpers import PLATFORM, bits
from static_guard import ReplayByRerun

from shuili import LLM, SamplingParams
from shuili.core.graphs import BATCH_BUCKETS, DecodeGraphs, batch_bucket, width_bucket

pytestmark = pytest.mark.slow


def make(graphs: bool, capture=None, **kw):
    base = dict(model="tiny-v4", platform=PLATFORM, tokens_per_block=16, max_num_seqs=8,
                max_num_batched_tokens=64, enforce_eager=not graphs)
    base.update(kw)
    llm = LLM(**base)
    eng = llm.engine
    if graphs and PLATFORM == "reference":
        capture.caches = eng.runner.caches
        eng.runner.graphs = DecodeGraphs(eng.model, capture, eng.runner.groups, eng.config.max_num_seqs,
                                         -(-eng.max_model_len // eng.kv.P), eng.kv.P, eng.device)
    assert (eng.runner.graphs is not None) == graphs
    return llm


def workload():
    # lengths straddle the CSA ratio (4), the HCA ratio (16) and block edges; decode crosses them too
    lens = [1, 3, 15, 16, 17, 33, 47]
    prompts = [[(7 * i + 3 * j) % 1000 + 2 for j in range(n)] for i, n in enumerate(lens)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=100 + i, max_tokens=6 + 3 * i,
                             ignore_eos=True, logprobs=1) for i in range(len(lens))]
    return prompts, params


@pytest.fixture(scope="module")
def eager():
    prompts, params = workload()
    return [bits(o) for o in make(False).generate(prompts, params)]


def test_graph_decode_matches_eager_bits(eager):
    cap = ReplayByRerun()
    llm = make(True, cap)
    prompts, params = workload()
    assert [bits(o) for o in llm.generate(prompts, params)] == eager
    g = llm.engine.runner.graphs
    assert g.disabled is None
    # the batch shrinks as requests finish and tables widen as they grow: several graphs
    assert len({b for b, _ in g.graphs}) >= 3 and len({w for _, w in g.graphs}) >= 2
    assert sum(x.replays for x in g.graphs.values()) >= 20
    if PLATFORM == "reference":
        assert cap.captured == len(g.graphs)
    llm.engine.scheduler.check()


def test_graph_decode_with_overlap_matches_eager(eager):
    llm = make(True, ReplayByRerun(), overlap=True)
    prompts, params = workload()
    assert [bits(o) for o in llm.generate(prompts, params)] == eager
    assert sum(x.replays for x in llm.engine.runner.graphs.graphs.values()) > 0


@pytest.mark.skipif(PLATFORM != "reference", reason="the failing capture is the device-free stand-in")
def test_failed_capture_falls_back_to_eager(eager, caplog):
    llm = make(True, ReplayByRerun(fail=True))
    prompts, params = workload()
    with caplog.at_level("WARNING", logger="shuili.graphs"):
        assert [bits(o) for o in llm.generate(prompts, params)] == eager
    g = llm.engine.runner.graphs
    assert "stream is capturing" in g.disabled and not g.graphs
    assert "decode runs eagerly" in caplog.text


def test_buckets():
    assert batch_bucket(1) == 1 and batch_bucket(33) == 48 and batch_bucket(BATCH_BUCKETS[-1] + 1) is None
    assert [width_bucket(n, 64) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 64]
    assert width_bucket(9, 12) == 12


@pytest.mark.skipif(PLATFORM != "reference", reason="the device-free capture stand-in")
def test_capture_all_records_every_bucket_and_serving_captures_none(eager):
    cap = ReplayByRerun()
    llm = make(True, cap)
    g = llm.engine.runner.graphs
    mw = g.max_width
    assert g.widths() == tuple(min(1 << i, mw) for i in range(mw.bit_length() + 1) if (1 << i) < 2 * mw)
    assert g.widths()[-1] == mw and len(set(g.widths())) == len(g.widths())
    n = g.capture_all()
    assert n == len(g.buckets) * len(g.widths()) == cap.captured == len(g.graphs)
    assert set(g.graphs) == {(b, w) for b in g.buckets for w in g.widths()}
    assert g.capture_all() == 0  # nothing left to record
    prompts, params = workload()
    assert [bits(o) for o in llm.generate(prompts, params)] == eager
    assert cap.captured == n and sum(x.replays for x in g.graphs.values()) >= 20


@pytest.mark.skipif(PLATFORM != "reference", reason="the device-free capture stand-in")
@pytest.mark.parametrize("when", ["startup", "lazy"])
def test_engine_records_graphs_at_startup_unless_lazy(monkeypatch, when):
    import dataclasses

    import shuili.core.engine as engine_mod

    cap = ReplayByRerun()
    cap.caches = {}  # the engine's caches exist only once it is built; padding writes are checked above
    real = engine_mod.resolve_platform
    monkeypatch.setattr(engine_mod, "resolve_platform",
                        lambda cfg: dataclasses.replace(real(cfg), capture_graph=cap))
    llm = LLM(model="tiny-v4", platform=PLATFORM, tokens_per_block=16, max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=64, graph_capture=when)
    g = llm.engine.runner.graphs
    assert g is not None
    want = len(g.buckets) * len(g.widths()) if when == "startup" else 0
    assert len(g.graphs) == cap.captured == want


@pytest.mark.skipif(PLATFORM != "reference", reason="the device-free capture stand-in")
def test_static_decode_reads_nothing_back_and_shapes_follow_the_bucket(eager):
    """Replays under the host-read guard (tests/core/static_guard.py): no tensor is read back in
    model code, and each graph's op calls have one shape signature, whatever the step's values."""
    from static_guard import guarded, install

    cap = guarded()
    llm = make(True, cap)
    install(cap, llm.engine)
    prompts, params = workload()
    assert [bits(o) for o in llm.generate(prompts, params)] == eager
    assert not cap.guard.caught
    replayed = [s for s in cap.signatures.values() if s]
    assert len(replayed) == len(llm.engine.runner.graphs.graphs) >= 3
    assert all(len(s) == 1 for s in replayed)
