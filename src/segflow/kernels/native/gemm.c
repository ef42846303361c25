/* segflow native kernels: a linear layer over a prepacked weight.
 *
 * segflow_linear computes y = act(x W^T + b) for float32 row-major x [m, k] (rows
 * lda floats apart), W [n, k] and y [m, n]. The weight is packed once, by
 * segflow_linear_pack, into panels of NR output columns (panel.h: 24 in an AVX2
 * build, 48 in an AVX-512 one): panel p holds W[NR p .. NR p + NR - 1][0 .. k-1]
 * stored k-major ([k][NR], the last panel padded with zeros), so the inner loop reads
 * NR consecutive floats per input column.
 *
 * The kernel is the usual register-blocked one: MR rows x NR columns of y (4 x 24, or
 * 8 x 48) live in 3 MR vector accumulators while the loop runs down k, each step
 * loading three vectors of the panel and broadcasting one x value per row.
 * k is taken KC columns at a time (linear.h: 384 with AVX2, 128 with AVX-512), so
 * that a panel's KC x NR block is read from L1/L2 for every MR rows of x, and the
 * rows' KC columns stay in L2. A call of fewer than MR rows reads each panel whole,
 * in the order it is stored; a single row (a GEMV), GEMV_PANELS panels at once. The
 * OpenMP threads libdnnl uses (kernels/linear.py passes libgomp's entry points)
 * claim chunks of panels as they go (a GEMV's GEMV_PANELS at a time), or of rows where
 * there are fewer panels than threads.
 *
 * It exists because at 128 rows and a transformer's widths (768 -> 768, 768 -> 3072,
 * 3072 -> 768), with cache-cold weights, the AVX2 build's 4 x 24 block runs close to
 * the cores' FMA peak and ahead of libdnnl 3.2's inner product (brgemm:avx2), most
 * at 768 -> 768. In an AVX-512 build the 8 x 48 block over 128-input blocks (24 KiB,
 * in L1) runs those shapes on two threads ahead of torch's, and ahead of 384-input
 * blocks (73 KiB, read from L2) (figures: docs/performance.md, 'Why each kernel
 * exists').
 *
 * While a panel's KC block is read for the rows of x, the next block the loop will
 * read (the next panel's, or the first panel's next KC block) is prefetched into L2,
 * a slice per MR rows: the weights of a large model come from DRAM, and the hardware
 * prefetcher only starts on a new stream after its first misses (figures:
 * docs/performance.md, 'Why each kernel exists').
 *
 * The activation is applied as each output's last KC block is stored: a clamp (ReLU,
 * LeakyReLU, Clip) or erf-GELU (linear.h's gelu_vf), where it costs no pass over y.
 *
 * Every output is b[j] + sum over k in order (KC blocks in order, each in order), the
 * sum fused-multiply-added: not bitwise torch's, within float32 rounding of it. Large
 * linears may instead run as one level of Strassen over the same panels (strassen.c),
 * which sums differently and mixes rows m / 2 apart at rounding level.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "linear.h"        /* segflow_linear_t, KC, block; panel.h's register block */

/* Panels a single row reads at once (a GEMV from memory is bound by the misses in
 * flight, one sequential stream per panel). At 1280 -> 1000 and 2048 -> 1000 with
 * cache-cold weights on two threads, 4 panels at once ran ahead of 2, 3, 6 or 8 and
 * of one at a time; claimed 4 at a time (gemv_work), not in guided chunks, they run
 * closer to torch's. With the weight in L3 (L2 flushed) the gap to torch's F.linear
 * is the same with one thread, and part of it is the call's Python; prefetching 8 to
 * 64 inputs ahead, or 1 to 3 panels a claim, changed nothing there (figures:
 * docs/performance.md, 'Why each kernel exists'). */
#define GEMV_PANELS 4     /* gemv_work's switch counts down from 4 */


/* 1 where the build has AVX2 and FMA, the vector width and multiply-add the kernel was
 * measured with (kernels/linear.py prefers it only then). */
