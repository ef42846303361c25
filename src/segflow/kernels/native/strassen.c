/* segflow native kernels: a large linear as one level of Strassen.
 *
 * segflow_linear (gemm.c) runs y = act(x W^T + b) this way where strassen_fits and
 * its caller passed scratch: x, W^T and y are each split into 2 x 2 blocks (rows at
 * m2, inputs at k / 2, outputs at n2; m2 is m / 2 rounded down to the register
 * block's MR rows, n2 is n / 2 rounded down to whole NR-column panels, and the rows
 * past 2 m2 (up to 2 MR - 1) and the outputs past 2 n2 (up to 2 NR - 1) are summed
 * classically),
 * and the 8 block products of the classic algorithm are replaced by Strassen's 7,
 * with A = x, B = W^T (B12: inputs below k / 2, outputs from n2) and C = y:
 *
 *   M1 = (A11 + A22) (B11 + B22)    C11 += M1, C22 += M1
 *   M2 = (A21 + A22) B11            C21 += M2, C22 -= M2
 *   M3 = A11 (B12 - B22)            C12 += M3, C22 += M3
 *   M4 = A22 (B21 - B11)            C11 += M4, C21 += M4
 *   M5 = (A11 + A12) B22            C11 -= M5, C12 += M5
 *   M6 = (A21 - A11) (B11 + B12)    C22 += M6
 *   M7 = (A12 - A22) (B21 + B22)    C11 += M7
 *
 * 7/8 of the multiply-adds, for sums of blocks:
 * - A's five sums are made first, each thread a share of the row pairs, into scratch
 *   ([m2][k / 2] each); the threads then wait for each other (a spin on a counter);
 * - B's five, of one SKC block of a pair of panels (outputs j and j + n2), into the
 *   thread's own scratch just before that block's products (5 x 36 KiB, in L2). The
 *   weight stays as segflow_linear_pack made it, and is read from memory once a run,
 *   as by the classic kernel: nothing about it is stored twice.
 * Every product is panel.h's register block over an SKC block, its tile added to
 * (or subtracted from) the one or two output tiles it belongs to, which start as the
 * bias; the activation is applied after the last SKC block's products. The threads
 * claim guided chunks of panel pairs, as gemm.c's do of panels, then the panels past
 * them one at a time. The rows past 2 m2 are summed classically within each panel
 * pair, while its weight blocks are at hand.
 *
 * It exists because in an AVX2 build (4 x 24 block) the classic kernel already runs
 * close to the cores' FMA peak, where only less arithmetic is faster: at 128 rows and
 * a transformer's four linear shapes (768 -> 2304, 768 -> 768, 768 -> 3072,
 * 3072 -> 768) with cache-cold weights, one level of Strassen takes less of the
 * classic kernel's time on each, and a whole run of such a model less time; this
 * file's version keeps most of that (A's and B's sums cost a little of it). Smaller
 * blocks gained less or lost: 512 and 256 inputs lost at every row count tried (32 to
 * 256 rows), hence strassen_fits. In an AVX-512 build (8 x 48 block) it does not pay:
 * the classic kernel reads its 128-input panel blocks from L1 at twice the width, and
 * the sums, which run at memory speed, cost what the products save (at 128 and 384
 * rows), so the layout pass uses it only with AVX2's panels unless told
 * (strassen_preferred) (figures: docs/performance.md, 'Why each kernel exists').
 *
 * Numerics. Each output is still summed in one fixed order, whatever the thread
 * count, but rows m2 apart, and output columns n2 apart, enter each other's
 * rounding errors (in exact arithmetic those terms cancel): Strassen's error is
 * bounded by whole blocks' magnitudes, not by each output's own terms. Measured
 * against float64 at 128 x 768 -> 768 (largest error over |x| |W| summed per
 * output): random data 3.8e-7 against the classic kernel's 3.2e-7; one half of the
 * rows 1000x the other, 2.7e-4 against 3.1e-7. So it runs only where the blocks are
 * alike, the weight checked once (segflow_linear_strassen_spread, from each output's
 * largest |W| taken while packing) and x at every call by the first phase:
 * - the largest |W| of output columns j and j + n2 within SPREAD of each other;
 * - the largest |x| of rows i and i + m2 within SPREAD of each other, every value
 *   finite (an infinity in one row would make NaN of its partner's outputs), and
 *   max |x| max |W| k under FAR_FROM_OVERFLOW;
 * otherwise the call runs the classic kernel, and says so (p->strassen = 0).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "linear.h"

#define SPREAD 16.0                 /* paired rows' (columns') largest |.| may differ so */
#define FAR_FROM_OVERFLOW 1e36      /* max |x| max |W| k must stay under this */
#define MIN_ROWS 32                 /* fewer rows, and the products are too thin */
#define MIN_WIDTH 768               /* inputs and outputs, each (see above) */
/* Inputs per block of B's sums and of the products: 384 in either build. An AVX-512
 * build's classic kernel takes 128 (linear.h's KC); here 128 cost more at 128 rows
 * and 768- and 3072-wide shapes (figures: docs/performance.md, 'Why each kernel
 * exists'): each product's tiles are added into y once a block. */
