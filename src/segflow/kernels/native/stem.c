/* segflow native kernels: a stem convolution, read from the NCHW image in place.
 *
 * segflow_stem_execute computes y = act(conv(x, w) + bias) for a convolution over
 * few input channels (an image's 1 to 4), ungrouped and undilated, any kernel size,
 * stride and padding: x is the float32 NCHW feed, y the channels-last output whose
 * channels are a multiple of the vector width (kernels/stem.py builds the plan).
 * It exists because libdnnl has only reference kernels for an NCHW source with a
 * channels-last destination: the stem convolution copied the image into
 * channels-last storage first (staging.c), and libdnnl's kernel for three input
 * channels keeps most of its vector lanes idle: a 3 -> 32, 3x3, stride-2 stem over
 * 224x224 paid for the staging on top of that convolution (figures:
 * docs/performance.md, 'Why each kernel exists').
 *
 * Each output row is one pass over the taps (ky, kx, input channel): per tap, one
 * load of the tap's output-channel weights (w is [kh][kw][c][k]) and one broadcast
 * of each of P pixels' input values, multiply-added into P x NV vector accumulators
 * (NV vectors of output channels, up to 4 at a time, 2 with AVX2's 16 registers; P
 * as many pixels as the registers hold). Rows a tap would read above or below the
 * image are skipped; pixels whose window crosses the left or right edge take a
 * checked path. The rows are split between the OpenMP threads libdnnl uses.
 *
 * Its signature is libdnnl's dnnl_primitive_execute, so the replay's C loop
 * (replay.c) and Python call it where they would execute a primitive: the plan stands
 * for the primitive, and the source and destination addresses are the ones the
 * caller just pointed the convolution's memories at (`handles`).
 */
#include <stddef.h>
#include <stdint.h>

#include "panel.h"         /* vf, VW, splat_vf, select_vf */

/* The layout kernels/stem.py's ctypes structure mirrors. */
typedef struct {
    int64_t n, c, h, w;           /* input [n][c][h][w] */
    int64_t k, oh, ow;            /* output [n][oh][ow][k] */
    int64_t kh, kw, sh, sw, pt, pl;
    int64_t act;                  /* apply the activation below */
    float slope, lo, hi;          /* min(max(max(v, slope v), lo), hi) */
    int32_t pad_;
    const float *weight;          /* [kh][kw][c][k] */
    const float *bias;            /* k floats, or NULL */
    const uintptr_t *handles;     /* where src and dst point now */
    void (*parallel)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
    int (*thread_num)(void);
    int (*num_threads)(void);
} segflow_stem_t;

/* Pixels a block takes: as many as the accumulators leave registers for (32 vector
 * registers with AVX-512, 16 with AVX2), for NV vectors of output channels. */
#if VW == 16
#define MAX_NV 4           /* vectors of output channels a row's pass takes at most */
#define PIXELS(NV) ((NV) == 1 ? 16 : (NV) == 2 ? 12 : 6)
#else
#define MAX_NV 2
#define PIXELS(NV) ((NV) == 1 ? 8 : 6)
#endif

static inline vf finish(const segflow_stem_t *p, vf v) {
    if (!p->act)
        return v;
    const vf leaky = v * splat_vf(p->slope);
    v = select_vf(v, leaky, (vfi)(leaky > v));
    v = select_vf(v, splat_vf(p->lo), (vfi)(v < splat_vf(p->lo)));
    return select_vf(v, splat_vf(p->hi), (vfi)(v > splat_vf(p->hi)));
}

/* Output channels [v0 * VW, (v0 + NV) * VW) of P pixels from column ox of row oy, image b,
 * every tap's column inside the image. */
static inline __attribute__((always_inline)) void
block(const segflow_stem_t *p, const float *x, float *y, int64_t b, int64_t oy,
      int64_t ox, int64_t v0, const int NV, const int P, int64_t ky0, int64_t ky1) {
    const int64_t c = p->c, k = p->k, sw = p->sw;
    const int64_t iy = oy * p->sh - p->pt, ix = ox * sw - p->pl;
    vf acc[16][4];          /* P x NV of them, in registers: the loops unrolled */
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        const vf start = p->bias ? *(const vf *)(p->bias + (v0 + v) * VW) : splat_vf(0.0f);
#pragma GCC unroll 16
        for (int q = 0; q < P; q++)
            acc[q][v] = start;
    }
    for (int64_t ky = ky0; ky < ky1; ky++)
        for (int64_t kx = 0; kx < p->kw; kx++)
            for (int64_t ci = 0; ci < c; ci++) {
                const float *wt = p->weight + ((ky * p->kw + kx) * c + ci) * k + v0 * VW;
                const float *in = x + ((b * c + ci) * p->h + iy + ky) * p->w + ix + kx;
                vf wv[4];
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++)
                    wv[v] = *(const vf *)(wt + v * VW);
#pragma GCC unroll 16
                for (int q = 0; q < P; q++) {
                    const vf a = splat_vf(in[q * sw]);
#pragma GCC unroll 4
                    for (int v = 0; v < NV; v++)
                        acc[q][v] += a * wv[v];
                }
            }
    float *out = y + ((b * p->oh + oy) * p->ow + ox) * k + v0 * VW;
