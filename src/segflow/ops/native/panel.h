/* segflow native kernels: the register block shared by gemm.c and attention.c.
 *
 * A "panel" is NR = 24 columns of a matrix stored k-major ([k][24], the last panel
 * of a matrix padded with zeros), so that one step down k reads 24 consecutive
 * floats. panel_fma adds R (<= MR = 4) rows of x times one panel into 4 x 3 vector
 * accumulators: per step three panel loads, one broadcast per row, 12 multiply-adds,
 * the 16 AVX2 registers exactly. Inlined into its callers, with R a constant, GCC
 * keeps the accumulators in registers.
 */
#ifndef SEGFLOW_PANEL_H
#define SEGFLOW_PANEL_H

#include <stdint.h>

#define NR 24              /* columns per panel: three vectors of eight */
#define MR 4               /* rows per register block */

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

static inline v8 splat(float a) { return (v8){a, a, a, a, a, a, a, a}; }

/* acc[r][0..2] += sum over i < kc of x[r * lda + i] * panel[i][0..23], r < R. */
static inline __attribute__((always_inline)) void
panel_fma(int R, int64_t kc, const float *restrict x, int64_t lda,
          const float *restrict panel, v8 acc[MR][3]) {
    for (int64_t i = 0; i < kc; i++) {
        v8 b0 = *(const v8 *)(panel), b1 = *(const v8 *)(panel + 8),
           b2 = *(const v8 *)(panel + 16);
        panel += NR;
        for (int r = 0; r < R; r++) {
            v8 a = splat(x[r * lda + i]);
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
            acc[r][2] += a * b2;
        }
    }
}

/* The narrow block: NARROW = 16 columns a panel, MR_NARROW = 6 rows (6 x 2
 * accumulators, the same 12 multiply-adds a step); for widths that are multiples of
 * 16 (attention's 64-wide heads, 128 keys), where 24-column panels would waste an
 * eighth of the work on padding. */
#define NARROW 16
#define MR_NARROW 6

/* acc[r][0..1] += sum over i < kc of x[r * lda + i] * panel[i][0..15], r < R. */
static inline __attribute__((always_inline)) void
narrow_panel_fma(int R, int64_t kc, const float *restrict x, int64_t lda,
                 const float *restrict panel, v8 acc[MR_NARROW][2]) {
    for (int64_t i = 0; i < kc; i++) {
        v8 b0 = *(const v8 *)(panel), b1 = *(const v8 *)(panel + 8);
        panel += NARROW;
        for (int r = 0; r < R; r++) {
            v8 a = splat(x[r * lda + i]);
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
        }
    }
}

#endif
