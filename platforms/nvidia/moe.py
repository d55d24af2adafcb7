"""MoE routing. Scores are computed in float64 and rounded once to float32 (so they land on the
reference's correctly-rounded values almost always); selection is an exact top-k on an int64 key
(score desc, expert id asc). T x E is small and every op is row-wise. In torch that is about 25
small kernels a layer (a decode step's graph replays them all), so where Triton runs one program
per token does the same operations (_route_kernel); softmax scoring, whose float64 sum order is
torch's own, keeps the torch path."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from shuili.platforms.nvidia.common import check, desc_key, in_range, interpreting, key_ids, pow2, tree_sum

SCORINGS = ("sqrtsoftplus", "softmax", "sigmoid")
FUSED = {"sqrtsoftplus": 0, "sigmoid": 1}  # scorings _route_kernel computes as torch does
MAX_K, MAX_E = 16, 4096  # one program holds a token's E scores and k picks


@triton.jit
def _tree_sum(w, KP: tl.constexpr, LEVELS: tl.constexpr):
    """hal.numerics.tree_sum of w [KP] (KP = 2^LEVELS, zero-padded), as mhc.py's collapse sums its
    streams: element i pairs with i + half at each level; a sum over two elements is one add."""
    for lvl in tl.static_range(LEVELS):
        w = tl.sum(tl.reshape(w, (2, KP >> (lvl + 1))), axis=0)
    return tl.sum(w, axis=0)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, tok_ptr, tid_ptr, w_ptr, ids_ptr, E, s_l, s_tid, scaling,
                  K: tl.constexpr, KP: tl.constexpr, LEVELS: tl.constexpr, EP: tl.constexpr, SCORING: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HASH: tl.constexpr, RENORM: tl.constexpr, INTERP: tl.constexpr):
    """One token: scores, the top-k (or the hash table's k experts), their weights. Each step is the
    torch path's operation in the same precision: float64 libdevice exp / log1p, one rounding to
    float32, IEEE sqrt and division, the int64 key of desc_key, the pairwise tree of tree_sum."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    eok = e < E
    x = tl.load(logits_ptr + t * s_l + e, mask=eok, other=0.0).to(tl.float64)
    if SCORING == 0:  # torch's softplus(x, threshold=1e9) = log1p(exp(x)) below the threshold
        if INTERP:  # the interpreter has no libdevice: tests there check the rest of the kernel
            sp = tl.log(1.0 + tl.exp(x))
        else:
            sp = libdevice.log1p(tl.exp(x))
        s = tl.math.sqrt_rn(tl.where(x > 1e9, x, sp).to(tl.float32))
    else:
        s = (1.0 / (1.0 + tl.exp(-x))).to(tl.float32)
    jj = tl.arange(0, KP)
    if HASH:
        tok = tl.load(tok_ptr + t).to(tl.int64)
        ids = tl.load(tid_ptr + tok * s_tid + jj, mask=jj < K, other=0).to(tl.int64)
    else:
        b = s
        if HAS_BIAS:
            b = s + tl.load(bias_ptr + e, mask=eok, other=0.0).to(tl.float32)
        bits = b.to(tl.int32, bitcast=True)
        mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        low = tl.full([EP], -9223372036854775807, tl.int64) - 1  # below every key
        key = tl.where(eok, (mono << 32) + (0xFFFFFFFF - e.to(tl.int64)), low)
        ids = tl.zeros([KP], tl.int64)
        for j in tl.static_range(K):  # keys are distinct (ids differ), so each max is one expert
            top = tl.max(key, 0)
            ids = tl.where(jj == j, 0xFFFFFFFF - (top & 0xFFFFFFFF), ids)
            key = tl.where(key == top, low, key)
    w = tl.zeros([KP], tl.float32)
    for j in tl.static_range(K):  # gather: one nonzero term, so the sum is exact
        pick = tl.sum(tl.where(jj == j, ids, 0), 0)
        w = tl.where(jj == j, tl.sum(tl.where(e == pick, s, 0.0), 0), w)
    if RENORM:
        w = tl.math.div_rn(w, _tree_sum(w, KP, LEVELS) + 1e-20)
    w = w * scaling
    tl.store(w_ptr + t * K + jj, w, mask=jj < K)
    tl.store(ids_ptr + t * K + jj, ids, mask=jj < K)


def _fused(logits, k, scoring) -> bool:
    t, e = logits.shape
    return (scoring in FUSED and 0 < k <= MAX_K and e <= MAX_E and t > 0
            and (logits.device.type != "cpu" or interpreting()))


def _route(logits, bias, tok, tid2eid, k, scoring, renormalize, scaling):
    t, e = logits.shape
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    lg = logits.float().contiguous()
    tid = tid2eid.contiguous() if tid2eid is not None else ids
    _route_kernel[(t,)](lg, bias.float().contiguous() if bias is not None else lg,
                        tok if tok is not None else ids, tid, w, ids, e, lg.stride(0), tid.stride(0),
                        float(scaling), K=k, KP=pow2(k), LEVELS=pow2(k).bit_length() - 1, EP=pow2(e, 2),
                        SCORING=FUSED[scoring],
                        HAS_BIAS=bias is not None, HASH=tid2eid is not None, RENORM=bool(renormalize),
                        INTERP=interpreting())
    return w, ids


def _score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    x = logits.to(torch.float64)
    if scoring == "sqrtsoftplus":
        return torch.sqrt(torch.nn.functional.softplus(x, threshold=1e9).to(torch.float32))
    if scoring == "softmax":
        return torch.softmax(x, -1).to(torch.float32)
    if scoring == "sigmoid":
        return torch.sigmoid(x).to(torch.float32)
    raise ValueError(f"unknown scoring {scoring!r}; use one of {SCORINGS}")


def _finish(s, ids, renormalize, scaling):
    w = torch.gather(s, 1, ids)
    if renormalize:
        w = w / (tree_sum(w) + 1e-20)[:, None]
    return (w * scaling).to(torch.float32), ids


def moe_route_topk(logits, bias, topk, scoring, renormalize, scaling):
    t, e = logits.shape
    if not 0 < topk <= e:
        raise ValueError(f"topk {topk} must be in [1, {e}] (the number of experts)")
    if _fused(logits, topk, scoring):
        return _route(logits, bias, None, None, topk, scoring, renormalize, scaling)
    s = _score(logits, scoring)
    biased = s if bias is None else s + bias.to(torch.float32)
    ids = torch.arange(e, device=logits.device).expand(t, e)
    top = torch.topk(desc_key(biased, ids), topk, dim=1, sorted=True).values
    return _finish(s, key_ids(top), renormalize, scaling)


def moe_route_hash(logits, token_ids, tid2eid, scoring, renormalize, scaling):
    tok = token_ids.to(torch.int64)
    e = logits.shape[1]
    check(tok, in_range(0, tid2eid.shape[0]), f"token ids must lie in [0, {tid2eid.shape[0]})")
    # the rows are gathered inside the check, so a step that skips it (captured, or the engine's) does not
    # gather them
    check(tok, lambda t: in_range(0, e)(tid2eid[t]), f"tid2eid holds expert ids outside [0, {e})")
    if _fused(logits, tid2eid.shape[1], scoring):
        return _route(logits, None, tok, tid2eid, tid2eid.shape[1], scoring, renormalize, scaling)
    return _finish(_score(logits, scoring), tid2eid.to(torch.int64)[tok], renormalize, scaling)
