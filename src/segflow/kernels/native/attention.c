/* segflow native kernels: scaled dot-product attention, float32.
 *
 * segflow_attention computes, for every batch b and head h,
 *   Y[b,h] = softmax(Q[b,h] K[b,h]^T * scale + M[b,h]) V[b,h]
 * with Q [sq][d], K [sk][d], V [sk][dv], Y [sq][dv] and the additive mask M
 * [sq][sk] (NULL: none) all read through strides, so that heads can be read in
 * place out of [batch, seq, heads * d] activations (the layout a transformer's
 * linears write) and Y written straight into that layout. Q and Y rows must be
 * contiguous (column stride 1); K, V and M may have any strides (a broadcast
 * dimension has stride 0, except M's key dimension, stride 1).
 *
 * Per (b, h): K is packed into panels of NARROW keys ([d][NARROW] each, panel.h's
 * narrow block: 16, or 32 with AVX-512) and V into panels of NARROW output columns
 * ([sk][NARROW]); then for every MR_NARROW query rows (6, or 12 with AVX-512) the
 * scores are the register block over K's panels, the softmax is taken in
 * place on those rows (one pass for the maximum, one for exp and the sum, the rows'
 * exps interleaved), and the output is the register block of the probabilities over
 * V's panels, scaled by 1 / sum. The scores of those rows sit in L1; K's and V's
 * packings in L2. The OpenMP threads libdnnl uses (kernels/attention.py passes
 * libgomp's entry points) claim the (b, h) pairs one at a time; with few pairs, each
 * pair's query rows are split too.
 *
 * It exists because at a transformer layer's shapes (12 heads of 128 x 64) torch's
 * CPU flash attention ran behind onnxruntime's; in an AVX-512 build the wider block
 * (32 keys a panel, 12 rows) runs ahead of the AVX2 one (16 keys, 6 rows)
 * (figures: docs/performance.md, 'Why each kernel exists').
 *
 * Numerics: exp is a polynomial after range reduction (within 1e-7 relative over
 * the softmax's range); every sum is fused-multiply-added in order. A row
 * whose scores are all -inf (fully masked) gives NaN, as the unfused ops do.
 *
 * With SEGFLOW_ATTENTION_NAN_TO_ZERO in `flags`, a row of probabilities holding a
 * NaN becomes zeros before it meets V (the "safe softmax" torch exports write as
 * Where(IsNaN(p), 0, p)). A NaN anywhere in a row makes the row's sum NaN and so every
 * probability of it NaN, so the sum alone tells: one test a row, and the zeroed row
 * still goes through P V, so that a non-finite V gives NaN there as 0 * Inf does.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "panel.h"

#define SEGFLOW_ATTENTION_NAN_TO_ZERO 1   /* kernels/attention.py's flag of the same name */

/* One call's arguments (segflow_attention fills it). Strides are in floats, in the
 * order batch, head, row, column. */
typedef struct {
    const float *q, *k, *v, *mask;   /* mask may be NULL */
    float *y;
    float *scratch;                  /* scratch_threads x segflow_attention_scratch() */
    int64_t batch, heads, sq, sk, d, dv;
    int64_t qs[4], ks[4], vs[4], ms[4], ys[4];
    int64_t scratch_threads;
    float scale;
    int32_t flags;                   /* SEGFLOW_ATTENTION_NAN_TO_ZERO */
    int32_t status;                  /* 1: a thread found no scratch of its own */
    int64_t next;                    /* the next unclaimed work unit */
    void (*parallel)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
    int (*thread_num)(void);
    int (*num_threads)(void);
} segflow_attention_t;

/* e^x, lanewise, for x <= 0 (a softmax's): x = n ln2 + r with |r| <= ln2 / 2 (n from
 * the rounding constant's low bits, r in two steps), e^r by Cephes' expf polynomial,
 * 2^n through the exponent bits. Within 1e-7 relative of exp; 0 below -87.3 (and for
 * -inf); NaN stays NaN (p is NaN). */
static inline vf exp_vf(vf x) {
    const vf round = splat_vf(12582912.0f);   /* 1.5 * 2^23 */
    const vfi under = (vfi)(x < splat_vf(-87.3365f));
    const vf t = x * splat_vf(1.44269504088896341f) + round;
    const vf n = t - round;
    vf r = x - n * splat_vf(0.693359375f);
    r = r - n * splat_vf(-2.12194440e-4f);
    vf p = splat_vf(1.9875691500e-4f);
    p = p * r + splat_vf(1.3981999507e-3f);
    p = p * r + splat_vf(8.3334519073e-3f);
    p = p * r + splat_vf(4.1665795894e-2f);
    p = p * r + splat_vf(1.6666665459e-1f);
    p = p * r + splat_vf(5.0000001201e-1f);
    p = p * (r * r) + r + splat_vf(1.0f);
    const vfi two_n = ((vfi)t - (vfi)round + 127) << 23;
    return (vf)((vfi)(p * (vf)two_n) & ~under);
}

