/* The reference platform's paged attention as one compiled loop (see ../native.py): the bits of
   paged_attention_torch in ../attention.py, which composes hal/numerics.py's dot, softmax_last and
   dot_pv. Per query and head, in the torch form's order and precision:

     logits  numerics.dot: query row and key rows on their own fixed-point grids (dot_bits(D)), the
             exact integer sum, ((acc + 0.0) * sa) * sb -> float32, times the scale in float32
     softmax numerics.softmax_last over the query's visible keys (max, sink, exp = exp64 rounded to
             float32, fixed pairwise tree_sum, one division); the torch form's -inf padding to the
             group's width adds exact zeros to the tree only, which change no bit
     p V     numerics.dot_pv: v rows on a 24-bit grid, p's row split in hi and lo grids, two exact
             integer sums, combined in float64 and rounded once

   The integer sums are exact (every partial sum below 2^53), so their loops may run in any order;
   everything else repeats numerics' IEEE operations one by one: build with -ffp-contract=off and
   without -ffast-math. One quirk of the torch form is kept: it multiplies p = 0 with every value
   row of the sequence's shared key range (keys before a query's window, after its position in a
   prefill), so a non-finite value there makes that output column nan; see `poison`.

   The constants (Taylor coefficients, ln 2 split, 1/ln 2) come from numerics.py through
   shuili_attention_init. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "numerics.h"
#ifdef __FMA__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define PV_BITS 24
#define QB 16 /* queries of one sequence per work item: a long prefill still splits over threads,
                 and each item's key grids (O(keys * D)) cost little beside its dots */

#ifndef EXP_N
#error "EXP_N (numerics' exp coefficient count) is set by native.py"
#endif
#define N_EXP EXP_N /* a build constant, so the Horner loop unrolls and exps vectorise */
static double EXP_C[N_EXP], LN2_HI, LN2_LO, INV_LN2;

/* Returns 0, or -1 when numerics has another number of coefficients than N_EXP (then the load
   check fails and the torch form runs). */
int shuili_attention_init(const double *exp_c, int n_exp, double ln2_hi, double ln2_lo, double inv_ln2) {
    if (n_exp != N_EXP) return -1;
    memcpy(EXP_C, exp_c, sizeof(double) * N_EXP);
    LN2_HI = ln2_hi;
    LN2_LO = ln2_lo;
    INV_LN2 = inv_ln2;
    return 0;
}

/* the exact sums' vectors: any order gives their bits, so they may be split in lanes */
typedef double v4d __attribute__((vector_size(32)));

static inline v4d load4(const double *p) {
    v4d v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store4(double *p, v4d v) { memcpy(p, &v, sizeof v); }

/* a * b + c of exact integer terms: fused or not, the same bits (-ffp-contract=off rules out only
   the implicit fusions elsewhere) */
static inline v4d madd4(v4d a, v4d b, v4d c) {
#ifdef __FMA__
    return (v4d)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
    return a * b + c;
#endif
}

static inline v4d splat4(double x) { return (v4d){x, x, x, x}; }

/* numerics.exp on float32: exp64 of the clamped float64 (n >= -160: the narrow form), rounded once */
static inline float exp32(float z) {
    return (float)exp64_narrow(clampd((double)z, -110.0, 90.0), EXP_C, INV_LN2, LN2_HI, LN2_LO);
}

static inline double absmax_d(const double *x, int64_t n) {
    uint64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint64_t b;
        memcpy(&b, x + i, 8);
        b &= 0x7FFFFFFFFFFFFFFFull;
        m = b > m ? b : m;
    }
    double f;
    memcpy(&f, &m, 8);
    return m > 0x7FF0000000000000ull ? NAN : f;
}

static inline int64_t ceil_log2(int64_t n) { /* numerics.ceil_log2, n >= 1 */
    return n > 1 ? 64 - __builtin_clzll((unsigned long long)(n - 1)) : 0;
}

typedef struct {
    const float *q, *kc, *vc, *sinks;
    const int64_t *table, *lens, *qsl;
    int64_t slots, cols, h, kvh, d, dv, bs, window, pa, pb;
    float scale;
    float *out;
} args_t;

typedef struct {
    int64_t b, kv, i0, i1;
} item_t;

