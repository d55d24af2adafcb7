"""Host-independent numeric primitives: exact dot products, fixed-tree sums, exp/log/sin/cos
built from IEEE basics.

Why: torch's CPU reductions and transcendental kernels pick code paths by tensor size, thread
split, CPU ISA (ATEN_CPU_CAPABILITY) and BLAS (MKL, OpenBLAS, Accelerate), so the same value may
round differently depending on where it sits in a batch or which machine runs it. Everything here
is composed of elementwise +, -, *, /, round, comparisons and bit manipulation, each
correctly rounded per element by IEEE 754 (sqrt is too, but torch.sqrt is not IEEE's: see
`sqrt64`), plus float64 matrix products whose every partial sum is an exactly representable
integer (`dot`), which no summation order can change. So an
element's bits depend only on its own inputs, on any CPU, BLAS or thread count, and the same
recipes can be replayed on any backend.
"""
from __future__ import annotations

import math

import torch

_LN2_HI = 6.93147180369123816490e-01  # ln2 with 32 trailing zero bits: n * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.0 / math.log(2.0)
_SQRT2 = math.sqrt(2.0)  # log64's mantissa split (math.sqrt is the C library's IEEE sqrt)
# pi/2 in three parts: the first two have 28 significant bits, so n * part is exact for |n| < 2**25
_PIO2 = (1.570796325802803, 9.920935739593517e-10, 5.721188726109832e-18)
_TWO_OVER_PI = 0.6366197723675814
_SIN_COEFFS = [(-1.0) ** i / math.factorial(2 * i + 1) for i in range(11)]  # |r| <= pi/4: < 1e-20
_COS_COEFFS = [(-1.0) ** i / math.factorial(2 * i) for i in range(11)]
_EXP_COEFFS = [1.0 / math.factorial(i) for i in range(14)]  # Taylor on |r| <= ln2/2: error < 1e-17
_LOG_COEFFS = [1.0 / (2 * i + 1) for i in range(13)]  # atanh series on |s| <= 0.1716


# ------------------------------------------------------------------------------- exact dot products
# float64 has a 53-bit significand: integers of magnitude <= 2**53 and their sums and products
# that stay within it are exact. A dot product of K terms, each |qa| <= 2**pa times |qb| <= 2**pb,
# has every partial sum within K * 2**(pa + pb), so pa + pb = 53 - ceil(log2 K) makes any BLAS's
# blocking, vectorisation, FMA use or thread split give the same exact integer.
_MIN_EXP = -200  # float32 inputs have |x| >= 2**-149 unless zero; keeps 2**(bits - e) finite


def pow2(n: torch.Tensor) -> torch.Tensor:
    """2.0**n as float64 for an int64 tensor n in [-1022, 1023], built from the bits (exact)."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def exponent_bound(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """int64 e (keepdim along `dim`) with max |x| < 2**e, read from the bits of the float64 max;
    all-zero slices give 0. Non-finite maxima give e = 1025 - 1022 (they propagate as inf/nan)."""
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        return torch.zeros(shape, dtype=torch.int64)
    # the max of |x| is exact in x's own dtype: widen only the [..., 1] maxima, not all of x
    m = x.abs().amax(dim, keepdim=True).to(torch.float64)
    e = ((m.view(torch.int64) >> 52) & 0x7FF) - 1022
    return torch.where(m > 0, e.clamp(_MIN_EXP, 1023), 0)


def dot_bits(k: int) -> tuple[int, int]:
    """(pa, pb): significant bits kept for the two factors of a K-term exact dot product."""
    total = 53 - max(k - 1, 0).bit_length()
    return total - total // 2, total // 2


def to_fixed(x: torch.Tensor, bits: int, e: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q, e): q = round(x * 2**(bits - e)) as integer-valued float64 with |q| <= 2**bits,
    e [..., 1] the row's `exponent_bound` unless given (then |x| < 2**e must hold)."""
    if e is None:
        e = exponent_bound(x)
    return _widen_mul(x, pow2((bits - e).clamp(-1022, 1023))).round_(), e


_MIXED_MUL_MAX = 1 << 15  # elements: above this a widening copy + in-place multiply is faster


