/* e^x in float32 for the CPU kernels, shared by every source that includes it (kernels/cbuild.py
 * compiles with this folder on the include path and keys its cache by this file too).
 *
 * x is clamped to [-87.3, 88] (about 1e-38 at the bottom); x = n ln2 + r, |r| <= ln2 / 2; e^r by a
 * degree-6 polynomial (Horner), 2^n put into the exponent bits. Within 2 ulp of expf on that range.
 * Branch-free, so loops of it vectorize; n is rounded with rint (nearest, ties to even: an
 * instruction, where roundf is a libm call that keeps a loop scalar). */
#ifndef LG_EXP_H
#define LG_EXP_H

#include <stdint.h>

static inline float lg_exp(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;             /* ln2, split in two for an exact product */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

#endif
