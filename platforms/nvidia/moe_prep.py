"""MoE routing prep in one launch (three at prefill sizes): the stable order of the (token, slot)
rows by expert, the rows per expert, and the grouped GEMMs' tile map. In torch this was an argsort
(a single-block radix sort, ~27 us on the H200 at 384 rows), an index_add and ~8 small kernels for
the tile map, per layer and decode step. One program counts and places the rows; the permutation
is the same as the stable sort's (it is unique), so no output bit changes. group_tiles, the torch
tile map, lives here too: grouped_linear uses it, and the routing prep falls back to it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import cdiv, interpreting, pow2

# above MAX_ROWS rows (prefill) the one program's row loop would grow with the rows: three launches
# over CHUNK_ROWS-row chunks instead (count, offsets + tile map, place), where torch's stable sort,
# counts and tile map took about ten, memsets among them, per MoE layer
MAX_ROWS = 4096
CHUNK_ROWS = 2048
# [chunk, groups] tiles of about TILE_VALUES values, PREP_WARPS warps: the one program's loop
# steps are its latency. benchmarks/nvidia_qgemm.py --prep-sweep (H100, 2026-12-07): at mid-v4's
# routing (384 rows, 32 experts) these are the fastest of 4096-16384 values x 4-8 warps (11.6 us)
TILE_VALUES = 4096
PREP_WARPS = 4
MAX_GROUPS = 1024  # _tiles_kernel holds every group's count in one program


@triton.jit
def _count_rows(ids_ptr, r0, r1, N, ex, EP: tl.constexpr, BC: tl.constexpr):
    """[EP] int32: the rows r0 .. r1 - 1 (those below N) per expert ex."""
    cnt = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(r0, r1, BC):
        i = c0 + tl.arange(0, BC)
        v = tl.load(ids_ptr + i, mask=i < N, other=-1).to(tl.int32)
        cnt += tl.sum((v[:, None] == ex[None, :]).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _place_rows(ids_ptr, order_ptr, r0, r1, N, ex, first, BC: tl.constexpr):
    """Rows r0 .. r1 - 1 (those below N) to their sorted places, in row order: each expert's rows
    from its place first [EP] on."""
    run = first
    for c0 in range(r0, r1, BC):
        i = c0 + tl.arange(0, BC)
        v = tl.load(ids_ptr + i, mask=i < N, other=-1).to(tl.int32)
        hot = (v[:, None] == ex[None, :]).to(tl.int32)  # [BC, EP]
        pos = tl.sum(hot * (tl.cumsum(hot, 0) - 1 + run[None, :]), axis=1)  # the row's expert column alone
        tl.store(order_ptr + pos, i.to(tl.int64), mask=i < N)
        run += tl.sum(hot, axis=0)


@triton.jit
def _prep_kernel(ids_ptr, order_ptr, sizes_ptr, te_ptr, t0_ptr, t1_ptr, N, E, NT, BM,
                 BC: tl.constexpr, EP: tl.constexpr, TC: tl.constexpr):
    ex = tl.arange(0, EP)
    eok = ex < E
    cnt = _count_rows(ids_ptr, 0, N, N, ex, EP, BC)
    start = tl.cumsum(cnt, 0) - cnt  # [EP] first sorted row of each expert
    _place_rows(ids_ptr, order_ptr, 0, N, N, ex, start, BC)
    tl.store(sizes_ptr + ex, cnt.to(tl.int64), mask=eok)
    _tile_map(cnt, start, ex, eok, te_ptr, t0_ptr, t1_ptr, E, NT, BM, TC)


@triton.jit
def _chunk_count_kernel(ids_ptr, hist_ptr, N, EP: tl.constexpr, BC: tl.constexpr, CH: tl.constexpr):
    """hist[c, :EP] = the rows of chunk c (CH rows) per expert."""
    c = tl.program_id(0)
    ex = tl.arange(0, EP)
    tl.store(hist_ptr + c * EP + ex, _count_rows(ids_ptr, c * CH, c * CH + CH, N, ex, EP, BC))


@triton.jit
def _chunk_offsets_kernel(hist_ptr, sizes_ptr, te_ptr, t0_ptr, t1_ptr, NC, E, NT, BM, EP: tl.constexpr,
                          TC: tl.constexpr):
    """hist[c] becomes chunk c's first sorted row per expert (the expert's first row, plus the rows
    the chunks before c give it); the sizes and the tile map as _prep_kernel writes them."""
    ex = tl.arange(0, EP)
    eok = ex < E
    cnt = tl.zeros([EP], dtype=tl.int32)
    for c in range(0, NC):
        cnt += tl.load(hist_ptr + c * EP + ex)
    start = tl.cumsum(cnt, 0) - cnt
    run = start
    for c in range(0, NC):
        h = tl.load(hist_ptr + c * EP + ex)
        tl.store(hist_ptr + c * EP + ex, run)
        run += h
    tl.store(sizes_ptr + ex, cnt.to(tl.int64), mask=eok)
    _tile_map(cnt, start, ex, eok, te_ptr, t0_ptr, t1_ptr, E, NT, BM, TC)


@triton.jit
def _chunk_place_kernel(ids_ptr, base_ptr, order_ptr, N, EP: tl.constexpr, BC: tl.constexpr, CH: tl.constexpr):
    """Chunk c's rows to their sorted places, from its first row per expert (base[c]), in row order."""
    c = tl.program_id(0)
    ex = tl.arange(0, EP)
    _place_rows(ids_ptr, order_ptr, c * CH, c * CH + CH, N, ex, tl.load(base_ptr + c * EP + ex), BC)


