/* segflow native kernels: an NCHW tensor copied into channels-last storage.
 *
 * segflow_to_channels_last copies x [n][c][hw] (float32, contiguous) into y
 * [n][hw][c]: the staging a direct convolution needs when its input arrives NCHW
 * (a model's image feed, which the stem convolution reads), since libdnnl has only
 * reference kernels for an NCHW source with a channels-last destination
 * (kernels/onednn/, DirectConv._staged). The pixels are split between the OpenMP
 * threads libdnnl uses (kernels/staging.py passes libgomp's entry points); each
 * thread writes its pixels' channels side by side, reading the c planes in step.
 *
 * It exists because torch's copy_ into channels-last of a 3 x 224 x 224 image ran
 * behind this loop, by a visible share of a small convolutional model's run, and
 * onnxruntime's stem reads the image in place (figures: docs/performance.md, 'Why
 * each kernel exists').
 */
#include <stddef.h>
#include <stdint.h>

/* What kernels/staging.py's ctypes structure mirrors. */
typedef struct {
    const float *x;              /* [n][c][hw] */
    float *y;                    /* [n][hw][c] */
    int64_t n, c, hw;
    void (*parallel)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
    int (*thread_num)(void);
    int (*num_threads)(void);
} segflow_staging_t;

/* Pixels [p0, p1) of image b; c a constant where the caller's switch made it one. */
static inline __attribute__((always_inline)) void
pixels(const segflow_staging_t *s, int64_t c, int64_t b, int64_t p0, int64_t p1) {
    const float *x = s->x + b * c * s->hw;
    float *y = s->y + b * c * s->hw;
    for (int64_t p = p0; p < p1; p++)
        for (int64_t ch = 0; ch < c; ch++)
            y[p * c + ch] = x[ch * s->hw + p];
}

static void work(void *data) {
    const segflow_staging_t *s = data;
    const int64_t threads = s->num_threads ? s->num_threads() : 1;
    const int64_t t = s->thread_num ? s->thread_num() : 0;
    const int64_t p0 = s->hw * t / threads, p1 = s->hw * (t + 1) / threads;
    for (int64_t b = 0; b < s->n; b++) {
        switch (s->c) {          /* an image's channels: the loop unrolled for them */
        case 1: pixels(s, 1, b, p0, p1); break;
        case 3: pixels(s, 3, b, p0, p1); break;
        case 4: pixels(s, 4, b, p0, p1); break;
        default: pixels(s, s->c, b, p0, p1); break;
        }
    }
}

/* Run it; 0. Under 64k floats it stays on this thread. */
int segflow_to_channels_last(segflow_staging_t *s) {
    if (s->n <= 0 || s->c <= 0 || s->hw <= 0)
        return 0;
    if (s->parallel && s->n * s->c * s->hw >= 65536)
        s->parallel(work, s, 0, 0);
    else
        work(s);
    return 0;
}