typedef struct { /* one thread's buffers, sized for the longest key range */
    double *qk;    /* [keys][D] key grids: gridded with unit-stride stores, dotted along D */
    double *qv;    /* [keys][Dv] value grids */
    double *sbk;   /* [keys] key grid scales 2^(e - pb) */
    double *vsc;   /* [keys] 2^ev: value row exponents moved onto p's columns */
    double *acc;   /* [keys] logit sums, then p's scaled row */
    double *hi, *lo, *qq, *ahi, *alo;
    float *lg, *e, *buf;
    int64_t *bad;  /* keys of the shared range with a non-finite value */
    char *poison;  /* [Dv] */
} scratch_t;

static inline int64_t window_lo(int64_t pos, int64_t window) {
    return window > 0 ? (pos - window + 1 > 0 ? pos - window + 1 : 0) : 0;
}

static inline int64_t slot_of(const args_t *a, int64_t b, int64_t j) {
    int64_t blk = a->table[b * a->cols + j / a->bs];
    int64_t s = blk * a->bs + j % a->bs;
    return blk >= 0 && s < a->slots ? s : -1;
}

/* key j's grids into row jj of the scratch; returns whether its value row is finite, -1 for a bad slot */
static int grid_key(const args_t *a, scratch_t *s, int64_t b, int64_t kv, int64_t j, int64_t jj) {
    int64_t slot = slot_of(a, b, j);
    if (slot < 0) return -1;
    const float *kr = a->kc + (slot * a->kvh + kv) * a->d;
    const float *vr = a->vc + (slot * a->kvh + kv) * a->dv;
    to_fixed_row(kr, a->d, a->pb, s->qk + jj * a->d, s->sbk + jj);
    double mv = absmax_f(vr, a->dv);
    int64_t ev = bound_of(mv);
    double vup = pow2(PV_BITS - ev);
    s->vsc[jj] = pow2(ev);
    double *qv = s->qv + jj * a->dv;
    for (int64_t x = 0; x < a->dv; ++x) qv[x] = nearbyint((double)vr[x] * vup);
    return isfinite(mv) ? 1 : 0;
}

static inline double hsum4(v4d v) { return (v[0] + v[1]) + (v[2] + v[3]); }

/* R keys' dots with the query grid, each along D in 4 lanes (exact: any order has the sum's bits) */
#define KEY_DOTS(R)                                                                        \
    for (; j0 + R <= cnt; j0 += R) {                                                       \
        const double *k0 = s->qk + (off + j0) * d;                                         \
        v4d ac[R];                                                                         \
        for (int r = 0; r < R; ++r) ac[r] = splat4(0.0);                                   \
        int64_t x = 0;                                                                     \
        for (; x + 4 <= d; x += 4) {                                                       \
            v4d qx = load4(s->qq + x);                                                     \
            for (int r = 0; r < R; ++r) ac[r] = madd4(qx, load4(k0 + r * d + x), ac[r]);  \
        }                                                                                  \
        for (int r = 0; r < R; ++r) {                                                      \
            double t = hsum4(ac[r]);                                                       \
            for (int64_t y = x; y < d; ++y) t += s->qq[y] * k0[r * d + y];                 \
            acc[j0 + r] = t;                                                               \
        }                                                                                  \
    }

static void logits(const args_t *a, scratch_t *s, const float *qr, int64_t off, int64_t cnt) {
    int64_t d = a->d;
    double sa;
    to_fixed_row(qr, d, a->pa, s->qq, &sa);
    double *acc = s->acc;
    int64_t j0 = 0;
    KEY_DOTS(8)
    KEY_DOTS(1)
    for (int64_t j = 0; j < cnt; ++j) s->lg[j] = (float)(((acc[j] + 0.0) * sa) * s->sbk[off + j]) * a->scale;
}

/* numerics.softmax_last of lg[0..cnt) with an optional sink, into e[] */
static void softmax(scratch_t *s, int64_t cnt, const float *sink) {
    float m = -INFINITY;
    for (int64_t j = 0; j < cnt; ++j) {
        float x = s->lg[j];
        if (x != x) { m = x; break; } /* torch.amax propagates nan */
        m = x > m ? x : m;
    }
    if (sink) m = (m != m || *sink != *sink) ? NAN : (*sink > m ? *sink : m); /* torch.maximum */
    if (isinf(m)) m = 0.0f;
    for (int64_t j = 0; j < cnt; ++j) s->e[j] = exp32(s->lg[j] - m);
    float denom = tree_sum(s->e, cnt, s->buf);
    if (sink) denom = denom + exp32(*sink - m);
    for (int64_t j = 0; j < cnt; ++j) s->e[j] = denom > 0 ? s->e[j] / denom : 0.0f;
}

