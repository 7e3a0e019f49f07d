/* A decoder layer's pointwise work on the CPU in float32, fused so that each row is read
 * once and no intermediate tensor is made, every row of a step in one call, spread over
 * torch's OpenMP threads. Bit for bit what kernels/pointwise/reference.py computes where
 * the reference's own torch ops are elementwise (the rotation; the residual add), within
 * float32 rounding where they reduce (RMSNorm's mean of squares sums in another order).
 * Compiled in ISO C mode: no multiply-add is contracted into an FMA that would round once
 * where torch's separate ops round twice.
 */
#include <math.h>
#include <stdint.h>

#include "lg_exp.h"

/* residual[r] += x[r]; out[r] = weight * (residual[r] * (1 / sqrt(mean(residual[r]^2) + eps)))
 * (HF's LlamaRMSNorm in float32, after the residual add). x NULL: no add (the first layer). */
void lg_add_rms_norm_f32(const float *x, float *residual, const float *weight, float eps,
                         float *out, int64_t rows, int64_t hidden, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * hidden;
        float *o = out + r * hidden;
        if (x) {
            const float *xr = x + r * hidden;
            #pragma omp simd
            for (int64_t i = 0; i < hidden; i++) h[i] = h[i] + xr[i];
        }
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < hidden; i++) ss += h[i] * h[i];
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
        #pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

/* One step's projected q/k/v rows [rows, (num_heads + 2 * num_kv_heads) * D] (row stride
 * `stride`): q rotated into q_out [rows, num_heads, D]; k rotated and v as it is written into
 * the caches [num_kv_heads, num_blocks, block_size, D] at each row's slot. The rotation is
 * the rotate-half form: x * cos + cat(-x2, x1) * sin, cos/sin rows [rows, D]. Every slot is
 * checked before anything is written: returns 3 (and writes nothing) when one lies outside
 * the cache, else 0. */
int lg_rope_write_kv_f32(const float *qkv, int64_t stride, int64_t rows, int64_t num_heads,
                         int64_t num_kv_heads, int64_t D, const float *cos, const float *sin,
                         const int64_t *slots, float *key_cache, float *value_cache,
                         int64_t num_slots, float *q_out, int num_threads)
{
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return 3;
    const int64_t half = D / 2;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * stride;
        const float *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            const float *x = row + h * D;
            float *o = h < num_heads ? q_out + (r * num_heads + h) * D
                                     : key_cache + ((h - num_heads) * num_slots + slots[r]) * D;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) o[i] = x[i] * c[i] + (-x[i + half]) * s[i];
            #pragma omp simd
            for (int64_t i = half; i < D; i++) o[i] = x[i] * c[i] + x[i - half] * s[i];
        }
        const float *v = row + (num_heads + num_kv_heads) * D;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            float *o = value_cache + (h * num_slots + slots[r]) * D;
            for (int64_t i = 0; i < D; i++) o[i] = v[h * D + i];
        }
    }
    return 0;
}

/* out[r] = silu(gate) * up for rows [gate | up] of gate_up [rows, 2 * inter] (row stride
 * `stride`): SiLU-and-mul, silu(x) = x / (1 + e^-x) as torch computes it, e^-x within 2 ulp */
void lg_silu_mul_f32(const float *gate_up, int64_t stride, int64_t rows, int64_t inter, float *out,
                     int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * inter >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * stride, *u = g + inter;
        float *o = out + r * inter;
        #pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + lg_exp(-g[i])) * u[i];
    }
}

/* out[r] = the index of row r's largest value, the first where several are equal; the first
 * NaN where the row has one (torch.argmax's answer). One vector pass keeps each lane's max
 * and where it was first seen (a strict > keeps the first), the lanes are then reduced to
 * the smallest index holding the row's max; a NaN (no comparison is true of one) is looked
 * for in a pass of its own and, when found, searched for alone. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16fu __attribute__((vector_size(64), aligned(4)));

static int64_t argmax_row(const float *v, int64_t cols) {
    int nan = 0;
    #pragma omp simd reduction(|:nan)
    for (int64_t i = 0; i < cols; i++) nan |= v[i] != v[i];
    if (nan) {
        for (int64_t i = 0; i < cols; i++)
            if (v[i] != v[i]) return i;
    }
    float best = -INFINITY;
    int64_t at = 0, i = 0;
    if (cols >= 16 && cols < ((int64_t)1 << 31)) {
        v16f mx = *(const v16fu *)v;
        v16i ix = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        v16i cur = ix;
        const v16i step = {16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};
        for (i = 16; i + 16 <= cols; i += 16) {
            cur += step;
            const v16f x = *(const v16fu *)(v + i);
            const v16i gt = x > mx;
            mx = (v16f)(((v16i)x & gt) | ((v16i)mx & ~gt));
            ix = (cur & gt) | (ix & ~gt);
        }
        best = mx[0];
        at = ix[0];
        for (int l = 1; l < 16; l++)
            if (mx[l] > best || (mx[l] == best && ix[l] < at)) { best = mx[l]; at = ix[l]; }
    }
    for (; i < cols; i++)
        if (v[i] > best || (i == 0 && cols < 16)) { best = v[i]; at = i; }
    return at;
}

void lg_argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * cols, cols);
}