/* The sum of a vector's lanes, halves added pairwise: lane i + VW / 2 to lane i, and
 * so on down to one. */
static inline float sum_lanes(vf a) {
    float l[VW];
    *(vf *)l = a;
    for (int half = VW / 2; half > 0; half /= 2)
        for (int i = 0; i < half; i++)
            l[i] += l[i + half];
    return l[0];
}

typedef struct {
    float *kp, *vp, *s, *tile;   /* K's and V's panels, MR_NARROW rows of scores, one block */
    int64_t skp, dvp;            /* sk and dv rounded up to NARROW */
    int64_t packed;              /* the (b, h) pair the panels hold; -1: none */
} scratch_t;

/* K [sk][d] -> panels [skp / NARROW][d][NARROW]; V [sk][dv] -> panels
 * [dvp / NARROW][sk][NARROW]; zero-padded. K is transposed NARROW keys at a time (each
 * panel written in order, its NARROW rows read side by side); V's rows are copied
 * NARROW floats at a time. */
static void pack(const segflow_attention_t *p, scratch_t *w, int64_t b, int64_t h) {
    const float *k = p->k + b * p->ks[0] + h * p->ks[1];
    const float *v = p->v + b * p->vs[0] + h * p->vs[1];
    const int64_t d = p->d, sk = p->sk, dv = p->dv;
    for (int64_t key0 = 0; key0 < w->skp; key0 += NARROW) {
        float *panel = w->kp + key0 * d;
        const int64_t keys = sk - key0 < NARROW ? sk - key0 : NARROW;
        if (keys < NARROW)
            memset(panel, 0, (size_t)(d * NARROW) * sizeof(float));
        if (p->ks[3] == 1) {         /* K's rows contiguous: the usual case */
            for (int64_t i = 0; i < d; i++)
                for (int64_t j = 0; j < keys; j++)
                    panel[i * NARROW + j] = k[(key0 + j) * p->ks[2] + i];
        } else {                     /* K^T's rows contiguous (the 4-D form's Kt) */
            for (int64_t i = 0; i < d; i++)
                for (int64_t j = 0; j < keys; j++)
                    panel[i * NARROW + j] = k[(key0 + j) * p->ks[2] + i * p->ks[3]];
        }
    }
    for (int64_t col0 = 0; col0 < w->dvp; col0 += NARROW) {
        float *panel = w->vp + col0 * sk;
        const int64_t cols = dv - col0 < NARROW ? dv - col0 : NARROW;
        for (int64_t key = 0; key < sk; key++) {
            const float *row = v + key * p->vs[2] + col0 * p->vs[3];
            float *out = panel + key * NARROW;
            if (cols == NARROW && p->vs[3] == 1) {
                *(vf *)out = *(const vf *)row;
                *(vf *)(out + VW) = *(const vf *)(row + VW);
            } else {
                for (int64_t j = 0; j < NARROW; j++)
                    out[j] = j < cols ? row[j * p->vs[3]] : 0.0f;
            }
        }
    }
    w->packed = b * p->heads + h;
}

/* softmax(s * scale + mask) of R rows of sk scores (ld floats apart), in place; inv[r]
 * is 1 / row r's sum. The rows' exps are interleaved: R independent chains. A NaN
 * score is never a row's maximum, but its exp is NaN and so is the row's sum: the
 * whole row comes out NaN, as through torch; so does a row of -inf scores. */
