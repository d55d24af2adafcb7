"""log_softmax (Triton, one program per row, fixed chunk order), penalties and seeded sampling.

Sampling follows the contract step by step with row-wise torch ops: ranks come from an exact sort
of an int64 (logprob desc, id asc) key, the noise from `shuili.hal.noise` (integer hash, so the
GPU draws the reference's u bit for bit), the choice from a first-max argmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.hal import noise
from shuili.platforms.nvidia.common import capturing, cdiv, desc_key, pow2


# The noise argmax cuts a row of V ids into chunks of CHUNK (a constant, never derived from B), so a
# wide vocabulary spreads over B * cdiv(V, CHUNK) programs instead of B.
CHUNK = 4096


@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, V, s_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * s_x + v0 + c, mask=v0 + c < V, other=float("-inf")).to(tl.float32)
        mx = tl.maximum(mx, x)
    m = tl.max(mx, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * s_x + v0 + c, mask=v0 + c < V, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - m)
    # (x - m) - log(s), never x - (m + log s): with |m| in the thousands m + log s keeps few bits of log s
    ls = tl.log(tl.sum(acc, axis=0))
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * s_x + v0 + c, mask=v0 + c < V, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * V + v0 + c, (x - m) - ls, mask=v0 + c < V)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"log_softmax takes logits [B, V], got shape {tuple(logits.shape)}")
    b, v = logits.shape
    out = torch.empty(b, v, dtype=torch.float32, device=logits.device)
    if b and v:
        x = logits if logits.stride(-1) == 1 else logits.contiguous()
        _log_softmax_kernel[(b,)](x, out, v, x.stride(0), BLOCK=min(4096, pow2(v, 16)),
                                  num_warps=8 if v >= 4096 else 4)
    return out


@triton.jit
def _rotl(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _mix(h, k):
    k = _rotl(k * 0xCC9E2D51, 15) * 0x1B873593
    return _rotl(h ^ k, 13) * 5 + 0xE6546B64


@triton.jit
def _gumbel_argmax_kernel(lp_ptr, keep_ptr, seed_ptr, pos_ptr, best_ptr, arg_ptr, V, NC,
                          HAS_KEEP: tl.constexpr, CH: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, chunk of CH ids): the max of lp + gumbel(seed, position, id) and its lowest id.
    The noise is shuili.hal.noise's MurmurHash3 (uint32 arithmetic wraps exactly as the spec's
    mod 2^32)."""
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    h0 = tl.full([BLOCK], 0x5348554C, tl.uint32)
    h0 = _mix(h0, (seed & 0xFFFFFFFF).to(tl.uint32))
    h0 = _mix(h0, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h0 = _mix(h0, (pos & 0xFFFFFFFF).to(tl.uint32))
    h0 = _mix(h0, ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32))
    c = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    arg = tl.full([BLOCK], 2147483647, tl.int32)
    for v0 in range(ch * CH, ch * CH + CH, BLOCK):
        ids = v0 + c
        ok = ids < V
        h = _mix(h0, ids.to(tl.uint32)) ^ 20
        h = (h ^ (h >> 16)) * 0x85EBCA6B
        h = (h ^ (h >> 13)) * 0xC2B2AE35
        h = h ^ (h >> 16)
        u = (h.to(tl.float64) + 0.5) * 2.3283064365386963e-10
        lp = tl.load(lp_ptr + row * V + ids, mask=ok, other=0.0)
        score = lp.to(tl.float64) - tl.log(-tl.log(u))
        if HAS_KEEP:
            ok = ok & (tl.load(keep_ptr + row * V + ids, mask=ok, other=0) != 0)
        score = tl.where(ok, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        arg = tl.where(better, ids, arg)
    top = tl.max(best, axis=0)
    tl.store(best_ptr + row * NC + ch, top)
    tl.store(arg_ptr + row * NC + ch, tl.min(tl.where(best == top, arg, 2147483647), axis=0))


_FUSED = {"ok": True}  # flips to False if the fused kernel fails to build on this stack


def _gumbel_argmax(lp, keep, seeds, positions):
    """argmax over ids of lp + gumbel, ties to the lowest id. Chunks keep their own (max, lowest
    id); the max of float64 maxima is exact, so the pick equals a single pass over the row."""
    b, v = lp.shape
    if _FUSED["ok"]:
        nc = cdiv(v, CHUNK)
        best = torch.empty(b, nc, dtype=torch.float64, device=lp.device)
        arg = torch.empty(b, nc, dtype=torch.int32, device=lp.device)
        blk = min(1024, pow2(v, 16))
        try:
            _gumbel_argmax_kernel[(b, nc)](lp.contiguous(), keep if keep is not None else lp,
                                           seeds.to(torch.int64).contiguous(),
                                           positions.to(torch.int64).contiguous(), best, arg, v, nc,
                                           HAS_KEEP=keep is not None, CH=CHUNK, BLOCK=blk,
                                           num_warps=4 if blk >= 1024 else 1)
            top = best.max(dim=1, keepdim=True).values
            return torch.where(best == top, arg, 2147483647).min(dim=1).values.to(torch.int64)
        except Exception:  # compile failure: the torch path computes the same function
            _FUSED["ok"] = False
    score = lp.to(torch.float64) + noise.gumbel(seeds[:, None], positions[:, None],
                                                torch.arange(v, device=lp.device)[None, :])
    if keep is not None:
        score = torch.where(keep, score, float("-inf"))
    return torch.argmax(score, dim=1)


# elementwise and device-agnostic: the reference implementation is already the right kernel
from shuili.platforms.reference.public import apply_penalties  # noqa: E402,F401


def _keep(lp: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    b, v = lp.shape
    ids = torch.arange(v, device=lp.device)
    order = torch.sort(desc_key(lp, ids.expand(b, v)), dim=1, descending=True).indices
    rank = ids.expand(b, v)
    k = top_k.to(torch.int64)[:, None]
    keep_sorted = (k <= 0) | (rank < k)
    probs = torch.exp(torch.gather(lp, 1, order).to(torch.float64))
    n_keep = (torch.cumsum(probs, 1) < top_p.to(torch.float64)[:, None]).sum(1, keepdim=True) + 1
    keep_sorted &= (top_p[:, None] >= 1.0) | (rank < n_keep)
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    p = torch.exp(lp.to(torch.float64))
    mp = min_p.to(torch.float64)[:, None]
    return keep & ((mp <= 0.0) | (p >= mp * p.max(1, keepdim=True).values))


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions, *, all_greedy=None,
           any_filter=None):
    """The hints replace `.any()` reads of device tensors: without them each is a host sync."""
    b, v = logits.shape
    x = logits.to(torch.float32)
    greedy = torch.argmax(x, dim=1) if v else torch.zeros(b, dtype=torch.int64, device=x.device)
    if b == 0 or v == 0:
        return greedy
    sampled = temperature != 0
    graph = capturing()  # a graph records every path: no host reads, no shortcuts
    if not graph and (all_greedy or (all_greedy is None and not bool(sampled.any()))):
        return greedy
    t = torch.where(sampled, temperature, 1.0).to(torch.float32)
    lp = log_softmax(x / t[:, None])
    filt = graph or any_filter or (
        any_filter is None and bool(((top_k > 0) | (top_p < 1.0) | (min_p > 0.0)).any()))
    keep = _keep(lp, top_k, top_p, min_p) if filt else None
    return torch.where(sampled, _gumbel_argmax(lp, keep, seeds, positions), greedy)
