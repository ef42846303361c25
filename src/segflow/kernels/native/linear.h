/* segflow native kernels: what gemm.c's linear and strassen.c's share.
 *
 * The call's arguments (segflow_linear_t, which kernels/linear.py mirrors), the
 * activations applied as outputs are stored (act_t, activate(), gelu_vf()), the
 * register block's pass over one panel (block()), the largest magnitude of a weight or
 * of rows (larger_magnitude()), guided chunk claiming, and the entry points each file
 * offers the other. Both read the weight packed by
 * segflow_linear_pack: panels of NR output columns (24, or 48 with AVX-512), [k][NR]
 * each.
 */
#ifndef SEGFLOW_LINEAR_H
#define SEGFLOW_LINEAR_H

#include <stdint.h>

#include "panel.h"         /* NR, MR, VW, vf, vfi, splat_vf, select_vf, panel_fma */

#if VW == 16
#define KC 128             /* input columns per pass over a panel: its block (24 KiB) in L1 */
#else
#define KC 384             /* input columns per pass over a panel */
#endif

/* The activation applied as outputs are stored (kernels/linear.py ACT_*). */
typedef enum {
    ACT_NONE = 0,
    ACT_CLAMP = 1,           /* min(max(max(v, slope v), lo), hi) */
    ACT_GELU = 2,            /* erf-GELU (gelu_vf) */
} act_t;

/* What kernels/linear.py's ctypes structure mirrors. */
typedef struct {
    const float *x;          /* [m][lda] */
    const float *w;          /* the packed weight: ceil(n / NR) panels of [k][NR] */
    const float *bias;       /* n floats, or NULL */
    float *y;                /* [m][n] */
    int64_t m, n, k, lda;
    int64_t act;             /* an act_t */
    float slope, lo, hi;
    int32_t pad_;
    /* The process's OpenMP runtime (libgomp's entry points); NULL: this thread alone. */
    void (*parallel)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
    int (*thread_num)(void);
    int (*num_threads)(void);
    int64_t next;            /* the next unclaimed chunk of panels or rows */
    /* One level of Strassen (strassen.c): */
    float *scratch;          /* segflow_linear_strassen_scratch() floats; NULL: classic */
    int64_t scratch_threads; /* the threads it has room for */
    double wmax;             /* the largest |W| (segflow_linear_strassen_spread) */
    int64_t arrived;         /* threads past the first phase */
    int64_t spare;           /* the next unclaimed panel past the paired ones */
    int32_t refused;         /* 1 where the first phase found x unfit for it */
    int32_t strassen;        /* out: 1 where the call ran as Strassen */
} segflow_linear_t;

/* x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, lanewise. erf(x / sqrt 2) is the rational
 * |x| P(x^2) / Q(x^2) on |x| <= 5.5 (P of degree 6, Q of degree 5, fitted for this
 * function: least squares reweighted towards minimax, with the weight |x| since the
 * error is scaled by x / 2, its float32 coefficients rounded one at a time and the
 * rest refitted), capped at 1, and exactly 1 beyond 5.5 (where erf rounds to 1 in
 * float32), so that a large negative x gives 0 as torch does, and -inf NaN as torch
 * does. Within 8.5e-7 of the exact GELU over [-12, 12] in float32 (the tests hold it
 * under 1.2e-6; torch's own vectorized GELU: 3.7e-7), below the ~1e-5 by which a
 * 768-term float32 sum differs from the exact one. 21 vector operations (one a
 * division) per vector, against the ~40 of an erf through exp: fused here, on a 768 ->
 * 3072 linear's last KC block, it costs less than torch's gelu_ as a pass over y
 * after it (figures: docs/performance.md, 'Why each kernel exists'). */
static inline vf gelu_vf(vf x) {
    const vfi sign = (vfi)splat_vf(-0.0f);
    const vf ax = (vf)((vfi)x & ~sign);
    const vf c = select_vf(ax, splat_vf(5.5f), (vfi)(ax > splat_vf(5.5f)));
    const vf t = c * c;
    vf num = splat_vf(-1.6107423728151105e-10f);
    num = num * t + splat_vf(1.0981689513300807e-07f);
    num = num * t + splat_vf(1.7170639694086276e-05f);
    num = num * t + splat_vf(0.000336903816787526f);
    num = num * t + splat_vf(0.009606008417904377f);
    num = num * t + splat_vf(0.06489741057157516f);
    num = num * t + splat_vf(0.7978846430778503f);
    vf den = splat_vf(2.0554402908601332e-06f);
    den = den * t + splat_vf(8.196599083021283e-05f);
    den = den * t + splat_vf(0.0019276351667940617f);
    den = den * t + splat_vf(0.028372740373015404f);
    den = den * t + splat_vf(0.24800385534763336f);
    den = den * t + splat_vf(1.0f);
    vf g = c * num / den;
    g = select_vf(g, splat_vf(1.0f), (vfi)(g > splat_vf(1.0f)) | (vfi)(ax >= splat_vf(5.5f)));
    g = (vf)((vfi)g | ((vfi)x & sign));
    const vf h = splat_vf(0.5f) * x;
    return h + h * g;
}