#define SKC 384

/* The paired rows' and outputs' halves: m2 rows, n2 outputs (whole panels). */
static inline int64_t rows_half(int64_t m) { return m / 2 / MR * MR; }
static inline int64_t outputs_half(int64_t n) { return n / 2 / NR * NR; }

/* The B sums of one SKC block of a panel pair, in a thread's scratch. */
enum { T1, T3, T4, T6, T7, B_SUMS };   /* B11+B22, B12-B22, B21-B11, B11+B12, B21+B22 */

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ __volatile__("yield")
#else
#define RELAX() ((void)0)
#endif

/* Floats of A's sums, rounded up so that the threads' B sums start 64-byte aligned. */
static int64_t a_sums_floats(int64_t m, int64_t k) {
    return (5 * rows_half(m) * (k / 2) + 15) / 16 * 16;
}

/* 1 where a weight of n outputs and k inputs may be run over as Strassen. */
int segflow_linear_strassen_weight_fits(int64_t n, int64_t k) {
    return n >= MIN_WIDTH && k >= MIN_WIDTH && k % 2 == 0;
}

/* 1 where a linear of m rows over such a weight may run as Strassen. */
int segflow_linear_strassen_fits(int64_t m, int64_t n, int64_t k) {
    return m >= MIN_ROWS && segflow_linear_strassen_weight_fits(n, k);
}

int strassen_fits(const segflow_linear_t *p) {
    return segflow_linear_strassen_fits(p->m, p->n, p->k) && p->wmax >= 0 &&
           p->scratch_threads > 0;
}

/* SPREAD, for kernels/linear.py to hold the weight's check to. */
double segflow_linear_strassen_max_spread(void) { return SPREAD; }

/* Floats of scratch a call of m rows and k inputs needs with `threads` threads. */
int64_t segflow_linear_strassen_scratch(int64_t m, int64_t k, int64_t threads) {
    return a_sums_floats(m, k) + threads * B_SUMS * SKC * NR;
}

/* The weight's check, from `top` (each output's largest |W|, as segflow_linear_pack
 * gives it): the largest ratio between those of outputs j and j + n2 over every j < n2
 * (infinity where one is 0 and the other not; NaN where W holds a NaN), and in *wmax
 * the largest of them. */
double segflow_linear_strassen_spread(const float *top, int64_t n, double *wmax) {
    double worst = 1.0, largest = 0.0;
    const int64_t n2 = outputs_half(n);
    for (int64_t j = 0; j < n2; j++) {
        const double a = top[j], b = top[j + n2];
        if (a != a || b != b) {
            *wmax = NAN;
            return NAN;
        }
        const double hi = fmax(a, b), lo = fmin(a, b);
        worst = fmax(worst, lo > 0.0 ? hi / lo : hi > 0.0 ? INFINITY : 1.0);
        largest = fmax(largest, hi);
    }
    *wmax = largest;
    return worst;
}

