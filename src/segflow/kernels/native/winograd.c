/* segflow native kernels: a 3x3 convolution as Winograd F(4x4, 3x3).
 *
 * segflow_winograd_execute computes y = act(conv3x3(x, w) + bias [+ z]) for a
 * stride-1, undilated, ungrouped convolution over channels-last float32 tensors
 * (kernels/winograd.py builds the plan). The output is cut into 4x4 tiles, taken a
 * chunk of tiles at a time: each tile's 6x6 input window is transformed
 * (V = B^T d B), the 36 transformed planes are multiplied by the transformed
 * weights (U = G g G^T, made once) in one batched libdnnl matmul
 * [36, chunk, C] x [36, C, K], and each tile's 6x6 result is transformed back
 * (y = A^T m A). That is 36 multiply-adds per 16 outputs and input channel
 * instead of 144: 4x fewer, paid for by the two transforms, which stream the
 * activations once each. A chunk's V and M (~1 MiB) stay in the caches from
 * one step to the next, and are all the workspace a convolution needs.
 *
 * It exists because oneDNN 3.2 has Winograd only for AVX-512, and in an AVX2
 * build the 3x3 convolutions are most of a residual network's time: at 64 channels
 * over 56x56 the batched matmul plus the transforms here take well under
 * onnxruntime's direct convolution (figures: docs/performance.md, 'Why each
 * kernel exists').
 *
 * Its signature is libdnnl's dnnl_primitive_execute, so the replay's C loop
 * (replay.c) and Python call it where they would execute a primitive: the plan
 * stands for the primitive, and the source, destination and residual addresses
 * are the ones the caller just pointed the convolution's memories at.
 *
 * The transforms work on eight channels at a time (C and K are multiples of 8)
 * and split each chunk's tiles over the OpenMP threads libdnnl uses.
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*segflow_execute_fn)(void *primitive, void *stream, int nargs, const void *args);
typedef int (*segflow_set_handle_fn)(void *memory, void *handle);

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* V x U -> M over one chunk of tiles: a libdnnl matmul and its memories. */
typedef struct {
    void *primitive;
    const void *args;
    int64_t nargs;
    void *src, *dst;              /* pointed at the workspace */
} segflow_matmul_t;

/* The layout kernels/winograd.py's ctypes structure mirrors. */
typedef struct {
    int64_t n, h, w, c, k;        /* input [n, h, w, c]; k output channels */
    int64_t oh, ow, pt, pl;       /* output size; top and left padding */
    int64_t th, tw;               /* tiles down and across */
    int64_t act, residual;        /* apply the activation below; add the residual (handles[2]) */
    float slope, lo, hi;          /* the activation: min(max(max(v, slope v), lo), hi) */
    int32_t pad_;
    const float *bias;            /* k floats, or NULL */
    const float *zeros;           /* c zeros: the padding */
    float *const *workspace;      /* *workspace: V [36][chunk][c], then M [36][chunk][k] */
    const uintptr_t *handles;     /* where src, dst and residual point now (0: none) */
    int64_t chunk;                /* tiles per matmul: V and M hold one chunk at a time */
    void *stream;
    segflow_matmul_t matmul[2];   /* for a whole chunk; for the last, shorter one (or none) */
    segflow_execute_fn execute;
    segflow_set_handle_fn set_handle;
    /* The process's OpenMP runtime (libgomp's entry points, the pool libdnnl runs on),
     * which splits the transforms' tiles between its threads; NULL: this thread alone. */
    void (*parallel)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
    int (*thread_num)(void);
    int (*num_threads)(void);
} segflow_winograd_t;

/* What the threads of one transform share: its input, its output, the residual, and
 * the chunk of tiles [base, base + rows) it transforms. */
typedef struct {
    const segflow_winograd_t *p;
    const float *in;
    float *out;
    const float *residual;
    int64_t base, rows;
} segflow_winograd_job_t;

/* B^T d for six values d0..d5 (one row or column of a 6x6 window). */
#define INPUT_1D(d0, d1, d2, d3, d4, d5, o0, o1, o2, o3, o4, o5) do { \
        o0 = 4 * (d0) - 5 * (d2) + (d4);                              \
        o1 = (d3) + (d4) - 4 * ((d1) + (d2));                         \
        o2 = 4 * ((d1) - (d2)) - (d3) + (d4);                         \
        o3 = 2 * ((d3) - (d1)) - (d2) + (d4);                         \
        o4 = 2 * ((d1) - (d3)) - (d2) + (d4);                         \
        o5 = 4 * (d1) - 5 * (d3) + (d5);                              \
    } while (0)

