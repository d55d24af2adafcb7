"""sparse_attention and indexer_topk against independent float64 code."""
import math

import pytest
import torch

from shuili.platforms.reference.quant import kv_quantize


def _softmax_out64(q, keys, scale, sink):
    h = q.shape[0]
    out = torch.zeros(h, q.shape[1], dtype=torch.float64)
    for hh in range(h):
        logits = [float(q[hh].double() @ k.double()) * scale for k in keys]
        extra = [] if sink is None else [float(sink[hh])]
        if not logits and not extra:
            continue
        m = max(logits + extra)
        den = sum(math.exp(l - m) for l in logits + extra)
        for l, k in zip(logits, keys):
            out[hh] += math.exp(l - m) / den * k.double()
    return out


@pytest.mark.parametrize("with_sink", [False, True])
def test_sparse_attention_two_caches(ops, gen, with_sink):
    t, h, d = 5, 3, 64
    a = torch.randn(3, 4, d, generator=gen)  # "none" pool: 12 slots
    ints = torch.randint(-16, 17, (10, d), generator=gen).float() / 8  # exact in mxfp8
    b = kv_quantize(ints, "mxfp8")
    q = torch.randn(t, h, d, generator=gen) * 0.2
    ia = torch.tensor([[0, 5, -1], [11, 11, 2], [-1, -1, -1], [3, -1, 7], [-1, -1, -1]], dtype=torch.int32)
    ib = torch.tensor([[9, -1], [0, 1], [4, -1], [-1, -1], [-1, -1]], dtype=torch.int32)
    sinks = torch.randn(h, generator=gen) if with_sink else None
    got = ops["sparse_attention"](q, [a, b], [ia, ib], 0.125, sinks, ["none", "mxfp8"])
    af = a.reshape(-1, d)
    for tt in range(t):
        keys = [af[i] for i in ia[tt].tolist() if i >= 0] + [ints[i] for i in ib[tt].tolist() if i >= 0]
        torch.testing.assert_close(got[tt].double(), _softmax_out64(q[tt], keys, 0.125, sinks),
                                   rtol=1e-5, atol=1e-6)
    assert torch.equal(got[4], torch.zeros(h, d))  # no entry: zeros, with or without a sink


def test_sparse_attention_query_alone_equals_batched(ops, gen):
    d = 32
    pool = torch.randn(2, 8, d, generator=gen)
    q = torch.randn(6, 2, d, generator=gen)
    idx = torch.randint(-1, 16, (6, 5), generator=gen, dtype=torch.int32)
    full = ops["sparse_attention"](q, [pool], [idx], 0.3, torch.zeros(2))
    for t in range(6):
        one = ops["sparse_attention"](q[t:t + 1], [pool], [idx[t:t + 1]], 0.3, torch.zeros(2))
        assert torch.equal(one[0], full[t])


def _indexer_setup(gen, lens, bs=4, h=3, dk=16):
    nb = sum(-(-l // bs) for l in lens) + 1
    k_cache = torch.randn(nb, bs, dk, generator=gen)
    perm = torch.randperm(nb, generator=gen).tolist()
    maxb = max(-(-l // bs) for l in lens)
    tables, used = [], 0
    for l in lens:
        nbl = -(-l // bs)
        tables.append(perm[used:used + nbl] + [0] * (maxb - nbl))
        used += nbl
    return k_cache, torch.tensor(tables, dtype=torch.int32)


def test_indexer_topk(ops, gen):
    ratio, topk, h, dk, bs = 2, 3, 3, 16, 4
    entries = [9, 6]  # compressed entries per sequence
    k_cache, bt = _indexer_setup(gen, entries, bs, h, dk)
    positions = torch.tensor([1, 2, 7, 18, 0, 5, 12, 13])
    qsl = torch.tensor([0, 4, 8], dtype=torch.int32)
    q = torch.randn(8, h, dk, generator=gen)
    w = torch.randn(8, h, generator=gen)
    got = ops["indexer_topk"](q, w, k_cache, bt, qsl, positions, ratio, topk)
    assert got.dtype == torch.int32 and got.shape == (8, topk)
    for t in range(8):
        b = 0 if t < 4 else 1
        n = (int(positions[t]) + 1) // ratio
        scores = []
        for e in range(n):
            key = k_cache[bt[b, e // bs], e % bs].double()
            scores.append((sum(float(w[t, hh]) * max(0.0, float(q[t, hh].double() @ key))
                               for hh in range(h)), e))
        want = [e for _, e in sorted(scores, key=lambda se: (-se[0], se[1]))[:topk]]
        assert got[t].tolist() == want + [-1] * (topk - len(want)), t


def test_indexer_ties_to_lower_entry_and_formats(ops, gen):
    k_cache, bt = _indexer_setup(gen, [8], 4, 2, 32)
    q = -torch.ones(1, 2, 32)
    keys = k_cache.abs()  # every dot negative -> relu 0 -> all scores tie at 0
    got = ops["indexer_topk"](q, torch.ones(1, 2), keys, bt, torch.tensor([0, 1], dtype=torch.int32),
                              torch.tensor([15]), 2, 5)
    assert got.tolist() == [[0, 1, 2, 3, 4]]
    ints = torch.randint(-6, 7, (k_cache.shape[0] * 4, 32), generator=gen).float() / 4  # exactly representable in mxfp8
    packed = kv_quantize(ints, "mxfp8").reshape(k_cache.shape[0], 4, -1)
    qr = torch.randn(1, 2, 32, generator=gen)
    a = ops["indexer_topk"](qr, torch.ones(1, 2), packed, bt, torch.tensor([0, 1], dtype=torch.int32),
                            torch.tensor([15]), 2, 8, "mxfp8")
    b = ops["indexer_topk"](qr, torch.ones(1, 2), ints.reshape(k_cache.shape[0], 4, 32), bt,
                            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([15]), 2, 8)
    assert torch.equal(a, b)


def test_indexer_query_alone_equals_batched(ops, gen):
    k_cache, bt = _indexer_setup(gen, [12, 7], 4, 4, 32)
    q = torch.randn(9, 4, 32, generator=gen)
    w = torch.randn(9, 4, generator=gen)
    pos = torch.tensor([3, 9, 22, 23, 17, 2, 6, 13, 15])
    qsl = torch.tensor([0, 5, 9], dtype=torch.int32)
    full = ops["indexer_topk"](q, w, k_cache, bt, qsl, pos, 2, 6)
    for t in range(9):
        b = 0 if t < 5 else 1
        one = ops["indexer_topk"](q[t:t + 1], w[t:t + 1], k_cache, bt[b:b + 1],
                                  torch.tensor([0, 1], dtype=torch.int32), pos[t:t + 1], 2, 6)
        assert torch.equal(one[0], full[t]), t
