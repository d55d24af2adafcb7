"""Input builders shared by the Ascend tests (paged KV caches, indexer caches)."""
from __future__ import annotations

import torch


def paged_case(gen, lens, qlens, bs, kvh=2, h=4, d=64, dtype=torch.bfloat16):
    b = len(lens)
    nblk = sum(-(-n // bs) for n in lens) + 2
    k_cache = (torch.randn(nblk, bs, kvh, d, generator=gen)).to(dtype)
    v_cache = (torch.randn(nblk, bs, kvh, d, generator=gen)).to(dtype)
    perm = torch.randperm(nblk, generator=gen)
    width = max(-(-n // bs) for n in lens)
    table = torch.full((b, width), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        c = -(-n // bs)
        table[s, :c] = perm[used:used + c].to(torch.int32)
        used += c
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), h, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), qsl


def indexer_case(gen, lens, qlens, ratio, bs=16, h=8, dk=128):
    entries = [n // ratio + 1 for n in lens]
    b = len(lens)
    nblk = sum(-(-n // bs) for n in entries) + 1
    k_cache = torch.randn(nblk, bs, dk, generator=gen).to(torch.bfloat16)
    width = max(-(-n // bs) for n in entries)
    table = torch.zeros(b, width, dtype=torch.int32)
    perm = torch.randperm(nblk, generator=gen)
    used = 0
    for s, n in enumerate(entries):
        c = -(-n // bs)
        table[s, :c] = perm[used:used + c].to(torch.int32)
        used += c
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    positions = torch.cat([torch.arange(n - ql, n) for n, ql in zip(lens, qlens)])
    q = torch.randn(int(qsl[-1]), h, dk, generator=gen).to(torch.bfloat16)
    weights = torch.randn(int(qsl[-1]), h, generator=gen).to(torch.bfloat16).to(torch.float32)
    return q, weights, k_cache, table, qsl, positions
