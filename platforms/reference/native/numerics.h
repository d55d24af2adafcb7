/* hal/numerics.py's elementary operations in C, shared by the reference platform's compiled loops
   (fixed_gemm.c, rowops.c, attention.c). Every function is the IEEE operation sequence of its
   numerics counterpart, built from bits where numerics builds from bits; each file compiles it
   under its own flags (never -ffast-math). native.py hashes this header into every library's
   cache key, so a change here rebuilds all three. */
#ifndef SHUILI_NUMERICS_H
#define SHUILI_NUMERICS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline int64_t clampi(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* numerics.pow2: 2^n from the bits, n in [-1022, 1023] */
static inline double pow2(int64_t n) {
    uint64_t b = (uint64_t)(n + 1023) << 52;
    double d;
    memcpy(&d, &b, 8);
    return d;
}

static inline double pow2c(int64_t n) { return pow2(clampi(n, -1022, 1023)); }

/* 2^n for an integer-valued double n in [-1022, 1023], from the bits without a float -> int
   conversion (AVX2 has none for 64-bit lanes): n + 1023 + 2^52 holds n + 1023 in its low bits */
static inline double pow2d(double n) {
    double t = n + 1023.0 + 0x1p52, one = 0x1p52;
    uint64_t bt, bo;
    memcpy(&bt, &t, 8);
    memcpy(&bo, &one, 8);
    uint64_t b = (bt - bo) << 52;
    double d;
    memcpy(&d, &b, 8);
    return d;
}

/* max |x| of a float32 row, nan when it holds one: the largest of the bit patterns with the sign
   cleared, which order like the magnitudes, nan above inf (an integer max: it vectorises) */
static inline double absmax_f(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        b &= 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    float f;
    memcpy(&f, &m, 4);
    return m > 0x7F800000u ? NAN : f;
}

/* numerics.exponent_bound from a row's max |x|: 0 for a zero or nan row, inf gives 1023 */
static inline int64_t bound_of(double m) {
    if (!(m > 0.0)) return 0;
    uint64_t b;
    memcpy(&b, &m, 8);
    return clampi((int64_t)((b >> 52) & 0x7FF) - 1022, -200, 1023);
}

/* numerics.to_fixed of one float32 row on a grid of `bits`: q[i] = round-half-even((double)x[i] *
   2^(bits - e)) and *scale = 2^(e - bits), e the row's exponent bound, both exponents clamped to
   [-1022, 1023] */
static inline void to_fixed_row(const float *x, int64_t n, int64_t bits, double *q, double *scale) {
    int64_t e = bound_of(absmax_f(x, n));
    double up = pow2c(bits - e);
    *scale = pow2c(e - bits);
    for (int64_t i = 0; i < n; ++i) q[i] = nearbyint((double)x[i] * up);
}

/* torch.clamp: nan stays nan. Two selects, not nested ones, with quiet comparisons (an ordered <
   may trap on nan): only then does gcc turn the selects of a loop over exp into vector blends */
static inline double clampd(double x, double lo, double hi) {
    x = __builtin_isless(x, lo) ? lo : x;
    return __builtin_isgreater(x, hi) ? hi : x;
}

#ifdef EXP_N
/* numerics.exp64 of x in [-745, 709] in its narrow form, one scaling by 2^n: the caller guarantees
   n = round(x / ln 2) >= -1000, where the two-factor form gives the same bits. c holds numerics'
   EXP_N Taylor coefficients; EXP_N is a build constant, so the Horner loop unrolls and loops over
   this vectorise. */
static inline double exp64_narrow(double x, const double *c, double inv_ln2, double ln2_hi, double ln2_lo) {
    double n = nearbyint(x * inv_ln2);
    double r = x - n * ln2_hi;
    r = r - n * ln2_lo;
    double p = r * c[EXP_N - 1] + c[EXP_N - 2];
    for (int i = EXP_N - 3; i >= 0; --i) p = p * r + c[i];
    return p * pow2d(n);
}
#endif

/* numerics.tree_sum of v[0..n) in float32: pad to a power of two with zeros, add the upper half
   onto the lower half until one remains; buf holds the next power of two >= n floats */
static inline float tree_sum(const float *v, int64_t n, float *buf) {
    if (n == 0) return 0.0f;
    int64_t width = 1;
    while (width < n) width <<= 1;
    memcpy(buf, v, sizeof(float) * n);
    for (int64_t i = n; i < width; ++i) buf[i] = 0.0f;
    while (width > 1) {
        width >>= 1;
        for (int64_t i = 0; i < width; ++i) buf[i] = buf[i] + buf[i + width];
    }
    return buf[0];
}

#endif
