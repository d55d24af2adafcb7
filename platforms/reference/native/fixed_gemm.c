/* The reference platform's exact fixed-point GEMM (see ../native.py and hal/numerics.py).

   out[i, n] = (float)(((sum_k a[i, k] * w[n, k]) + 0.0) * sa[i] * sb[n])

   a holds integer-valued float64 grids, w the weight's integer grid stored as float32 (|q| <= 2^24,
   so exactly) in panels of NR rows: p[N / NR][K][NR]. numerics.dot_bits keeps every product and every
   partial sum of up to K products an integer below 2^53, so each addition is exact and the sum is
   the same in any order, blocking, vector width, FMA or thread split: the result bits are those of
   the torch float64 matmul path on any CPU. The finishing adds and multiplies are the same IEEE
   operations in the same order as numerics.scaled_matmul's. Build without -ffast-math (signed
   zeros, NaN and inf must follow IEEE). */
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "numerics.h"

#define NR 8
#define MR 6

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16), aligned(4)));

/* One block of K (k terms from a and the panel widened to float64 in p) for up to MR rows. The first
   row tile of a block reads the float32 panel f and leaves its widened values in p for the other row
   tiles (f NULL): the panel's loads, often from memory, overlap that tile's multiply-adds instead of
   stalling a separate widening pass. The first block starts from zero, later ones from the partial
   sums in cb (row stride NR); the last one finishes the rows into out, the others park their sums in
   cb. Every partial sum is exact, so blocking K changes no bit; it keeps the block's panel and rows
   in L1. */
static inline __attribute__((always_inline)) void tile(int mr, int64_t k, const double *a, int64_t lda,
                                                       double *p, const double *sa, const double *sb,
                                                       float *out, int64_t ldo, int nc, double *cb, int first,
                                                       int last, const float *f, const float *nx) {
    v4d acc[MR][2];
    for (int i = 0; i < MR; ++i) {
        acc[i][0] = first ? (v4d){0.0, 0.0, 0.0, 0.0} : *(const v4d *)(cb + i * NR);
        acc[i][1] = first ? (v4d){0.0, 0.0, 0.0, 0.0} : *(const v4d *)(cb + i * NR + 4);
    }
    for (int64_t kk = 0; kk < k; ++kk) {
        if (nx && !(kk & 1)) __builtin_prefetch(nx + kk * NR, 0, 2);
        v4d b0, b1;
        if (f) {  /* the block's first row tile widens the float32 panel as it goes, for the others */
            b0 = __builtin_convertvector(*(const v4f *)(f + kk * NR), v4d);
            b1 = __builtin_convertvector(*(const v4f *)(f + kk * NR + 4), v4d);
            *(v4d *)(p + kk * NR) = b0;
            *(v4d *)(p + kk * NR + 4) = b1;
        } else {
            b0 = *(const v4d *)(p + kk * NR);
            b1 = *(const v4d *)(p + kk * NR + 4);
        }
        for (int i = 0; i < mr; ++i) {
            double ai = a[i * lda + kk];
            acc[i][0] += ai * b0;
            acc[i][1] += ai * b1;
        }
    }
    if (!last) {
        for (int i = 0; i < mr; ++i) {
            *(v4d *)(cb + i * NR) = acc[i][0];
            *(v4d *)(cb + i * NR + 4) = acc[i][1];
        }
        return;
    }
    for (int i = 0; i < mr; ++i) {
        double s = sa[i];
        for (int j = 0; j < nc; ++j) {
            double t = acc[i][j >> 2][j & 3] + 0.0;
            t = t * s;
            t = t * sb[j];
            out[i * ldo + j] = (float)t;
        }
    }
}