/* numerics.dot_pv of p = e[0..cnt) with the value grids from row off */
static void weighted(const args_t *a, scratch_t *s, int64_t off, int64_t cnt, float *o) {
    double *pn = s->acc;
    int64_t nz = 0;
    for (int64_t j = 0; j < cnt; ++j) {
        pn[j] = (double)s->e[j] * s->vsc[off + j];
        nz += pn[j] != 0.0;
    }
    int64_t ea = bound_of(absmax_d(pn, cnt));
    int64_t pa = 53 - PV_BITS - ceil_log2(nz > 0 ? nz : 1);
    double sc = pow2c(pa - ea), up = pow2(pa);
    for (int64_t j = 0; j < cnt; ++j) {
        double x = pn[j] * sc;
        double hi = nearbyint(x);
        s->hi[j] = hi;
        s->lo[j] = nearbyint((x - hi) * up);
    }
    int64_t dv = a->dv, x0 = 0;
    double *ahi = s->ahi, *alo = s->alo;
    for (; x0 + 8 <= dv; x0 += 8) { /* 8 columns' two sums in registers along the keys */
        v4d h0 = splat4(0.0), h1 = h0, l0 = h0, l1 = h0;
        const double *v = s->qv + off * dv + x0;
        for (int64_t j = 0; j < cnt; ++j, v += dv) {
            v4d v0 = load4(v), v1 = load4(v + 4), hj = splat4(s->hi[j]), lj = splat4(s->lo[j]);
            h0 = madd4(hj, v0, h0);
            h1 = madd4(hj, v1, h1);
            l0 = madd4(lj, v0, l0);
            l1 = madd4(lj, v1, l1);
        }
        store4(ahi + x0, h0);
        store4(ahi + x0 + 4, h1);
        store4(alo + x0, l0);
        store4(alo + x0 + 4, l1);
    }
    for (int64_t x = x0; x < dv; ++x) {
        double th = 0.0, tl = 0.0;
        for (int64_t j = 0; j < cnt; ++j) {
            th += s->hi[j] * s->qv[(off + j) * dv + x];
            tl += s->lo[j] * s->qv[(off + j) * dv + x];
        }
        ahi[x] = th;
        alo[x] = tl;
    }
    double s1 = pow2c(ea - pa - PV_BITS), s2 = pow2c(ea - 2 * pa - PV_BITS);
    for (int64_t x = 0; x < dv; ++x) {
        double t1 = (ahi[x] + 0.0) * s1;
        double t2 = (alo[x] + 0.0) * s2;
        o[x] = s->poison[x] ? NAN : (float)(t1 + t2);
    }
}

/* columns where the torch form's 0 * value of an unseen key of the shared range is nan */
static void poison(const args_t *a, scratch_t *s, int64_t b, int64_t kv, int64_t nbad, int64_t lo, int64_t pos) {
    memset(s->poison, 0, (size_t)a->dv);
    for (int64_t i = 0; i < nbad; ++i) {
        int64_t j = s->bad[i];
        if (j >= lo && j <= pos) continue;
        const float *vr = a->vc + (slot_of(a, b, j) * a->kvh + kv) * a->dv;
        for (int64_t x = 0; x < a->dv; ++x) s->poison[x] |= !isfinite(vr[x]);
    }
}

/* queries i0..i1-1 of sequence b, the heads of kv head kv. Returns 0, or -2 for a slot outside the
   cache. */
