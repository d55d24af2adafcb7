/* The reference platform's exact fixed-point GEMM (see ../native.py and hal/numerics.py).

   out[i, n] = (float)(((sum_k a[i, k] * w[n, k]) + 0.0) * sa[i] * sb[n])

   a holds integer-valued float64 grids, w the weight's integer grid in panels of NR rows, either as
   float32 (|q| <= 2^24, so exactly): p[N / NR][K][NR], or in the affine form of a quantized weight
   (4- or 8-bit codes, see tile()). numerics.dot_bits keeps every product and every
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
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "numerics.h"

#define NR 8
#define MR 6
#define CH 32 /* K per chunk of an affine panel: one (D, M) pair per output column */
#ifndef MC_BYTES
#define MC_BYTES (1 << 20) /* the rows of a one pass over the panels serves: in L2, so each widened panel feeds many tiles */
#endif
#ifndef KC
#define KC 192 /* K per block: the block's widened panels and its rows' a fit in L1 together */
#endif

#ifndef UNITS
#define UNITS 8 /* work units per thread: few enough to keep each unit's panel stream long */
#endif

#if KC % CH
#error "KC must be a multiple of CH: an affine block holds whole chunks"
#endif

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16), aligned(4)));

/* Weight panels come in three forms (native.py's Panels), decoded by the first row tile of a K block
   (mode) into the float64 panel p that the block's other row tiles read (mode 0):
     mode 1, float32: [K][NR] grid values per panel;
     mode 8 and 4, affine: per chunk of CH K, 2 NR float32 (D[NR] then M[NR], integers) and CH x NR
       codes c, one byte each (mode 8), or two per byte (mode 4: row 2t in the low nibble of byte
       row t, row 2t + 1 in the high one); the grid value is D[j] * c + M[j].
   D * c and D * c + M are integers of magnitude at most 2^24 (native.pack checks): exact in float32
   however they are rounded or fused, so each form gives the same grid values and the same sums. A
   panel's chunk is CHUNK_BYTES(mode) bytes. */
#define CHUNK_BYTES(mode) (2 * NR * 4 + CH * NR * (mode) / 8)

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef float v8fa __attribute__((vector_size(32)));
typedef int32_t v8si __attribute__((vector_size(32)));

static inline v4d cvt4(const float *f) { return __builtin_convertvector(*(const v4f *)f, v4d); }

/* the NR codes of one panel row as int32 lanes, from NR bytes */
static inline v8si code_bytes(const uint8_t *c) {
#if defined(__AVX2__)
    return (v8si)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
#else
    v8si r;
    for (int j = 0; j < NR; ++j) r[j] = c[j];
    return r;
#endif
}

/* D * c + M for one panel row in float32, exact (see above) */
static inline v8fa affine_row(v8si c, v8fa d, v8fa m) { return __builtin_convertvector(c, v8fa) * d + m; }

/* float32 [NR] -> two float64 [4] halves */
static inline void widen(v8fa v, v4d *b0, v4d *b1) {
    *b0 = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), v4d);
    *b1 = __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), v4d);
}

#define FMA_ROWS(KK, B0, B1)                        \
    for (int i = 0; i < mr; ++i) {                  \
        double ai = a[i * lda + (KK)];              \
        acc[i][0] += ai * (B0);                     \
        acc[i][1] += ai * (B1);                     \
    }

/* One block of K (k terms from a, the panel from w, decoded per `mode`) for up to MR rows. The first
   row tile of a block reads the stored panel w and leaves its float64 values in p for the other row
   tiles (mode 0): the panel's loads, often from memory, overlap that tile's multiply-adds instead of
   stalling a separate pass. The first block starts from zero, later ones from the partial sums in cb
   (row stride NR); the last one finishes the rows into out, the others park their sums in cb. Every
   partial sum is exact, so blocking K changes no bit; it keeps the block's panel and rows in L1. */
