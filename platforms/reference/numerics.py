"""Position-independent numeric primitives: fixed-tree sums and exp/log built from IEEE basics.

Why: torch's CPU reductions and transcendental kernels pick code paths by tensor size and thread
split (vectorised body, scalar tail, per-thread chunks), so the same value may round differently
depending on where it sits in a batch. Everything here is composed of elementwise +, -, *, /,
sqrt, comparisons and bit manipulation, each correctly rounded per element, so an element's bits
depend only on its own inputs. The same recipes can be replayed on any backend.
"""
from __future__ import annotations

import math

import torch

_LN2_HI = 6.93147180369123816490e-01  # ln2 with 32 trailing zero bits: n * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.0 / math.log(2.0)
_EXP_COEFFS = [1.0 / math.factorial(i) for i in range(14)]  # Taylor on |r| <= ln2/2: error < 1e-17
_LOG_COEFFS = [1.0 / (2 * i + 1) for i in range(13)]  # atanh series on |s| <= 0.1716


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` by a fixed pairwise tree: zero-pad to a power of two, then repeatedly add the
    upper half onto the lower half (element i pairs with i + n/2). The order depends only on n.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        return torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def _pow2_int(n: torch.Tensor) -> torch.Tensor:
    """2.0**n as float64 for integer-valued float64 n in [-1022, 1023], built from the bits."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp in float64 from basic ops: x = n ln2 + r (Cody-Waite), Taylor(r) by Horner, times 2^n.
    Input is clamped to [-745, 709]; float32 callers clamp tighter (see `exp`).
    """
    x = x.to(torch.float64).clamp(-745.0, 709.0)
    n = torch.round(x * _INV_LN2)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[-1])
    for c in reversed(_EXP_COEFFS[:-1]):
        p = p * r + c
    # split 2^n in two factors so n near the ends of the range stays inside the exponent field
    half = torch.floor(n * 0.5)
    return p * _pow2_int(half) * _pow2_int(n - half)


def exp(x: torch.Tensor) -> torch.Tensor:
    """float32 exp: float64 `exp64` rounded once to float32 (inf above 88.73, 0 below -103.98)."""
    return exp64(x.to(torch.float64).clamp(-110.0, 90.0)).to(torch.float32)


def log64(x: torch.Tensor) -> torch.Tensor:
    """Natural log in float64: x = m 2^e with m in [sqrt(1/2), sqrt(2)) (subnormals rescaled
    exactly first), log m = 2 atanh((m-1)/(m+1)) by series. 0 -> -inf, negative -> nan, inf -> inf.
    """
    x = x.to(torch.float64)
    sub = (x > 0) & (x < 2.0 ** -1022)  # subnormal: scale into the normal range first (exact)
    bits = torch.where(sub, x * 2.0 ** 54, x).contiguous().view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023 - 54 * sub.to(torch.int64)
    m = ((bits & 0xFFFFFFFFFFFFF) | (1023 << 52)).view(torch.float64)  # mantissa in [1, 2)
    big = m > math.sqrt(2.0)
    m = torch.where(big, m * 0.5, m)
    e = (e + big.to(torch.int64)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = torch.full_like(s, _LOG_COEFFS[-1])
    for c in reversed(_LOG_COEFFS[:-1]):
        p = p * s2 + c
    out = (e * _LN2_HI + 2.0 * s * p) + e * _LN2_LO
    out = torch.where(x == 0, torch.full_like(out, -math.inf), out)
    out = torch.where(x < 0, torch.full_like(out, math.nan), out)
    out = torch.where(torch.isinf(x) & (x > 0), x, out)
    return torch.where(torch.isnan(x), x, out)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """float32 1 / (1 + exp(-x)), evaluated in float64 and rounded once."""
    x = x.to(torch.float64).clamp(-745.0, 709.0)
    return (1.0 / (1.0 + exp64(-x))).to(torch.float32)


def silu(x: torch.Tensor) -> torch.Tensor:
    """float32 x * sigmoid(x), evaluated in float64 and rounded once."""
    x64 = x.to(torch.float64)
    return (x64 / (1.0 + exp64(-x64.clamp(-745.0, 709.0)))).to(torch.float32)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """float32 log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)), in float64, rounded once.
    log1p(u) uses log(w) * u / (w - 1) with w = 1 + u (exact when w == 1: returns u).
    """
    x64 = x.to(torch.float64)
    u = exp64(-x64.abs())
    w = 1.0 + u
    denom = torch.where(w == 1.0, torch.ones_like(w), w - 1.0)
    l1p = torch.where(w == 1.0, u, log64(w) * (u / denom))
    return (x64.clamp_min(0.0) + l1p).to(torch.float32)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x) with two correctly rounded steps (same dtype as x)."""
    return 1.0 / torch.sqrt(x)


def softmax_last(x: torch.Tensor, extra_logit: torch.Tensor | None = None) -> torch.Tensor:
    """float32 softmax over the last dim: subtract the row max, `exp`, divide by the `tree_sum`.
    extra_logit [...] (broadcast over the rows) joins the max and the denominator but gets no output
    column (an attention sink). A row with no finite entry and no extra logit is all zeros.
    Entries of -inf get exactly 0 and do not change the other entries' bits: exp gives an exact
    zero, and zeros appended to a row only fold onto it as x + 0 = x, so a row padded at
    its end with -inf to any width gives the bits of the unpadded row (attention relies on it).
    """
    x = x.to(torch.float32)
    if x.shape[-1] == 0 and extra_logit is None:
        return x.clone()
    m = x.amax(-1) if x.shape[-1] else torch.full(x.shape[:-1], -math.inf)
    if extra_logit is not None:
        extra = extra_logit.to(torch.float32).expand(m.shape)
        m = torch.maximum(m, extra)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all -inf rows: avoid inf - inf
    e = exp(x - m[..., None])
    denom = tree_sum(e)
    if extra_logit is not None:
        denom = denom + exp(extra - m)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.where((denom > 0)[..., None], e / safe[..., None], torch.zeros_like(e))
