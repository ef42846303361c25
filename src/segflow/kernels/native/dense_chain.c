/* segflow native kernels: a chain of small dense layers in one call.
 *
 * segflow_dense_chain runs y = act_L(... act_1(x @ W_1 + b_1) ...) for float32
 * row-major x [rows, K_1] and weights W_l stored [K_l, N_l] (input-major, so the
 * inner loop runs along contiguous output columns and vectorizes without
 * reassociating sums: every output is b[j] + x[0]*w[0][j] + x[1]*w[1][j] + ...
 * in input order). Built by segflow.kernels.native.build with the system C
 * compiler (-O3 -march=native) on first use and cached on disk.
 *
 * It exists because a layer of 64 x 64 at batch 1 is ~4k multiply-adds, far less
 * arithmetic than one ATen call's dispatch costs: a chain called once does the
 * whole stack for one call's overhead (figures: docs/performance.md, 'Why each
 * kernel exists').
 */
#include <math.h>
#include <stddef.h>

/* The ABI of the whole library (every file in kernels/native/): kernels/native/build.py ABI. */
#define SEGFLOW_NATIVE_ABI 18

enum { ACT_NONE, ACT_RELU, ACT_LEAKY_RELU, ACT_CLIP, ACT_SIGMOID, ACT_TANH,
       ACT_HARD_SIGMOID, ACT_HARD_SWISH, ACT_GELU, ACT_GELU_TANH, ACT_COUNT };

int segflow_native_abi(void) { return SEGFLOW_NATIVE_ABI; }

int segflow_dense_activations(void) { return ACT_COUNT; }

/* Eight floats as one value: GCC and Clang lower it to one AVX register, two SSE or NEON
 * registers, or scalars, whichever the target has. aligned(4): loads need no alignment. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline v8 splat(float a) { return (v8){a, a, a, a, a, a, a, a}; }

/* R rows x 8*V columns of the output, accumulated in R*V registers over all K inputs
 * (R*V <= 8 leaves registers for the weights and broadcasts on 16-register targets). */
#define MICRO(NAME, R, V)                                                               \
    static inline void NAME(long k, long n, const float *restrict x,                    \
                            const float *restrict w, const float *restrict b,           \
                            float *restrict y) {                                        \
        v8 acc[R][V];                                                                   \
        for (int r = 0; r < R; r++)                                                     \
            for (int v = 0; v < V; v++) acc[r][v] = *(const v8 *)(b + 8 * v);          \
        for (long i = 0; i < k; i++) {                                                  \
            const float *restrict wi = w + i * n;                                       \
            v8 wv[V];                                                                   \
            for (int v = 0; v < V; v++) wv[v] = *(const v8 *)(wi + 8 * v);             \
            for (int r = 0; r < R; r++) {                                               \
                v8 a = splat(x[r * k + i]);                                             \
                for (int v = 0; v < V; v++) acc[r][v] += a * wv[v];                     \
            }                                                                           \
        }                                                                               \
        for (int r = 0; r < R; r++)                                                     \
            for (int v = 0; v < V; v++) *(v8 *)(y + r * n + 8 * v) = acc[r][v];        \
    }

/* With AVX-512's 32 vector registers, blocks of 16 accumulators fit; with 16 (AVX2,
 * SSE) they would spill, so there the largest blocks hold 8. */
#if defined(__AVX512F__)
#define WIDE_BLOCKS 1
MICRO(micro_8x16, 8, 2)
MICRO(micro_4x32, 4, 4)
#else
#define WIDE_BLOCKS 0
#endif
MICRO(micro_4x16, 4, 2)
MICRO(micro_4x8, 4, 1)
MICRO(micro_1x64, 1, 8)
MICRO(micro_1x32, 1, 4)
MICRO(micro_1x8, 1, 1)

/* One output column (the n % 8 tail), in the same summation order. */
static inline void column(long k, long n, const float *restrict x, const float *restrict w,
                          float b, float *restrict y) {
    float acc = b;
    for (long i = 0; i < k; i++) acc += x[i] * w[i * n];
    *y = acc;
}

/* Rows r0 .. r0+R-1 (R = 8, 4 or 1) from column j on, with the narrower kernels. */
static void rows_tail(long R, long j, long k, long n, const float *restrict xr,
                      const float *restrict w, const float *restrict b, float *restrict yr) {
    long vec = n - n % 8;
    for (long q = 0; q < R; q++) {
        long c = j;
        for (; c < vec; c += 8) micro_1x8(k, n, xr + q * k, w + c, b + c, yr + q * n + c);
        for (; c < n; c++) column(k, n, xr + q * k, w + c, b[c], yr + q * n + c);
    }
}