/* The first phase, this thread's share of the row pairs: A's five sums, and whether x
 * is fit for Strassen (0 sets p->refused). */
static void a_sums(segflow_linear_t *p, int64_t t, int64_t threads) {
    const int64_t m2 = rows_half(p->m), k2 = p->k / 2, lda = p->lda, size = m2 * k2;
    const int64_t kv = k2 / VW * VW;
    float top = 0.0f;
    int fit = 1;
    for (int64_t r = m2 * t / threads; r < m2 * (t + 1) / threads && fit; r++) {
        const float *a11 = p->x + r * lda, *a12 = a11 + k2;
        const float *a21 = a11 + m2 * lda, *a22 = a21 + k2;
        float *s1 = p->scratch + r * k2, *s2 = s1 + size, *s5 = s2 + size, *s6 = s5 + size,
              *s7 = s6 + size;
        vfi upper = {0}, lower = {0};   /* the largest magnitudes of rows r, r + m2 */
        for (int64_t i = 0; i < kv; i += VW) {
            const vf v11 = *(const vf *)(a11 + i), v12 = *(const vf *)(a12 + i);
            const vf v21 = *(const vf *)(a21 + i), v22 = *(const vf *)(a22 + i);
            *(vf *)(s1 + i) = v11 + v22;
            *(vf *)(s2 + i) = v21 + v22;
            *(vf *)(s5 + i) = v11 + v12;
            *(vf *)(s6 + i) = v21 - v11;
            *(vf *)(s7 + i) = v12 - v22;
            upper = larger_magnitude(larger_magnitude(upper, v11), v12);
            lower = larger_magnitude(larger_magnitude(lower, v21), v22);
        }
        int32_t hi = 0, lo = 0;
        for (int l = 0; l < VW; l++) {
            hi = upper[l] > hi ? upper[l] : hi;
            lo = lower[l] > lo ? lower[l] : lo;
        }
        for (int64_t i = kv; i < k2; i++) {
            const float v11 = a11[i], v12 = a12[i], v21 = a21[i], v22 = a22[i];
            s1[i] = v11 + v22;
            s2[i] = v21 + v22;
            s5[i] = v11 + v12;
            s6[i] = v21 - v11;
            s7[i] = v12 - v22;
            hi = larger_magnitude1(larger_magnitude1(hi, v11), v12);
            lo = larger_magnitude1(larger_magnitude1(lo, v21), v22);
        }
        /* As bits a NaN is the largest magnitude of all: not finite, so refused. */
        const float big = magnitude_value(hi > lo ? hi : lo);
        const float small = magnitude_value(hi > lo ? lo : hi);
        fit &= isfinite(big) && (big <= (float)SPREAD * small || big == 0.0f);
        top = big > top ? big : top;
    }
    if (!fit || (double)top * p->wmax * (double)p->k >= FAR_FROM_OVERFLOW)
        __atomic_store_n(&p->refused, 1, __ATOMIC_RELAXED);
}

/* One product's MR x NR tile over an SKC block, added to c1 (s1 > 0) or subtracted from
 * it, and likewise to c2 where there is one. */
static inline __attribute__((always_inline)) void
product(int64_t kc, const float *a, int64_t lda, const float *panel, float *c1, int s1,
        float *c2, int s2, int64_t ldy) {
    vf acc[MR][3];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < 3; v++)
            acc[r][v] = splat_vf(0.0f);
    panel_fma(MR, kc, a, lda, panel, acc);
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < 3; v++) {
            vf *y1 = (vf *)(c1 + r * ldy + VW * v);
            *y1 = s1 > 0 ? *y1 + acc[r][v] : *y1 - acc[r][v];
            if (c2 != NULL) {
                vf *y2 = (vf *)(c2 + r * ldy + VW * v);
                *y2 = s2 > 0 ? *y2 + acc[r][v] : *y2 - acc[r][v];
            }
        }
}