#pragma GCC unroll 16
    for (int q = 0; q < P; q++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            *(vf *)(out + q * k + v * VW) = finish(p, acc[q][v]);
}

/* One pixel whose window may cross the image's left or right edge: two sets of
 * accumulators (even and odd kx), so that NV = 1 or 2 still has chains to overlap. */
static inline __attribute__((always_inline)) void
pixel(const segflow_stem_t *p, const float *x, float *y, int64_t b, int64_t oy, int64_t ox,
      int64_t v0, const int NV, int64_t ky0, int64_t ky1) {
    const int64_t c = p->c, k = p->k;
    const int64_t iy = oy * p->sh - p->pt, ix = ox * p->sw - p->pl;
    vf acc[2][4];
    for (int v = 0; v < NV; v++) {
        acc[0][v] = p->bias ? *(const vf *)(p->bias + (v0 + v) * VW) : splat_vf(0.0f);
        acc[1][v] = splat_vf(0.0f);
    }
    for (int64_t ky = ky0; ky < ky1; ky++)
        for (int64_t kx = 0; kx < p->kw; kx++) {
            if (ix + kx < 0 || ix + kx >= p->w)
                continue;
            for (int64_t ci = 0; ci < c; ci++) {
                const float *wt = p->weight + ((ky * p->kw + kx) * c + ci) * k + v0 * VW;
                const vf a = splat_vf(x[((b * c + ci) * p->h + iy + ky) * p->w + ix + kx]);
                for (int v = 0; v < NV; v++)
                    acc[kx & 1][v] += a * *(const vf *)(wt + v * VW);
            }
        }
    float *out = y + ((b * p->oh + oy) * p->ow + ox) * k + v0 * VW;
    for (int v = 0; v < NV; v++)
        *(vf *)(out + v * VW) = finish(p, acc[0][v] + acc[1][v]);
}

/* Row oy of image b, output channels [v0 * VW, (v0 + NV) * VW). */
static inline __attribute__((always_inline)) void
row(const segflow_stem_t *p, const float *x, float *y, int64_t b, int64_t oy, int64_t v0,
    const int NV) {
    const int P = PIXELS(NV);
    const int64_t iy = oy * p->sh - p->pt;
    const int64_t ky0 = iy < 0 ? -iy : 0;
    const int64_t ky1 = p->h - iy < p->kh ? p->h - iy : p->kh;
    /* Columns whose whole window is inside the image: [lo, hi). */
    int64_t lo = (p->pl + p->sw - 1) / p->sw;
    int64_t hi = p->w - p->kw + p->pl >= 0 ? (p->w - p->kw + p->pl) / p->sw + 1 : 0;
    if (lo > p->ow)
        lo = p->ow;
    if (hi > p->ow)
        hi = p->ow;
    if (hi < lo)
        hi = lo;
    int64_t ox = 0;
    for (; ox < lo; ox++)
        pixel(p, x, y, b, oy, ox, v0, NV, ky0, ky1);
    for (; ox + P <= hi; ox += P)
        block(p, x, y, b, oy, ox, v0, NV, P, ky0, ky1);
    for (; ox + P / 2 <= hi; ox += P / 2)      /* what is left of the inside: half blocks */
        block(p, x, y, b, oy, ox, v0, NV, P / 2, ky0, ky1);
    for (; ox < p->ow; ox++)
        pixel(p, x, y, b, oy, ox, v0, NV, ky0, ky1);
}

static void work(void *data) {
    const segflow_stem_t *p = data;
    const float *x = (const float *)p->handles[0];
    float *y = (float *)p->handles[1];
    const int64_t threads = p->parallel ? p->num_threads() : 1;
    const int64_t me = p->parallel ? p->thread_num() : 0;
    const int64_t rows = p->n * p->oh;
    const int64_t r0 = rows * me / threads, r1 = rows * (me + 1) / threads;
    const int64_t vectors = p->k / VW;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t b = r / p->oh, oy = r % p->oh;
        for (int64_t v0 = 0; v0 < vectors; v0 += MAX_NV) {
            switch (vectors - v0 < MAX_NV ? vectors - v0 : MAX_NV) {
#if MAX_NV == 4
            case 4: row(p, x, y, b, oy, v0, 4); break;
            case 3: row(p, x, y, b, oy, v0, 2); row(p, x, y, b, oy, v0 + 2, 1); break;
#endif
            case 2: row(p, x, y, b, oy, v0, 2); break;
            default: row(p, x, y, b, oy, v0, 1); break;
            }
        }
    }
}

/* dnnl_primitive_execute's signature; `plan` is a segflow_stem_t. Returns 0. */
int segflow_stem_execute(void *plan, void *stream, int nargs, const void *args) {
    (void)stream, (void)nargs, (void)args;
    segflow_stem_t *p = plan;
    if (p->n * p->oh * p->ow == 0)
        return 0;
    if (p->parallel)
        p->parallel(work, p, 0, 0);    /* 0 threads: the calling thread's OpenMP default */
    else
        work(p);
    return 0;
}

/* The vector width the kernel was built for: output channels must be a multiple. */
int segflow_stem_vector_width(void) { return VW; }