/* ReLU, LeakyReLU (0 <= slope <= 1), Clip; NaN stays NaN (every comparison is false).
 * Or GELU. */
static inline vf activate(const segflow_linear_t *p, vf v) {
    if (p->act == ACT_GELU)
        return gelu_vf(v);
    const vf lo = splat_vf(p->lo), hi = splat_vf(p->hi), leaky = v * splat_vf(p->slope);
    v = select_vf(v, leaky, leaky > v);
    v = select_vf(v, lo, v < lo);
    return select_vf(v, hi, v > hi);
}

/* y[0..R-1][0..NR-1] (rows ldy apart) = (first ? start : y) + x[0..R-1][0..kc-1] panel,
 * activated when last. `start` is NR floats (the bias) used for every row. */
static inline __attribute__((always_inline)) void
block(const segflow_linear_t *p, int R, int64_t kc, const float *restrict x, int64_t lda,
      const float *restrict panel, float *restrict y, int64_t ldy, const float *start,
      int first, int last) {
    vf acc[MR][3];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 3; v++)
            acc[r][v] = first ? *(const vf *)(start + VW * v) : *(const vf *)(y + r * ldy + VW * v);
    panel_fma(R, kc, x, lda, panel, acc);
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 3; v++)
            *(vf *)(y + r * ldy + VW * v) = last && p->act ? activate(p, acc[r][v]) : acc[r][v];
}

/* CALL(R) with R the constant 1 .. MR equal to `rows` (1 <= rows <= MR): the register
 * block's loops unrolled for each row count, as a switch. */
#if MR == 8
#define WITH_ROWS(rows, CALL) do {                                                      \
        switch (rows) {                                                                 \
        case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break;         \
        case 5: CALL(5); break; case 4: CALL(4); break; case 3: CALL(3); break;         \
        case 2: CALL(2); break; default: CALL(1); break;                                \
        }                                                                               \
    } while (0)
#else
#define WITH_ROWS(rows, CALL) do {                                                      \
        switch (rows) {                                                                 \
        case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break;         \
        default: CALL(1); break;                                                        \
        }                                                                               \
    } while (0)
#endif

/* The largest magnitude seen, lanewise, kept as the bits of |x|: as integers they order
 * as the magnitudes do, and every NaN sorts above infinity, so a NaN, once seen, stays
 * (no separate check for it). magnitude_value turns the bits back into the float. */
static inline vfi larger_magnitude(vfi top, vf x) {
    const vfi a = (vfi)x & ~(vfi)splat_vf(-0.0f);
    const vfi more = a > top;
    return (top & ~more) | (a & more);
}

static inline int32_t larger_magnitude1(int32_t top, float x) {
    union { float f; int32_t i; } u = {x};
    const int32_t a = u.i & 0x7fffffff;
    return a > top ? a : top;
}

static inline float magnitude_value(int32_t bits) {
    union { int32_t i; float f; } u = {bits};
    return u.f;
}

/* The next guided chunk of `total` units counted by *next: a quarter of what is left
 * (remaining / (2 threads)), at least one, claimed with a compare-and-swap. Returns its
 * first unit, its size in *chunk; `total` once none is left. */
static inline int64_t claim_guided(int64_t *next, int64_t total, int64_t threads,
                                   int64_t *chunk) {
    int64_t c = __atomic_load_n(next, __ATOMIC_RELAXED);
    while (c < total) {          /* on a failed exchange c is the counter's new value */
        const int64_t n = (total - c) / (2 * threads) > 1 ? (total - c) / (2 * threads) : 1;
        if (__atomic_compare_exchange_n(next, &c, c + n, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
            *chunk = n;
            return c;
        }
    }
    return total;
}

/* gemm.c: the OpenMP region body of the classic kernel (claims chunks of p->next), and
 * the classic kernel over panels [p0, p1) and rows [r0, r1). */
__attribute__((visibility("hidden"))) void linear_work(void *data);
__attribute__((visibility("hidden"))) void linear_part(const segflow_linear_t *p, int64_t p0,
                                                       int64_t p1, int64_t r0, int64_t r1);
/* strassen.c: whether the call can run as Strassen, and its region body. */
__attribute__((visibility("hidden"))) int strassen_fits(const segflow_linear_t *p);
__attribute__((visibility("hidden"))) void strassen_work(void *data);

#endif
