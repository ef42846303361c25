/* segflow native kernels: the register blocks shared by gemm.c, strassen.c and
 * attention.c.
 *
 * A "panel" is NR columns of a matrix stored k-major ([k][NR], the last panel of a
 * matrix padded with zeros), so that one step down k reads NR consecutive floats.
 * panel_fma adds R (<= MR) rows of x times one panel into MR x 3 vector
 * accumulators: per step three panel loads, one broadcast per row, 3 MR multiply-adds.
 * The block follows the build's widest vectors (vf, VW floats):
 * - AVX-512: NR = 48, MR = 8: 24 accumulators of the 32 zmm registers, 24
 *   multiply-adds per 11 loads;
 * - otherwise (AVX2): NR = 24, MR = 4: 12 accumulators, the 16 ymm registers exactly.
 * Inlined into its callers, with R a constant, GCC keeps the accumulators in
 * registers. In an AVX-512 build the 8 x 48 block runs well ahead of the 4 x 24 one
 * and of torch's matmul (one thread, 128 x 768 -> 3072, warm) (figures:
 * docs/performance.md, 'Why each kernel exists').
 */
#ifndef SEGFLOW_PANEL_H
#define SEGFLOW_PANEL_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

static inline v8 splat(float a) { return (v8){a, a, a, a, a, a, a, a}; }

#if defined(__AVX512F__)
#define VW 16              /* floats per vector */
#define MR 8               /* rows per register block */
typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef int32_t vfi __attribute__((vector_size(64), aligned(4)));
static inline vf splat_vf(float a) {
    return (vf){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a};
}
#else
#define VW 8
#define MR 4
typedef v8 vf;
typedef v8i vfi;
static inline vf splat_vf(float a) { return splat(a); }
#endif
#define NR (3 * VW)        /* columns per panel: three vectors */

/* where `take`, b, else a */
static inline vf select_vf(vf a, vf b, vfi take) { return (vf)(((vfi)a & ~take) | ((vfi)b & take)); }

/* acc[r][0..2] += sum over i < kc of x[r * lda + i] * panel[i][0..NR-1], r < R. */
static inline __attribute__((always_inline)) void
panel_fma(int R, int64_t kc, const float *restrict x, int64_t lda,
          const float *restrict panel, vf acc[MR][3]) {
    for (int64_t i = 0; i < kc; i++) {
        vf b0 = *(const vf *)(panel), b1 = *(const vf *)(panel + VW),
           b2 = *(const vf *)(panel + 2 * VW);
        panel += NR;
        for (int r = 0; r < R; r++) {
            vf a = splat_vf(x[r * lda + i]);
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
            acc[r][2] += a * b2;
        }
    }
}

/* The narrow block: NARROW columns a panel (two vectors: 16 floats with AVX2, 32 with
 * AVX-512), MR_NARROW rows (6, or 12 with AVX-512: 2 MR_NARROW accumulators); for
 * widths that are multiples of 16 (attention's 64-wide heads, 128 keys), where
 * three-vector panels would waste a share of the work on padding. */
#define NARROW (2 * VW)
#if VW == 16
#define MR_NARROW 12
#else
#define MR_NARROW 6
#endif

/* acc[r][0..1] += sum over i < kc of x[r * lda + i] * panel[i][0..NARROW-1], r < R. */
static inline __attribute__((always_inline)) void
narrow_panel_fma(int R, int64_t kc, const float *restrict x, int64_t lda,
                 const float *restrict panel, vf acc[MR_NARROW][2]) {
    for (int64_t i = 0; i < kc; i++) {
        vf b0 = *(const vf *)(panel), b1 = *(const vf *)(panel + VW);
        panel += NARROW;
        for (int r = 0; r < R; r++) {
            vf a = splat_vf(x[r * lda + i]);
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
        }
    }
}

#endif