/* Tiles [first, last) of a chunk of `rows` tiles from tile `base`, into V [36][rows][c]. */
static void input_transform(const segflow_winograd_t *p, const float *x, float *v,
                            int64_t base, int64_t rows, int64_t first, int64_t last) {
    const int64_t c = p->c;
    const size_t plane = (size_t)rows * c;
    for (int64_t t = first; t < last; t++) {
        const int64_t n = t / (p->th * p->tw), ty = t / p->tw % p->th, tx = t % p->tw;
        const float *row[36];      /* the window's 36 pixels (zeros outside the input) */
        for (int i = 0; i < 6; i++) {
            int64_t iy = ty * 4 - p->pt + i;
            for (int j = 0; j < 6; j++) {
                int64_t ix = tx * 4 - p->pl + j;
                row[i * 6 + j] = (iy >= 0 && iy < p->h && ix >= 0 && ix < p->w)
                    ? x + ((n * p->h + iy) * p->w + ix) * c : p->zeros;
            }
        }
        float *out = v + (t - base) * c;
        for (int64_t ch = 0; ch < c; ch += 8) {
            v8 r[36];
            for (int i = 0; i < 6; i++) {
                const float *const *d = row + i * 6;
                INPUT_1D(*(const v8 *)(d[0] + ch), *(const v8 *)(d[1] + ch),
                         *(const v8 *)(d[2] + ch), *(const v8 *)(d[3] + ch),
                         *(const v8 *)(d[4] + ch), *(const v8 *)(d[5] + ch),
                         r[i * 6 + 0], r[i * 6 + 1], r[i * 6 + 2], r[i * 6 + 3],
                         r[i * 6 + 4], r[i * 6 + 5]);
            }
            for (int j = 0; j < 6; j++) {
                v8 o0, o1, o2, o3, o4, o5;
                INPUT_1D(r[j], r[6 + j], r[12 + j], r[18 + j], r[24 + j], r[30 + j],
                         o0, o1, o2, o3, o4, o5);
                *(v8 *)(out + (0 * 6 + j) * plane + ch) = o0;
                *(v8 *)(out + (1 * 6 + j) * plane + ch) = o1;
                *(v8 *)(out + (2 * 6 + j) * plane + ch) = o2;
                *(v8 *)(out + (3 * 6 + j) * plane + ch) = o3;
                *(v8 *)(out + (4 * 6 + j) * plane + ch) = o4;
                *(v8 *)(out + (5 * 6 + j) * plane + ch) = o5;
            }
        }
    }
}

/* A^T m for six values: four outputs. */
#define OUTPUT_1D(m0, m1, m2, m3, m4, m5, o0, o1, o2, o3) do {       \
        v8 a_ = (m1) + (m2), b_ = (m1) - (m2);                        \
        v8 c_ = (m3) + (m4), d_ = (m3) - (m4);                        \
        o0 = (m0) + a_ + c_;                                          \
        o1 = b_ + 2 * d_;                                             \
        o2 = a_ + 4 * c_;                                             \
        o3 = b_ + 8 * d_ + (m5);                                      \
    } while (0)