static void tile_rows(int mr, int64_t k, const double *a, int64_t lda, double *p, const double *sa,
                      const double *sb, float *out, int64_t ldo, int nc, double *cb, int first, int last,
                      const float *f, const float *nx) {
    /* one specialised loop per row count, so acc stays in registers */
    switch (mr) {
        case 6: tile(6, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, f, nx); break;
        case 5: tile(5, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, f, nx); break;
        case 4: tile(4, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, f, nx); break;
        case 3: tile(3, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, f, nx); break;
        case 2: tile(2, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, f, nx); break;
        default: tile(1, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, f, nx); break;
    }
}

typedef struct {
    const double *a, *sa, *sb;
    const float *p;
    float *out;
    int64_t m, k, n, mc, p0, p1;
} job_t;

#if defined(__AVX512F__)
/* With AVX-512 a panel row is one 8-wide register: two panels side by side and 12 rows make 24
   accumulators out of 32 registers, twice the multiply-adds per cycle of the 256-bit tile. The sums
   are exact, so the bits are those of tile() (test_native checks it on hosts that have AVX-512). */
typedef double v8d __attribute__((vector_size(64)));
#define MR2 12

/* row kk of a panel as float64: widened from the float32 panel f and kept in p, or from p when f is NULL */
static inline __attribute__((always_inline)) v8d panel_row(const float *f, double *p, int64_t kk) {
    typedef float v8f __attribute__((vector_size(32), aligned(4)));
    if (!f) return *(const v8d *)(p + kk * NR);
    v8d b = __builtin_convertvector(*(const v8f *)(f + kk * NR), v8d);
    *(v8d *)(p + kk * NR) = b;
    return b;
}

static inline __attribute__((always_inline)) void tile2(int mr, int np, int64_t k, const double *a, int64_t lda,
                                                        double *p, const double *sa, const double *sb,
                                                        float *out, int64_t ldo, int nc, double *cb, int first,
                                                        int last, const float *f0, const float *f1,
                                                        const float *nx0, const float *nx1) {
    v8d acc[MR2][2];  /* cb: row stride 2 * NR, as tile()'s */
    for (int i = 0; i < MR2; ++i) {
        acc[i][0] = first ? (v8d){0.0} : *(const v8d *)(cb + i * 2 * NR);
        acc[i][1] = first || np != 2 ? (v8d){0.0} : *(const v8d *)(cb + i * 2 * NR + NR);
    }
    double *q = p + k * NR;  /* the second panel, widened right after the first */
    for (int64_t kk = 0; kk < k; ++kk) {
        if (nx0) __builtin_prefetch((kk & 1 ? nx1 : nx0) + (kk >> 1) * 16, 0, 2);
        /* the block's first row tile widens the float32 panels as it goes, for the others */
        v8d b0 = panel_row(f0, p, kk);
        if (np == 2) {
            v8d b1 = panel_row(f1, q, kk);
            for (int i = 0; i < mr; ++i) {
                double ai = a[i * lda + kk];
                acc[i][0] += ai * b0;
                acc[i][1] += ai * b1;
            }
        } else {
            for (int i = 0; i < mr; ++i) acc[i][0] += a[i * lda + kk] * b0;
        }
    }
    if (!last) {
        for (int i = 0; i < mr; ++i) {
            *(v8d *)(cb + i * 2 * NR) = acc[i][0];
            if (np == 2) *(v8d *)(cb + i * 2 * NR + NR) = acc[i][1];
        }
        return;
    }
    if (nc == np * NR) {  /* whole panels: the same three operations per element, 8 lanes at a time */
        typedef double v8du __attribute__((vector_size(64), aligned(8)));
        v8d s0 = *(const v8du *)sb, s1 = np == 2 ? *(const v8du *)(sb + NR) : s0;
        for (int i = 0; i < mr; ++i) {
            v8d s = (v8d){0.0} + sa[i];
            typedef float v8f __attribute__((vector_size(32), aligned(4)));
            *(v8f *)(out + i * ldo) = __builtin_convertvector((acc[i][0] + 0.0) * s * s0, v8f);
            if (np == 2) *(v8f *)(out + i * ldo + NR) = __builtin_convertvector((acc[i][1] + 0.0) * s * s1, v8f);
        }
        return;
    }
    for (int i = 0; i < mr; ++i) {
        double s = sa[i];
        for (int j = 0; j < nc; ++j) {
            double t = acc[i][j >> 3][j & 7] + 0.0;
            t = t * s;
            t = t * sb[j];
            out[i * ldo + j] = (float)t;
        }
    }
}