def _widen_mul(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x.to(float64) * s for a float64 s: the exact widening, then one rounded multiply, either way.
    Small x: in one pass, type promotion widening x's elements on the fly (a 0-dim s would not
    promote a float32 x, hence the dim check). Large x: torch's mixed-dtype loop is not vectorised
    (~1.4x slower than a float64 copy and an in-place multiply at 300K elements on AVX2)."""
    if x.dtype == torch.float64 or (s.dim() == x.dim() and x.numel() <= _MIXED_MUL_MAX):
        return x * s
    x64 = x.to(torch.float64)
    return x64.mul_(s) if torch.broadcast_shapes(x64.shape, s.shape) == x64.shape else x64 * s


def fixed_matmul(qa: torch.Tensor, ea: torch.Tensor, pa: int, qb: torch.Tensor, eb: torch.Tensor,
                 pb: int) -> torch.Tensor:
    """qa [..., M, K] (row exponents ea [..., M, 1]) times qb [..., N, K]^T (eb [..., N, 1]) -> float32
    [..., M, N]: the exact integer products summed by float64 BLAS (exact by `dot_bits`), scaled
    back by two exact power-of-two multiplies, rounded once to float32. A zero sum is +0."""
    sb = pow2((eb - pb).clamp(-1022, 1023)).transpose(-1, -2)
    return scaled_matmul(qa, pow2((ea - pa).clamp(-1022, 1023)), qb, sb)


def scaled_matmul(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """`fixed_matmul` with its power-of-two row scales given: sa [..., M, 1], sb [..., 1, N] float64
    (a caller with a fixed weight computes sb once)."""
    # + 0.0: an exact zero sum is +0 whatever the order (-0 + +0 = +0; a lone -0 product stays -0);
    # in place on the fresh product, the same roundings as (acc + 0.0) * sa * sb
    acc = torch.matmul(qa, qb.transpose(-1, -2))
    return acc.add_(0.0).mul_(sa).mul_(sb).to(torch.float32)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] . b [..., N, K] -> float32 [..., M, N]. Each row of a and of b is rounded to a
    fixed-point grid relative to its own largest element (`dot_bits`: 22 + 21 bits at K = 576,
    20 + 20 at K = 16384), the exact sum of products is formed and rounded once. A result's bits
    depend only on its own row of a and row of b: not on M, N, the batch, the BLAS or the CPU."""
    pa, pb = dot_bits(a.shape[-1])
    qa, ea = to_fixed(a, pa)
    qb, eb = to_fixed(b, pb)
    return fixed_matmul(qa, ea, pa, qb, eb, pb)


_PV_BITS = 24  # grid of a value row relative to its own largest element: float32's precision


def ceil_log2(n: torch.Tensor) -> torch.Tensor:
    """int64 ceil(log2 n) for integers 1 <= n <= 2**53, read from the float64 bits of n - 1 (exact;
    torch.log2 runs MKL VML's vdLog2, whose bits are the library's)."""
    m = (n.to(torch.int64) - 1).to(torch.float64)
    return torch.where(m > 0, ((m.view(torch.int64) >> 52) & 0x7FF) - 1022, 0)