/* Tiles [first, last) of a chunk of `rows` tiles from tile `base`, from M [36][rows][k]. */
static void output_transform(const segflow_winograd_t *p, const float *m, float *y,
                             const float *z, int64_t base, int64_t rows, int64_t first,
                             int64_t last) {
    const int64_t k = p->k;
    const size_t plane = (size_t)rows * k;
    const v8 zero = {0};
    for (int64_t t = first; t < last; t++) {
        const int64_t n = t / (p->th * p->tw), ty = t / p->tw % p->th, tx = t % p->tw;
        const float *in = m + (t - base) * k;
        int64_t height = p->oh - ty * 4 < 4 ? p->oh - ty * 4 : 4;   /* of this tile */
        int64_t width = p->ow - tx * 4 < 4 ? p->ow - tx * 4 : 4;
        for (int64_t ch = 0; ch < k; ch += 8) {
            v8 r[24];
            for (int j = 0; j < 6; j++) {
                const float *col = in + ch + j * plane;
                OUTPUT_1D(*(const v8 *)(col + 0 * 6 * plane), *(const v8 *)(col + 1 * 6 * plane),
                          *(const v8 *)(col + 2 * 6 * plane), *(const v8 *)(col + 3 * 6 * plane),
                          *(const v8 *)(col + 4 * 6 * plane), *(const v8 *)(col + 5 * 6 * plane),
                          r[j], r[6 + j], r[12 + j], r[18 + j]);
            }
            v8 bias = p->bias ? *(const v8 *)(p->bias + ch) : zero;
            const v8 slope = zero + p->slope, lo = zero + p->lo, hi = zero + p->hi;
            for (int64_t i = 0; i < height; i++) {
                v8 o[4];
                const v8 *ri = r + i * 6;
                OUTPUT_1D(ri[0], ri[1], ri[2], ri[3], ri[4], ri[5], o[0], o[1], o[2], o[3]);
                size_t at = (size_t)((n * p->oh + ty * 4 + i) * p->ow + tx * 4) * k + ch;
                for (int64_t j = 0; j < width; j++, at += k) {
                    v8 out = o[j] + bias;
                    if (z)
                        out += *(const v8 *)(z + at);
                    if (p->act) {   /* ReLU, LeakyReLU (0 <= slope <= 1), Clip */
                        v8 leaky = out * slope;
                        v8i up = out > leaky;
                        out = (v8)(((v8i)out & up) | ((v8i)leaky & ~up));
                        v8i low = out < lo, high = out > hi;
                        out = (v8)(((v8i)out & ~low) | ((v8i)lo & low));
                        out = (v8)(((v8i)out & ~high) | ((v8i)hi & high));
                    }
                    *(v8 *)(y + at) = out;
                }
            }
        }
    }
}

/* This thread's share of the tiles when a team of OpenMP threads runs `job`. */
static void share(const segflow_winograd_job_t *job, int64_t *first, int64_t *last) {
    const segflow_winograd_t *p = job->p;
    int64_t threads = p->parallel ? p->num_threads() : 1;
    int64_t me = p->parallel ? p->thread_num() : 0;
    *first = job->base + job->rows * me / threads;
    *last = job->base + job->rows * (me + 1) / threads;
}

static void input_job(void *arg) {
    const segflow_winograd_job_t *job = arg;
    int64_t first, last;
    share(job, &first, &last);
    input_transform(job->p, job->in, job->out, job->base, job->rows, first, last);
}

static void output_job(void *arg) {
    const segflow_winograd_job_t *job = arg;
    int64_t first, last;
    share(job, &first, &last);
    output_transform(job->p, job->in, job->out, job->residual, job->base, job->rows, first,
                     last);
}

static void run_job(const segflow_winograd_t *p, void (*fn)(void *), segflow_winograd_job_t *job) {
    if (p->parallel)
        p->parallel(fn, job, 0, 0);    /* 0 threads: the calling thread's OpenMP default */
    else
        fn(job);
}

/* dnnl_primitive_execute's signature; `plan` is a segflow_winograd_t. Returns 0, or
 * the matmul's oneDNN status. */
int segflow_winograd_execute(void *plan, void *stream, int nargs, const void *args) {
    (void)stream, (void)nargs, (void)args;
    const segflow_winograd_t *p = plan;
    const int64_t tiles = p->n * p->th * p->tw;
    float *v = *p->workspace, *m = v + 36 * p->chunk * p->c;
    const float *x = (const float *)p->handles[0];
    float *y = (float *)p->handles[1];
    const float *z = p->residual ? (const float *)p->handles[2] : NULL;
    for (int64_t base = 0; base < tiles; base += p->chunk) {
        const int64_t rows = tiles - base < p->chunk ? tiles - base : p->chunk;
        const segflow_matmul_t *mm = &p->matmul[rows == p->chunk ? 0 : 1];
        int failed = p->set_handle(mm->src, v);
        if (!failed)
            failed = p->set_handle(mm->dst, m);
        if (failed)
            return failed;
        segflow_winograd_job_t in = {p, x, v, NULL, base, rows};
        run_job(p, input_job, &in);
        failed = p->execute(mm->primitive, p->stream, (int)mm->nargs, mm->args);
        if (failed)
            return failed;
        segflow_winograd_job_t out = {p, m, y, z, base, rows};
        run_job(p, output_job, &out);
    }
    return 0;
}
