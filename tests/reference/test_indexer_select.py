"""indexer_select (the DeepSeek-V4.1 two-level indexer) against independent float64 code."""
import pytest
import torch


def _keys(gen, lens, bs, dk):
    nb = sum(-(-n // bs) for n in lens) + 1
    k_cache = torch.randn(nb, bs, dk, generator=gen)
    perm = torch.randperm(nb, generator=gen).tolist()
    maxb = max(-(-n // bs) for n in lens)
    tables, used = [], 0
    for n in lens:
        nbl = -(-n // bs)
        tables.append(perm[used:used + nbl] + [-1] * (maxb - nbl))
        used += nbl
    return k_cache, torch.tensor(tables, dtype=torch.int32)


def _expected(q, w, keys, n_vis, topk, pool, cand_k, S):
    """One query: (entry ids, candidate block ids), ranked by float64 score desc, then id asc."""
    scores = {}
    for e in range(n_vis):
        s = sum(float(w[h]) * max(float(q[h].double() @ keys[e].double()), 0.0) for h in range(q.shape[0]))
        if pool is None or e // S in pool:
            scores[e] = s
    ids = sorted(scores, key=lambda e: (-scores[e], e))[:topk]
    blocks = {}
    for e in range(n_vis):
        if pool is None:
            blocks[e // S] = max(blocks.get(e // S, float("-inf")), scores[e])
    if n_vis:
        blocks[(n_vis - 1) // S] = float("inf")
    cand = sorted(blocks, key=lambda j: (-blocks[j], j))[:cand_k]
    return ids, cand


@pytest.mark.parametrize("mode", ["plain", "pool", "level_one"])
def test_indexer_select(ops, gen, mode):
    ratio, topk, h, dk, bs, S = 2, 3, 4, 16, 4, 2
    tok_lens = [19, 12]
    entries = [n // ratio for n in tok_lens]
    k_cache, table = _keys(gen, entries, bs, dk)
    q_lens = [5, 3]
    qsl = torch.tensor([0, 5, 8], dtype=torch.int32)
    pos = torch.cat([torch.arange(n - ql, n) for n, ql in zip(tok_lens, q_lens)])
    q = torch.randn(8, h, dk, generator=gen)
    w = torch.rand(8, h, generator=gen) * 2 - 0.5
    pool = torch.randint(-1, 4, (8, 2), generator=gen, dtype=torch.int32) if mode == "pool" else None
    cand_k = 3 if mode == "level_one" else 0
    idx, cand = ops["indexer_select"](q, w, k_cache, table, qsl, pos, ratio, topk, "none", pool, cand_k, S)
    assert idx.shape == (8, topk) and cand.shape == (8, cand_k)
    kf = k_cache.reshape(-1, dk)
    for t in range(8):
        b = 0 if t < 5 else 1
        n_vis = (int(pos[t]) + 1) // ratio
        slots = [int(table[b, e // bs]) * bs + e % bs for e in range(n_vis)]
        keys = [kf[s] for s in slots]
        p = None if pool is None else {int(j) for j in pool[t] if j >= 0}
        ids, blocks = _expected(q[t], w[t], keys, n_vis, topk, p, cand_k, S)
        assert idx[t].tolist() == ids + [-1] * (topk - len(ids)), t
        assert cand[t].tolist() == blocks + [-1] * (cand_k - len(blocks)), t


def test_indexer_select_pool_restricts_and_pin_holds(ops, gen):
    """The newest block is kept even when it scores lowest; a pool without it hides its entries."""
    dk, bs = 8, 8
    keys = torch.zeros(1, bs, dk)
    keys[0, :, 0] = torch.tensor([8.0, 7, 6, 5, 4, 3, 2, 0.5])  # newest entry scores lowest
    q = torch.zeros(1, 1, dk)
    q[0, 0, 0] = 1.0
    args = (q, torch.ones(1, 1), keys, torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([7]), 1, 2, "none")
    idx, cand = ops["indexer_select"](*args, None, 2, 2)
    assert idx[0].tolist() == [0, 1]
    assert cand[0].tolist() == [3, 0]  # block 3 (entries 6, 7) pinned, then the best block
    idx, _ = ops["indexer_select"](*args, torch.tensor([[3, -1]], dtype=torch.int32), 0, 2)
    assert idx[0].tolist() == [6, 7]


def test_indexer_select_matches_indexer_topk_without_levels(ops, gen):
    k_cache, table = _keys(gen, [9], 4, 16)
    q, w = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, generator=gen)
    pos = torch.tensor([5, 11, 17])
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    a = ops["indexer_topk"](q, w, k_cache, table, qsl, pos, 2, 4)
    b, c = ops["indexer_select"](q, w, k_cache, table, qsl, pos, 2, 4)
    assert torch.equal(a, b) and c.shape == (3, 0)