/* Rows r.. (R of them, past 2 m2) of panel pair j, inputs [pc, pc + kc) of each half,
 * classically: C1 += x1 B11 + x2 B21, C2 += x1 B12 + x2 B22 (x1, x2: the rows' inputs
 * in each half; C1, C2: their outputs in each), through linear.h's block(). */
static inline __attribute__((always_inline)) void
rows_classic(const segflow_linear_t *p, int R, int64_t r, int64_t j, int64_t pc, int64_t kc,
             const float *b11, const float *b21, const float *b12, const float *b22) {
    static const float zeros[NR];
    const int64_t n = p->n, n2 = outputs_half(n), k2 = p->k / 2, lda = p->lda;
    const float *x1 = p->x + r * lda + pc, *x2 = x1 + k2;
    const int first = pc == 0, last = pc + kc == k2;
    float *c[2] = {p->y + r * n + j * NR, p->y + r * n + n2 + j * NR};
    const float *start[2] = {p->bias ? p->bias + j * NR : zeros,
                             p->bias ? p->bias + n2 + j * NR : zeros};
    const float *panels[2][2] = {{b11, b21}, {b12, b22}};
    for (int h = 0; h < 2; h++) {
        block(p, R, kc, x1, lda, panels[h][0], c[h], n, start[h], first, 0);
        block(p, R, kc, x2, lda, panels[h][1], c[h], n, start[h], 0, last);
    }
}

/* The rows past 2 m2 (fewer than 2 MR) of panel pair j: a copy per row count. */
static __attribute__((noinline)) void
leftover_rows(const segflow_linear_t *p, int64_t j, int64_t pc, int64_t kc, const float *b11,
              const float *b21, const float *b12, const float *b22) {
    for (int64_t r = 2 * rows_half(p->m); r < p->m; r += MR) {
#define ROWS(R) rows_classic(p, R, r, j, pc, kc, b11, b21, b12, b22)
        WITH_ROWS(p->m - r < MR ? p->m - r : MR, ROWS);
#undef ROWS
    }
}

/* Panel pair j (outputs j NR.. and n2 + j NR..), inputs [pc, pc + kc) of each half,
 * every row pair: B's sums into bs, then the seven products; then the rows past 2 m2. */
