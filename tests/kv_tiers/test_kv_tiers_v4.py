"""KV tiers end to end on tiny-v4 (sliding window, compressed, indexer and compressor-state groups):
a host hit, a disk hit in a new process and a full recompute give the same bits; damaged files
are detected and recomputed; integrity holds after every step under eviction churn."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiers_helpers import bits, cold, in_new_process, params, prompts

from shuili import LLM, SamplingParams
from shuili.core.kv_cache import ROOT_HASH, chain_hash

MODEL = "tiny-v4"
VOCAB = 1000


@pytest.fixture(scope="module")
def case():
    ps = prompts(VOCAB, 70, 2, seed=1)
    pars = params(len(ps))
    return ps, pars, cold(MODEL, ps, pars, max_num_seqs=4)


def tiered(store: Path | None, **kw) -> LLM:
    kw.setdefault("kv_host_bytes", "64M")
    kw.setdefault("max_num_seqs", 4)
    return LLM(model=MODEL, platform="reference", kv_store=str(store) if store else None, **kw)


def run(llm: LLM, ps, pars) -> list:
    outs = llm.generate(ps, [SamplingParams(**q) for q in pars])
    llm.engine.scheduler.check()
    return [bits(o) for o in outs]


def hashes(tokens: list[int], n: int, P: int = 16) -> list[bytes]:
    hs, h = [], ROOT_HASH
    for i in range(n):
        h = chain_hash(h, tokens[i * P:(i + 1) * P])
        hs.append(h)
    return hs


def test_the_model_has_every_kind_of_group():
    kinds = {(g.kind, g.name) for g in tiered(None).engine.kv.groups}
    assert {k for k, _ in kinds} == {"sliding", "compressed"} and len(kinds) == 6


def test_host_hit_disk_hit_in_a_new_process_and_recompute_are_bit_identical(tmp_path, case):
    ps, pars, want = case
    llm = tiered(tmp_path / "store")
    assert run(llm, ps, pars) == want
    t = llm.engine.kv_tiers
    assert t.hit_tokens["host"] == 0 and t.evict_device_cache(llm.engine.kv) > 0
    assert run(llm, ps, pars) == want
    # the first prompt's prefix comes from the host; the second may find part of it back on the device
    assert t.hit_tokens["host"] >= 64 and sum(t.hit_tokens.values()) == llm.engine.kv.num_hit_tokens
    assert t.loaded_blocks["host"] > 0 and t.hit_tokens["disk"] == 0
    llm.engine.kv_tiers.flush()
    child = in_new_process(MODEL, ps, pars, {"max_num_seqs": 4, "kv_store": str(tmp_path / "store")})
    assert child["bits"] == want
    assert child["stats"]["kv_hit_tokens_disk"] >= 64 and child["stats"]["kv_store_hits"] >= 4
    assert child["stats"]["kv_store_writes"] == 0  # every block it computed is in the store already


def test_a_wrong_loaded_bit_changes_the_answer(tmp_path, case):
    """Negative control: the comparison above can fail. Loads that land one value off must show."""
    ps, pars, want = case
    llm = tiered(None)
    run(llm, ps[:1], pars[:1])
    llm.engine.kv_tiers.evict_device_cache(llm.engine.kv)
    mover = llm.engine.kv_tiers.mover
    load = mover.to_device

    def off_by_a_bit(group, block, host):
        host = host.clone()
        if host.dtype == torch.float32:
            host.view(torch.int32)[..., 0] ^= 1 << 20
        load(group, block, host)

    mover.to_device = off_by_a_bit
    assert run(llm, ps[:1], pars[:1]) != want[:1]


def test_damaged_files_are_recomputed_bit_identically(tmp_path, case):
    ps, pars, want = case
    store = tmp_path / "store"
    writer = tiered(store, kv_host_bytes=0)
    run(writer, ps[:1], pars[:1])
    writer.engine.kv_tiers.flush()
    t = writer.engine.kv_tiers
    keys = [t.key(h) for h in hashes(ps[0], 4)]
    paths = [Path(t.store.path(k)) for k in keys]
    assert all(p.exists() for p in paths)
    raw = bytearray(paths[2].read_bytes())
    raw[-7] ^= 0x01  # one bit of block 2's payload
    paths[2].write_bytes(bytes(raw))
    paths[3].write_bytes(paths[3].read_bytes()[:1000])  # block 3 cut short
    reader = tiered(store, kv_host_bytes=0)
    assert run(reader, ps[:1], pars[:1]) == want[:1]
    s = reader.engine.kv_tiers.stats()
    assert s["kv_store_rejected_corrupt"] == 1 and s["kv_store_rejected_truncated"] == 1
    assert s["kv_hit_tokens_disk"] == 32  # blocks 0 and 1 only
    reader.engine.kv_tiers.flush()
    assert paths[2].exists() and paths[3].stat().st_size > 1000
    again = tiered(store, kv_host_bytes=0)
    assert run(again, ps[:1], pars[:1]) == want[:1]
    assert again.engine.kv_tiers.hit_tokens["disk"] == 64


def flip_in_section(path: Path, group: str) -> None:
    """One bit inside `group`'s section of a store file."""
    from shuili.core.kv_tiers.block_file import read_header

    raw = bytearray(path.read_bytes())
    meta, at = read_header(bytes(raw))
    _, _, _, off, n, _ = next(s for s in meta["sections"] if s[0] == group)
    raw[at + off + n // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_damaged_section_counts_only_where_a_hit_reads_it(tmp_path, case):
    """Block 1's window KV is damaged. A hit of the whole prompt reads block 1's full / compressed
    sections only (its sliding ones lie before the last window): it is served whole, the file kept.
    A prompt that shares only blocks 0 and 1 needs block 1's window: the file is rejected and
    deleted, block 1 recomputed (and written again), the answer still the recompute's bits."""
    ps, pars, want = case
    store = tmp_path / "store"
    writer = tiered(store, kv_host_bytes=0)
    run(writer, ps[:1], pars[:1])
    writer.engine.kv_tiers.flush()
    t = writer.engine.kv_tiers
    path = Path(t.store.path(t.key(hashes(ps[0], 2)[1])))
    flip_in_section(path, "swa_kv")
    whole = tiered(store, kv_host_bytes=0)
    assert run(whole, ps[:1], pars[:1]) == want[:1]
    s = whole.engine.kv_tiers.stats()
    assert s["kv_store_rejected_corrupt"] == 0 and s["kv_hit_tokens_disk"] == (len(ps[0]) - 1) // 16 * 16
    assert s["kv_store_bytes_read"] < sum(p.stat().st_size for p in store.rglob("*.kv2")) // 2
    assert path.exists()
    short = ps[0][:40]  # blocks 0 and 1 of the same prefix, then the hit ends: block 1's window is read
    short_want = cold(MODEL, [short], pars[:1], max_num_seqs=4)
    reader = tiered(store, kv_host_bytes=0)
    assert run(reader, [short], pars[:1]) == short_want
    s = reader.engine.kv_tiers.stats()
    assert s["kv_store_rejected_corrupt"] == 1 and s["kv_hit_tokens_disk"] == 16
    reader.engine.kv_tiers.flush()  # block 1 was recomputed and written through again, whole
    rt = reader.engine.kv_tiers
    assert rt.store.get(rt.key(hashes(ps[0], 2)[1]), rt.expect) is not None


def test_truncated_file_alone(tmp_path, case):
    ps, pars, want = case
    store = tmp_path / "store"
    writer = tiered(store, kv_host_bytes=0)
    run(writer, ps[:1], pars[:1])
    writer.engine.kv_tiers.flush()
    path = Path(writer.engine.kv_tiers.store.path(writer.engine.kv_tiers.key(hashes(ps[0], 1)[0])))
    path.write_bytes(path.read_bytes()[:-1])
    reader = tiered(store, kv_host_bytes=0)
    assert run(reader, ps[:1], pars[:1]) == want[:1]
    s = reader.engine.kv_tiers.stats()
    assert s["kv_store_rejected_truncated"] == 1 and s["kv_hit_tokens_disk"] == 0


def test_missing_store_directory_degrades_to_recompute(tmp_path, case):
    ps, pars, want = case
    (tmp_path / "f").write_text("not a directory")
    llm = tiered(tmp_path / "f" / "store", kv_host_bytes=0)
    assert run(llm, ps, pars) == want
    assert llm.engine.kv_tiers.stats()["kv_store_writes"] == 0


def test_another_fingerprint_never_hits(tmp_path, case):
    ps, pars, _ = case
    store = tmp_path / "store"
    run(tiered(store, kv_host_bytes=0, seed=0), ps[:1], pars[:1])
    other = tiered(store, kv_host_bytes=0, seed=1)  # other synthetic weights: other bits
    want_other = cold(MODEL, ps[:1], pars[:1], max_num_seqs=4, seed=1)
    assert run(other, ps[:1], pars[:1]) == want_other
    assert other.engine.kv_tiers.hit_tokens["disk"] == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_integrity_after_every_step_under_churn(tmp_path, overlap):
    """A small device pool and host budget: blocks go down and come back all the time. Every
    step keeps the manager's invariants; every answer equals its solo recompute; nothing leaks."""
    ps = prompts(VOCAB, 40, 4, seed=2) + prompts(VOCAB, 56, 4, seed=3)
    pars = params(len(ps))
    want = cold(MODEL, ps, pars, max_num_seqs=4)
    for round_ in range(2):
        host = 200_000 if round_ == 0 else 0  # round 1: a new engine, the store only
        llm = tiered(tmp_path / "store", kv_host_bytes=host, num_blocks=14, max_num_seqs=3,
                     max_num_batched_tokens=48, overlap=overlap)
        eng = llm.engine
        reqs = [eng.add_request(p, SamplingParams(**q)) for p, q in zip(ps + ps, pars + pars)]
        while eng.has_unfinished():
            eng.step()
            eng.scheduler.check()
        assert [bits(eng.output(r).outputs[0]) for r in reqs] == want + want
        t = eng.kv_tiers
        lower = t.loaded_blocks["host"] if round_ == 0 else t.hit_tokens["disk"]
        assert lower > 0, t.stats()
        if round_ == 0:
            assert t.host.num_evicted > 0 and t.host.bytes <= 200_000
        assert all(c["used"] == 0 for c in eng.kv.usage().values())
        assert t._staged is None
        t.flush()
    assert not list((tmp_path / "store").rglob(".tmp-*"))


class FakeRuntime:
    """torch.cuda's Event API on the CPU: the accelerator branch of BlockMover (non-blocking copies,
    an event per save, the store writer waiting on it) runs end to end and is counted."""

    def __init__(self):
        self.recorded = 0
        self.waited = 0
        runtime = self

        class Event:
            def record(self):
                runtime.recorded += 1

            def synchronize(self):
                runtime.waited += 1

        self.Event = Event


def test_the_event_path_gives_the_same_bits(tmp_path, case):
    from shuili.core.kv_tiers.mover import BlockMover

    ps, pars, want = case
    llm = tiered(tmp_path / "store")
    rt = FakeRuntime()
    llm.engine.kv_tiers.mover = BlockMover(llm.engine.runner.caches, "cpu", rt)
    assert run(llm, ps, pars) == want
    llm.engine.kv_tiers.evict_device_cache(llm.engine.kv)
    assert run(llm, ps, pars) == want
    llm.engine.kv_tiers.flush()
    assert rt.recorded > 0 and rt.waited > 0 and llm.engine.kv_tiers.loaded_blocks["host"] > 0
    reader = tiered(tmp_path / "store", kv_host_bytes=0)
    assert run(reader, ps, pars) == want and reader.engine.kv_tiers.hit_tokens["disk"] > 0