#define TILE2_CASE(R)                                                             \
    case R:                                                                       \
        if (np == 2) tile2(R, 2, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, f0, f1, nx0, nx1); \
        else tile2(R, 1, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, f0, f1, nx0, nx1);         \
        break;

static void tile2_rows(int mr, int np, int64_t k, const double *a, int64_t lda, double *p,
                       const double *sa, const double *sb, float *out, int64_t ldo, int nc, double *cb,
                       int first, int last, const float *f0, const float *f1, const float *nx0,
                       const float *nx1) {
    switch (mr) {
        TILE2_CASE(12) TILE2_CASE(11) TILE2_CASE(10) TILE2_CASE(9) TILE2_CASE(8) TILE2_CASE(7)
        TILE2_CASE(6) TILE2_CASE(5) TILE2_CASE(4) TILE2_CASE(3) TILE2_CASE(2)
        default:
            if (np == 2) tile2(1, 2, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, f0, f1, nx0, nx1);
            else tile2(1, 1, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, f0, f1, nx0, nx1);
    }
}
#define PSTEP 2
#define ROWS MR2
#else
#define PSTEP 1
#define ROWS MR
#endif

#ifndef MC_BYTES
#define MC_BYTES (1 << 20) /* the rows of a one pass over the panels serves: in L2, so each widened panel feeds many tiles */
#endif
#ifndef KC
#define KC 192 /* K per block: the block's widened panels and its rows' a fit in L1 together */
#endif

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    /* the panels of one K block widened to float64 (PSTEP x KC x NR x 8 bytes) and the partial sums
       of a block of rows (mc x PSTEP x NR doubles) between K blocks */
    double *panel = aligned_alloc(64, (size_t)PSTEP * KC * NR * 8 + 64);
    double *cb = aligned_alloc(64, (size_t)(j->mc + ROWS) * PSTEP * NR * 8 + 64);
    if (!panel || !cb) {
        free(panel);
        free(cb);
        return (void *)1;
    }
    for (int64_t m0 = 0; m0 < j->m; m0 += j->mc) {  /* a block of rows stays in L2 while panels stream */
        int64_t m1 = m0 + j->mc < j->m ? m0 + j->mc : j->m;
        for (int64_t pp = j->p0; pp < j->p1; pp += PSTEP) {
            int np = j->p1 - pp < PSTEP ? (int)(j->p1 - pp) : PSTEP;
            int64_t n0 = pp * NR;
            int nc = j->n - n0 < np * NR ? (int)(j->n - n0) : np * NR;
            const float *src = j->p + pp * j->k * NR;
            for (int64_t k0 = 0; k0 < j->k || k0 == 0; k0 += KC) {
                int64_t kb = j->k - k0 < KC ? j->k - k0 : KC;
                int first = k0 == 0, last = k0 + kb >= j->k;
                /* the next block's float32 lines (this pair's, or the next pair's first), fetched into L2 by
                   the first row tile, one line per step of its loop, ahead of the next block's first tile */
                const float *nx0 = last ? src + np * j->k * NR : src + (k0 + kb) * NR;
                const float *nx1 = nx0 + j->k * NR;
                if (last && pp + np >= j->p1) nx0 = nx1 = NULL;
                /* row tiles of equal height (16 rows: 8 + 8, not 12 + 4): a short tile has too few
                   independent sums to keep the FMA units busy */
                int64_t tiles = (m1 - m0 + ROWS - 1) / ROWS;
                for (int64_t t = 0, i = m0; t < tiles; ++t) {
                    int64_t i1 = m0 + (m1 - m0) * (t + 1) / tiles;
                    int mr = (int)(i1 - i);
                    double *c = cb + (i - m0) * PSTEP * NR;
#if PSTEP == 2
                    const float *f0 = i == m0 ? src + k0 * NR : NULL;
                    tile2_rows(mr, np, kb, j->a + i * j->k + k0, j->k, panel, j->sa + i, j->sb + n0,
                               j->out + i * j->n + n0, j->n, nc, c, first, last, f0, f0 ? f0 + j->k * NR : NULL,
                               i == m0 ? nx0 : NULL, nx1);
#else
                    tile_rows(mr, kb, j->a + i * j->k + k0, j->k, panel, j->sa + i, j->sb + n0,
                              j->out + i * j->n + n0, j->n, nc, c, first, last, i == m0 ? src + k0 * NR : NULL,
                              i == m0 ? nx0 : NULL);
#endif
                    i = i1;
                }
            }
        }
    }
    free(panel);
    free(cb);
    return NULL;
}

