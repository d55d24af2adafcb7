"""KV-cache manager without a model: pools, LRU eviction, prefix hits per group kind, integrity."""
from __future__ import annotations

import pytest

from shuili import SamplingParams
from shuili.core.kv_cache import BlockPool, KVCacheManager
from shuili.core.model_api import CacheGroupSpec
from shuili.core.request import Request

P = 4
FULL = CacheGroupSpec(name="full", kind="full", layers=(0,), entry_shape=(2,))
SWA = CacheGroupSpec(name="swa", kind="sliding", layers=(1,), entry_shape=(2,), window=6)
COMP = CacheGroupSpec(name="comp", kind="compressed", layers=(2,), entry_shape=(2,), ratio=2)


def req(rid, tokens, **kw):
    return Request(rid, list(tokens), SamplingParams(**kw), 0, 0)


def compute(kv, r, n, hits=None):
    """Allocate and 'run' n tokens, then publish (what scheduler + engine do)."""
    assert kv.allocate(r, n, hits)
    r.num_computed_tokens += n
    kv.publish(r, r.num_computed_tokens)
    kv.check_integrity()


def test_pool_lru_eviction_order():
    pool = BlockPool("g", 3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.publish(blk, h)
    pool.release(b)
    pool.release(a)
    pool.release(c)
    pool.touch(pool.lookup(b"a"))  # a hit removes a from the LRU list
    assert pool.allocate() == b  # the least recently freed cached block is evicted first
    assert pool.lookup(b"b") is None and pool.lookup(b"c") == c
    pool.check()


def test_pool_release_twice_is_caught():
    pool = BlockPool("g", 2)
    b = pool.allocate()
    pool.release(b)
    with pytest.raises(AssertionError):
        pool.release(b)


def test_integrity_catches_a_leak():
    kv = KVCacheManager([FULL], 8, P)
    r = req("a", range(10))
    compute(kv, r, 10)
    kv.requests.clear()  # forget the request without freeing its blocks: a leak
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_prefix_hit_full_and_compressed_groups():
    kv = KVCacheManager([FULL, COMP], 16, P)
    a = req("a", range(13))
    compute(kv, a, 13)
    kv.free(a)
    kv.check_integrity()
    assert kv.usage()["full"]["cached"] == 3 and kv.usage()["comp"]["cached"] == 3
    b = req("b", list(range(9)) + [99, 98])
    n, hits = kv.find_cached(b)
    assert n == 8 and len(hits["full"]) == 2 and len(hits["comp"]) == 2
    b.num_computed_tokens = n
    compute(kv, b, 3, hits)
    assert kv.usage()["full"]["used"] == 3


def test_hit_leaves_the_last_token_to_compute():
    kv = KVCacheManager([FULL], 16, P)
    a = req("a", range(8))
    compute(kv, a, 8)
    n, _ = kv.find_cached(req("b", range(8)))
    assert n == 4  # 8 tokens are cached, but the last one must run to produce logits


def test_sliding_window_frees_and_hits():
    kv = KVCacheManager([FULL, SWA], 32, P)
    a = req("a", range(22))
    compute(kv, a, 22)
    freed = kv.release_out_of_window(a)
    # next query at 22 reads kv >= 17: blocks 0..3 (tokens < 16) are dead in the sliding group
    assert freed == 4 and a.block_ids["swa"][:4] == [-1] * 4 and a.block_ids["swa"][4] >= 0
    assert a.block_ids["full"].count(-1) == 0
    kv.check_integrity()
    kv.free(a)
    # a hit needs only the window's blocks in the sliding group
    b = req("b", list(range(20)) + [7, 7, 7])
    n, hits = kv.find_cached(b)
    assert n == 20
    assert hits["swa"][:3] == [-1, -1, -1] and all(x >= 0 for x in hits["swa"][3:])
    b.num_computed_tokens = n
    compute(kv, b, 3, hits)


def test_sliding_hit_shrinks_when_window_blocks_were_evicted():
    kv = KVCacheManager([FULL, SWA], 32, P)
    a = req("a", range(21))
    compute(kv, a, 21)
    kv.release_out_of_window(a)  # swa blocks 0..3 freed: they stay cached (published before)
    kv.free(a)
    pool = kv.pools["swa"]
    h3 = a.block_hashes[3]
    blk = pool.lookup(h3)
    del pool.cached[h3]
    pool.hash[blk] = None  # evict just swa block 3
    n, _ = kv.find_cached(req("b", list(range(20)) + [1]))
    # L=5 needs swa blocks 3,4 (tokens >= 15); L=4 needs 2,3; L=3 needs 1,2 (tokens >= 7): ok
    assert n == 12
    kv.check_integrity()


def test_allocation_fails_cleanly_and_frees_everything():
    kv = KVCacheManager([FULL, SWA], 4, P)
    a = req("a", range(12))
    assert kv.allocate(a, 12)
    b = req("b", range(12))
    assert not kv.allocate(b, 8)  # only one block left
    assert b.block_ids == {}
    kv.check_integrity()
    kv.free(a)
    kv.check_integrity()
    assert all(u["used"] == 0 for u in kv.usage().values())


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager([FULL], 16, P)
    a = req("a", range(9))
    compute(kv, a, 9)
    assert kv.find_cached(req("b", range(9)))[0] == 8
    assert kv.find_cached(req("c", range(9), prompt_logprobs=True))[0] == 0


def test_tokens_per_block_must_fit_the_ratio():
    with pytest.raises(ValueError, match="multiple"):
        KVCacheManager([CacheGroupSpec(name="c", kind="compressed", layers=(0,), entry_shape=(1,), ratio=3)], 4, P)


def test_admissions_count_queried_and_hit_tokens():
    kv = KVCacheManager([FULL], 16, P)
    a = req("a", range(13))
    n, hits = kv.find_cached(a)
    compute(kv, a, 13, hits)
    compute(kv, a, 0)  # a running request's allocation is not an admission
    b = req("b", list(range(9)) + [99])
    n, hits = kv.find_cached(b)
    b.num_computed_tokens = n
    compute(kv, b, 10 - n, hits)
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (13 + 10, 8)
