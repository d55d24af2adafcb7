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
                  s_qh, s_bt, ROW, BS: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
                  HP: tl.constexpr, BE: tl.constexpr, FMT: tl.constexpr, F32: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    b = tl.load(seq_ptr + t)
    nvis = (tl.load(pos_ptr + t) + 1) // ratio
    if tl.program_id(1) * BE >= nvis:  # past this token's visible keys (the grid spans the longest table)
        tl.store(out_ptr + t * E_MAX + e, tl.full([BE], float("-inf"), tl.float32), mask=e < E_MAX)
        return
    eok = e < nvis
    h = tl.arange(0, HP)
    hok = h < H
    d = tl.arange(0, DKP)
    dok = d < DK
    q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + d[None, :], mask=hok[:, None] & dok[None, :],
                other=0.0)
    page = tl.load(bt_ptr + b * s_bt + e // BS, mask=eok, other=0)
    slot = page.to(tl.int64) * BS + e % BS
    if FMT == 0:
        keys = tl.load(k_ptr + slot[:, None] * ROW + d[None, :], mask=eok[:, None] & dok[None, :],
                       other=0.0)
    else:
        keys = load_packed_rows(k_ptr + slot * ROW, eok, d, DK, FMT)
    keys = keys.to(q.dtype)
    if F32:
        dots = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        dots = tl.dot(q, tl.trans(keys))
    w = tl.load(w_ptr + t * H + h, mask=hok, other=0.0)
    score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), axis=0)
    tl.store(out_ptr + t * E_MAX + e, tl.where(eok, score, float("-inf")), mask=e < E_MAX)


def _scores(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, k_format):
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
    _score_kernel[(t, cdiv(e_max, be))](
        q, weights.float().contiguous(), rows, block_tables.to(torch.int32).contiguous(), seq,
        positions.to(torch.int64).contiguous(), scores, h, int(ratio), e_max, q.stride(0), q.stride(1),
        block_tables.shape[1], row, BS=bs, DK=dk, DKP=pow2(dk, 16), HP=pow2(h, 16), BE=be,
        FMT=FORMAT_ID[k_format], F32=q.dtype == torch.float32)
    return scores


def _top(scores: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """int32 [T, width]: ids of the k highest finite scores (desc, ties to the lower id), -1 padded."""
    t, n = scores.shape
    out = torch.full((t, width), -1, dtype=torch.int32, device=scores.device)
    k = min(k, n)
    if t == 0 or k == 0:
        return out
    ids = torch.arange(n, device=scores.device).expand(t, n)
    top = key_ids(torch.topk(desc_key(scores, ids), k, dim=1, sorted=True).values)
    valid = torch.gather(scores, 1, top) > float("-inf")
    out[:, :k] = torch.where(valid, top, -1).to(torch.int32)
    return out


def indexer_topk(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, topk,
                 k_format="none"):
    if ratio <= 0 or topk <= 0:
        raise ValueError(f"ratio ({ratio}) and topk ({topk}) must be positive")
    scores = _scores(q, weights, k_cache, block_tables, query_start_loc, positions, ratio, k_format)
    return _top(scores, topk, topk)


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
