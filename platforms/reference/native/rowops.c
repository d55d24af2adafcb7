/* The reference platform's row-local ops as compiled loops (see ../native.py): rms_norm with the
   residual add, SwiGLU, log_softmax. Each performs, per element, the IEEE operations of its torch
   form in hal/numerics.py and platforms/reference/{norm,elementwise,sampling}.py in the same order
   and precision, so the bits are the same; what it saves is ~50-150 torch ops per call, each a pass
   through memory plus dispatch. Build with -ffp-contract=off and without -ffast-math: a fused
   multiply-add or a reassociation would change bits. The constants (Taylor and atanh
   coefficients, ln 2 split, 1/ln 2, sqrt 2) are handed over from numerics.py by shuili_rowops_init,
   so they live in one place. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "numerics.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef EXP_N
#error "EXP_N (numerics' exp coefficient count) is set by native.py"
#endif

static double EXP_C[EXP_N], LOG_C[32], LN2_HI, LN2_LO, INV_LN2, SQRT2;
static int N_LOG;

/* Returns -1 when numerics has another exp coefficient count than this build's EXP_N. */
int shuili_rowops_init(const double *exp_c, int n_exp, const double *log_c, int n_log, double ln2_hi,
                       double ln2_lo, double inv_ln2, double sqrt2) {
    if (n_exp != EXP_N) return -1;
    N_LOG = n_log < 32 ? n_log : 32;
    memcpy(EXP_C, exp_c, sizeof(double) * EXP_N);
    memcpy(LOG_C, log_c, sizeof(double) * N_LOG);
    LN2_HI = ln2_hi;
    LN2_LO = ln2_lo;
    INV_LN2 = inv_ln2;
    SQRT2 = sqrt2;
    return 0;
}

/* numerics.log64 of one element */
static inline double log64(double x) {
    if (x != x) return x;
    if (x == 0.0) return -INFINITY;
    if (x < 0.0) return NAN;
    if (isinf(x)) return x;
    int sub = x > 0.0 && x < 0x1p-1022;
    double xs = sub ? x * 0x1p54 : x;
    int64_t bits;
    memcpy(&bits, &xs, 8);
    int64_t e = ((bits >> 52) & 0x7FF) - 1023 - 54 * sub;
    int64_t mb = (bits & 0xFFFFFFFFFFFFFLL) | (1023LL << 52);
    double m;
    memcpy(&m, &mb, 8);
    int big = m > SQRT2;
    if (big) m = m * 0.5;
    double ef = (double)(e + big);
    double s = (m - 1.0) / (m + 1.0);
    double s2 = s * s;
    double p = LOG_C[N_LOG - 1];
    for (int i = N_LOG - 2; i >= 0; --i) p = p * s2 + LOG_C[i];
    return (ef * LN2_HI + 2.0 * s * p) + ef * LN2_LO;
}

static int64_t pow2_at_least(int64_t n) {
    int64_t w = 1;
    while (w < n) w <<= 1;
    return w;
}

/* norm.add_rms_norm / rms_norm, float32: s = x + res (if res), y = s * (1 / sqrt(tree_sum(s*s) / d
   + eps)) (* w); s_out may be NULL. Returns 0, -1 when out of memory. */
int shuili_rms_norm(const float *x, const float *res, const float *w, int64_t rows, int64_t d, float eps,
                    float *y, float *s_out) {
    int64_t width = pow2_at_least(d);
    float *sq = malloc(sizeof(float) * (size_t)(d + 2 * width + 1));
    if (!sq) return -1;
    float *buf = sq + d, *s = sq + d + width;
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * d;
        if (res) {
            const float *rr = res + r * d;
            for (int64_t i = 0; i < d; ++i) s[i] = xr[i] + rr[i];
            if (s_out) memcpy(s_out + r * d, s, sizeof(float) * d);
        } else {
            memcpy(s, xr, sizeof(float) * d);
        }
        for (int64_t i = 0; i < d; ++i) sq[i] = s[i] * s[i];
        float ms = tree_sum(sq, d, buf) / (float)d;
        float inv = 1.0f / sqrtf(ms + eps);  /* sqrtf is IEEE: correctly rounded, as numerics.sqrt */
        float *yr = y + r * d;
        for (int64_t i = 0; i < d; ++i) yr[i] = s[i] * inv;
        if (w)
            for (int64_t i = 0; i < d; ++i) yr[i] = yr[i] * w[i];
    }
    free(sq);
    return 0;
}