static void dense(long rows, long k, long n, const float *restrict x,
                  const float *restrict w, const float *restrict b, float *restrict y) {
    long r = 0;
    long vec = n - n % 8;
#if WIDE_BLOCKS
    for (; r + 8 <= rows; r += 8) {
        const float *xr = x + r * k;
        float *yr = y + r * n;
        long j = 0;
        for (; j + 16 <= vec; j += 16) micro_8x16(k, n, xr, w + j, b + j, yr + j);
        rows_tail(8, j, k, n, xr, w, b, yr);
    }
#endif
    for (; r + 4 <= rows; r += 4) {
        const float *xr = x + r * k;
        float *yr = y + r * n;
        long j = 0;
#if WIDE_BLOCKS
        for (; j + 32 <= vec; j += 32) micro_4x32(k, n, xr, w + j, b + j, yr + j);
#endif
        for (; j + 16 <= vec; j += 16) micro_4x16(k, n, xr, w + j, b + j, yr + j);
        for (; j < vec; j += 8) micro_4x8(k, n, xr, w + j, b + j, yr + j);
        rows_tail(4, j, k, n, xr, w, b, yr);
    }
    for (; r < rows; r++) {
        const float *xr = x + r * k;
        float *yr = y + r * n;
        long j = 0;
        for (; j + 64 <= vec; j += 64) micro_1x64(k, n, xr, w + j, b + j, yr + j);
        for (; j + 32 <= vec; j += 32) micro_1x32(k, n, xr, w + j, b + j, yr + j);
        for (; j < vec; j += 8) micro_1x8(k, n, xr, w + j, b + j, yr + j);
        for (; j < n; j++) column(k, n, xr, w + j, b[j], yr + j);
    }
}

static inline float clampf(float v, float lo, float hi) {
    /* torch.clamp: NaN stays NaN (both comparisons are false). */
    return v < lo ? lo : (v > hi ? hi : v);
}

/* The activations of segflow.ops.fused.ACTIVATIONS, with torch's formulas. */
static void activate(int code, float p0, float p1, long len, float *restrict y) {
    switch (code) {
    case ACT_RELU:
        for (long i = 0; i < len; i++) y[i] = y[i] < 0.f ? 0.f : y[i];
        break;
    case ACT_LEAKY_RELU:
        for (long i = 0; i < len; i++) y[i] = y[i] < 0.f ? y[i] * p0 : y[i];
        break;
    case ACT_CLIP:
        for (long i = 0; i < len; i++) y[i] = clampf(y[i], p0, p1);
        break;
    case ACT_SIGMOID:
        for (long i = 0; i < len; i++) y[i] = 1.f / (1.f + expf(-y[i]));
        break;
    case ACT_TANH:
        for (long i = 0; i < len; i++) y[i] = tanhf(y[i]);
        break;
    case ACT_HARD_SIGMOID:
        for (long i = 0; i < len; i++) y[i] = clampf(y[i] * p0 + p1, 0.f, 1.f);
        break;
    case ACT_HARD_SWISH:
        for (long i = 0; i < len; i++) y[i] = y[i] * clampf(y[i] + 3.f, 0.f, 6.f) / 6.f;
        break;
    case ACT_GELU:
        for (long i = 0; i < len; i++) y[i] = 0.5f * y[i] * (1.f + erff(y[i] * (float)M_SQRT1_2));
        break;
    case ACT_GELU_TANH:
        for (long i = 0; i < len; i++) {
            float v = y[i];
            float inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);
            y[i] = 0.5f * v * (1.f + tanhf(inner));
        }
        break;
    default:
        break;
    }
}

/* dims[0..layers]: K of the first layer, then each layer's N. scratch holds
 * 2 * rows * max(N of every layer but the last) floats. Returns 0, or -1 for an
 * unknown activation code (nothing is written then). */
int segflow_dense_chain(int layers, long rows, const long *dims, const float *const *weights,
                        const float *const *biases, const int *acts, const float *p0,
                        const float *p1, const float *x, float *y, float *scratch) {
    long widest = 0;
    for (int l = 0; l < layers; l++) {
        if (acts[l] < 0 || acts[l] >= ACT_COUNT) return -1;
        if (l + 1 < layers && dims[l + 1] > widest) widest = dims[l + 1];
    }
    const float *in = x;
    for (int l = 0; l < layers; l++) {
        float *out = l == layers - 1 ? y : scratch + (l % 2) * rows * widest;
        dense(rows, dims[l], dims[l + 1], in, weights[l], biases[l], out);
        activate(acts[l], p0[l], p1[l], rows * dims[l + 1], out);
        in = out;
    }
    return 0;
}