/* a [m, k] float64 (contiguous), p packed [ceil(n / NR), k, NR] float32, sa [m], sb [n] float64,
   out [m, n] float32; the output columns are split over `threads` threads. Built with OpenMP, the
   threads are the team of the OpenMP runtime torch itself uses (native.py links the same one), so
   torch's pool and this kernel do not fight over the cores; without OpenMP, pthreads (a part whose
   thread cannot be started runs on the calling thread). */
void shuili_fixed_gemm(const double *a, const double *sa, int64_t m, int64_t k, const float *p,
                       const double *sb, int64_t n, float *out, int threads) {
    int64_t panels = (n + NR - 1) / NR;
    int64_t mc = (MC_BYTES / (8 * (k > 0 ? k : 1))) / ROWS * ROWS;
    if (mc < ROWS) mc = ROWS;
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    if (threads > panels) threads = panels > 0 ? (int)panels : 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        job_t j = {a, sa, sb, p, out, m, k, n, mc, panels * t / nt, panels * (t + 1) / nt};
        run(&j);
    }
#else
    job_t jobs[256];
    pthread_t tids[256];
    int started[256];
    for (int t = 0; t < threads; ++t) {
        jobs[t] = (job_t){a, sa, sb, p, out, m, k, n, mc, panels * t / threads, panels * (t + 1) / threads};
        started[t] = 0;
    }
    for (int t = 1; t < threads; ++t)
        started[t] = pthread_create(&tids[t], NULL, run, &jobs[t]) == 0;
    run(&jobs[0]);
    for (int t = 1; t < threads; ++t) {
        if (started[t]) pthread_join(tids[t], NULL);
        else run(&jobs[t]);
    }
#endif
}

/* linear's fixed-point product from the float32 activations: each row of x [m, k] goes to its grid
   (numerics.h's to_fixed_row) and through shuili_fixed_gemm. One call per linear instead of
   the ~10 torch ops and two host transfers that built the grids. Returns 1 when out of memory. */
int shuili_fixed_linear(const float *x, int64_t m, int64_t k, int pa, const float *p, const double *sb,
                        int64_t n, float *out, int threads) {
    size_t bytes = ((size_t)(m * k) * 8 + 63) / 64 * 64 + 64;
    double *qa = aligned_alloc(64, bytes);
    double *sa = malloc((size_t)(m > 0 ? m : 1) * 8);
    if (!qa || !sa) {
        free(qa);
        free(sa);
        return 1;
    }
    for (int64_t i = 0; i < m; ++i) to_fixed_row(x + i * k, k, pa, qa + i * k, sa + i);
    shuili_fixed_gemm(qa, sa, m, k, p, sb, n, out, threads);
    free(qa);
    free(sa);
    return 0;
}