def dot_pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [..., M, n] @ v [..., n, D] -> float32 [..., M, D], exact in the sense of `dot`, with grids
    chosen per row of p and per row (key) of v, so a result row depends only on its own row of p and
    the rows of v it weights with a non-zero p: masked keys (p exactly 0) add nothing, and a query
    gives the same bits whatever the range of keys it shares a call with.

    v's row exponents move onto p's columns (exact power-of-two scalings); v rows get a fixed
    `_PV_BITS` grid. A row of p with c non-zero entries gets pa = 53 - _PV_BITS - ceil(log2 c) bits,
    which keeps its own partial sums exact; p is split into two such slices (hi, then the
    remainder), so it keeps ~2 pa bits even at long context. Both exact sums are combined in
    float64 and rounded once to float32.
    """
    pb = _PV_BITS
    ev = exponent_bound(v)  # [..., n, 1]
    qv = _widen_mul(v, pow2(pb - ev)).round_()  # [..., n, D]
    pn = _widen_mul(p, pow2(ev).transpose(-1, -2))
    ea = exponent_bound(pn)  # [..., M, 1]
    count = (pn != 0).sum(-1, keepdim=True).clamp_min(1)
    pa = 53 - pb - ceil_log2(count)
    scaled = pn.mul_(pow2((pa - ea).clamp(-1022, 1023)))
    hi = torch.round(scaled)
    lo = scaled.sub_(hi).mul_(pow2(pa)).round_()  # scaled - hi is exact: |.| <= 1/2 on hi's grid
    acc_hi = torch.matmul(hi, qv).add_(0.0)  # + 0.0: see fixed_matmul
    acc_lo = torch.matmul(lo, qv).add_(0.0)
    out = acc_hi.mul_(pow2((ea - pa - pb).clamp(-1022, 1023))).add_(acc_lo.mul_(pow2((ea - 2 * pa - pb).clamp(-1022, 1023))))
    return out.to(torch.float32)


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
    fresh = False  # the first level reads the caller's x, so it allocates; the middle ones reuse it
    while width > 1:
        width //= 2
        lo, hi = x.split(width, -1)
        x = lo.add_(hi) if fresh and width > 1 else lo + hi  # the last level: a compact result
        fresh = True
    return x[..., 0]


def exp64(x: torch.Tensor, narrow: bool = False) -> torch.Tensor:
    """exp in float64 from basic ops: x = n ln2 + r (Cody-Waite), Taylor(r) by Horner, times 2^n.
    Input is clamped to [-745, 709]; float32 callers clamp tighter (see `exp`). narrow: the caller
    guarantees x >= -693 (so n >= -1000).
    """
    x = x.to(torch.float64).clamp(-745.0, 709.0)
    n = (x * _INV_LN2).round_()
    r = x.sub_(n * _LN2_HI).sub_(n * _LN2_LO)  # x is clamp's fresh copy: reuse it
    p = r * _EXP_COEFFS[-1] + _EXP_COEFFS[-2]
    for c in reversed(_EXP_COEFFS[:-2]):
        p.mul_(r).add_(c)  # in place: the same two roundings per step as p * r + c
    # the range test reads n only on the host: a device read would sync, which a captured graph
    # (static decode) cannot do; both forms give the same bits whenever n >= -1000
    if not p.numel() or narrow or (x.device.type == "cpu" and float(n.min()) >= -1000.0):
        # p * 2^n rounds once from the exact p 2^n, as the two-factor form below does
        return p.mul_(pow2(n))
    # split 2^n in two factors so n near the ends of the range stays inside the exponent field
    half = torch.floor(n * 0.5)
    return p.mul_(pow2(half)).mul_(pow2(n - half))


def exp(x: torch.Tensor) -> torch.Tensor:
    """float32 exp: float64 `exp64` rounded once to float32 (inf above 88.73, 0 below -103.98)."""
    return exp64(x.to(torch.float64).clamp(-110.0, 90.0), narrow=True).to(torch.float32)


def log64(x: torch.Tensor) -> torch.Tensor:
    """Natural log in float64: x = m 2^e with m in [sqrt(1/2), sqrt(2)) (subnormals rescaled
    exactly first), log m = 2 atanh((m-1)/(m+1)) by series. 0 -> -inf, negative -> nan, inf -> inf.
    """
    x = x.to(torch.float64)
    sub = (x > 0) & (x < 2.0 ** -1022)  # subnormal: scale into the normal range first (exact)
    bits = torch.where(sub, x * 2.0 ** 54, x).contiguous().view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023 - 54 * sub.to(torch.int64)
    m = ((bits & 0xFFFFFFFFFFFFF) | (1023 << 52)).view(torch.float64)  # mantissa in [1, 2)
    big = m > _SQRT2
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


def _series(r2: torch.Tensor, coeffs: list[float]) -> torch.Tensor:
    p = torch.full_like(r2, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * r2 + c
    return p


def sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) in float64 from basic ops, for |x| < 2**24 (rotary angles): x = n pi/2 + r by a
    three-part Cody-Waite reduction, Taylor series on |r| <= pi/4, the quadrant n mod 4 applied
    by swapping and negating (exact)."""
    x = x.to(torch.float64)
    n = torch.round(x * _TWO_OVER_PI)
    r = ((x - n * _PIO2[0]) - n * _PIO2[1]) - n * _PIO2[2]
    r2 = r * r
    s, c = r * _series(r2, _SIN_COEFFS), _series(r2, _COS_COEFFS)
    q = n.to(torch.int64) & 3
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [P, R] of the float32 angles positions[:, None] * inv_freq[None, :] (one
    float32 product each, as transformers forms them), each rounded once from `sincos64`."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    sin, cos = sincos64(angles)
    return cos.to(torch.float32), sin.to(torch.float32)