static int attend(const args_t *a, const item_t *it, scratch_t *s) {
    int64_t b = it->b, kv = it->kv, g = a->h / a->kvh;
    int64_t len = a->lens[b], first = len - (a->qsl[b + 1] - a->qsl[b]);
    int64_t lo0 = window_lo(first, a->window);
    int64_t klo = window_lo(first + it->i0, a->window), khi = first + it->i1;
    int64_t nbad = 0;
    for (int64_t j = klo; j < khi; ++j) {
        int ok = grid_key(a, s, b, kv, j, j - klo);
        if (ok < 0) return -2;
        if (!ok) s->bad[nbad++] = j;
    }
    for (int64_t j = lo0; j < len; ++j) { /* the rest of the range the torch form multiplies */
        if (j >= klo && j < khi) continue;
        int64_t slot = slot_of(a, b, j);
        if (slot < 0) return -2;
        if (!isfinite(absmax_f(a->vc + (slot * a->kvh + kv) * a->dv, a->dv))) s->bad[nbad++] = j;
    }
    for (int64_t i = it->i0; i < it->i1; ++i) {
        int64_t pos = first + i, lo = window_lo(pos, a->window), cnt = pos + 1 - lo, row = a->qsl[b] + i;
        poison(a, s, b, kv, nbad, lo, pos);
        for (int64_t hh = 0; hh < g; ++hh) {
            int64_t head = kv * g + hh;
            logits(a, s, a->q + (row * a->h + head) * a->d, lo - klo, cnt);
            softmax(s, cnt, a->sinks ? a->sinks + head : NULL);
            weighted(a, s, lo - klo, cnt, a->out + (row * a->h + head) * a->dv);
        }
    }
    return 0;
}

static int scratch_alloc(scratch_t *s, int64_t keys, int64_t d, int64_t dv) {
    int64_t w = 1;
    while (w < keys) w <<= 1;
    size_t nd = (size_t)(keys * (d + dv + 5) + d + 2 * dv);
    double *p = malloc(sizeof(double) * nd);
    float *f = malloc(sizeof(float) * (size_t)(2 * keys + w + 1));
    int64_t *bad = malloc(sizeof(int64_t) * (size_t)(keys + 1));
    char *poison = malloc((size_t)dv + 1);
    *s = (scratch_t){p, p + keys * d, p + keys * (d + dv), p + keys * (d + dv + 1), p + keys * (d + dv + 2),
                     p + keys * (d + dv + 3), p + keys * (d + dv + 4), p + keys * (d + dv + 5),
                     p + keys * (d + dv + 5) + d, p + keys * (d + dv + 5) + d + dv,
                     f, f + keys, f + 2 * keys, bad, poison};
    return p && f && bad && poison ? 0 : -1;
}

static void scratch_free(scratch_t *s) {
    free(s->qk);
    free(s->lg);
    free(s->bad);
    free(s->poison);
}

/* q [T, H, D], caches [slots, KVH, D] / [slots, KVH, Dv] float32 contiguous; table [B, cols],
   lens [B], qsl [B + 1] int64, validated by the caller (attention._check_lens); sinks [H] or NULL;
   out [T, H, Dv]. Work items (sequence, kv head, QB queries) are shared out over `threads`
   (torch's OpenMP team: native.py links its runtime). Returns 0, -1 when out of memory, -2 when a
   block table entry points outside the cache. */
int shuili_paged_attention(const float *q, const float *kc, const float *vc, int64_t slots, const int64_t *table,
                           int64_t cols, const int64_t *lens, const int64_t *qsl, int64_t nseq, int64_t h,
                           int64_t kvh, int64_t d, int64_t dv, int64_t bs, int64_t window, int pa, int pb,
                           float scale, const float *sinks, float *out, int threads) {
    args_t a = {q, kc, vc, sinks, table, lens, qsl, slots, cols, h, kvh, d, dv, bs, window, pa, pb, scale, out};
    int64_t nitems = 0, keys = 1;
    for (int64_t b = 0; b < nseq; ++b) {
        int64_t ql = qsl[b + 1] - qsl[b];
        nitems += kvh * ((ql + QB - 1) / QB);
        int64_t n = lens[b] - window_lo(lens[b] - ql, window);
        if (ql > 0 && n > keys) keys = n;
    }
    item_t *items = malloc(sizeof(item_t) * (size_t)(nitems + 1));
    if (!items) return -1;
    int64_t k = 0;
    for (int64_t b = 0; b < nseq; ++b) {
        int64_t ql = qsl[b + 1] - qsl[b];
        for (int64_t i0 = 0; i0 < ql; i0 += QB)
            for (int64_t kv = 0; kv < kvh; ++kv) items[k++] = (item_t){b, kv, i0, i0 + QB < ql ? i0 + QB : ql};
    }
    int status = 0;
    if (threads < 1) threads = 1;
    if (threads > nitems) threads = nitems > 0 ? (int)nitems : 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        scratch_t s;
        int mine = scratch_alloc(&s, keys, d, dv);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t i = 0; i < nitems; ++i) {
            int r = mine ? mine : attend(&a, &items[i], &s);
            if (r) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
                status = r;
            }
        }
        scratch_free(&s);
    }
    free(items);
    return status;
}
