"""Routing, grouped GEMM, routed experts and mHC against independent float64 code."""
import math

import pytest
import torch

from shuili.hal.types import Weight


def _score64(logits, scoring):
    l = logits.double()
    if scoring == "sqrtsoftplus":
        return torch.sqrt(torch.log1p(torch.exp(l)))
    if scoring == "softmax":
        e = torch.exp(l - l.max(-1, keepdim=True).values)
        return e / e.sum(-1, keepdim=True)
    return 1 / (1 + torch.exp(-l))


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax", "sigmoid"])
@pytest.mark.parametrize("renorm", [True, False])
def test_route_topk(ops, gen, scoring, renorm):
    logits = torch.randn(9, 12, generator=gen)
    bias = torch.randn(12, generator=gen) * 0.3
    w, ids = ops["moe_route_topk"](logits, bias, 3, scoring, renorm, 1.5)
    s = _score64(logits, scoring)
    for t in range(9):
        biased = [(float(s[t, e] + bias[e].double()), -e) for e in range(12)]
        want_ids = [-neg for _, neg in sorted(biased, reverse=True)[:3]]
        assert ids[t].tolist() == want_ids
        sel = [float(s[t, e]) for e in want_ids]
        tot = sum(sel) + 1e-20 if renorm else 1.0
        torch.testing.assert_close(w[t].double(), torch.tensor([v / tot * 1.5 for v in sel],
                                   dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64


def test_route_topk_ties_lower_expert(ops):
    logits = torch.zeros(2, 6)
    _, ids = ops["moe_route_topk"](logits, None, 4, "sigmoid", True, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    _, ids = ops["moe_route_topk"](logits, bias, 3, "sigmoid", True, 1.0)
    assert ids.tolist() == [[2, 4, 0]] * 2


def test_route_hash(ops, gen):
    logits = torch.randn(4, 8, generator=gen)
    tid2eid = torch.tensor([[0, 1], [7, 3], [2, 5]])
    toks = torch.tensor([2, 0, 1, 2])
    w, ids = ops["moe_route_hash"](logits, toks, tid2eid, "sqrtsoftplus", True, 2.0)
    assert ids.tolist() == [[2, 5], [0, 1], [7, 3], [2, 5]]
    s = _score64(logits, "sqrtsoftplus")
    for t in range(4):
        sel = s[t, ids[t]]
        torch.testing.assert_close(w[t].double(), sel / (sel.sum() + 1e-20) * 2.0, rtol=1e-6, atol=1e-7)


def test_grouped_linear(ops, gen):
    e, n, k = 4, 10, 24
    w = torch.randn(e, n, k, generator=gen)
    sizes = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, k, generator=gen)
    got = ops["grouped_linear"](x, Weight.dense(w), sizes)
    groups = [0] * 3 + [2] * 5 + [3]
    for r, g in enumerate(groups):
        want = torch.einsum("k,nk->n", x[r].double(), w[g].double())
        torch.testing.assert_close(got[r].double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sum"):
        ops["grouped_linear"](x, Weight.dense(w), torch.tensor([3, 0, 5, 2]))


@pytest.mark.parametrize("limit", [None, 0.7])
def test_moe_experts(ops, gen, limit):
    e, d, i, t, k = 5, 16, 8, 6, 3
    w13 = torch.randn(e, 2 * i, d, generator=gen)
    w2 = torch.randn(e, d, i, generator=gen)
    x = torch.randn(t, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=gen)
    got = ops["moe_experts"](x, ids, wts, Weight.dense(w13), Weight.dense(w2), limit)
    for tt in range(t):
        acc = torch.zeros(d, dtype=torch.float64)
        for j in range(k):
            ex = int(ids[tt, j])
            h = w13[ex].double() @ x[tt].double()
            g, u = h[:i], h[i:]
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            a = g * torch.sigmoid(g) * u
            acc += float(wts[tt, j]) * (w2[ex].double() @ a)
        torch.testing.assert_close(got[tt].double(), acc, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        ops["moe_experts"](x, ids.clone().fill_(5), wts, Weight.dense(w13), Weight.dense(w2))


def test_hc_split_sinkhorn(ops, gen):
    m, t, iters, eps = 4, 3, 20, 1e-6
    mix = torch.randn(t, m * (m + 2), generator=gen)
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn(m * (m + 2), generator=gen)
    pre, post, comb = ops["hc_split_sinkhorn"](mix, scale, base, m, iters, eps)
    for tt in range(t):
        mx = [float(v) for v in mix[tt]]
        sc, bs = [float(v) for v in scale], [float(v) for v in base]
        sig = lambda z: 1 / (1 + math.exp(-z))
        want_pre = [sig(mx[j] * sc[0] + bs[j]) + eps for j in range(m)]
        want_post = [2 * sig(mx[m + j] * sc[1] + bs[m + j]) for j in range(m)]
        c = [[mx[2 * m + r * m + q] * sc[2] + bs[2 * m + r * m + q] for q in range(m)] for r in range(m)]
        c = [[math.exp(v - max(row)) / sum(math.exp(u - max(row)) for u in row) + eps for v in row]
             for row in c]
        col = lambda c: [[c[r][q] / (sum(c[rr][q] for rr in range(m)) + eps) for q in range(m)] for r in range(m)]
        row = lambda c: [[c[r][q] / (sum(c[r]) + eps) for q in range(m)] for r in range(m)]
        c = col(c)
        for _ in range(iters - 1):
            c = col(row(c))
        torch.testing.assert_close(pre[tt].double(), torch.tensor(want_pre, dtype=torch.float64))
        torch.testing.assert_close(post[tt].double(), torch.tensor(want_post, dtype=torch.float64))
        torch.testing.assert_close(comb[tt].double(), torch.tensor(c, dtype=torch.float64), rtol=1e-5, atol=1e-6)
