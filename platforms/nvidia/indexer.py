"""DeepSeek-V4 Lightning Indexer: a Triton score kernel over each query's visible compressed keys
(paged, plain or MXFP4), then an exact top-k on an int64 (score desc, entry id asc) key."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import cdiv, desc_key, key_ids, pow2
from shuili.platforms.nvidia.quant import FORMAT_ID, bytes_per_row, load_packed_rows


@triton.jit
def _score_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, seq_ptr, pos_ptr, out_ptr, H, ratio, E_MAX, s_qt,
                  s_qh, s_bt, ROW, RA: tl.constexpr, BS: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                  HP: tl.constexpr, BE: tl.constexpr, FMT: tl.constexpr, F32: tl.constexpr,
                  KEYS: tl.constexpr):
    """Scores of BE keys for one token (packed keys decoded by quant.load_packed_rows, the faster
    decode here: see its docstring). KEYS: out is int64, each score's desc_key (common.py) with its
    entry id, ready for an exact top-k."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    b = tl.load(seq_ptr + t)
    nvis = (tl.load(pos_ptr + t) + 1) // ratio
    if tl.program_id(1) * BE >= nvis:  # past this token's visible keys (the grid spans the longest table)
        _store(out_ptr + t * E_MAX + e, tl.full([BE], float("-inf"), tl.float32), e, e < E_MAX, KEYS)
        return
    eok = e < nvis
    h = tl.arange(0, HP)
    hok = h < H
    page = tl.load(bt_ptr + b * s_bt + e // BS, mask=eok, other=0)
    slot = page.to(tl.int64) * BS + e % BS
    # RA: the largest power of two (<= 16) dividing ROW, so what each row's bytes may be loaded as.
    # Stated, since Triton 3.6 derives more from page (other=0) and e % BS: it vectorized the row
    # loads by 8-16 bytes on 17- to 68-byte rows, a misaligned address on the GPU.
    at = k_ptr + tl.multiple_of(slot * ROW, RA)
    d = tl.arange(0, DKP)
    dok = d < DK
    q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + d[None, :], mask=hok[:, None] & dok[None, :],
                other=0.0)
    if FMT == 0:
        keys = tl.load(at[:, None] + d[None, :], mask=eok[:, None] & dok[None, :], other=0.0)
    else:
        keys = load_packed_rows(at, eok, d, DK, FMT)
    keys = keys.to(q.dtype)
    if F32:
        dots = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        dots = tl.dot(q, tl.trans(keys))
    w = tl.load(w_ptr + t * H + h, mask=hok, other=0.0)
    score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), axis=0)
    _store(out_ptr + t * E_MAX + e, tl.where(eok, score, float("-inf")), e, e < E_MAX, KEYS)


@triton.jit
def _store(at, score, e, ok, KEYS: tl.constexpr):
    if KEYS:  # desc_key(score, e): the float's bits made monotone, then the id descending
        bits = score.to(tl.int32, bitcast=True)
        mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        tl.store(at, (mono << 32) + (0xFFFFFFFF - e.to(tl.int64)), mask=ok)
    else:
        tl.store(at, score, mask=ok)


def _scores(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, k_format, keys=False):
    """float32 [T, E_MAX] scores, -inf past each query's visible entries (E_MAX = the table's width);
    keys: their int64 desc_key instead (common.py)."""
    t, h, dk = q.shape
    nb, bs = k_cache.shape[:2]
    e_max = block_tables.shape[1] * bs
    scores = torch.empty(t, e_max, dtype=torch.int64 if keys else torch.float32, device=q.device)
    if t == 0 or e_max == 0:
        return scores
    row = dk if k_format == "none" else bytes_per_row(k_format, dk)
    rows = k_cache.reshape(nb * bs, row).contiguous()
    qsl = query_start_loc.to(torch.int64)
    seq = torch.searchsorted(qsl[1:].contiguous(), torch.arange(t, device=q.device), right=True)
    be = 64
    q = q.contiguous()
    _score_kernel[(t, cdiv(e_max, be))](
        q, weights.float().contiguous(), rows, block_tables.to(torch.int32).contiguous(), seq,
        positions.to(torch.int64).contiguous(), scores, h, int(ratio), e_max, q.stride(0), q.stride(1),
        block_tables.shape[1], row, RA=min(16, row & -row), BS=bs, DK=dk, DKP=pow2(dk, 16),
        HP=pow2(h, 16), BE=be, FMT=FORMAT_ID[k_format], F32=q.dtype == torch.float32, KEYS=keys)
    return scores


_NO_SCORE = int(desc_key(torch.tensor([float("-inf")]), torch.zeros(1, dtype=torch.int64))[0]) >> 32


def _top(scores: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """int32 [T, width]: ids of the k highest finite scores (desc, ties to the lower id), -1 padded."""
    t, n = scores.shape
    ids = torch.arange(n, device=scores.device).expand(t, n)
    return _top_keys(desc_key(scores, ids), k, width)


def _top_keys(keys: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """_top on the scores' desc_keys. A key above -inf's is a score above -inf; a NaN score with
    its sign bit clear is one too and comes first (as the reference's stable sort puts NaN)."""
    t, n = keys.shape
    out = torch.full((t, width), -1, dtype=torch.int32, device=keys.device)
    k = min(k, n)
    if t == 0 or k == 0:
        return out
    top = torch.topk(keys, k, dim=1, sorted=True).values
    out[:, :k] = torch.where((top >> 32) > _NO_SCORE, key_ids(top), -1).to(torch.int32)
    return out


def indexer_topk(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, topk,
                 k_format="none"):
    if ratio <= 0 or topk <= 0:
        raise ValueError(f"ratio ({ratio}) and topk ({topk}) must be positive")
    keys = _scores(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, k_format, keys=True)
    return _top_keys(keys, topk, topk)


def indexer_select(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, topk,
                   k_format="none", candidates=None, candidate_topk=0, candidate_block_size=1):
    """The V4.1 levels in torch on the kernel's scores: candidate-pool mask, block max with the
    newest block pinned, and exact top-k on (score desc, id asc) keys for both."""
    if ratio <= 0 or topk <= 0:
        raise ValueError(f"ratio ({ratio}) and topk ({topk}) must be positive")
    scores = _scores(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, k_format)
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
