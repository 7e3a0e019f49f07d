/* Decode attention on the CPU: one query token per sequence over its paged context, every
 * sequence and KV head of a layer in one call, spread over OpenMP threads (torch's own
 * runtime: libgomp.so.1 is already loaded by torch when this library is).
 *
 * Layouts as kernels/paged_attention/reference.py: query and out [num_tokens, num_heads, D];
 * key and value cache [num_kv_heads, num_blocks, block_size, D]; block tables
 * [num_seqs, table_stride] of int64. Sequence i of the call is row seq_rows[i] of the
 * tables, its query is row token_rows[i] of query, its context ctx_lens[i] tokens.
 * Query head h reads KV head h / (num_heads / num_kv_heads).
 *
 * float32 only. One pass over the context, a cache block at a time (an online softmax, as
 * flash attention does): the block's scores, the running max and sum rescaled once per
 * block, the block's values weighted into the accumulator while its K and V are still in
 * L1. Query heads of a KV head go two at a time, each load of K and V serving both. The
 * next block's K and V are prefetched while this one is worked on (blocks lie anywhere in
 * the cache: the hardware prefetcher cannot guess them). exp is a polynomial the compiler
 * vectorizes (within 2 ulp of expf on the range used, exponents <= 0; its rounding is
 * rint's, an instruction, where roundf is a libm call that kept the loop scalar). Scores
 * take 8 keys at a time, their 8 dot products summed by one transposing add tree. Returns
 * 0, 1 when a scratch buffer could not be had, 2 when the head counts do not divide.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lg_exp.h"

#define MAX_GROUP 64
#define MAX_BLOCK 256

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

/* 8 floats as one vector (GCC's vector extension: AVX on x86-64, NEON pairs on Arm) */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));
static inline v8 ld8(const float *p) { return *(const v8u *)p; }
static inline void st8(float *p, v8 v) { *(v8u *)p = v; }

/* lane i of the result: the sum of a_i's 8 lanes (a transposing add tree: 7 shuffle pairs
 * and 7 adds for 8 sums) */
/* lanes of a and b, as GCC and clang each spell it */
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