static inline float silu_mul(float g, float u) {
    double x = (double)g;
    /* numerics.silu's exp64(-clamp(x, -745, 709)), with the argument held above -700 (n >= -1010):
       below it exp is under 2^-1000 either way and den rounds to exactly 1 */
    double den = exp64_narrow(clampd(-x, -700.0, 709.0), EXP_C, INV_LN2, LN2_HI, LN2_LO) + 1.0;
    return (float)(x / den) * u;
}

/* restrict rows of their own: gcc vectorises these loops, not the same loops inlined in the
   OpenMP region with possibly aliasing pointers */
static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, int64_t n) {
    for (int64_t i = 0; i < n; ++i) o[i] = silu_mul(g[i], u[i]);
}

static void silu_mul_row_limit(const float *restrict g, const float *restrict u, float *restrict o, int64_t n,
                               float limit) {
    for (int64_t i = 0; i < n; ++i) {
        float gi = g[i] > limit ? limit : g[i];
        float ui = u[i] < -limit ? -limit : (u[i] > limit ? limit : u[i]);
        o[i] = silu_mul(gi, ui);
    }
}

/* elementwise.swiglu, float32 [rows, 2 * inter] -> [rows, inter]: silu(g) in float64 rounded once,
   times u in float32; limit applied when has_limit */
void shuili_swiglu(const float *gu, int64_t rows, int64_t inter, int has_limit, float limit, float *out,
                   int threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
#endif
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * 2 * inter;
        if (has_limit) silu_mul_row_limit(g, g + inter, out + r * inter, inter, limit);
        else silu_mul_row(g, g + inter, out + r * inter, inter);
    }
}

/* sampling._log_softmax_rows, float32 [rows, v]: z = x - m (m the row max, 0 if infinite),
   z - log64(tree_sum(exp(z))); exp = exp64(clamp(z, -110, 90)) rounded to float32. Rows are split
   over `threads`. Returns 0, -1 when out of memory. */
int shuili_log_softmax(const float *x, int64_t rows, int64_t v, float *out, int threads) {
    int64_t width = pow2_at_least(v);
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : failed)
#endif
    {
        float *e = malloc(sizeof(float) * (size_t)(v + width + 1));
        if (!e) {
            failed = 1;
        } else {
            float *buf = e + v;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t r = 0; r < rows; ++r) {
                const float *xr = x + r * v;
                float *o = out + r * v;
                float m = v ? xr[0] : -INFINITY;
                for (int64_t i = 0; i < v; ++i) {
                    float a = xr[i];
                    if (a != a) { m = a; break; }  /* torch.amax propagates nan */
                    if (a > m) m = a;
                }
                if (isinf(m)) m = 0.0f;
                for (int64_t i = 0; i < v; ++i) {
                    float z = xr[i] - m;
                    o[i] = z;
                    e[i] = (float)exp64_narrow(clampd((double)z, -110.0, 90.0), EXP_C, INV_LN2, LN2_HI, LN2_LO);
                }
                float l = (float)log64((double)tree_sum(e, v, buf));
                for (int64_t i = 0; i < v; ++i) o[i] = o[i] - l;
            }
            free(e);
        }
    }
    return failed ? -1 : 0;
}

/* rope.rope, float32 x [t, h, d] (token stride xs, head stride d) -> out [t, h, d] contiguous: the
   first d - rd channels copied, the last rd rotated by the token's c, s [t, rd / 2] (s negated when
   inverse): (a, b) -> (a c - b s, a s + b c), each product and the sum rounded in float32 as torch's
   four multiplies and two adds. Pairs are (2i, 2i + 1) when interleaved, else (i, i + rd / 2). */
void shuili_rope(const float *x, int64_t t, int64_t h, int64_t d, int64_t xs, const float *cos_rows,
                 const float *sin_rows, int64_t rd, int interleaved, int inverse, float *out) {
    int64_t half = rd / 2, keep = d - rd;
    for (int64_t r = 0; r < t; ++r) {
        const float *c = cos_rows + r * half, *s0 = sin_rows + r * half;
        for (int64_t j = 0; j < h; ++j) {
            const float *xr = x + r * xs + j * d;
            float *o = out + (r * h + j) * d;
            memcpy(o, xr, sizeof(float) * keep);
            const float *xa = xr + keep, *xb = xa + (interleaved ? 1 : half);
            float *oa = o + keep, *ob = oa + (interleaved ? 1 : half);
            int64_t step = interleaved ? 2 : 1;
            for (int64_t i = 0; i < half; ++i) {
                float a = xa[i * step], b = xb[i * step], ci = c[i], si = inverse ? -s0[i] : s0[i];
                float ac = a * ci, bs = b * si, as = a * si, bc = b * ci;
                oa[i * step] = ac - bs;
                ob[i * step] = as + bc;
            }
        }
    }
}
