"""DeepSeek-V4 Lightning Indexer: a Triton score kernel over each query's visible compressed keys
(paged, plain or MXFP4), then an exact top-k on (score desc, entry id asc) in one program a row."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import cdiv, desc_key, pow2
from shuili.platforms.nvidia.quant import FORMAT_ID, bytes_per_row, load_packed_rows
from shuili.platforms.nvidia.softmax import dot

# Default mode from GROUP_MIN_TOKENS query tokens (a prefill): GROUP_TOKENS consecutive tokens a score
# program, so neighbours of one sequence load each key once between them (one token a program read
# every key once per query: the 4k prefill's score took 1.85 ms, about 27% of its FLOP floor) and
# multiply it in one [GROUP_TOKENS x heads, keys] product. The head sum then reduces another shape,
# so a token's scores may differ in the last bits from one token a program: batch-invariant mode
# and smaller batches keep one token a program. 0 turns the groups off, the default until a GPU has
# timed them (benchmarks/nvidia_sparse_prefill.py): no GPU was lent to the session that wrote them.
# 512 is the value they were written for
GROUP_TOKENS = 4
GROUP_MIN_TOKENS = int(os.environ.get("SHUILI_INDEXER_GROUP_MIN_TOKENS", "0"))


@triton.jit
def _score_token(q_ptr, w_ptr, k_ptr, bt_ptr, seq_ptr, pos_ptr, out_ptr, t, e, H, ratio, E_MAX, s_qt, s_qh, s_bt,
                 ROW, RA: tl.constexpr, BS: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, HP: tl.constexpr,
                 BE: tl.constexpr, FMT: tl.constexpr, F32: tl.constexpr):
    """Scores of the keys e [BE] for token t (packed keys decoded by quant.load_packed_rows, the
    faster decode here: see its docstring)."""
    b = tl.load(seq_ptr + t)
    nvis = (tl.load(pos_ptr + t) + 1) // ratio
    if tl.min(e, 0) >= nvis:  # past this token's visible keys (the grid spans the longest table)
        tl.store(out_ptr + t * E_MAX + e, tl.full([BE], float("-inf"), tl.float32), mask=e < E_MAX)
    else:
        eok = e < nvis
        h = tl.arange(0, HP)
        hok = h < H
        at = _key_rows(k_ptr, bt_ptr, b, e, eok, s_bt, ROW, RA, BS)
        d = tl.arange(0, DKP)
        dok = d < DK
        q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + d[None, :], mask=hok[:, None] & dok[None, :],
                    other=0.0)
        keys = _keys(at, eok, d, dok, DK, FMT).to(q.dtype)
        dots = dot(q, tl.trans(keys), F32)
        w = tl.load(w_ptr + t * H + h, mask=hok, other=0.0)
        score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), axis=0)
        tl.store(out_ptr + t * E_MAX + e, tl.where(eok, score, float("-inf")), mask=e < E_MAX)


@triton.jit
def _key_rows(k_ptr, bt_ptr, b, e, eok, s_bt, ROW, RA: tl.constexpr, BS: tl.constexpr):
    """Byte (or element) addresses [BE] of sequence b's compressed keys e in the paged cache."""
    page = tl.load(bt_ptr + b * s_bt + e // BS, mask=eok, other=0)
    slot = page.to(tl.int64) * BS + e % BS
    # RA: the largest power of two (<= 16) dividing ROW, so what each row's bytes may be loaded as.
    # Stated, since Triton 3.6 derives more from page (other=0) and e % BS: it vectorized the row
    # loads by 8-16 bytes on 17- to 68-byte rows, a misaligned address on the GPU.
    return k_ptr + tl.multiple_of(slot * ROW, RA)


@triton.jit
def _keys(at, eok, d, dok, DK: tl.constexpr, FMT: tl.constexpr):
    """Keys [BE, DKP] at the row addresses at (FMT 0: plain; else packed, decoded per element)."""
    if FMT == 0:
        keys = tl.load(at[:, None] + d[None, :], mask=eok[:, None] & dok[None, :], other=0.0)
    else:
        keys = load_packed_rows(at, eok, d, DK, FMT)
    return keys


@triton.jit
def _score_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, seq_ptr, pos_ptr, out_ptr, T, H, ratio, E_MAX, s_qt,
                  s_qh, s_bt, ROW, RA: tl.constexpr, BS: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                  HP: tl.constexpr, BE: tl.constexpr, FMT: tl.constexpr, F32: tl.constexpr, TOK: tl.constexpr):
    """Scores of BE keys (program_id(1)) for TOK consecutive tokens (program_id(0)). TOK 1: the token
    alone (_score_token). TOK > 1, where the tokens are of one sequence (a prefill's neighbours):
    its keys load once for all of them, one [TOK * HP, BE] product; else each token alone."""
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    if TOK == 1:
        _score_token(q_ptr, w_ptr, k_ptr, bt_ptr, seq_ptr, pos_ptr, out_ptr, tl.program_id(0).to(tl.int64), e, H,
                     ratio, E_MAX, s_qt, s_qh, s_bt, ROW, RA, BS, DK, DKP, HP, BE, FMT, F32)
    else:
        t0 = tl.program_id(0).to(tl.int64) * TOK
        tt = t0 + tl.arange(0, TOK)
        tok_ok = tt < T
        b0 = tl.load(seq_ptr + t0)
        b = tl.load(seq_ptr + tt, mask=tok_ok, other=b0)
        nvis = (tl.load(pos_ptr + tt, mask=tok_ok, other=-1) + 1) // ratio  # [TOK]
        if (tl.min(b, 0) == tl.max(b, 0)) & (tl.min(e, 0) < tl.max(nvis, 0)):
            eok = e < tl.max(nvis, 0)
            at = _key_rows(k_ptr, bt_ptr, b0, e, eok, s_bt, ROW, RA, BS)
            d = tl.arange(0, DKP)
            dok = d < DK
            M: tl.constexpr = TOK * HP
            r = tl.arange(0, M)
            tr = t0 + r // HP
            h = r % HP
            rok = (tr < T) & (h < H)
            q = tl.load(q_ptr + tr[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                        mask=rok[:, None] & dok[None, :], other=0.0)
            keys = _keys(at, eok, d, dok, DK, FMT).to(q.dtype)
            dots = dot(q, tl.trans(keys), F32)  # [M, BE]
            w = tl.load(w_ptr + tr * H + h, mask=rok, other=0.0)
            score = tl.sum(tl.reshape(w[:, None] * tl.maximum(dots, 0.0), (TOK, HP, BE)), axis=1)
            score = tl.where(e[None, :] < nvis[:, None], score, float("-inf"))
            tl.store(out_ptr + tt[:, None] * E_MAX + e[None, :], score, mask=tok_ok[:, None] & (e < E_MAX)[None, :])
        else:
            for i in tl.static_range(TOK):
                if t0 + i < T:
                    _score_token(q_ptr, w_ptr, k_ptr, bt_ptr, seq_ptr, pos_ptr, out_ptr, t0 + i, e, H, ratio, E_MAX,
                                 s_qt, s_qh, s_bt, ROW, RA, BS, DK, DKP, HP, BE, FMT, F32)


def _scores(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, k_format, batch_invariant=False):
    """float32 [T, E_MAX] scores, -inf past each query's visible entries (E_MAX = the table's width)."""
    t, h, dk = q.shape
    nb, bs = k_cache.shape[:2]
    e_max = block_tables.shape[1] * bs
    scores = torch.empty(t, e_max, dtype=torch.float32, device=q.device)
    if t == 0 or e_max == 0:
        return scores
    row = dk if k_format == "none" else bytes_per_row(k_format, dk)
    rows = k_cache.reshape(nb * bs, row).contiguous()
    qsl = query_start_loc.to(torch.int64)
    seq = torch.searchsorted(qsl[1:].contiguous(), torch.arange(t, device=q.device), right=True)
    be = 64
    q = q.contiguous()
    tok = GROUP_TOKENS if not batch_invariant and 0 < GROUP_MIN_TOKENS <= t else 1
    _score_kernel[(cdiv(t, tok), cdiv(e_max, be))](
        q, weights.float().contiguous(), rows, block_tables.to(torch.int32).contiguous(), seq,
        positions.to(torch.int64).contiguous(), scores, t, h, int(ratio), e_max, q.stride(0), q.stride(1),
        block_tables.shape[1], row, RA=min(16, row & -row), BS=bs, DK=dk, DKP=pow2(dk, 16),
        HP=pow2(h, 16), BE=be, FMT=FORMAT_ID[k_format], F32=q.dtype == torch.float32, TOK=tok,
        num_warps=4 if tok == 1 else 8)
    return scores


_NO_SCORE = int(desc_key(torch.tensor([float("-inf")]), torch.zeros(1, dtype=torch.int64))[0]) >> 32
# rows up to this many entries are sorted whole; longer ones are radix-selected first
SORT_MAX = 2048


@triton.jit
def _order(row, i, n):
    """Scores row[i] (i < n) as int64 u = mono + 2^31 in [0, 2^32): common.desc_key's order of the
    float32 bits (NaN with the sign bit clear on top)."""
    bits = tl.load(row + i, mask=i < n, other=0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648


@triton.jit
def _key(u, i):
    """common.desc_key of _order's u and entry ids i: one int64, score desc then id asc."""
    return ((u - 2147483648) << 32) + (0xFFFFFFFF - i.to(tl.int64))


@triton.jit
def _topk_kernel(s_ptr, keep_ptr, out_ptr, n, K, no_score, s_row, WHOLE: tl.constexpr, KP: tl.constexpr,
                 NP: tl.constexpr, BLOCK: tl.constexpr):
    """One row of scores -> the ids of its K highest int64 (score desc, id asc) keys, in that order;
    keys at or below -inf's (no score) as -1. WHOLE: the row's NP >= n keys are sorted. Otherwise an
    8-bit radix select finds the K-th highest score (4 passes over the row, a histogram each), one
    more pass keeps every key above it and the lowest ids of those equal to it (exactly K), and the
    kept keys are sorted: the same K keys, in the same order, as a sort of the whole row."""
    t = tl.program_id(0).to(tl.int64)
    row = s_ptr + t * s_row
    if WHOLE:
        j = tl.arange(0, NP)
        key = tl.where(j < n, _key(_order(row, j, n), j), -9223372036854775807 - 1)
    else:
        b = tl.arange(0, 256)
        prefix = tl.zeros([], tl.int64)  # the K-th highest u, found 8 bits a pass
        rem = K  # of the keys matching prefix, how many are still to take
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros([256], tl.int32)
            for c0 in range(0, n, BLOCK):
                i = c0 + tl.arange(0, BLOCK)
                u = _order(row, i, n)
                hit = (i < n) & ((u >> (shift + 8)) == prefix)
                hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=hit)
            above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # [256]: matching keys with a higher digit
            d = tl.min(tl.where(above < rem, b, 256), 0)  # the digit of the K-th highest
            rem -= tl.sum(tl.where(b > d, hist, 0), 0)
            prefix = prefix * 256 + d
        taken = 0
        ties = 0
        for c0 in range(0, n, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            u = _order(row, i, n)
            eq = ((i < n) & (u == prefix)).to(tl.int32)
            keep = ((i < n) & (u > prefix)).to(tl.int32) | (eq & ((ties + tl.cumsum(eq, 0) - eq) < rem))
            pos = taken + tl.cumsum(keep, 0) - keep
            tl.store(keep_ptr + t * KP + pos, _key(u, i), mask=keep != 0)
            taken += tl.sum(keep, 0)
            ties += tl.sum(eq, 0)
        tl.debug_barrier()  # the kept keys, stored by other threads of this program
        j = tl.arange(0, KP)
        key = tl.load(keep_ptr + t * KP + j, mask=j < K, other=-9223372036854775807 - 1)
    key = tl.sort(key, 0, descending=True)
    ids = tl.where((key >> 32) > no_score, 0xFFFFFFFF - (key & 0xFFFFFFFF), -1).to(tl.int32)
    tl.store(out_ptr + t * K + j, ids, mask=j < K)


def _top(scores: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """int32 [T, width]: ids of the k highest scores (desc, ties to the lower id), -1 padded; scores at
    -inf count as none. A NaN score with its sign bit clear comes first (as the reference's stable
    sort puts NaN). One program a row (_topk_kernel)."""
    t, n = scores.shape
    out = torch.full((t, width), -1, dtype=torch.int32, device=scores.device)
    k = min(k, n)
    if t == 0 or k == 0:
        return out
    scores = scores.float().contiguous()
    top = out if k == width else torch.empty(t, k, dtype=torch.int32, device=scores.device)
    kp = pow2(k)
    whole = n <= max(kp, SORT_MAX)
    keep = scores if whole else torch.empty(t, kp, dtype=torch.int64, device=scores.device)
    _topk_kernel[(t,)](scores, keep, top, n, k, _NO_SCORE, scores.stride(0), WHOLE=whole, KP=kp,
                       NP=pow2(n), BLOCK=1024, num_warps=4 if whole and n <= 512 else 8)
    if top is not out:
        out[:, :k] = top
    return out


def indexer_topk(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, topk,
                 k_format="none", *, batch_invariant: bool = False):
    if ratio <= 0 or topk <= 0:
        raise ValueError(f"ratio ({ratio}) and topk ({topk}) must be positive")
    scores = _scores(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, k_format,
                     batch_invariant)
    return _top(scores, topk, topk)


def indexer_select(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, topk,
                   k_format="none", candidates=None, candidate_topk=0, candidate_block_size=1, *,
                   batch_invariant: bool = False):
    """The V4.1 levels in torch on the kernel's scores: candidate-pool mask, block max with the
    newest block pinned, and exact top-k on (score desc, id asc) keys for both."""
    if ratio <= 0 or topk <= 0:
        raise ValueError(f"ratio ({ratio}) and topk ({topk}) must be positive")
    scores = _scores(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, k_format,
                     batch_invariant)
    t, n = scores.shape
    S = candidate_block_size
    blk = torch.arange(n, device=q.device) // S
    if candidates is not None and t:
        allowed = (blk[None, :, None] == candidates.to(torch.int64)[:, None, :]).any(-1)
        scores = scores.masked_fill(~allowed, float("-inf"))
    idx = _top(scores, topk, topk)
    cand = torch.full((t, candidate_topk), -1, dtype=torch.int32, device=q.device)
    if candidate_topk and t and n:
        nblk = cdiv(n, S)
        padded = torch.full((t, nblk * S), float("-inf"), device=q.device)
        padded[:, :n] = scores
        bscore = padded.view(t, nblk, S).amax(-1)
        n_t = torch.div(positions.to(torch.int64) + 1, ratio, rounding_mode="floor")
        last = torch.div(n_t - 1, S, rounding_mode="floor")
        pin = (torch.arange(nblk, device=q.device)[None, :] == last[:, None]) & (n_t[:, None] > 0)
        bscore = bscore.masked_fill(pin, float("inf"))
        cand = _top(bscore, candidate_topk, candidate_topk)
    return idx, cand
