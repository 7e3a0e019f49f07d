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
 * float32 only. Softmax in two passes over the scores (max, then exp and sum), the values
 * weighted and summed in a third; each dot product keeps 8 partial sums (vectorizable
 * without reassociating anything). Returns 0, or 1 when a scratch buffer could not be had.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 64

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < d; i++) s += a[i] * b[i];
    return s;
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
    int failed = 0;
    if (G > MAX_GROUP || G * num_kv_heads != num_heads) return 2;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < n * num_kv_heads; task++) {
        const int64_t i = task / num_kv_heads, h = task % num_kv_heads;
        const int64_t ctx = ctx_lens[i];
        const int64_t *table = block_tables + seq_rows[i] * table_stride;
        const float *q = query + (token_rows[i] * num_heads + h * G) * D;
        float *o = out + (token_rows[i] * num_heads + h * G) * D;
        float *s = (float *)malloc(sizeof(float) * (size_t)(G * ctx + G * D));
        if (!s) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        float *acc = s + G * ctx;
        float mx[MAX_GROUP], sum[MAX_GROUP];
        for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
        const int64_t head_base = h * num_blocks;
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const float *kb = key_cache + (head_base + table[t0 / block_size]) * block_size * D;
            const int64_t m = ctx - t0 < block_size ? ctx - t0 : block_size;
            for (int64_t t = 0; t < m; t++)
                for (int64_t g = 0; g < G; g++) {
                    const float v = dot(q + g * D, kb + t * D, D) * scale;
                    s[g * ctx + t0 + t] = v;
                    if (v > mx[g]) mx[g] = v;
                }
        }
        for (int64_t g = 0; g < G; g++) {
            float z = 0.f;
            float *sg = s + g * ctx;
            for (int64_t t = 0; t < ctx; t++) {
                sg[t] = expf(sg[t] - mx[g]);
                z += sg[t];
            }
            sum[g] = z;
            for (int64_t d = 0; d < D; d++) acc[g * D + d] = 0.f;
        }
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const float *vb = value_cache + (head_base + table[t0 / block_size]) * block_size * D;
            const int64_t m = ctx - t0 < block_size ? ctx - t0 : block_size;
            for (int64_t t = 0; t < m; t++)
                for (int64_t g = 0; g < G; g++) {
                    const float p = s[g * ctx + t0 + t];
                    float *a = acc + g * D;
                    const float *vr = vb + t * D;
                    for (int64_t d = 0; d < D; d++) a[d] += p * vr[d];
                }
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++) o[g * D + d] = acc[g * D + d] / sum[g];
        free(s);
    }
    return failed;
}