int segflow_linear_vector_fma(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* Columns per panel: NR, 48 in an AVX-512 build, else 24 (panel.h). */
int64_t segflow_linear_panel_width(void) { return NR; }

/* Floats in the packing of an [n, k] weight. */
int64_t segflow_linear_packed_size(int64_t n, int64_t k) {
    return (n + NR - 1) / NR * NR * k;
}

/* W [n][k] (rows ldw floats apart) -> panels [ceil(n / NR)][k][NR], zero-padded; with
 * `top` (n floats, or NULL), each output's largest |W| as well (NaN where it has one:
 * strassen.c's check reads them), while the rows are at hand. */
void segflow_linear_pack(const float *w, int64_t n, int64_t k, int64_t ldw, float *out,
                         float *top) {
    for (int64_t p = 0; p < (n + NR - 1) / NR; p++) {
        float *panel = out + p * k * NR;
        for (int64_t j = 0; j < NR; j++) {
            int64_t row = p * NR + j;
            if (row < n) {
                const float *src = w + row * ldw;
                int32_t largest = 0;
                for (int64_t i = 0; i < k; i++) {
                    panel[i * NR + j] = src[i];
                    largest = larger_magnitude1(largest, src[i]);
                }
                if (top)
                    top[row] = magnitude_value(largest);
            } else {
                for (int64_t i = 0; i < k; i++) panel[i * NR + j] = 0.0f;
            }
        }
    }
}

/* The same panels from W's transpose: B [k][n] (rows ldb floats apart, B[i][j] =
 * W[j][i]), as an ONNX MatMul stores its weight. Each panel row is NR consecutive
 * floats of a row of B: a copy, where packing W [n][k] is a transpose. `top` as
 * above. */
void segflow_linear_pack_kn(const float *b, int64_t n, int64_t k, int64_t ldb, float *out,
                            float *top) {
    for (int64_t p = 0; p < (n + NR - 1) / NR; p++) {
        float *panel = out + p * k * NR;
        const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
        vfi largest[3] = {{0}, {0}, {0}};   /* larger_magnitude's bits */
        for (int64_t i = 0; i < k; i++) {
            const float *src = b + i * ldb + p * NR;
            float *row = panel + i * NR;
            if (cols == NR) {    /* three vectors, not a call to memcpy per 96 bytes */
                for (int v = 0; v < 3; v++)
                    *(vf *)(row + VW * v) = *(const vf *)(src + VW * v);
            } else {
                memcpy(row, src, (size_t)cols * sizeof(float));
                memset(row + cols, 0, (size_t)(NR - cols) * sizeof(float));
            }
            if (top)             /* over the panel row just written (zeros past n) */
                for (int v = 0; v < 3; v++)
                    largest[v] = larger_magnitude(largest[v], *(const vf *)(row + VW * v));
        }
        if (top)
            for (int64_t c = 0; c < cols; c++)
                top[p * NR + c] = magnitude_value(largest[c / VW][c % VW]);
    }
}

/* The inverse: panels -> W [n][k]. */
void segflow_linear_unpack(const float *packed, int64_t n, int64_t k, float *w) {
    for (int64_t row = 0; row < n; row++) {
        const float *panel = packed + row / NR * k * NR + row % NR;
        for (int64_t i = 0; i < k; i++) w[row * k + i] = panel[i * NR];
    }
}

/* Rows [r0, r1) of one panel's KC block, R rows at a time; `next` (next_bytes long, or
 * NULL) is prefetched into L2 a slice before each block of MR rows. */
static void rows(const segflow_linear_t *p, int64_t r0, int64_t r1, int64_t pc, int64_t kc,
                 const float *panel, float *y, int64_t ldy, const float *start,
                 const char *next, int64_t next_bytes) {
    const int first = pc == 0, last = pc + kc == p->k;
    const float *x = p->x + pc;
    const int64_t blocks = (r1 - r0) / MR > 0 ? (r1 - r0) / MR : 1;
    const int64_t slice = (next_bytes / 64 + blocks - 1) / blocks * 64;
    const char *end = next ? next + next_bytes : NULL;
    int64_t r = r0;
    for (; r + MR <= r1; r += MR) {
        for (int64_t b = 0; b < slice && next < end; b += 64, next += 64)
            __builtin_prefetch(next, 0, 2);
        block(p, MR, kc, x + r * p->lda, p->lda, panel, y + r * ldy, ldy, start, first, last);
    }
    if (r < r1) {
#define REST(R) block(p, R, kc, x + r * p->lda, p->lda, panel, y + r * ldy, ldy, start, first, last)
        WITH_ROWS(r1 - r, REST);
#undef REST
    }
}

/* Row r of x times G consecutive panels (from panel q; 1 <= G <= GEMV_PANELS), each
 * whole: as many streams from memory at once, where a panel at a time is one. The
 * padded last panel (n % NR columns) is summed in full, over the packing's zeros, and
 * only its columns are stored. */
static inline __attribute__((always_inline)) void
gemv_panels(const segflow_linear_t *p, int64_t r, int64_t q, const int G) {
    const int64_t k = p->k, n = p->n;
    const float *x = p->x + r * p->lda, *w = p->w + q * k * NR;
    vf acc[GEMV_PANELS][3];
    for (int g = 0; g < G; g++) {
        const int64_t cols = n - (q + g) * NR < NR ? n - (q + g) * NR : NR;
        float start[NR] = {0};
        if (p->bias)
            memcpy(start, p->bias + (q + g) * NR, (size_t)cols * sizeof(float));
        for (int v = 0; v < 3; v++)
            acc[g][v] = *(const vf *)(start + VW * v);
    }
    for (int64_t i = 0; i < k; i++) {
        const vf a = splat_vf(x[i]);
        for (int g = 0; g < G; g++)
            for (int v = 0; v < 3; v++)
                acc[g][v] += a * *(const vf *)(w + (g * k + i) * NR + VW * v);
    }
    float *y = p->y + r * n + q * NR;
    for (int g = 0; g < G; g++) {
        const int64_t cols = n - (q + g) * NR < NR ? n - (q + g) * NR : NR;
        float tile[NR];
        float *out = cols == NR ? y + g * NR : tile;
        for (int v = 0; v < 3; v++)
            *(vf *)(out + VW * v) = p->act ? activate(p, acc[g][v]) : acc[g][v];
        if (cols < NR)
            memcpy(y + g * NR, tile, (size_t)cols * sizeof(float));
    }
}

/* A GEMV's region body: each thread claims GEMV_PANELS panels at a time (the last claim
 * fewer), so that every claim reads that many streams at once. One row of a 2048 ->
 * 1000 classifier is 21 panels of 48: claimed in guided chunks, most of a thread's
 * last panels ran one stream at a time. */
static void gemv_work(void *data) {
    segflow_linear_t *p = data;
    const int64_t panels = (p->n + NR - 1) / NR;
    for (int64_t q; (q = __atomic_fetch_add(&p->next, GEMV_PANELS, __ATOMIC_RELAXED)) < panels;) {
        switch (panels - q < GEMV_PANELS ? panels - q : GEMV_PANELS) {
        case 4: gemv_panels(p, 0, q, 4); break;
        case 3: gemv_panels(p, 0, q, 3); break;
        case 2: gemv_panels(p, 0, q, 2); break;
        default: gemv_panels(p, 0, q, 1); break;
        }
    }
}

/* Panels [p0, p1) for rows [r0, r1). A panel past n's last full one is computed into a
 * row-by-row scratch of NR columns and copied out. */
void linear_part(const segflow_linear_t *p, int64_t p0, int64_t p1, int64_t r0, int64_t r1) {
    static const float zeros[NR];
    const int64_t n = p->n, k = p->k, full = n / NR;
    if (r1 - r0 < MR) {          /* a few rows: each panel whole, as it is stored */
        const int64_t q1 = p1 < full ? p1 : full;
        for (int64_t q = p0; q < q1; q++)
            rows(p, r0, r1, 0, k, p->w + q * k * NR, p->y + q * NR, n,
                 p->bias ? p->bias + q * NR : zeros, NULL, 0);
    } else for (int64_t pc = 0; pc < k || pc == 0; pc += KC) {
        const int64_t kc = k - pc < KC ? k - pc : KC;
        const int64_t q1 = p1 < full ? p1 : full;
        for (int64_t q = p0; q < q1; q++) {    /* prefetching the block read next */
            const int64_t next_kc = q + 1 < q1 ? kc : k - pc - kc < KC ? k - pc - kc : KC;
            const float *next = q + 1 < q1 ? p->w + ((q + 1) * k + pc) * NR
                              : next_kc > 0 ? p->w + (p0 * k + pc + kc) * NR : NULL;
            rows(p, r0, r1, pc, kc, p->w + (q * k + pc) * NR, p->y + q * NR, n,
                 p->bias ? p->bias + q * NR : zeros, (const char *)next,
                 next_kc * NR * (int64_t)sizeof(float));
        }
    }
    if (p1 > full) {             /* the padded last panel: n % NR columns */
        const int64_t cols = n - full * NR;
        float start[NR] = {0}, tile[MR * NR];
        if (p->bias)
            memcpy(start, p->bias + full * NR, (size_t)cols * sizeof(float));
        for (int64_t r = r0; r < r1; r += MR) {
            const int64_t end = r + MR < r1 ? r + MR : r1;
            for (int64_t pc = 0; pc < k || pc == 0; pc += KC) {
                const int64_t kc = k - pc < KC ? k - pc : KC;
                const segflow_linear_t *q = p;
                const float *x = q->x + pc + r * q->lda;
                const float *panel = q->w + (full * k + pc) * NR;
                const int first = pc == 0, last = pc + kc == k;
#define TILE(R) block(q, R, kc, x, q->lda, panel, tile, NR, start, first, last)
                WITH_ROWS(end - r, TILE);
#undef TILE
            }
            for (int64_t i = r; i < end; i++)
                memcpy(p->y + i * n + full * NR, tile + (i - r) * NR, (size_t)cols * sizeof(float));
        }
    }
}

/* The threads claim chunks of panels (or, with fewer panels than threads, of row
 * blocks) until none are left: a split fixed in advance waits for the slowest thread,
 * and a VM's vCPUs do not always run at one speed: with a busy process sharing one
 * vCPU a fixed split lost more than chunks do; on quiet vCPUs the two are even. A
 * chunk of panels is a quarter of what is left (remaining / (2 threads)), down to one
 * panel: the large first chunks keep a KC block of x in L2 across many panels (x is
 * read again for every chunk: 1.5 MiB a chunk at 128 x 3072), the small last ones
 * leave little for a thread to wait on at the end. Against a fixed ~8 chunks a
 * thread, with cache-cold weights at 128 rows, they run ahead at 3072 -> 768,
 * 768 -> 768 and 768 -> 3072, even at 768 -> 2304 (figures: docs/performance.md,
 * 'Why each kernel exists'). GOMP's barrier at the end of the region still waits for
 * every thread to check in. */
void linear_work(void *data) {
    segflow_linear_t *p = data;
    const int64_t threads = p->num_threads ? p->num_threads() : 1;
    const int64_t panels = (p->n + NR - 1) / NR;
    if (panels >= threads || p->m < MR * threads) {
        for (int64_t c, chunk; (c = claim_guided(&p->next, panels, threads, &chunk)) < panels;)
            linear_part(p, c, c + chunk, 0, p->m);
    } else {                     /* few panels, many rows: split the rows (whole blocks) */
        const int64_t blocks = (p->m + MR - 1) / MR;
        const int64_t chunk = (blocks + 8 * threads - 1) / (8 * threads);
        for (int64_t c; (c = __atomic_fetch_add(&p->next, chunk, __ATOMIC_RELAXED)) < blocks;) {
            const int64_t r1 = (c + chunk) * MR;
            linear_part(p, 0, panels, c * MR, r1 < p->m ? r1 : p->m);
        }
    }
}

/* Run one linear; 0 (the status libdnnl's execute would return). Work under
 * ~64k multiply-adds stays on this thread: waking the pool costs more. With scratch,
 * and where strassen_fits, as one level of Strassen (strassen.c), which may still
 * turn to this kernel once it has seen x; p->strassen says which ran. */
int segflow_linear(segflow_linear_t *p) {
    p->strassen = 0;
    if (p->m == 0 || p->n == 0)
        return 0;
    p->next = 0;
    p->arrived = 0;
    p->spare = 0;
    p->refused = 0;
    void (*body)(void *) = p->scratch && strassen_fits(p) ? strassen_work
                         : p->m == 1 ? gemv_work : linear_work;
    if (p->parallel && p->m * p->n * p->k >= 65536)
        p->parallel(body, p, 0, 0);
    else
        body(p);
    return 0;
}
