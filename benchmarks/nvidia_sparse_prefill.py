"""Sparse attention and the indexer at prefill sizes (issue 20), on one GPU: the direct path (one
program a token) against sparse_group's (TOKENS neighbouring tokens a program over the columns they
share), and the indexer's score with one token a program against groups of one sequence's tokens.

mid-v4's attention (16 heads x 512, bf16 rows, as the packed caches are decoded once at these sizes)
over B prompts of L tokens at position 0, each sequence's rows its own part of each pool:
- `swa`: the 128-slot window alone (the first two layers);
- `csa`: the window + 512 compressed entries picked at random among the (p + 1) / 4 the token sees
  (all of them up to position 2,047): the real indexer's picks, from similar queries, overlap at
  least as much between neighbours;
- `hca`: the window + every one of the (p + 1) / 128 compressed entries the token sees.
sparse_group at 4 and at 2 tokens a program (sparse_group.TOKENS). Times are medians of eager calls
(the columns kernel included); "diff" is the outputs' relative difference between the two paths.
"floor" counts the FLOPs of each token's own entries (q k and p v, 2 x 2 x H x D a row) at the
bf16 matmul rate measured in the same run: the direct path's work.

Then the indexer of a CSA layer at the same sizes (32 heads x 128, keys plain and mxfp4, 64 a block):
its score kernel with one token a program against indexer.GROUP_TOKENS tokens of one sequence a
program, alone and with the top-512; "diff" is the scores' relative difference and the share of
top-k ids that differ. Its floor: 2 x heads x dim FLOPs a visible key and query.

    python benchmarks/nvidia_sparse_prefill.py [--batch 2] [--len 4096] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton.testing as tt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvidia_e2e import matmul_rate  # noqa: E402
from nvidia_qgemm import rel  # noqa: E402

from shuili.platforms.nvidia import attention, indexer, sparse_group  # noqa: E402
from shuili.platforms.reference.ops import OPS as REF  # noqa: E402

DEV = "cuda"
H, D, WIN, TOPK, CSA, HCA = 16, 512, 128, 512, 4, 128
IH, IDK, BS = 32, 128, 64  # indexer heads and dim, compressed entries a block


def layer_inputs(b: int, n: int, kind: str, gen: torch.Generator):
    """(kv caches [slots, D], index rows int32 [b * n, L]) of one layer kind."""
    pos = torch.arange(n)
    win = pos[:, None] - (WIN - 1) + torch.arange(WIN)[None, :]
    wins, comps = [], []
    for s in range(b):
        wins.append(torch.where(win >= 0, win + s * n, -1))
        if kind == "csa":
            vis = (pos + 1) // CSA
            score = torch.rand(n, n // CSA, generator=gen)
            score[torch.arange(n // CSA)[None, :] >= vis[:, None]] = -1.0
            top = score.topk(min(TOPK, n // CSA), dim=1)
            comps.append(torch.where(top.values >= 0, top.indices + s * (n // CSA), -1))
        elif kind == "hca":
            e = torch.arange(n // HCA)
            comps.append(torch.where(e[None, :] < ((pos + 1) // HCA)[:, None], e[None, :] + s * (n // HCA), -1))
    idx = [torch.cat(wins)]
    kv = [torch.randn(b * n, D, generator=gen).to(DEV, torch.bfloat16)]
    if comps:
        idx.append(torch.cat(comps))
        kv.append(torch.randn(b * (n // (CSA if kind == "csa" else HCA)), D, generator=gen).to(DEV, torch.bfloat16))
    return kv, [i.to(DEV, torch.int32).contiguous() for i in idx]


def indexer_rows(b: int, n: int, fmt: str, rate: float, gen: torch.Generator) -> dict:
    """The CSA indexer at B prompts of n tokens: scores and top-k, one token a program vs groups."""
    t, ents = b * n, n // CSA
    blocks = -(-ents // BS)
    table = torch.arange(b * blocks, dtype=torch.int32).view(b, blocks)
    keys = torch.randn(b * blocks * BS, IDK, generator=gen)
    cache = (keys if fmt == "none" else REF["kv_quantize"](keys, fmt)).view(b * blocks, BS, -1)
    args = ((torch.randn(t, IH, IDK, generator=gen) * 0.3).to(DEV, torch.bfloat16),
            torch.rand(t, IH, generator=gen).to(DEV), cache.to(DEV, torch.bfloat16 if fmt == "none" else None),
            table.to(DEV), (torch.arange(b + 1) * n).to(DEV, torch.int32), torch.arange(n).repeat(b).to(DEV), CSA)
    visible = b * sum((p + 1) // CSA for p in range(n))
    floor = 2 * IH * IDK * visible / rate
    res, keep = {}, indexer.GROUP_MIN_TOKENS
    for name, min_tokens in (("one", 1 << 62), ("groups", 1)):
        indexer.GROUP_MIN_TOKENS = min_tokens
        try:
            score = lambda: indexer._scores(*args, fmt)  # noqa: E731
            top = lambda: indexer.indexer_topk(*args, TOPK, fmt)  # noqa: E731
            res[name] = (tt.do_bench(score, warmup=5, rep=50) * 1e-3, tt.do_bench(top, warmup=5, rep=50) * 1e-3,
                         score(), top())
        finally:
            indexer.GROUP_MIN_TOKENS = keep
    s1, s4 = res["one"][2], res["groups"][2]
    fin = torch.isfinite(s1)
    diff = rel(s4[fin], s1[fin])
    ids = float((res["one"][3] != res["groups"][3]).float().mean())
    row = {"kind": f"indexer {fmt}", "tokens": t, "floor_us": floor * 1e6, "one_score_us": res["one"][0] * 1e6,
           "groups_score_us": res["groups"][0] * 1e6, "one_topk_us": res["one"][1] * 1e6,
           "groups_topk_us": res["groups"][1] * 1e6, "diff": diff, "ids_differ": ids}
    print(f"indexer {fmt} B{b} x {n}: score one {row['one_score_us']:8.1f} us, groups {row['groups_score_us']:8.1f} "
          f"us ({row['one_score_us'] / row['groups_score_us']:4.2f}x, floor {row['floor_us']:6.1f} us); with "
          f"top-{TOPK}: {row['one_topk_us']:8.1f} / {row['groups_topk_us']:8.1f} us; diff {diff:.1e}, "
          f"{ids * 100:.2f}% of ids differ", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rate = matmul_rate(DEV)
    t = a.batch * a.len
    q = (torch.randn(t, H, D, generator=gen) * 0.5).to(DEV, torch.bfloat16)
    sinks = torch.randn(H, generator=gen).to(DEV)
    rows, keep, keep_tok = [], sparse_group.MIN_TOKENS, sparse_group.TOKENS
    for kind in ("swa", "csa", "hca"):
        kv, idx = layer_inputs(a.batch, a.len, kind, gen)
        entries = sum(int((i >= 0).sum()) for i in idx)
        floor = 4 * H * D * entries / rate
        res = {}
        for name, min_tokens, tokens in (("direct", 1 << 62, keep_tok), ("groups4", 1, 4), ("groups2", 1, 2)):
            sparse_group.MIN_TOKENS, sparse_group.TOKENS = min_tokens, tokens
            try:
                f = lambda: attention.sparse_attention(q, kv, idx, D ** -0.5, sinks, ["none"] * len(kv))  # noqa: E731
                res[name] = (tt.do_bench(f, warmup=5, rep=50) * 1e-3, f())
            finally:
                sparse_group.MIN_TOKENS, sparse_group.TOKENS = keep, keep_tok
        row = {"kind": kind, "tokens": t, "entries": entries, "floor_us": floor * 1e6,
               "direct_us": res["direct"][0] * 1e6}
        for g in ("groups4", "groups2"):
            row[f"{g}_us"] = res[g][0] * 1e6
            row[f"{g}_diff"] = rel(res[g][1].float(), res["direct"][1].float())
            print(f"sparse prefill {kind} B{a.batch} x {a.len}: direct {row['direct_us']:8.1f} us, {g} "
                  f"{row[g + '_us']:8.1f} us ({row['direct_us'] / row[g + '_us']:4.2f}x), floor "
                  f"{row['floor_us']:6.1f} us ({row['floor_us'] / row[g + '_us'] * 100:4.1f}% of {g}), "
                  f"diff {row[g + '_diff']:.1e}", flush=True)
        rows.append(row)
    for fmt in ("none", "mxfp4"):
        rows.append(indexer_rows(a.batch, a.len, fmt, rate, gen))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"matmul_TFLOPs": rate / 1e12, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