static inline __attribute__((always_inline)) void
softmax_rows(const segflow_attention_t *p, int R, float *s, int64_t ld,
             const float *const mask[MR_NARROW], float inv[MR_NARROW]) {
    const int64_t n = p->sk, nv = n / VW * VW;
    const vf scale = splat_vf(p->scale);
    vf top[MR_NARROW], acc[MR_NARROW];
    float tail[MR_NARROW];
    for (int r = 0; r < R; r++) {
        float *row = s + r * ld;
        const float *m = mask[r];
        float t = -INFINITY;
        vf mx = splat_vf(-INFINITY);
        for (int64_t i = 0; i < nv; i += VW) {
            vf x = *(vf *)(row + i) * scale;
            if (m)
                x += *(const vf *)(m + i);
            *(vf *)(row + i) = x;
            mx = select_vf(mx, x, (vfi)(x > mx));
        }
        for (int64_t i = nv; i < n; i++) {
            row[i] = row[i] * p->scale + (m ? m[i] : 0.0f);
            t = row[i] > t ? row[i] : t;
        }
        for (int l = 0; l < VW; l++)
            t = mx[l] > t ? mx[l] : t;
        top[r] = splat_vf(t);
        acc[r] = splat_vf(0.0f);
        tail[r] = 0.0f;
    }
    for (int64_t i = 0; i < nv; i += VW)
        for (int r = 0; r < R; r++) {
            vf e = exp_vf(*(vf *)(s + r * ld + i) - top[r]);
            *(vf *)(s + r * ld + i) = e;
            acc[r] += e;
        }
    for (int r = 0; r < R; r++) {
        float *row = s + r * ld;
        for (int64_t i = nv; i < n; i++) {
            vf e = exp_vf(splat_vf(row[i]) - top[r]);
            row[i] = e[0];
            tail[r] += e[0];
        }
        const float sum = tail[r] + sum_lanes(acc[r]);
        if (isnan(sum) && (p->flags & SEGFLOW_ATTENTION_NAN_TO_ZERO)) {
            memset(row, 0, (size_t)n * sizeof(float));
            inv[r] = 1.0f;
        } else {
            inv[r] = 1.0f / sum;
        }
    }
}

/* Query rows [r, r + R) of pair (b, h), K and V packed in w. */
static inline __attribute__((always_inline)) void
rows_block(const segflow_attention_t *p, scratch_t *w, int R, int64_t b, int64_t h, int64_t r) {
    const float *q = p->q + b * p->qs[0] + h * p->qs[1] + r * p->qs[2];
    for (int64_t key0 = 0; key0 < w->skp; key0 += NARROW) {      /* scores = Q K^T */
        vf acc[MR_NARROW][2] = {{{0}}};
        narrow_panel_fma(R, p->d, q, p->qs[2], w->kp + key0 * p->d, acc);
        for (int i = 0; i < R; i++)
            for (int v = 0; v < 2; v++)
                *(vf *)(w->s + i * w->skp + key0 + VW * v) = acc[i][v];
    }
    float inv[MR_NARROW];
    const float *mask[MR_NARROW];
    for (int i = 0; i < R; i++)
        mask[i] = p->mask ? p->mask + b * p->ms[0] + h * p->ms[1] + (r + i) * p->ms[2] : NULL;
    softmax_rows(p, R, w->s, w->skp, mask, inv);
    float *y = p->y + b * p->ys[0] + h * p->ys[1] + r * p->ys[2];
    for (int64_t col0 = 0; col0 < w->dvp; col0 += NARROW) {      /* Y = P V / sum */
        vf acc[MR_NARROW][2] = {{{0}}};
        narrow_panel_fma(R, p->sk, w->s, w->skp, w->vp + col0 * p->sk, acc);
        const int64_t cols = p->dv - col0 < NARROW ? p->dv - col0 : NARROW;
        for (int i = 0; i < R; i++) {
            const vf scale = splat_vf(inv[i]);
            float *out = y + i * p->ys[2] + col0;
            if (cols == NARROW) {
                *(vf *)out = acc[i][0] * scale;
                *(vf *)(out + VW) = acc[i][1] * scale;
            } else {
                *(vf *)w->tile = acc[i][0] * scale;
                *(vf *)(w->tile + VW) = acc[i][1] * scale;
                memcpy(out, w->tile, (size_t)cols * sizeof(float));
            }
        }
    }
}

/* The last rows of a pair, fewer than MR_NARROW: a generic copy of the block (its
 * accumulators in memory), which keeps the build small (an inlined copy per row
 * count doubled its compile time, 0.9 to 1.8 s) for a block that is rare. */
static __attribute__((noinline)) void
last_rows(const segflow_attention_t *p, scratch_t *w, int R, int64_t b, int64_t h, int64_t r) {
    rows_block(p, w, R, b, h, r);
}

/* Unit u is pair u / split's share u % split of the query rows. */
static void unit(const segflow_attention_t *p, scratch_t *w, int64_t u, int64_t split) {
    const int64_t pair = u / split, share = u % split;
    const int64_t b = pair / p->heads, h = pair % p->heads;
    if (w->packed != pair)
        pack(p, w, b, h);
    const int64_t blocks = (p->sq + MR_NARROW - 1) / MR_NARROW;
    const int64_t end = blocks * (share + 1) / split * MR_NARROW;
    for (int64_t r = blocks * share / split * MR_NARROW; r < end && r < p->sq;
         r += MR_NARROW) {
        if (p->sq - r >= MR_NARROW)
            rows_block(p, w, MR_NARROW, b, h, r);
        else
            last_rows(p, w, (int)(p->sq - r), b, h, r);
    }
}

