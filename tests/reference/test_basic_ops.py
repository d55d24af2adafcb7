"""Simple ops against independent float64 computations written differently from the implementation."""
import math

import pytest
import torch

from shuili.hal.ops import OP_NAMES, accepts, check_signature, with_hints
from shuili.hal.types import Weight
from shuili.platforms.reference.ops import OPS


def test_table_covers_contract_with_exact_signatures():
    assert set(OPS) == set(OP_NAMES)
    for name in OP_NAMES:
        assert check_signature(name, OPS[name]) is None, name


def test_sample_hints_are_optional_for_implementations():
    """HAL 1.2's keyword-only sample hints: a 1.0-style implementation still fits the contract,
    and callers can tell whether to pass them."""
    def old(logits, temperature, top_k, top_p, min_p, seeds, positions):
        return logits

    def renamed(logits, temperature, top_k, top_p, min_p, seeds, position):
        return logits

    assert check_signature("sample", old) is None
    assert "position" in check_signature("sample", renamed)
    assert accepts(OPS["sample"], "all_greedy") and accepts(OPS["sample"], "any_filter")
    assert not accepts(old, "all_greedy") and accepts(lambda *a, **kw: None, "any_filter")


def test_hintless_sample_is_adapted_once_at_resolve():
    """The dispatch table's sample always takes the hints; a 1.0-style one is wrapped, once."""
    def old(logits, temperature, top_k, top_p, min_p, seeds, positions):
        return logits

    adapted = with_hints("sample", old)
    assert adapted(7, 0, 0, 0, 0, 0, 0, all_greedy=True, any_filter=False) == 7
    assert with_hints("sample", OPS["sample"]) is OPS["sample"]  # names both hints: no wrapper


def test_sample_hints_never_change_the_result(gen):
    b, v = 6, 50
    logits = torch.randn(b, v, generator=gen) * 2
    args = dict(logits=logits, temperature=torch.tensor([0.0, 0.7, 0.0, 1.2, 0.9, 0.0]),
                top_k=torch.tensor([0, 5, 0, 0, 0, 0], dtype=torch.int32),
                top_p=torch.tensor([1.0, 1.0, 1.0, 0.6, 1.0, 1.0]), min_p=torch.zeros(b),
                seeds=torch.arange(b) + 11, positions=torch.arange(b) + 40)
    want = OPS["sample"](**args)
    # hints that promise nothing
    assert torch.equal(OPS["sample"](**args, all_greedy=False, any_filter=True), want)
    plain = dict(args, top_k=torch.zeros(b, dtype=torch.int32), top_p=torch.ones(b))
    assert torch.equal(OPS["sample"](**plain, any_filter=False), OPS["sample"](**plain))
    greedy = dict(args, temperature=torch.zeros(b))
    assert torch.equal(OPS["sample"](**greedy, all_greedy=True), logits.argmax(1))


@pytest.mark.parametrize("t,k,n", [(1, 8, 3), (7, 64, 33), (40, 130, 17)])
def test_linear_matches_float64(ops, gen, t, k, n):
    x = torch.randn(t, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    want = [[sum(float(x[i, j]) * float(w[o, j]) for j in range(k)) + float(bias[o]) for o in range(n)]
            for i in range(t)] if t * n * k < 20000 else (x.double() @ w.double().T + bias.double())
    want = torch.as_tensor(want, dtype=torch.float64)
    got = ops["linear"](x, Weight.dense(w), bias)
    assert got.dtype == torch.float32 and got.shape == (t, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_rms_norm_and_add(ops, gen):
    x = torch.randn(5, 3, 48, generator=gen)
    w = torch.randn(48, generator=gen)
    x64 = x.double()
    want = x64 / torch.sqrt((x64 ** 2).sum(-1, keepdim=True) / 48 + 1e-6) * w.double()
    torch.testing.assert_close(ops["rms_norm"](x, w, 1e-6).double(), want, rtol=1e-5, atol=1e-6)
    want_nw = x64 / torch.sqrt((x64 ** 2).sum(-1, keepdim=True) / 48 + 1e-6)
    torch.testing.assert_close(ops["rms_norm"](x, None, 1e-6).double(), want_nw, rtol=1e-5, atol=1e-6)
    a, r = torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen)
    y, s = ops["add_rms_norm"](a, r, w[:32], 1e-5)
    assert torch.equal(s, a + r)
    s64 = a.double() + r.double()
    want = s64 * (1.0 / torch.sqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5)) * w[:32].double()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)


