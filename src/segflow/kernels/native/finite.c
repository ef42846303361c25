/* segflow native kernels: whether a float32 buffer holds a NaN or an infinity.
 *
 * A session whose kernels may lose NaN checks every float feed of every run
 * (runtime/nonfinite.py): a NaN or an infinity has all eight exponent bits set. The
 * scan is a vectorized OR over blocks, stopping at the first block that has one, and
 * costs a ctypes call where torch's reduction costs a dispatch and a result tensor:
 * the difference is what matters for a small model's feed.
 */
#include <stdint.h>
#include <string.h>

#define EXPONENT 0x7f800000u
#define BLOCK 4096

/* 1 if one of the n floats at x is NaN or +-Inf, else 0. */
int segflow_any_nonfinite_f32(const float *x, int64_t n) {
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = n - start < BLOCK ? n : start + BLOCK;
        uint32_t hit = 0;
        for (int64_t i = start; i < end; i++) {
            uint32_t bits;
            memcpy(&bits, x + i, sizeof bits);
            hit |= (uint32_t)((bits & EXPONENT) == EXPONENT);
        }
        if (hit)
            return 1;
    }
    return 0;
}
