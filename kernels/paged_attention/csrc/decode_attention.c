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
 * flash attention does): the block's scores for every query head of the KV head, the
 * running max and sum rescaled once per block, the block's values weighted into the
 * accumulator while its K and V are still in L1. The next block's K and V are prefetched
 * while this one is worked on (blocks lie anywhere in the cache: the hardware prefetcher
 * cannot guess them). exp is a polynomial the compiler vectorizes (within 2 ulp of expf
 * on the range used, exponents <= 0). Dot products keep 8 partial sums. Returns 0, 1 when
 * a scratch buffer could not be had, 2 when the head counts do not divide.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* e^x for x <= 0 (about 1e-38 at and below -87.3): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6
 * polynomial (Horner), 2^n put into the exponent bits. Branch-free, so loops of it vectorize. */
static inline float exp_neg(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = __builtin_roundf(x * 1.44269504088896341f);
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

/* 8 floats as one vector (GCC's vector extension: AVX on x86-64, NEON pairs on Arm) */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
static inline v8 ld8(const float *p) { return *(const v8u *)p; }
static inline void st8(float *p, v8 v) { *(v8u *)p = v; }
static inline float hsum8(v8 v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* s[t] = q . k_t * scale for the m keys of a block; 8 keys at a time when D is a multiple
 * of 8 (8 independent accumulators keep the FMA units busy; each is one dot product, its
 * lanes summed as dot() sums them) */
static inline float block_scores(const float *q, const float *kb, int64_t m, int64_t D, float scale, float *s) {
    float bmax = -INFINITY;
    int64_t t = 0;
    if (D % 8 == 0) {
        for (; t + 8 <= m; t += 8) {
            const float *k = kb + t * D;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
            for (int64_t d = 0; d < D; d += 8) {
                const v8 qv = ld8(q + d);
                a0 += qv * ld8(k + d);
                a1 += qv * ld8(k + D + d);
                a2 += qv * ld8(k + 2 * D + d);
                a3 += qv * ld8(k + 3 * D + d);
                a4 += qv * ld8(k + 4 * D + d);
                a5 += qv * ld8(k + 5 * D + d);
                a6 += qv * ld8(k + 6 * D + d);
                a7 += qv * ld8(k + 7 * D + d);
            }
            s[t] = hsum8(a0) * scale; s[t + 1] = hsum8(a1) * scale;
            s[t + 2] = hsum8(a2) * scale; s[t + 3] = hsum8(a3) * scale;
            s[t + 4] = hsum8(a4) * scale; s[t + 5] = hsum8(a5) * scale;
            s[t + 6] = hsum8(a6) * scale; s[t + 7] = hsum8(a7) * scale;
        }
    }
    for (; t < m; t++) s[t] = dot(q, kb + t * D, D) * scale;
    for (t = 0; t < m; t++) bmax = s[t] > bmax ? s[t] : bmax;
    return bmax;
}

/* a += sum_t p[t] * v_t over the m values of a block, 64 columns at a time held in
 * registers across the keys */
static inline void block_values(float *a, const float *p, const float *vb, int64_t m, int64_t D) {
    int64_t d0 = 0;
    if (D % 8 == 0) {
        for (; d0 + 64 <= D; d0 += 64) {
            v8 r0 = ld8(a + d0), r1 = ld8(a + d0 + 8), r2 = ld8(a + d0 + 16), r3 = ld8(a + d0 + 24);
            v8 r4 = ld8(a + d0 + 32), r5 = ld8(a + d0 + 40), r6 = ld8(a + d0 + 48), r7 = ld8(a + d0 + 56);
            for (int64_t t = 0; t < m; t++) {
                const float *v = vb + t * D + d0;
                const v8 pv = {p[t], p[t], p[t], p[t], p[t], p[t], p[t], p[t]};
                r0 += pv * ld8(v); r1 += pv * ld8(v + 8); r2 += pv * ld8(v + 16); r3 += pv * ld8(v + 24);
                r4 += pv * ld8(v + 32); r5 += pv * ld8(v + 40); r6 += pv * ld8(v + 48); r7 += pv * ld8(v + 56);
            }
            st8(a + d0, r0); st8(a + d0 + 8, r1); st8(a + d0 + 16, r2); st8(a + d0 + 24, r3);
            st8(a + d0 + 32, r4); st8(a + d0 + 40, r5); st8(a + d0 + 48, r6); st8(a + d0 + 56, r7);
        }
    }
    for (int64_t t = 0; t < m; t++)
        for (int64_t d = d0; d < D; d++) a[d] += p[t] * vb[t * D + d];
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
        float s[MAX_BLOCK];
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
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = q + g * D;
                    const float bmax = block_scores(qg, kb, m, D, scale, s);
                    const float new_max = bmax > mx[g] ? bmax : mx[g];
                    if (new_max == -INFINITY) continue;   /* every key so far at -inf: nothing to weigh yet */
                    float psum = 0.f;
                    #pragma omp simd reduction(+:psum)
                    for (int64_t t = 0; t < m; t++) {
                        s[t] = exp_neg(s[t] - new_max);
                        psum += s[t];
                    }
                    float *a = acc + g * D;
                    if (new_max > mx[g] && mx[g] != -INFINITY) {
                        const float alpha = exp_neg(mx[g] - new_max);
                        sum[g] *= alpha;
                        for (int64_t d = 0; d < D; d++) a[d] *= alpha;
                    }
                    mx[g] = new_max;
                    sum[g] += psum;
                    block_values(a, s, vb, m, D);
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