def _rope64(x, pos, cos, sin, rope_dim, interleaved, inverse):
    out = x.double().clone()
    d = x.shape[-1]
    for t in range(x.shape[0]):
        for i in range(rope_dim // 2):
            c, s = float(cos[pos[t], i]), float(sin[pos[t], i])
            if inverse:
                s = -s
            ia, ib = ((d - rope_dim + 2 * i, d - rope_dim + 2 * i + 1) if interleaved
                      else (d - rope_dim + i, d - rope_dim // 2 + i))
            a, b = x[t, :, ia].double(), x[t, :, ib].double()
            out[t, :, ia], out[t, :, ib] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope(ops, gen, interleaved, inverse):
    rd, maxpos = 8, 20
    ang = torch.arange(maxpos, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(rd // 2) / (rd // 2))
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    x = torch.randn(4, 3, 12, generator=gen)
    pos = torch.tensor([0, 5, 19, 3])
    got = ops["rope"](x, pos, cos, sin, rd, interleaved, inverse)
    torch.testing.assert_close(got.double(), _rope64(x, pos, cos, sin, rd, interleaved, inverse),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., :4], x[..., :4])
    back = ops["rope"](got, pos, cos, sin, rd, interleaved, not inverse)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("limit", [None, 1.5])
def test_swiglu(ops, gen, limit):
    gu = torch.randn(5, 2 * 24, generator=gen) * 3
    g, u = gu[:, :24].double(), gu[:, 24:].double()
    if limit is not None:
        g, u = torch.minimum(g, torch.tensor(limit)), u.clamp(-limit, limit)
    want = g / (1 + torch.exp(-g)) * u
    torch.testing.assert_close(ops["swiglu"](gu, limit).double(), want, rtol=1e-6, atol=1e-6)


def test_embedding(ops, gen):
    table = torch.randn(10, 4, generator=gen)
    ids = torch.tensor([3, 0, 9, 3])
    got = ops["embedding"](ids, table)
    assert all(torch.equal(got[i], table[j]) for i, j in enumerate(ids.tolist()))
    with pytest.raises(ValueError, match="vocabulary"):
        ops["embedding"](torch.tensor([10]), table)


def test_cache_write(ops, gen):
    cache = torch.zeros(3, 4, 2, 5)
    vals = torch.randn(3, 2, 5, generator=gen)
    ops["cache_write"](cache, torch.tensor([5, -1, 11]), vals)
    assert torch.equal(cache[1, 1], vals[0]) and torch.equal(cache[2, 3], vals[2])
    assert int((cache != 0).any(-1).any(-1).sum()) == 2
    packed = torch.zeros(2, 2, 7, dtype=torch.uint8)
    ops["cache_write"](packed, torch.tensor([2]), torch.full((1, 7), 9, dtype=torch.uint8))
    assert packed[1, 0].tolist() == [9] * 7 and int(packed.sum()) == 63
    with pytest.raises(ValueError, match="dtype|cache is"):
        ops["cache_write"](cache, torch.tensor([0]), vals[:1].double())


def test_cache_write_checks_a_reused_mapping_again(ops, gen):
    """A step's slot mapping is checked once for all its layers: the memo must not let a mapping
    that was changed in place, or a smaller cache, past the range check."""
    big, small = torch.zeros(8, 4, 3), torch.zeros(2, 4, 3)
    vals = torch.randn(2, 3, generator=gen)
    slots = torch.tensor([30, 7])
    ops["cache_write"](big, slots, vals)
    ops["cache_write"](big, slots, vals)  # the memo's hit
    assert torch.equal(big.view(-1, 3)[30], vals[0]) and torch.equal(big.view(-1, 3)[7], vals[1])
    with pytest.raises(ValueError, match="past the cache's 8 slots"):
        ops["cache_write"](small, slots, vals)
    slots[0] = 32
    with pytest.raises(ValueError, match="slot 32 is past the cache's 32 slots"):
        ops["cache_write"](big, slots, vals)
    slots[0] = -1  # skipped, and not remembered as all valid
    ops["cache_write"](big, slots, vals * 2)
    assert torch.equal(big.view(-1, 3)[7], vals[1] * 2) and torch.equal(big.view(-1, 3)[30], vals[0])


def test_collectives_single_rank(ops, gen):
    x = torch.randn(3, 2, generator=gen)
    assert ops["all_reduce"](x) is x
    assert ops["all_gather"](x, None, 1) is x


# ------------------------------------------------------------------------------------- attention
def _attn64(q, ks, vs, scale, sink):
    """q [H, D]; ks, vs lists of [H, D] rows per visible position (already head-mapped)."""
    h = q.shape[0]
    out = torch.zeros(h, vs[0].shape[-1] if vs else q.shape[1], dtype=torch.float64)
    for hh in range(h):
        logits = [float((q[hh].double() * k[hh].double()).sum()) * scale for k in ks]
        extra = [] if sink is None else [float(sink[hh])]
        m = max(logits + extra)
        ex = [math.exp(l - m) for l in logits]
        den = sum(ex) + sum(math.exp(e - m) for e in extra)
        for w, v in zip(ex, vs):
            out[hh] += (w / den) * v[hh].double()
    return out


def _paged_setup(gen, lens, q_lens, bs=4, h=4, kvh=2, d=8):
    nb = sum(-(-l // bs) for l in lens) + 2
    k_cache = torch.randn(nb, bs, kvh, d, generator=gen)
    v_cache = torch.randn(nb, bs, kvh, d, generator=gen)
    perm = torch.randperm(nb, generator=gen)
    tables, used = [], 0
    maxb = max(-(-l // bs) for l in lens)
    for l in lens:
        nbl = -(-l // bs)
        row = perm[used:used + nbl].tolist() + [0] * (maxb - nbl)
        used += nbl
        tables.append(row)
    q = torch.randn(sum(q_lens), h, d, generator=gen)
    qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0).tolist()), dtype=torch.int32)
    return q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), qsl


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("with_sink", [False, True])
def test_paged_attention_matches_float64(ops, gen, window, with_sink):
    lens, q_lens = [7, 1, 10], [7, 1, 3]
    q, kc, vc, bt, sl, qsl = _paged_setup(gen, lens, q_lens)
    sinks = torch.randn(4, generator=gen) if with_sink else None
    got = ops["paged_attention"](q, kc, vc, bt, sl, qsl, 0.35, window, sinks)
    bs, g = kc.shape[1], 2
    for b, (l, ql) in enumerate(zip(lens, q_lens)):
        for i in range(ql):
            p = l - ql + i
            vis = [j for j in range(p + 1) if window == 0 or j > p - window]
            ks = [kc[bt[b, j // bs], j % bs].repeat_interleave(g, 0) for j in vis]
            vs = [vc[bt[b, j // bs], j % bs].repeat_interleave(g, 0) for j in vis]
            want = _attn64(q[qsl[b] + i], ks, vs, 0.35, sinks)
            torch.testing.assert_close(got[qsl[b] + i].double(), want, rtol=1e-5, atol=1e-5)


def test_paged_attention_prefill_equals_decode_and_batch_invariant(ops, gen):
    lens = [9, 5, 12]
    q, kc, vc, bt, sl, qsl = _paged_setup(gen, lens, lens)
    full = ops["paged_attention"](q, kc, vc, bt, sl, qsl, 0.5, 0, torch.ones(4))
    for b, l in enumerate(lens):
        start = int(qsl[b])
        for p in range(l):  # decode step p alone: one query, cache holds p + 1 tokens
            one = ops["paged_attention"](q[start + p:start + p + 1], kc, vc, bt[b:b + 1],
                                         torch.tensor([p + 1], dtype=torch.int32),
                                         torch.tensor([0, 1], dtype=torch.int32), 0.5, 0, torch.ones(4))
            assert torch.equal(one[0], full[start + p])
        chunk = ops["paged_attention"](q[start + 2:start + l], kc, vc, bt[b:b + 1],
                                       torch.tensor([l], dtype=torch.int32),
                                       torch.tensor([0, l - 2], dtype=torch.int32), 0.5, 0, torch.ones(4))
        assert torch.equal(chunk, full[start + 2:start + l])
