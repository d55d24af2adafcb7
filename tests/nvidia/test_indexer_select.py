"""nvidia indexer_select (the V4.1 two-level indexer) equals the reference exactly: small-integer
keys and queries make every score exact and tie often, so the candidate mask, the block max with
the pinned newest block and both top-k tie orders are checked bit for bit."""
import math

import pytest
import torch

from shuili.platforms.nvidia import indexer
from shuili.platforms.reference.ops import OPS as REF


@pytest.mark.parametrize("mode", ["plain", "pool", "level_one"])
@pytest.mark.parametrize("fmt", ["none", "mxfp4"])
def test_indexer_select_exact(device, fmt, mode):
    gen = torch.Generator().manual_seed(61)
    b, bs, ratio, h, dk, topk, S = 3, 8, 2, 4, 64, 5, 4
    toks, ql = [50, 9, 33], [3, 1, 33]
    ents = [max(1, n // ratio) for n in toks]
    blocks = [math.ceil(e / bs) for e in ents]
    pool = sum(blocks) + 1
    phys = torch.randperm(pool, generator=gen)
    table = torch.full((b, max(blocks)), -1, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = phys[at:at + nb].to(torch.int32)
        at += nb
    qsl = torch.tensor([0] + ql).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n - q, n) for n, q in zip(toks, ql)])
    rows = torch.randint(-2, 3, (pool * bs, dk), generator=gen).float()
    k_cache = rows.view(pool, bs, dk) if fmt == "none" else REF["kv_quantize"](rows, fmt).view(pool, bs, -1)
    t = int(qsl[-1])
    q = torch.randint(-2, 3, (t, h, dk), generator=gen).float()
    w = torch.randint(-2, 3, (t, h), generator=gen).float()
    cands = torch.randint(-1, 7, (t, 3), generator=gen, dtype=torch.int32) if mode == "pool" else None
    ck = 3 if mode == "level_one" else 0
    args = (q, w, k_cache, table, qsl, pos, ratio, topk, fmt, cands, ck, S)
    want = REF["indexer_select"](*args)
    got = indexer.indexer_select(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args])
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