@triton.jit
def _tile_map(cnt, start, ex, eok, te_ptr, t0_ptr, t1_ptr, E, NT, BM, TC: tl.constexpr):
    """The tile map of group_tiles from the rows per group (cnt [EP]) and each group's first row
    (start [EP]): tile j belongs to the first group whose cumulative tile count exceeds j (-1 past
    the last)."""
    per = tl.where(eok, (cnt + BM - 1) // BM, 0)
    ctile = tl.cumsum(per, 0)
    first = ctile - per
    for j0 in range(0, NT, TC):
        j = j0 + tl.arange(0, TC)
        grp = tl.sum(((ctile[None, :] <= j[:, None]) & eok[None, :]).to(tl.int32), axis=1)
        sel = ex[None, :] == tl.minimum(grp, E - 1)[:, None]  # [TC, EP]
        first_g = tl.sum(tl.where(sel, first[None, :], 0), axis=1)
        start_g = tl.sum(tl.where(sel, start[None, :], 0), axis=1)
        cnt_g = tl.sum(tl.where(sel, cnt[None, :], 0), axis=1)
        jok = j < NT
        tl.store(te_ptr + j, tl.where(grp < E, grp, -1).to(tl.int64), mask=jok)
        tl.store(t0_ptr + j, (start_g + (j - first_g) * BM).to(tl.int64), mask=jok)
        tl.store(t1_ptr + j, (start_g + cnt_g).to(tl.int64), mask=jok)


@triton.jit
def _tiles_kernel(sizes_ptr, te_ptr, t0_ptr, t1_ptr, E, NT, BM, EP: tl.constexpr, TC: tl.constexpr):
    ex = tl.arange(0, EP)
    eok = ex < E
    cnt = tl.load(sizes_ptr + ex, mask=eok, other=0).to(tl.int32)
    _tile_map(cnt, tl.cumsum(cnt, 0) - cnt, ex, eok, te_ptr, t0_ptr, t1_ptr, E, NT, BM, TC)


def _widths(e: int) -> tuple[int, int]:
    """(groups padded to a power of two, rows or tiles per chunk): [chunk, groups] tiles of about
    TILE_VALUES values."""
    ep = pow2(e, 2)
    return ep, max(16, min(TILE_VALUES // 32, TILE_VALUES // ep))  # at most the 32-group chunk


def group_tiles(group_sizes: torch.Tensor, m: int, bm: int):
    """Tile map for rows sorted by group, built on the device (no host sync, graph safe):
    per tile its group (-1 = unused), first row and end row. One launch (_tiles_kernel) where
    Triton runs; torch's ~20 small kernels (each grouped linear of a decode step paid them: mid-v4's
    wo_a, 12 a step) on a plain CPU, or past MAX_GROUPS groups."""
    e = group_sizes.numel()
    if 0 < e <= MAX_GROUPS and m < 2 ** 31 and (group_sizes.device.type != "cpu" or interpreting()):
        nt = cdiv(m, bm) + e
        dev = group_sizes.device
        te, t0, t1 = (torch.empty(nt, dtype=torch.int64, device=dev) for _ in range(3))
        ep, tc = _widths(e)
        _tiles_kernel[(1,)](group_sizes.contiguous(), te, t0, t1, e, nt, bm, EP=ep, TC=tc, num_warps=4)
        return te, t0, t1, nt
    return _group_tiles_torch(group_sizes, m, bm)


def _group_tiles_torch(group_sizes: torch.Tensor, m: int, bm: int):
    gs = group_sizes.to(torch.int64)
    e = gs.numel()
    per = (gs + bm - 1) // bm
    cum = torch.cumsum(per, 0)
    first = cum - per
    off = torch.cumsum(gs, 0) - gs
    nt = cdiv(m, bm) + e
    j = torch.arange(nt, device=gs.device)
    grp = torch.searchsorted(cum, j, right=True)
    g = grp.clamp(max=e - 1)
    r0 = off[g] + (j - first[g]) * bm
    r1 = off[g] + gs[g]
    return torch.where(grp < e, grp, -1).contiguous(), r0.contiguous(), r1.contiguous(), nt


def moe_prep(flat: torch.Tensor, e: int, bm: int):
    """flat int64 [n] expert ids in [0, e) (checked by the caller) -> (order int64 [n]: the stable
    sort of the rows by expert, sizes int64 [e], tiles: group_tiles(sizes, n, bm)'s tuple)."""
    n = flat.numel()
    if n == 0 or n >= 2 ** 31 or (flat.device.type == "cpu" and not interpreting()):
        order = torch.argsort(flat, stable=True)
        sizes = torch.zeros(e, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
        return order, sizes, group_tiles(sizes, n, bm)
    nt = cdiv(n, bm) + e
    dev = flat.device
    order = torch.empty(n, dtype=torch.int64, device=dev)
    sizes = torch.empty(e, dtype=torch.int64, device=dev)
    te, t0, t1 = (torch.empty(nt, dtype=torch.int64, device=dev) for _ in range(3))
    ep, bc = _widths(e)
    flat = flat.contiguous()
    if n <= MAX_ROWS:
        _prep_kernel[(1,)](flat, order, sizes, te, t0, t1, n, e, nt, bm,
                           BC=bc, EP=ep, TC=bc, num_warps=PREP_WARPS)
        return order, sizes, (te, t0, t1, nt)
    nc = cdiv(n, CHUNK_ROWS)
    hist = torch.empty(nc, ep, dtype=torch.int32, device=dev)
    _chunk_count_kernel[(nc,)](flat, hist, n, EP=ep, BC=bc, CH=CHUNK_ROWS, num_warps=PREP_WARPS)
    _chunk_offsets_kernel[(1,)](hist, sizes, te, t0, t1, nc, e, nt, bm, EP=ep, TC=bc, num_warps=PREP_WARPS)
    _chunk_place_kernel[(nc,)](flat, hist, order, n, EP=ep, BC=bc, CH=CHUNK_ROWS, num_warps=PREP_WARPS)
    return order, sizes, (te, t0, t1, nt)