def normal(shape, generator: torch.Generator, mean: float = 0.0, std: float = 1.0,
           device: str | torch.device | None = None) -> torch.Tensor:
    """float32 normal samples with the same bits on every host: Box-Muller over torch.rand's float64
    uniforms (a serial stream from the generator), with `log64` and `sincos64`. torch.randn's own
    transform uses SIMD log/sin/cos whose bits depend on ATEN_CPU_CAPABILITY.

    The uniforms always come from the CPU generator; the transform (elementwise IEEE float64 ops
    only, so the same bits anywhere) runs on `device` in slices of _NORMAL_SLICE pairs, which
    bounds the float64 temporaries and lets a GPU transform a multi-GB random model in seconds."""
    shape = tuple(shape)
    n = 1
    for s in shape:
        n *= s
    u = torch.rand(2 * ((n + 1) // 2), dtype=torch.float64, generator=generator).view(-1, 2)
    out = torch.empty(u.shape, dtype=torch.float32, device=device)
    for i in range(0, u.shape[0], _NORMAL_SLICE):
        ui = u[i:i + _NORMAL_SLICE].to(out.device)
        r = sqrt64(-2.0 * log64(1.0 - ui[:, 0]))  # 1 - u in (0, 1]: log stays finite
        sin, cos = sincos64(ui[:, 1] * (2.0 * math.pi))
        out[i:i + _NORMAL_SLICE] = (torch.stack([r * cos, r * sin], 1) * std + mean).to(torch.float32)
    return out.reshape(-1)[:n].reshape(shape)


_NORMAL_SLICE = 1 << 22


def pow_f32(base: float, y: torch.Tensor) -> torch.Tensor:
    """float32 base ** y for a positive scalar base: exp64(y * log64(base)), rounded once."""
    if not base > 0:
        raise ValueError(f"pow_f32 needs a positive base, got {base}")
    lb = log64(torch.tensor(float(base), dtype=torch.float64))
    return exp64(y.to(torch.float64) * lb).to(torch.float32)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """float32 1 / (1 + exp(-x)), evaluated in float64 and rounded once."""
    x = x.to(torch.float64).clamp(-745.0, 709.0)
    return exp64(-x).add_(1.0).reciprocal_().to(torch.float32)


def silu(x: torch.Tensor) -> torch.Tensor:
    """float32 x * sigmoid(x), evaluated in float64 and rounded once."""
    x64 = x.to(torch.float64)
    return torch.div(x64, exp64(-x64.clamp(-745.0, 709.0)).add_(1.0)).to(torch.float32)


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


_SPLIT = 134217729.0  # 2**27 + 1: Veltkamp's constant, splits a float64 into two 26-bit halves


def _square_residual(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x - r * r for float64 x, r > 0 with r * r within a factor 2 of x and no under/overflow:
    r * r = p + q exactly (Dekker's product over Veltkamp halves, no FMA), x - p exact (Sterbenz),
    and (x - p) - q exact whenever x - r^2 is representable, which holds for any faithful r."""
    g = r * _SPLIT
    hi = g - (g - r)
    lo = r - hi
    p = r * r
    q = ((hi * hi - p) + 2.0 * hi * lo) + lo * lo
    return (x - p) - q


def sqrt64(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float64 sqrt from IEEE basics. torch.sqrt is not: on x86 builds with MKL it
    runs MKL VML's vdSqrt / vsSqrt (1 ulp off for ~1% of float64 and ~17% of float32 inputs on an
    AMD EPYC; MKL picks its kernel by CPU vendor and ISA, not ATEN_CPU_CAPABILITY), so its bits
    differ between hosts. Here torch.sqrt is only a first guess: two Newton steps on the exact
    residual make it faithful, then the exact residual e = x - r^2 decides between r and its two
    neighbours (r is the nearest iff -r u_lo < e <= r u_hi; a midpoint is never a square root).
    Inputs are scaled by an even power of two into [2^-500, 2^500] so no product under/overflows.
    """
    x = x.to(torch.float64)
    ok = torch.isfinite(x) & (x > 0)
    xs = torch.where(ok, x, torch.ones_like(x))
    small, big = xs < 2.0 ** -500, xs > 2.0 ** 500
    xs = torch.where(small, xs * 2.0 ** 600, torch.where(big, xs * 2.0 ** -600, xs))
    r = torch.sqrt(xs)
    for _ in range(2):  # from a guess good to 2^-24 relative: 2^-48, then faithful
        r = r + _square_residual(xs, r) / (2.0 * r)
    up = (r.view(torch.int64) + 1).view(torch.float64)
    down = (r.view(torch.int64) - 1).view(torch.float64)
    e = _square_residual(xs, r)
    r = torch.where(e > r * (up - r), up, torch.where(e <= -r * (r - down), down, r))
    r = torch.where(small, r * 2.0 ** -300, torch.where(big, r * 2.0 ** 300, r))
    # sqrt(+-0) = +-0, sqrt(+inf) = +inf, negative or nan -> nan
    return torch.where(ok, r, torch.where(x >= 0, x, torch.full_like(x, math.nan)))


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded sqrt in x's dtype (float32 or float64): `sqrt64`, rounded once more for
    float32 (rounding a correctly rounded 53-bit sqrt to 24 bits gives the correctly rounded one)."""
    return sqrt64(x).to(x.dtype)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x) with two correctly rounded steps (same dtype as x)."""
    return 1.0 / sqrt(x)


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
