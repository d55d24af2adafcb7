"""KV tiers under data parallelism: every DP group of a ParallelEngine has its host pool and the one
shared disk store. A prefix published by DP group 0 is a disk hit for DP group 1 (whose caches
live in another process), and the answer has the bits of a full recompute; corrupting the bytes
copied into group 1 changes the answer (negative control: the hit is really read); integrity
after every step, and every block is back in its pool at the end."""
from __future__ import annotations

import struct

import torch
from tiers_helpers import params, prompts

from shuili import LLM, SamplingParams
from shuili.core.config import EngineConfig
from shuili.core.parallel.engine import ParallelEngine

MODEL = "tiny-v41"
VOCAB = 256


def _bits(r) -> list:
    return [list(r.output_token_ids), [struct.pack("<f", x).hex() for x in r.logprobs]]


def _serve(eng, ps, pars) -> list:
    """Submit in order (a fresh engine's groups alternate 0, 1, 0, ...); integrity after every step."""
    reqs = [eng.add_request(p, SamplingParams(**q)) for p, q in zip(ps, pars)]
    while eng.has_unfinished():
        eng.step_requests()
        for s in eng.schedulers:
            s.kv.check_integrity()
    for s in eng.schedulers:  # nothing held: every block free or cached with no reference
        assert all(p.counts()["used"] == 0 for p in s.kv.pools.values())
    return [_bits(r) for r in reqs]


def _group_of(eng, request_id: str) -> int:
    return next(d for d, s in enumerate(eng.schedulers) if request_id in s.requests)


def test_disk_hit_in_dp_group_1_from_a_prefix_written_by_group_0(tmp_path):
    a, b, c = prompts(VOCAB, 70, 3, seed=5)
    filler = [[7, 3, 1, 9, 4]]
    pars = params(3)
    fill_par = [dict(max_tokens=2, temperature=0.0, ignore_eos=True)]
    want = []
    ref = LLM(model=MODEL, platform="reference", enable_prefix_caching=False, max_num_seqs=4)
    for p, q in zip((a, b, c), pars):
        r = ref.engine.add_request(p, SamplingParams(**q))
        while ref.engine.has_unfinished():
            ref.engine.step_requests()
        want.append(_bits(r))

    eng = ParallelEngine(EngineConfig(
        model=MODEL, platform="reference", data_parallel_size=2, max_num_seqs=4, kv_store=str(tmp_path / "store"),
        kv_host_bytes="64M"))
    try:
        t0, t1 = eng.dp_tiers
        assert t0.store is t1.store is not None and t0.fingerprint == t1.fingerprint
        assert _serve(eng, [a], pars[:1]) == [want[0]]  # group 0 computes and writes the prefix
        t0.flush()
        assert t0.bytes["device_to_disk"] > 0

        got = _serve(eng, filler + [b], fill_par + pars[1:2])  # b lands on group 1
        assert got[1] == want[1], "a disk hit in DP group 1 changed the answer"
        assert t1.hit_tokens["disk"] >= 64 and t1.loaded_blocks["disk"] > 0
        assert t1.hit_tokens["device"] == 0 and eng.remote_movers[0].round_trips > 0

        # negative control: flip the bytes group 1 receives -> the answer changes
        assert t1.evict_device_cache(eng.schedulers[1].kv, keep=False) > 0
        mover = eng.remote_movers[0]
        real = mover.to_device

        def corrupt(group, block, host):
            bad = host.clone()
            bad.view(torch.uint8).view(-1)[::7] ^= 0x5A
            real(group, block, bad)

        mover.to_device = corrupt
        t1.on_published = lambda *a: None  # blocks computed on the corrupted ones must not reach the store
        before = t1.loaded_blocks["disk"]
        assert _serve(eng, filler + [c], fill_par + pars[2:3])[1] != want[2]
        assert t1.loaded_blocks["disk"] > before
        mover.to_device = real
        del t1.on_published
        t1.evict_device_cache(eng.schedulers[1].kv, keep=False)  # drop the corrupted copies
        assert _serve(eng, filler + [c], fill_par + pars[2:3])[1] == want[2]
        # group 1's host pool: its device blocks read back over the control plane, then a host hit
        assert t1.evict_device_cache(eng.schedulers[1].kv, keep=True) > 0 and t1.host.entries
        assert _serve(eng, filler + [c], fill_par + pars[2:3])[1] == want[2]
        assert t1.hit_tokens["host"] >= 64
        t0.check()
        t1.check()
    finally:
        eng.close()


def test_store_fingerprint_names_what_changes_bits_under_parallelism():
    """TP size and EP on/off change bits (docs/parallel.md), so they change the store address;
    the DP size does not, and a one-rank engine's fingerprint has no parallel field at all."""
    from shuili.core.kv_tiers.fingerprint import kv_fingerprint
    from shuili.core.models import load_model
    from shuili.hal import resolve_platform

    platform = resolve_platform(EngineConfig(model="tiny-v4").platform)
    model = load_model("tiny-v4", platform.ops, platform.device, "float32", 0)
    model.kv_fingerprint = "synthetic:tiny-v4:seed=0"
    groups = model.cache_groups()

    def fp(**kw):
        return kv_fingerprint(EngineConfig(model="tiny-v4", **kw), model, groups, 16, platform, True)

    one, dp2, dp4 = fp(), fp(data_parallel_size=2), fp(data_parallel_size=4)
    tp2, tp2ep = fp(tensor_parallel_size=2), fp(tensor_parallel_size=2, enable_expert_parallel=True)
    assert "parallel" not in one and dp2["sha256"] == dp4["sha256"]
    assert len({one["sha256"], dp2["sha256"], tp2["sha256"], tp2ep["sha256"]}) == 4


def test_disk_hit_across_dp_groups_of_tp2(tmp_path):
    """TP2 x DP2 (4 processes): group 1's blocks live on ranks 2 and 3, written on both (the TP
    ranks of a group hold the same KV); the answer equals TP2's own recompute (TP changes bits,
    so the reference is a TP2 engine without a prefix cache)."""
    a, b = prompts(VOCAB, 70, 2, seed=9)
    pars = params(2)
    ref = ParallelEngine(EngineConfig(model=MODEL, platform="reference", tensor_parallel_size=2, max_num_seqs=4,
                                      enable_prefix_caching=False))
    try:
        want = [_serve(ref, [p], [q])[0] for p, q in zip((a, b), pars)]
    finally:
        ref.close()
    eng = ParallelEngine(EngineConfig(model=MODEL, platform="reference", tensor_parallel_size=2, data_parallel_size=2,
                                      max_num_seqs=4, kv_store=str(tmp_path / "store"), kv_host_bytes="64M"))
    try:
        t0, t1 = eng.dp_tiers
        assert _serve(eng, [a], pars[:1]) == [want[0]]
        t0.flush()
        assert _serve(eng, [[7, 3, 1, 9, 4], b], [dict(max_tokens=2, temperature=0.0, ignore_eos=True)] + pars[1:])[1] \
            == want[1]
        assert t1.hit_tokens["disk"] >= 64
        assert t1.evict_device_cache(eng.schedulers[1].kv, keep=True) > 0  # read back from rank 2
        assert _serve(eng, [[7, 3, 1, 9, 4], b], [dict(max_tokens=2, temperature=0.0, ignore_eos=True)] + pars[1:])[1] \
            == want[1]
        assert t1.hit_tokens["host"] >= 64
    finally:
        eng.close()
