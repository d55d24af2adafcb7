"""Decode attention at long context against its KV-read roofline (issue 20), on one GPU.

mid-v4's decode shapes in the released KV formats, T tokens (one per sequence), CUDA-graph replay
(no Python launch cost, as in the engine's decode graph), per context length:
- `indexer score`: each token scores its sequence's ctx/4 compressed keys (mxfp4, 32 heads x 128);
  `indexer top-k`: the same plus the exact top-512 (the whole op);
- `sparse csa`: 16 heads x 512 over 128 window rows (mxfp8) + min(512, ctx/4) selected compressed
  rows (fp4_e4m3), as a CSA layer reads them; `sparse hca`: the window + all ctx/128 compressed rows.
Each sequence's rows are its own part of one pool, as in a paged cache (larger than L2 from 16k on).

Roofline: the bytes the op must read (each indexed row once, the keys each token may see, q) and
write (out; the indexer's float32 scores are counted as its output), over the copy rate measured in
the same run. Partials of split softmax are the kernels' own traffic and are not counted.

    python benchmarks/nvidia_sparse_decode.py [--ctx 1024,16384,65536] [--batch 64] [--json out.json]
        [--old DIR]     also time DIR/attention.py and DIR/indexer.py (an earlier version of those files,
                        with DIR/quant.py if there) on the same inputs; "diff" is the relative difference
                        of the outputs (top-k rows: the share of ids that differ)
        [--tiles]       sparse attention: sweep the packed-row tile (BL, warps, stages) and the split
Sparse rows marked [bytes] load packed rows as bytes where split_rows would load int32 words
(quant.WORD_LOADS).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvidia_qgemm import copy_rate, graph_time, rel  # noqa: E402

from shuili.platforms.nvidia import attention, indexer, quant  # noqa: E402

DEV = "cuda"
BF = torch.bfloat16
H, D, WIN, TOPK = 16, 512, 128, 512  # mid-v4 attention: heads, head dim, window, selected entries
IH, IDK, RATIO, BS = 32, 128, 4, 64  # indexer heads and dim, CSA ratio, compressed entries per block
HCA = 128


def load_old(path: str, name: str):
    """DIR/name.py as a module of its own. Where DIR holds a quant.py too, the old module imports
    that one in place of today's (the kernels' row decoders live there)."""
    def load(n):
        spec = importlib.util.spec_from_file_location(f"old_{n}", os.path.join(path, f"{n}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    key = "shuili.platforms.nvidia.quant"
    if not os.path.exists(os.path.join(path, "quant.py")):
        return load(name)
    today = sys.modules[key]
    sys.modules[key] = load("quant")
    try:
        return load(name)
    finally:
        sys.modules[key] = today


@contextlib.contextmanager
def byte_loads():
    """split_rows on bytes, where it would load int32 words (quant.WORD_LOADS)."""
    was, quant.WORD_LOADS = quant.WORD_LOADS, False
    try:
        yield
    finally:
        quant.WORD_LOADS = was


def pool(rows: int, fmt: str, d: int) -> torch.Tensor:
    """Packed rows [rows, bytes] of random values, built in slices (the float rows of a 64k pool
    would not fit beside it)."""
    out = torch.empty(rows, quant.bytes_per_row(fmt, d), dtype=torch.uint8, device=DEV)
    for i in range(0, rows, 1 << 16):
        n = min(1 << 16, rows - i)
        out[i:i + n] = quant.kv_quantize(torch.randn(n, d, device=DEV), fmt)
    return out


def sparse_case(t: int, ctx: int, kind: str):
    """(q, caches, indices, formats, bytes read): window rows + this layer's compressed rows."""
    gen = torch.Generator(device=DEV).manual_seed(ctx)
    n_comp = ctx // RATIO if kind == "csa" else ctx // HCA
    width = min(TOPK, n_comp) if kind == "csa" else n_comp
    win = pool(t * WIN, "mxfp8", D)
    comp = pool(t * n_comp, "fp4_e4m3", D)
    wi = (torch.arange(t, device=DEV)[:, None] * WIN + torch.arange(WIN, device=DEV)).to(torch.int32)
    if kind == "csa":  # distinct rows of the token's own sequence, sorted as a top-k's ids are not
        pick = torch.rand(t, n_comp, device=DEV, generator=gen).argsort(1)[:, :width]
    else:
        pick = torch.arange(width, device=DEV).expand(t, width)
    ci = (torch.arange(t, device=DEV)[:, None] * n_comp + pick).to(torch.int32)
    q = torch.randn(t, H, D, device=DEV, dtype=BF)
    nbytes = t * (WIN * win.shape[1] + width * comp.shape[1]) + 2 * q.numel() * 2
    return q, [win.view(-1, 1, win.shape[1]), comp.view(-1, 1, comp.shape[1])], [wi, ci], \
        ["mxfp8", "fp4_e4m3"], nbytes


