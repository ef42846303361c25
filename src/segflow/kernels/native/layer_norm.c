/* segflow native kernels: LayerNormalization (or RMSNormalization) over the sum of two
 * tensors.
 *
 * segflow_add_layer_norm computes, for each of `rows` rows of `width` floats,
 * y = (s - mean(s)) / sqrt(var(s) + eps) * gamma + beta with s = a + b (b may be
 * NULL: s = a; beta may be NULL: no shift). With `rms` set the row is not centred:
 * y = s / sqrt(mean(s * s) + eps) * gamma (+ beta), ONNX's RMSNormalization. a, b, y
 * and sum are row-major [rows][width] (y and sum may be a or b); gamma and beta have
 * `width` floats. A row is summed into `sum` where given (the residual a later Add
 * reads again, written in the same pass), else into y; then its mean and its variance
 * about that mean are taken (two passes over the row while it sits in L1), then it is
 * normalized into y. The OpenMP threads libdnnl uses (kernels/layer_norm.py passes
 * libgomp's entry points) claim the rows in chunks.
 *
 * It exists because a transformer's residual Add and the LayerNormalization after
 * it are two passes over the activations through torch (each a kernel call that
 * allocates its output) where one does, each row summed, reduced and normalized while
 * it sits in L1; at [128, 768] it runs ahead with cold caches too (figures:
 * docs/performance.md, 'Why each kernel exists').
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline v8 splat(float a) { return (v8){a, a, a, a, a, a, a, a}; }

static inline float hsum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* What kernels/layer_norm.py's ctypes structure mirrors. */
typedef struct {
    const float *a, *b;           /* [rows][width]; b may be NULL */
    const float *gamma, *beta;    /* [width]; beta may be NULL */
    float *y;                     /* [rows][width] */
    float *sum;                   /* [rows][width], a + b; may be NULL */
    int64_t rows, width;
    float eps;
    int32_t rms;                  /* 1: RMSNormalization (no centring) */
    void (*parallel)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
    int (*thread_num)(void);
    int (*num_threads)(void);
    int64_t next;                 /* the next unclaimed chunk of rows */
} segflow_layer_norm_t;

static void normalize_row(const segflow_layer_norm_t *p, int64_t r) {
    const int64_t w = p->width, wv = w / 8 * 8;
    const float *a = p->a + r * w, *b = p->b ? p->b + r * w : NULL;
    float *y = p->y + r * w;
    float *t = p->sum ? p->sum + r * w : y;   /* where the row's sum is kept */
    v8 acc = splat(0.0f);
    float tail = 0.0f;
    for (int64_t i = 0; i < wv; i += 8) {
        v8 s = *(const v8 *)(a + i);
        if (b)
            s += *(const v8 *)(b + i);
        *(v8 *)(t + i) = s;
        acc += s;
    }
    for (int64_t i = wv; i < w; i++) {
        t[i] = a[i] + (b ? b[i] : 0.0f);
        tail += t[i];
    }
    const float mean = p->rms ? 0.0f : (hsum(acc) + tail) / (float)w;
    const v8 m = splat(mean);
    acc = splat(0.0f);
    tail = 0.0f;
    for (int64_t i = 0; i < wv; i += 8) {
        v8 d = *(v8 *)(t + i) - m;
        acc += d * d;
    }
    for (int64_t i = wv; i < w; i++)
        tail += (t[i] - mean) * (t[i] - mean);
    const float rstd = 1.0f / sqrtf((hsum(acc) + tail) / (float)w + p->eps);
    const v8 rs = splat(rstd);
    for (int64_t i = 0; i < wv; i += 8) {
        v8 v = (*(v8 *)(t + i) - m) * rs * *(const v8 *)(p->gamma + i);
        if (p->beta)
            v += *(const v8 *)(p->beta + i);
        *(v8 *)(y + i) = v;
    }
    for (int64_t i = wv; i < w; i++)
        y[i] = (t[i] - mean) * rstd * p->gamma[i] + (p->beta ? p->beta[i] : 0.0f);
}

/* The threads claim chunks of rows (about 8 a thread) until none are left: a split
 * fixed in advance waits for the slowest thread (as in gemm.c). */
static void normalize_rows(void *data) {
    segflow_layer_norm_t *p = data;
    const int64_t threads = p->num_threads ? p->num_threads() : 1;
    const int64_t chunk = (p->rows + 8 * threads - 1) / (8 * threads);
    for (int64_t c; (c = __atomic_fetch_add(&p->next, chunk, __ATOMIC_RELAXED)) < p->rows;)
        for (int64_t r = c; r < c + chunk && r < p->rows; r++)
            normalize_row(p, r);
}

/* Run it; 0. Under 16k elements the rows stay on this thread. */
int segflow_add_layer_norm(segflow_layer_norm_t *p) {
    if (p->rows <= 0 || p->width <= 0)
        return 0;
    p->next = 0;
    if (p->parallel && p->rows > 1 && p->rows * p->width >= 16384)
        p->parallel(normalize_rows, p, 0, 0);
    else
        normalize_rows(p);
    return 0;
}