static inline __attribute__((always_inline)) void tile(int mr, int mode, int64_t k, const double *a, int64_t lda,
                                                       double *p, const double *sa, const double *sb,
                                                       float *out, int64_t ldo, int nc, double *cb, int first,
                                                       int last, const uint8_t *w, const uint8_t *nx) {
    v4d acc[MR][2];
    for (int i = 0; i < MR; ++i) {
        acc[i][0] = first ? (v4d){0.0, 0.0, 0.0, 0.0} : *(const v4d *)(cb + i * NR);
        acc[i][1] = first ? (v4d){0.0, 0.0, 0.0, 0.0} : *(const v4d *)(cb + i * NR + 4);
    }
    if (mode == 4 || mode == 8) {
        for (int64_t c0 = 0; c0 < k; c0 += CH) {
            const uint8_t *ch = w + (c0 / CH) * CHUNK_BYTES(mode);
            const float *dm = (const float *)ch;
            const uint8_t *code = ch + 2 * NR * 4;
            v8fa d = *(const v8f *)dm, mo = *(const v8f *)(dm + NR);
            for (int o = 0; nx && o < CHUNK_BYTES(mode); o += 64) __builtin_prefetch(nx + (c0 / CH) * CHUNK_BYTES(mode) + o, 0, 2);
            if (mode == 4) {
                for (int t = 0; t < CH; t += 2) {
                    v8si x = code_bytes(code + (t >> 1) * NR);
                    v4d b0, b1;
                    widen(affine_row(x & 15, d, mo), &b0, &b1);
                    *(v4d *)(p + (c0 + t) * NR) = b0;
                    *(v4d *)(p + (c0 + t) * NR + 4) = b1;
                    FMA_ROWS(c0 + t, b0, b1)
                    widen(affine_row(x >> 4, d, mo), &b0, &b1);
                    *(v4d *)(p + (c0 + t + 1) * NR) = b0;
                    *(v4d *)(p + (c0 + t + 1) * NR + 4) = b1;
                    FMA_ROWS(c0 + t + 1, b0, b1)
                }
            } else {
                for (int t = 0; t < CH; ++t) {
                    v4d b0, b1;
                    widen(affine_row(code_bytes(code + t * NR), d, mo), &b0, &b1);
                    *(v4d *)(p + (c0 + t) * NR) = b0;
                    *(v4d *)(p + (c0 + t) * NR + 4) = b1;
                    FMA_ROWS(c0 + t, b0, b1)
                }
            }
        }
    } else {
        const float *f = (const float *)w, *nf = (const float *)nx;
        for (int64_t kk = 0; kk < k; ++kk) {
            v4d b0, b1;
            if (mode == 1) {  /* the block's first row tile widens the float32 panel as it goes, for the others */
                if (nf && !(kk & 1)) __builtin_prefetch(nf + kk * NR, 0, 2);
                b0 = cvt4(f + kk * NR);
                b1 = cvt4(f + kk * NR + 4);
                *(v4d *)(p + kk * NR) = b0;
                *(v4d *)(p + kk * NR + 4) = b1;
            } else {
                b0 = *(const v4d *)(p + kk * NR);
                b1 = *(const v4d *)(p + kk * NR + 4);
            }
            FMA_ROWS(kk, b0, b1)
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
#undef FMA_ROWS

#define TILE_CASE(R, MODE) \
    case R: tile(R, MODE, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, w, nx); break;
#define TILE_MODE(MODE)                                                                                  \
    switch (mr) {                                                                                        \
        TILE_CASE(6, MODE) TILE_CASE(5, MODE) TILE_CASE(4, MODE) TILE_CASE(3, MODE) TILE_CASE(2, MODE)   \
        default: tile(1, MODE, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, w, nx);             \
    }                                                                                                    \
    break;

static void tile_rows(int mr, int np, int mode, int64_t k, const double *a, int64_t lda, double *p, const double *sa,
                      const double *sb, float *out, int64_t ldo, int nc, double *cb, int first, int last,
                      const uint8_t *w, const uint8_t *w1, const uint8_t *nx, const uint8_t *nx1) {
    (void)np; /* one panel at a time: tile2_rows' signature */
    (void)w1;
    (void)nx1;
    /* one specialised loop per row count and panel form, so acc stays in registers */
    switch (mode) {
        case 8: TILE_MODE(8)
        case 4: TILE_MODE(4)
        case 1: TILE_MODE(1)
        default: TILE_MODE(0)
    }
}

typedef struct {
    const double *a, *sa, *sb;
    const uint8_t *w;
    float *out;
    int64_t m, k, n, mc, panels, group; /* group: panels per work unit, a multiple of PSTEP */
    int mode;
    int64_t *next; /* the next work unit, shared by the threads */
} job_t;

#if defined(__AVX512F__)
/* With AVX-512 a panel row is one 8-wide register: two panels side by side and 12 rows make 24
   accumulators out of 32 registers, twice the multiply-adds per cycle of the 256-bit tile. The sums
   are exact, so the bits are those of tile() (test_native checks it on hosts that have AVX-512). */
typedef double v8d __attribute__((vector_size(64)));
#define MR2 12

static inline v8d cvt8(const float *f) { return __builtin_convertvector(*(const v8f *)f, v8d); }
static inline v8d wide8(v8fa v) { return __builtin_convertvector(v, v8d); }

#define FMA_ROWS2(KK, B0, B1)                                                 \
    if (np == 2) {                                                            \
        for (int i = 0; i < mr; ++i) {                                        \
            double ai = a[i * lda + (KK)];                                    \
            acc[i][0] += ai * (B0);                                           \
            acc[i][1] += ai * (B1);                                           \
        }                                                                     \
    } else {                                                                  \
        for (int i = 0; i < mr; ++i) acc[i][0] += a[i * lda + (KK)] * (B0);   \
    }

/* tile() for two panels (np = 2) or one, w0 and w1 their blocks, decoded per `mode` into p (the
   second panel right after the first). */
static inline __attribute__((always_inline)) void tile2(int mr, int np, int mode, int64_t k, const double *a,
                                                        int64_t lda, double *p, const double *sa, const double *sb,
                                                        float *out, int64_t ldo, int nc, double *cb, int first,
                                                        int last, const uint8_t *w0, const uint8_t *w1,
                                                        const uint8_t *nx0, const uint8_t *nx1) {
    v8d acc[MR2][2];  /* cb: row stride 2 * NR, as tile()'s */
    for (int i = 0; i < MR2; ++i) {
        acc[i][0] = first ? (v8d){0.0} : *(const v8d *)(cb + i * 2 * NR);
        acc[i][1] = first || np != 2 ? (v8d){0.0} : *(const v8d *)(cb + i * 2 * NR + NR);
    }
    double *q = p + k * NR;
    if (mode == 4 || mode == 8) {
        for (int64_t c0 = 0; c0 < k; c0 += CH) {
            const uint8_t *ch0 = w0 + (c0 / CH) * CHUNK_BYTES(mode), *ch1 = w1 + (c0 / CH) * CHUNK_BYTES(mode);
            v8fa d0 = *(const v8f *)ch0, m0 = *(const v8f *)((const float *)ch0 + NR), d1 = d0, m1 = m0;
            if (np == 2) {
                d1 = *(const v8f *)ch1;
                m1 = *(const v8f *)((const float *)ch1 + NR);
            }
            const uint8_t *c0p = ch0 + 2 * NR * 4, *c1p = ch1 + 2 * NR * 4;
            if (nx0) {
                for (int o = 0; o < CHUNK_BYTES(mode); o += 64) {
                    __builtin_prefetch(nx0 + (c0 / CH) * CHUNK_BYTES(mode) + o, 0, 2);
                    if (np == 2) __builtin_prefetch(nx1 + (c0 / CH) * CHUNK_BYTES(mode) + o, 0, 2);
                }
            }
            if (mode == 4) {
                for (int t = 0; t < CH; t += 2) {
                    v8si x0 = code_bytes(c0p + (t >> 1) * NR), x1 = np == 2 ? code_bytes(c1p + (t >> 1) * NR) : x0;
                    v8d b0 = wide8(affine_row(x0 & 15, d0, m0)), b1 = wide8(affine_row(x1 & 15, d1, m1));
                    *(v8d *)(p + (c0 + t) * NR) = b0;
                    if (np == 2) *(v8d *)(q + (c0 + t) * NR) = b1;
                    FMA_ROWS2(c0 + t, b0, b1)
                    b0 = wide8(affine_row(x0 >> 4, d0, m0));
                    b1 = wide8(affine_row(x1 >> 4, d1, m1));
                    *(v8d *)(p + (c0 + t + 1) * NR) = b0;
                    if (np == 2) *(v8d *)(q + (c0 + t + 1) * NR) = b1;
                    FMA_ROWS2(c0 + t + 1, b0, b1)
                }
            } else {
                for (int t = 0; t < CH; ++t) {
                    v8d b0 = wide8(affine_row(code_bytes(c0p + t * NR), d0, m0));
                    v8d b1 = np == 2 ? wide8(affine_row(code_bytes(c1p + t * NR), d1, m1)) : b0;
                    *(v8d *)(p + (c0 + t) * NR) = b0;
                    if (np == 2) *(v8d *)(q + (c0 + t) * NR) = b1;
                    FMA_ROWS2(c0 + t, b0, b1)
                }
            }
        }
    } else {
        const float *f0 = (const float *)w0, *f1 = (const float *)w1;
        const float *n0 = (const float *)nx0, *n1 = (const float *)nx1;
        for (int64_t kk = 0; kk < k; ++kk) {
            v8d b0, b1;
            if (mode == 1) {  /* the block's first row tile widens the float32 panels as it goes, for the others */
                if (n0) __builtin_prefetch((kk & 1 ? n1 : n0) + (kk >> 1) * 16, 0, 2);
                b0 = cvt8(f0 + kk * NR);
                *(v8d *)(p + kk * NR) = b0;
                b1 = b0;
                if (np == 2) {
                    b1 = cvt8(f1 + kk * NR);
                    *(v8d *)(q + kk * NR) = b1;
                }
            } else {
                b0 = *(const v8d *)(p + kk * NR);
                b1 = np == 2 ? *(const v8d *)(q + kk * NR) : b0;
            }
            FMA_ROWS2(kk, b0, b1)
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
#undef FMA_ROWS2

#define TILE2_CASE(R, MODE)                                                                               \
    case R:                                                                                               \
        if (np == 2) tile2(R, 2, MODE, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, w0, w1, nx0, nx1); \
        else tile2(R, 1, MODE, k, a, lda, p, sa, sb, out, ldo, nc, cb, first, last, w0, w1, nx0, nx1);         \
        break;
#define TILE2_MODE(MODE)                                                                                  \
    switch (mr) {                                                                                         \
        TILE2_CASE(12, MODE) TILE2_CASE(11, MODE) TILE2_CASE(10, MODE) TILE2_CASE(9, MODE)                \
        TILE2_CASE(8, MODE) TILE2_CASE(7, MODE) TILE2_CASE(6, MODE) TILE2_CASE(5, MODE)                   \
        TILE2_CASE(4, MODE) TILE2_CASE(3, MODE) TILE2_CASE(2, MODE) TILE2_CASE(1, MODE)                   \
    }                                                                                                     \
    break;

static void tile2_rows(int mr, int np, int mode, int64_t k, const double *a, int64_t lda, double *p,
                       const double *sa, const double *sb, float *out, int64_t ldo, int nc, double *cb,
                       int first, int last, const uint8_t *w0, const uint8_t *w1, const uint8_t *nx0,
                       const uint8_t *nx1) {
    switch (mode) {
        case 8: TILE2_MODE(8)
        case 4: TILE2_MODE(4)
        case 1: TILE2_MODE(1)
        default: TILE2_MODE(0)
    }
}
#define PSTEP 2
#define ROWS MR2
#define TILE_ROWS tile2_rows
#else
#define PSTEP 1
#define ROWS MR
#define TILE_ROWS tile_rows
#endif

/* bytes of one panel, and the offset of K block k0 in it */
static inline int64_t panel_bytes(int mode, int64_t k) { return mode == 1 ? k * NR * 4 : (k / CH) * CHUNK_BYTES(mode); }
static inline int64_t block_offset(int mode, int64_t k0) { return mode == 1 ? k0 * NR * 4 : (k0 / CH) * CHUNK_BYTES(mode); }

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
    int64_t pbytes = panel_bytes(j->mode, j->k);
    int64_t chunks = (j->panels + j->group - 1) / j->group, units = chunks * ((j->m + j->mc - 1) / j->mc);
    /* work units (a block of rows by a group of panels) go to whichever thread is free: a thread slowed
       by the host's other work takes fewer. Each unit's sums are exact, so who does which changes no bit. */
    for (int64_t u; (u = __atomic_fetch_add(j->next, 1, __ATOMIC_RELAXED)) < units;) {
        int64_t m0 = u / chunks * j->mc, m1 = m0 + j->mc < j->m ? m0 + j->mc : j->m;
        int64_t p0 = u % chunks * j->group, p1 = p0 + j->group < j->panels ? p0 + j->group : j->panels;
        for (int64_t pp = p0; pp < p1; pp += PSTEP) {
            int np = p1 - pp < PSTEP ? (int)(p1 - pp) : PSTEP;
            int64_t n0 = pp * NR;
            int nc = j->n - n0 < np * NR ? (int)(j->n - n0) : np * NR;
            const uint8_t *src = j->w + pp * pbytes;
            for (int64_t k0 = 0; k0 < j->k || k0 == 0; k0 += KC) {
                int64_t kb = j->k - k0 < KC ? j->k - k0 : KC;
                int first = k0 == 0, last = k0 + kb >= j->k;
                const uint8_t *w0 = src + block_offset(j->mode, k0), *w1 = w0 + pbytes;
                /* the next block's lines (this pair's, or the next pair's first), fetched into L2 by the
                   first row tile as it goes, ahead of the next block's first tile */
                const uint8_t *nx0 = last ? src + np * pbytes : src + block_offset(j->mode, k0 + kb);
                const uint8_t *nx1 = nx0 + pbytes;
                if (last && pp + np >= p1) nx0 = nx1 = NULL;
                /* row tiles of equal height (16 rows: 8 + 8, not 12 + 4): a short tile has too few
                   independent sums to keep the FMA units busy */
                int64_t tiles = (m1 - m0 + ROWS - 1) / ROWS;
                for (int64_t t = 0, i = m0; t < tiles; ++t) {
                    int64_t i1 = m0 + (m1 - m0) * (t + 1) / tiles;
                    int head = i == m0;
                    TILE_ROWS((int)(i1 - i), np, head ? j->mode : 0, kb, j->a + i * j->k + k0, j->k, panel,
                              j->sa + i, j->sb + n0, j->out + i * j->n + n0, j->n, nc, cb + (i - m0) * PSTEP * NR,
                              first, last, w0, w1, head ? nx0 : NULL, nx1);
                    i = i1;
                }
            }
        }
    }
    free(panel);
    free(cb);
    return NULL;
}

/* a [m, k] float64 (contiguous), sa [m], sb [n] float64, out [m, n] float32; w the weight's
   ceil(n / NR) panels in `bits`' form (32: float32 [k][NR] each; 8 or 4: affine chunks, k a
   multiple of CH). Up to `threads` threads take work units (rows by groups of output panels) as
   they come free. Built with OpenMP, the threads are the team of the OpenMP runtime torch itself
   uses (native.py links the same one), so torch's pool and this kernel do not fight over the cores;
   without OpenMP, pthreads (the calling thread takes the units of any that cannot start). Returns
   2 for a form it cannot read, 1 when no thread had memory for its buffers. */
int shuili_fixed_gemm(const double *a, const double *sa, int64_t m, int64_t k, const void *w, int bits,
                      const double *sb, int64_t n, float *out, int threads) {
    int mode = bits == 32 ? 1 : bits;
    if ((mode != 1 && mode != 4 && mode != 8) || (mode != 1 && k % CH)) return 2;
    int64_t panels = (n + NR - 1) / NR;
    int64_t mc = (MC_BYTES / (8 * (k > 0 ? k : 1))) / ROWS * ROWS;
    if (mc < ROWS) mc = ROWS;
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    if (threads > panels) threads = panels > 0 ? (int)panels : 1;
    /* about UNITS work units per thread, whole panel pairs each */
    int64_t group = (panels + (int64_t)threads * UNITS - 1) / ((int64_t)threads * UNITS);
    group = (group + PSTEP - 1) / PSTEP * PSTEP;
    int64_t next = 0;
    job_t job = {a, sa, sb, (const uint8_t *)w, out, m, k, n, mc, panels, group, mode, &next};
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    run(&job);
#else
    pthread_t tids[256];
    int started[256];
    for (int t = 1; t < threads; ++t) started[t] = pthread_create(&tids[t], NULL, run, &job) == 0;
    run(&job); /* returns once every unit is taken: a thread that could not start leaves its share to the others */
    for (int t = 1; t < threads; ++t)
        if (started[t]) pthread_join(tids[t], NULL);
#endif
    if (next == 0 && m > 0) return 1; /* a thread with its buffers takes units until none is left */
    return 0;
}

/* linear's fixed-point product from the float32 activations: each row of x [m, k] goes to its grid
   (numerics.h's to_fixed_row) and through shuili_fixed_gemm. One call per linear instead of
   the ~10 torch ops and two host transfers that built the grids. Returns 1 when out of memory. */
int shuili_fixed_linear(const float *x, int64_t m, int64_t k, int pa, const void *w, int bits, const double *sb,
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
    int rc = shuili_fixed_gemm(qa, sa, m, k, w, bits, sb, n, out, threads);
    free(qa);
    free(sa);
    return rc;
}