/* Floats of scratch each thread needs: K's and V's panels, MR_NARROW rows of scores,
 * one output block. The caller passes threads x this many (no allocation here). */
int64_t segflow_attention_scratch(int64_t sk, int64_t d, int64_t dv) {
    const int64_t skp = (sk + NARROW - 1) / NARROW * NARROW;
    const int64_t dvp = (dv + NARROW - 1) / NARROW * NARROW;
    return skp * d + dvp * sk + MR_NARROW * skp + NARROW;
}

/* Each thread claims units until none are left: a VM's vCPUs do not always run at
 * one speed, so an even split in advance waits for the slowest. At least 4 units a
 * thread where the rows allow it. */
static void work(void *data) {
    segflow_attention_t *p = data;
    const int64_t threads = p->num_threads ? p->num_threads() : 1;
    const int64_t pairs = p->batch * p->heads;
    const int64_t blocks = (p->sq + MR_NARROW - 1) / MR_NARROW;
    int64_t split = (4 * threads + pairs - 1) / pairs;
    split = split < blocks ? split : blocks;
    scratch_t w;
    w.skp = (p->sk + NARROW - 1) / NARROW * NARROW;
    w.dvp = (p->dv + NARROW - 1) / NARROW * NARROW;
    w.packed = -1;
    const int64_t t = p->thread_num ? p->thread_num() : 0;
    if (t >= p->scratch_threads) {      /* more threads than the caller made room for */
        p->status = 1;
        return;
    }
    w.kp = p->scratch + t * segflow_attention_scratch(p->sk, p->d, p->dv);
    w.vp = w.kp + w.skp * p->d;
    w.s = w.vp + w.dvp * p->sk;
    w.tile = w.s + MR_NARROW * w.skp;
    for (int64_t u; (u = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED)) < pairs * split;)
        unit(p, &w, u, split);
}

/* Run it; 0 (1 only if a thread found no scratch). `sizes` holds 27 numbers: batch,
 * heads, sq, sk, d, dv; the strides of Q, K, V, the mask and Y (4 each); the threads
 * the scratch has room for (at most that many run). `flags`: see the top. Under ~64k multiply-adds it
 * stays on this thread: waking the pool costs more. */
int segflow_attention(const float *q, const float *k, const float *v, const float *mask,
                      float *y, float *scratch, const int64_t *sizes, float scale,
                      int32_t flags, void (*parallel)(void (*)(void *), void *, unsigned, unsigned),
                      int (*thread_num)(void), int (*num_threads)(void)) {
    segflow_attention_t p = {q, k, v, mask, y, scratch, sizes[0], sizes[1], sizes[2],
                             sizes[3], sizes[4], sizes[5], {0}, {0}, {0}, {0}, {0},
                             sizes[26], scale, flags, 0, 0, parallel, thread_num,
                             num_threads};
    for (int i = 0; i < 4; i++) {
        p.qs[i] = sizes[6 + i];
        p.ks[i] = sizes[10 + i];
        p.vs[i] = sizes[14 + i];
        p.ms[i] = sizes[18 + i];
        p.ys[i] = sizes[22 + i];
    }
    if (p.batch <= 0 || p.heads <= 0 || p.sq <= 0 || p.sk <= 0 || p.dv <= 0)
        return 0;
    if (parallel && p.batch * p.heads * p.sq * p.sk * (p.d + p.dv) >= 65536)
        parallel(work, &p, (unsigned)p.scratch_threads, 0);
    else
        work(&p);
    return p.status;
}

/* segflow_attention's arguments as one structure, so that a recorded call is one
 * pointer (replay.c's segflow_replay_calls; kernels/attention.py mirrors it). */
typedef struct {
    const float *q, *k, *v, *mask;
    float *y, *scratch;
    const int64_t *sizes;
    float scale;
    int32_t flags;
    void (*parallel)(void (*)(void *), void *, unsigned, unsigned);
    int (*thread_num)(void);
    int (*num_threads)(void);
} segflow_attention_call_t;

int segflow_attention_call(const segflow_attention_call_t *a) {
    return segflow_attention(a->q, a->k, a->v, a->mask, a->y, a->scratch, a->sizes, a->scale,
                             a->flags, a->parallel, a->thread_num, a->num_threads);
}
