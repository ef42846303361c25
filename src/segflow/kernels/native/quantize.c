/* segflow native kernels: DynamicQuantizeLinear of a float32 tensor to uint8.
 *
 * onnxruntime's dynamic quantizer puts one DynamicQuantizeLinear before every group of
 * linears; through torch it is eight kernel calls (the range, the scale and zero point,
 * the division, rounding, shift, clamp and conversion), each a pass over the tensor and
 * a dispatch, where this is two passes: the range, then the quantization.
 *
 * segflow_dynamic_quantize_u8 follows ONNX's definition in float32 as torch's path
 * computes it: the range widened to hold 0, scale = (max - min) / 255 (1 where the range
 * is empty), zero point = round(clamp(-min / scale, 0, 255)), and each value
 * y = clamp(round(x / scale) + zero point, 0, 255), rounding half to even (as
 * nearbyintf does in the default rounding mode) and dividing, not multiplying by the
 * inverse, so that every byte equals the reference's. A NaN anywhere returns 1 without writing y: the
 * caller takes torch's path, which decides what NaN becomes.
 *
 * The range is taken in eight-lane vectors (the compiler does not vectorize a scalar
 * min/max loop: with NaN and signed zeros its order would matter; here a NaN is
 * caught apart, and -0 and +0 give the same scale and zero point).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ROUNDER 12582912.0f /* 1.5 * 2^23 */

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8v __attribute__((vector_size(32), aligned(4)));

static inline v8 pick(i8v take_a, v8 a, v8 b) {
    i8v ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const i8v r = (ai & take_a) | (bi & ~take_a);
    v8 out;
    memcpy(&out, &r, sizeof out);
    return out;
}

int segflow_dynamic_quantize_u8(const float *x, int64_t n, uint8_t *y, float *scale_out,
                                uint8_t *zero_point_out) {
    v8 lo8 = {0}, hi8 = {0};
    i8v nan8 = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 v;
        memcpy(&v, x + i, sizeof v);
        nan8 |= v != v;
        lo8 = pick(v < lo8, v, lo8);
        hi8 = pick(v > hi8, v, hi8);
    }
    float lo = 0.0f, hi = 0.0f;
    int nan = 0;
    for (int k = 0; k < 8; k++) {
        nan |= nan8[k] != 0;
        lo = lo8[k] < lo ? lo8[k] : lo;
        hi = hi8[k] > hi ? hi8[k] : hi;
    }
    for (; i < n; i++) {
        const float v = x[i];
        nan |= v != v;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    if (nan)
        return 1;
    const float scale = hi == lo ? 1.0f : (hi - lo) / 255.0f;
    float zp = -lo / scale;
    zp = nearbyintf(zp < 0.0f ? 0.0f : (zp > 255.0f ? 255.0f : zp));
    for (i = 0; i < n; i++) {
        /* |x / scale| <= 255 here, so adding and taking away 1.5 * 2^23 rounds it to an
         * integer half to even, exactly (as nearbyintf does), in a form that vectorizes. */
        float q = ((x[i] / scale + ROUNDER) - ROUNDER) + zp;
        q = q < 0.0f ? 0.0f : q;
        q = q > 255.0f ? 255.0f : q;
        y[i] = (uint8_t)(int32_t)q;
    }
    *scale_out = scale;
    *zero_point_out = (uint8_t)zp;
    return 0;
}