def indexer_case(t: int, ctx: int):
    ents = ctx // RATIO
    nblk = (ents + BS - 1) // BS
    kc = pool(t * nblk * BS, "mxfp4", IDK).view(t * nblk, BS, -1)
    bt = torch.randperm(t * nblk, device=DEV).to(torch.int32).view(t, nblk)  # scattered pages
    q = torch.randn(t, IH, IDK, device=DEV, dtype=BF)
    w = torch.randn(t, IH, device=DEV)
    qsl = torch.arange(t + 1, device=DEV, dtype=torch.int32)
    pos = torch.full((t,), ctx - 1, device=DEV, dtype=torch.int64)
    nbytes = t * ents * kc.shape[-1] + q.numel() * 2 + w.numel() * 4 + t * nblk * BS * 4
    return (q, w, kc, bt, qsl, pos), nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="1024,16384,65536")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--old", default=None)
    ap.add_argument("--tiles", action="store_true")
    ap.add_argument("--ms", type=int, default=100)
    args = ap.parse_args()
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()}  copy rate {rate / 1e12:.2f} TB/s  batch {args.batch}")
    old_att = load_old(args.old, "attention") if args.old else None
    old_idx = load_old(args.old, "indexer") if args.old else None
    rows = []

    def record(name, sec, nbytes, err=None):
        floor = nbytes / rate
        rows.append(dict(case=name, us=sec * 1e6, floor_us=floor * 1e6, pct=100 * floor / sec, err=err))
        e = "" if err is None else f"  diff {err:.1e}"
        print(f"{name:<44} {sec * 1e6:9.1f} us  floor {floor * 1e6:7.1f} us  {100 * floor / sec:5.1f}%{e}",
              flush=True)

    t = args.batch
    for ctx in [int(c) for c in args.ctx.split(",")]:
        iargs, ibytes = indexer_case(t, ctx)
        sargs = (*iargs[:6], RATIO)
        score = lambda mod=indexer: mod._scores(*sargs, "mxfp4")  # noqa: E731
        top = lambda mod=indexer: mod.indexer_topk(*iargs, RATIO, TOPK, "mxfp4")  # noqa: E731
        s_new = score()
        record(f"indexer score ctx{ctx}", graph_time([score], args.ms), ibytes + t * (ctx // RATIO) * 4)
        record(f"indexer top-k ctx{ctx}", graph_time([top], args.ms), ibytes)
        if old_idx is not None:
            s_old = score(old_idx)
            ok = torch.isfinite(s_old)
            record(f"indexer score ctx{ctx} [old]", graph_time([lambda: score(old_idx)], args.ms),
                   ibytes + t * (ctx // RATIO) * 4, rel(s_new[ok], s_old[ok]))
            same = (top() == top(old_idx)).float().mean().item()
            record(f"indexer top-k ctx{ctx} [old]", graph_time([lambda: top(old_idx)], args.ms), ibytes,
                   1 - same)
        del iargs, sargs, s_new
        for kind in ("csa", "hca"):
            q, kv, idx, fmts, nbytes = sparse_case(t, ctx, kind)
            run = lambda mod=attention: mod.sparse_attention(q, kv, idx, D ** -0.5, None, fmts)  # noqa: E731
            out = run()
            record(f"sparse {kind} ctx{ctx} L{WIN + idx[1].shape[1]}", graph_time([run], args.ms), nbytes)
            with byte_loads():
                record(f"sparse {kind} ctx{ctx} [bytes]", graph_time([run], args.ms), nbytes,
                       rel(run().float(), out.float()))
            if old_att is not None:
                record(f"sparse {kind} ctx{ctx} [old]", graph_time([lambda: run(old_att)], args.ms), nbytes,
                       rel(out.float(), run(old_att).float()))
            if args.tiles and kind == "csa":
                base, split0 = attention._sparse_tiles, attention.SPARSE_SPLIT
                try:
                    for words in (True, False):
                        for bl, warps, stages, split in ((16, 4, 3, 128), (32, 4, 2, 128), (32, 4, 3, 128),
                                                         (64, 4, 2, 128), (32, 4, 2, 256), (64, 4, 2, 256)):
                            attention._sparse_tiles = lambda d, h, packed, c=(bl, warps, stages): (
                                16, c[0], c[1], c[2], True)
                            attention.SPARSE_SPLIT = split
                            how = "words" if words else "bytes"
                            name = f"  tile BL{bl} w{warps} s{stages} split{split} {how}"
                            quant.WORD_LOADS = words
                            try:
                                sec = graph_time([run], args.ms)
                                record(name, sec, nbytes, rel(run().float(), out.float()))
                            except Exception as e:  # noqa: BLE001 (a tile that fails: say so, go on)
                                print(f"{name}: {type(e).__name__}")
                finally:
                    attention._sparse_tiles, attention.SPARSE_SPLIT = base, split0
                    quant.WORD_LOADS = True
            del q, kv, idx, out
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_rate=rate, batch=t, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