static inline v8 sum8x8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
    const v8 x01 = SHUF(a0, a1, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a0, a1, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 x23 = SHUF(a2, a3, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a2, a3, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 x45 = SHUF(a4, a5, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a4, a5, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 x67 = SHUF(a6, a7, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a6, a7, 1, 9, 3, 11, 5, 13, 7, 15);
    const v8 y0 = SHUF(x01, x23, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(x01, x23, 2, 3, 10, 11, 6, 7, 14, 15);
    const v8 y1 = SHUF(x45, x67, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(x45, x67, 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(y0, y1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(y0, y1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* s[t] = q . k_t * scale for the m keys of a block, for one query head (s1 NULL) or two
 * (q1, s1) sharing each load of K; 8 keys at a time when D is a multiple of 8. Returns the
 * block's max score of each head in mx[0] (and mx[1]). */
static inline void block_scores(const float *q0, const float *q1, const float *kb, int64_t m, int64_t D,
                                float scale, float *s0, float *s1, float *mx) {
    int64_t t = 0;
    const v8 sc = {scale, scale, scale, scale, scale, scale, scale, scale};
    if (D % 8 == 0) {
        for (; t + 8 <= m; t += 8) {
            const float *k = kb + t * D;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
            v8 b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, b4 = {0}, b5 = {0}, b6 = {0}, b7 = {0};
            if (s1) {
                for (int64_t d = 0; d < D; d += 8) {
                    const v8 qa = ld8(q0 + d), qb = ld8(q1 + d);
                    v8 kv;
                    kv = ld8(k + d);         a0 += qa * kv; b0 += qb * kv;
                    kv = ld8(k + D + d);     a1 += qa * kv; b1 += qb * kv;
                    kv = ld8(k + 2 * D + d); a2 += qa * kv; b2 += qb * kv;
                    kv = ld8(k + 3 * D + d); a3 += qa * kv; b3 += qb * kv;
                    kv = ld8(k + 4 * D + d); a4 += qa * kv; b4 += qb * kv;
                    kv = ld8(k + 5 * D + d); a5 += qa * kv; b5 += qb * kv;
                    kv = ld8(k + 6 * D + d); a6 += qa * kv; b6 += qb * kv;
                    kv = ld8(k + 7 * D + d); a7 += qa * kv; b7 += qb * kv;
                }
                st8(s1 + t, sum8x8(b0, b1, b2, b3, b4, b5, b6, b7) * sc);
            } else {
                for (int64_t d = 0; d < D; d += 8) {
                    const v8 qa = ld8(q0 + d);
                    a0 += qa * ld8(k + d);         a1 += qa * ld8(k + D + d);
                    a2 += qa * ld8(k + 2 * D + d); a3 += qa * ld8(k + 3 * D + d);
                    a4 += qa * ld8(k + 4 * D + d); a5 += qa * ld8(k + 5 * D + d);
                    a6 += qa * ld8(k + 6 * D + d); a7 += qa * ld8(k + 7 * D + d);
                }
            }
            st8(s0 + t, sum8x8(a0, a1, a2, a3, a4, a5, a6, a7) * sc);
        }
    }
    for (; t < m; t++) {
        s0[t] = dot(q0, kb + t * D, D) * scale;
        if (s1) s1[t] = dot(q1, kb + t * D, D) * scale;
    }
    float m0 = -INFINITY, m1 = -INFINITY;
    for (t = 0; t < m; t++) m0 = s0[t] > m0 ? s0[t] : m0;
    mx[0] = m0;
    if (s1) {
        for (t = 0; t < m; t++) m1 = s1[t] > m1 ? s1[t] : m1;
        mx[1] = m1;
    }
}

/* a0 += sum_t p0[t] * v_t (and a1 with p1, when given) over the m values of a block, 64
 * columns at a time held in registers across the keys, each load of V serving both heads */
static inline void block_values(float *a0, float *a1, const float *p0, const float *p1, const float *vb,
                                int64_t m, int64_t D) {
    int64_t d0 = 0;
    if (D % 8 == 0) {
        for (; d0 + 64 <= D; d0 += 64) {
            v8 r0 = ld8(a0 + d0), r1 = ld8(a0 + d0 + 8), r2 = ld8(a0 + d0 + 16), r3 = ld8(a0 + d0 + 24);
            v8 r4 = ld8(a0 + d0 + 32), r5 = ld8(a0 + d0 + 40), r6 = ld8(a0 + d0 + 48), r7 = ld8(a0 + d0 + 56);
            if (a1) {
                v8 u0 = ld8(a1 + d0), u1 = ld8(a1 + d0 + 8), u2 = ld8(a1 + d0 + 16), u3 = ld8(a1 + d0 + 24);
                v8 u4 = ld8(a1 + d0 + 32), u5 = ld8(a1 + d0 + 40), u6 = ld8(a1 + d0 + 48), u7 = ld8(a1 + d0 + 56);
                for (int64_t t = 0; t < m; t++) {
                    const float *v = vb + t * D + d0;
                    const v8 pa = {p0[t], p0[t], p0[t], p0[t], p0[t], p0[t], p0[t], p0[t]};
                    const v8 pb = {p1[t], p1[t], p1[t], p1[t], p1[t], p1[t], p1[t], p1[t]};
                    v8 x;
                    x = ld8(v);      r0 += pa * x; u0 += pb * x;
                    x = ld8(v + 8);  r1 += pa * x; u1 += pb * x;
                    x = ld8(v + 16); r2 += pa * x; u2 += pb * x;
                    x = ld8(v + 24); r3 += pa * x; u3 += pb * x;
                    x = ld8(v + 32); r4 += pa * x; u4 += pb * x;
                    x = ld8(v + 40); r5 += pa * x; u5 += pb * x;
                    x = ld8(v + 48); r6 += pa * x; u6 += pb * x;
                    x = ld8(v + 56); r7 += pa * x; u7 += pb * x;
                }
                st8(a1 + d0, u0); st8(a1 + d0 + 8, u1); st8(a1 + d0 + 16, u2); st8(a1 + d0 + 24, u3);
                st8(a1 + d0 + 32, u4); st8(a1 + d0 + 40, u5); st8(a1 + d0 + 48, u6); st8(a1 + d0 + 56, u7);
            } else {
                for (int64_t t = 0; t < m; t++) {
                    const float *v = vb + t * D + d0;
                    const v8 pa = {p0[t], p0[t], p0[t], p0[t], p0[t], p0[t], p0[t], p0[t]};
                    r0 += pa * ld8(v); r1 += pa * ld8(v + 8); r2 += pa * ld8(v + 16); r3 += pa * ld8(v + 24);
                    r4 += pa * ld8(v + 32); r5 += pa * ld8(v + 40); r6 += pa * ld8(v + 48); r7 += pa * ld8(v + 56);
                }
            }
            st8(a0 + d0, r0); st8(a0 + d0 + 8, r1); st8(a0 + d0 + 16, r2); st8(a0 + d0 + 24, r3);
            st8(a0 + d0 + 32, r4); st8(a0 + d0 + 40, r5); st8(a0 + d0 + 48, r6); st8(a0 + d0 + 56, r7);
        }
    }
    for (int64_t t = 0; t < m; t++)
        for (int64_t d = d0; d < D; d++) {
            a0[d] += p0[t] * vb[t * D + d];
            if (a1) a1[d] += p1[t] * vb[t * D + d];
        }
}

/* the online softmax's step for one head over a block: scores s (m of them, block max bmax)
 * become weights in place; the running max mx and sum, and the accumulator a, are rescaled
 * when the max rises. Returns 0 when every score so far is -inf (nothing to weigh). */
static inline int softmax_step(float *s, int64_t m, float bmax, float *mx, float *sum, float *a, int64_t D) {
    const float new_max = bmax > *mx ? bmax : *mx;
    if (new_max == -INFINITY) return 0;
    float psum = 0.f;
    #pragma omp simd reduction(+:psum)
    for (int64_t t = 0; t < m; t++) {
        s[t] = lg_exp(s[t] - new_max);
        psum += s[t];
    }
    if (new_max > *mx && *mx != -INFINITY) {
        const float alpha = lg_exp(*mx - new_max);
        *sum *= alpha;
        for (int64_t d = 0; d < D; d++) a[d] *= alpha;
    }
    *mx = new_max;
    *sum += psum;
    return 1;
}

static inline void prefetch_block(const float *p, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(p + i, 0, 1);
}

int lg_decode_attention_f32(
    const float *query, const float *key_cache, const float *value_cache,
    const int64_t *block_tables, int64_t table_stride,
    const int64_t *seq_rows, const int64_t *token_rows, const int64_t *ctx_lens, int64_t n,
    int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
    int64_t head_dim, float scale, float *out, int num_threads)
{
    const int64_t G = num_heads / num_kv_heads;
    const int64_t D = head_dim;
    const int64_t block_floats = block_size * D;
    int failed = 0;
    if (G > MAX_GROUP || G * num_kv_heads != num_heads || block_size > MAX_BLOCK) return 2;
    #pragma omp parallel num_threads(num_threads)
    {
        float *acc = (float *)malloc(sizeof(float) * (size_t)(G * D));
        float s[MAX_BLOCK] __attribute__((aligned(32))), s2[MAX_BLOCK] __attribute__((aligned(32)));
        float mx[MAX_GROUP], sum[MAX_GROUP];
        if (!acc) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n * num_kv_heads; task++) {
            if (!acc) continue;
            const int64_t i = task / num_kv_heads, h = task % num_kv_heads;
            const int64_t ctx = ctx_lens[i];
            const int64_t *table = block_tables + seq_rows[i] * table_stride;
            const float *q = query + (token_rows[i] * num_heads + h * G) * D;
            float *o = out + (token_rows[i] * num_heads + h * G) * D;
            const int64_t head_base = h * num_blocks;
            memset(acc, 0, sizeof(float) * (size_t)(G * D));
            for (int64_t g = 0; g < G; g++) { mx[g] = -INFINITY; sum[g] = 0.f; }
            for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += block_size, b++) {
                const float *kb = key_cache + (head_base + table[b]) * block_floats;
                const float *vb = value_cache + (head_base + table[b]) * block_floats;
                const int64_t m = ctx - t0 < block_size ? ctx - t0 : block_size;
                if (t0 + block_size < ctx) {
                    const int64_t next = (head_base + table[b + 1]) * block_floats;
                    prefetch_block(key_cache + next, block_floats);
                    prefetch_block(value_cache + next, block_floats);
                }
                for (int64_t g = 0; g < G; g += 2) {
                    const int pair = g + 1 < G;
                    float bm[2] = {-INFINITY, -INFINITY};
                    block_scores(q + g * D, pair ? q + (g + 1) * D : NULL, kb, m, D, scale, s, pair ? s2 : NULL, bm);
                    const int w0 = softmax_step(s, m, bm[0], &mx[g], &sum[g], acc + g * D, D);
                    const int w1 = pair && softmax_step(s2, m, bm[1], &mx[g + 1], &sum[g + 1], acc + (g + 1) * D, D);
                    if (w0 && w1) block_values(acc + g * D, acc + (g + 1) * D, s, s2, vb, m, D);
                    else if (w0) block_values(acc + g * D, NULL, s, NULL, vb, m, D);
                    else if (w1) block_values(acc + (g + 1) * D, NULL, s2, NULL, vb, m, D);
                }
            }
            for (int64_t g = 0; g < G; g++) {
                const float inv = 1.f / sum[g];
                for (int64_t d = 0; d < D; d++) o[g * D + d] = acc[g * D + d] * inv;
            }
        }
        free(acc);
    }
    return failed;
}