static void panel_pair(const segflow_linear_t *p, int64_t j, int64_t pc, int64_t kc,
                       float *bs) {
    const int64_t k = p->k, k2 = k / 2, m2 = rows_half(p->m), n = p->n, n2 = outputs_half(n);
    const int64_t half = n2 / NR, lda = p->lda, size = m2 * k2;
    const float *b11 = p->w + (j * k + pc) * NR, *b21 = b11 + k2 * NR;
    const float *b12 = p->w + ((j + half) * k + pc) * NR, *b22 = b12 + k2 * NR;
    float *t1 = bs + T1 * SKC * NR, *t3 = bs + T3 * SKC * NR, *t4 = bs + T4 * SKC * NR,
          *t6 = bs + T6 * SKC * NR, *t7 = bs + T7 * SKC * NR;
    for (int64_t i = 0; i < kc * NR; i += VW) {
        const vf v11 = *(const vf *)(b11 + i), v12 = *(const vf *)(b12 + i);
        const vf v21 = *(const vf *)(b21 + i), v22 = *(const vf *)(b22 + i);
        *(vf *)(t1 + i) = v11 + v22;
        *(vf *)(t3 + i) = v12 - v22;
        *(vf *)(t4 + i) = v21 - v11;
        *(vf *)(t6 + i) = v11 + v12;
        *(vf *)(t7 + i) = v21 + v22;
    }
    const float *s1 = p->scratch + pc, *s2 = s1 + size, *s5 = s2 + size, *s6 = s5 + size,
                *s7 = s6 + size;
    const float *a11 = p->x + pc, *a22 = p->x + m2 * lda + k2 + pc;
    const int first = pc == 0, last = pc + kc == k2;
    for (int64_t r = 0; r < m2; r += MR) {
        float *c11 = p->y + r * n + j * NR, *c12 = c11 + n2, *c21 = c11 + m2 * n,
              *c22 = c21 + n2;
        if (first) {
            for (int v = 0; v < 3; v++) {
                const vf lo = p->bias ? *(const vf *)(p->bias + j * NR + VW * v) : splat_vf(0.0f);
                const vf hi = p->bias ? *(const vf *)(p->bias + n2 + j * NR + VW * v)
                                      : splat_vf(0.0f);
                for (int i = 0; i < MR; i++) {
                    *(vf *)(c11 + i * n + VW * v) = lo;
                    *(vf *)(c21 + i * n + VW * v) = lo;
                    *(vf *)(c12 + i * n + VW * v) = hi;
                    *(vf *)(c22 + i * n + VW * v) = hi;
                }
            }
        }
        product(kc, s1 + r * k2, k2, t1, c11, 1, c22, 1, n);        /* M1 */
        product(kc, s2 + r * k2, k2, b11, c21, 1, c22, -1, n);      /* M2 */
        product(kc, a11 + r * lda, lda, t3, c12, 1, c22, 1, n);     /* M3 */
        product(kc, a22 + r * lda, lda, t4, c11, 1, c21, 1, n);     /* M4 */
        product(kc, s5 + r * k2, k2, b22, c11, -1, c12, 1, n);      /* M5 */
        product(kc, s6 + r * k2, k2, t6, c22, 1, NULL, 0, n);       /* M6 */
        product(kc, s7 + r * k2, k2, t7, c11, 1, NULL, 0, n);       /* M7 */
        if (last && p->act) {
            float *tiles[4] = {c11, c12, c21, c22};
            for (int q = 0; q < 4; q++)
                for (int i = 0; i < MR; i++)
                    for (int v = 0; v < 3; v++) {
                        vf *y = (vf *)(tiles[q] + i * n + VW * v);
                        *y = activate(p, *y);
                    }
        }
    }
    if (2 * m2 < p->m)
        leftover_rows(p, j, pc, kc, b11, b21, b12, b22);
}

/* The OpenMP region's body (gemm.c's segflow_linear starts it): the first phase, the
 * wait, then chunks of panel pairs; or the classic kernel where x is unfit, or where
 * the scratch has no room for this many threads. */
void strassen_work(void *data) {
    segflow_linear_t *p = data;
    const int64_t threads = p->num_threads ? p->num_threads() : 1;
    const int64_t t = p->thread_num ? p->thread_num() : 0;
    if (threads > p->scratch_threads) {
        linear_work(p);
        return;
    }
    a_sums(p, t, threads);
    __atomic_add_fetch(&p->arrived, 1, __ATOMIC_ACQ_REL);
    while (__atomic_load_n(&p->arrived, __ATOMIC_ACQUIRE) < threads)
        RELAX();
    if (__atomic_load_n(&p->refused, __ATOMIC_RELAXED)) {
        linear_work(p);
        return;
    }
    if (t == 0)
        p->strassen = 1;
    float *bs = p->scratch + a_sums_floats(p->m, p->k) + t * B_SUMS * SKC * NR;
    const int64_t pairs = outputs_half(p->n) / NR, k2 = p->k / 2;
    for (int64_t c, chunk; (c = claim_guided(&p->next, pairs, threads, &chunk)) < pairs;)
        for (int64_t pc = 0; pc < k2; pc += SKC)
            for (int64_t j = c; j < c + chunk; j++)
                panel_pair(p, j, pc, k2 - pc < SKC ? k2 - pc : SKC, bs);
    /* The panels past the pairs (outputs from 2 n2), classically, one at a time. */
    const int64_t panels = (p->n + NR - 1) / NR;
    for (int64_t q; (q = 2 * pairs + __atomic_fetch_add(&p->spare, 1, __ATOMIC_RELAXED)) < panels;)
        linear_part(p, q, q + 1, 0, p->m);
}
