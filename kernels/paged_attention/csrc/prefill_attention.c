/* Causal attention of prefill chunks on the CPU in float32, for sequences whose context sits
 * in consecutive cache slots (the engine places a sequence's blocks consecutively where it
 * can; the others take the reference). Flash-style: per (sequence, KV head, block of 16 query
 * positions x the query heads sharing that KV head), over blocks of 64 keys up to the causal
 * limit, scores by an outer-product micro-kernel against the key block transposed once into
 * L1, an online softmax (running max and sum per query row), and the value block added in
 * with the weights broadcast; the accumulators of a few rows stay in registers. Work is shared out
 * over torch's OpenMP threads, longest contexts first.
 *
 * Query i of a chunk of q_len new tokens sits at position ctx_len - q_len + i and sees keys
 * 0..that position. Head sizes 64 and 128 (the caller sends others to the reference). Results
 * equal SDPA's within float32 rounding (another summation order; e^x of lg_exp.h).
 */
#pragma GCC optimize("fp-contract=fast")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lg_exp.h"

/* Vectors as wide as the machine's registers (AVX-512's 16 floats, else AVX2's 8): a vector
 * type wider than the registers is lowered through the stack. Register tiles of TR rows x TV
 * vectors: 4 x 4 zmm (64 keys or dims) of 32 registers, 3 x 4 ymm (32) of 16. */
#if defined(__AVX512F__)
#define VL 16
#define TR 4
#else
#define VL 8
#define TR 3
#endif
#define TV 4
#define TW (TV * VL)     /* a tile's columns */
typedef float vec __attribute__((vector_size(VL * 4)));
static inline __attribute__((always_inline)) vec loadv(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline __attribute__((always_inline)) void storev(float *p, vec v) { memcpy(p, &v, sizeof v); }

#define QB 16            /* query positions per work item */
#define KB 64            /* keys per block */
#define MAX_GROUP 8      /* query heads per KV head */
#define MAX_ROWS (QB * MAX_GROUP)   /* query vectors per work item */

/* One work item for head size D (a constant in each instance). */
static inline __attribute__((always_inline)) void attend_block(
    const int D, const float *query, int64_t num_heads, int64_t kv_head, int64_t group,
    const float *keys, const float *values,      /* this KV head's context: row j at j * D */
    int64_t q_row0, int64_t pos0, int64_t npos, float scale, float *out, float *scratch)
{
    const int64_t rows = npos * group;
    /* the thread's scratch: q and acc [rows][D], kt [D][KB] (the key block transposed), s [rows][KB] */
    float (*q)[D] = (float (*)[D])scratch;
    float (*acc)[D] = (float (*)[D])(scratch + MAX_ROWS * D);
    float (*kt)[KB] = (float (*)[KB])(scratch + 2 * MAX_ROWS * D);
    float (*s)[KB] = (float (*)[KB])(scratch + 2 * MAX_ROWS * D + D * KB);
    float m[MAX_ROWS], l[MAX_ROWS];
    /* row r = position r / group, head kv_head * group + r % group; q pre-scaled */
    for (int64_t r = 0; r < rows; r++) {
        const float *src = query + ((q_row0 + r / group) * num_heads + kv_head * group + r % group) * D;
        for (int d = 0; d < D; d++) q[r][d] = src[d] * scale;
        for (int d = 0; d < D; d++) acc[r][d] = 0.f;
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int64_t last = pos0 + npos - 1;      /* the furthest any row sees */
    for (int64_t j0 = 0; j0 <= last; j0 += KB) {
        const int64_t nk = last + 1 - j0 < KB ? last + 1 - j0 : KB;
        for (int64_t j = 0; j < nk; j++)
            for (int d = 0; d < D; d++) kt[d][j] = keys[(j0 + j) * D + d];
        for (int64_t j = nk; j < KB; j++)
            for (int d = 0; d < D; d++) kt[d][j] = 0.f;
        /* scores: TR rows x TW keys a tile */
        for (int64_t r0 = 0; r0 < rows; r0 += TR) {
            const int64_t nr = rows - r0 < TR ? rows - r0 : TR;
            for (int c0 = 0; c0 < KB; c0 += TW) {
                vec a[TR][TV];
                for (int i = 0; i < TR; i++) for (int c = 0; c < TV; c++) a[i][c] = (vec){0};
                for (int d = 0; d < D; d++) {
                    vec kv[TV];
                    for (int c = 0; c < TV; c++) kv[c] = loadv(&kt[d][c0 + c * VL]);
                    for (int i = 0; i < TR; i++) {
                        const vec b = (vec){0} + q[r0 + (i < nr ? i : 0)][d];
                        for (int c = 0; c < TV; c++) a[i][c] += b * kv[c];
                    }
                }
                for (int64_t i = 0; i < nr; i++)
                    for (int c = 0; c < TV; c++) storev(&s[r0 + i][c0 + c * VL], a[i][c]);
            }
        }
        /* causal mask, online softmax: s becomes the weights, acc and l rescaled */
        for (int64_t r = 0; r < rows; r++) {
            const int64_t pos = pos0 + r / group;
            const int64_t allowed = pos - j0 + 1 < nk ? pos - j0 + 1 : nk;   /* keys j0 .. pos */
            float *sr = s[r];
            if (allowed <= 0) { for (int64_t j = 0; j < KB; j++) sr[j] = 0.f; continue; }
            float mx = m[r];
            for (int64_t j = 0; j < allowed; j++) mx = sr[j] > mx ? sr[j] : mx;
            const float corr = lg_exp(m[r] - mx);     /* 0 the first time (m = -inf clamps) */
            float sum = 0.f;
            #pragma omp simd reduction(+:sum)
            for (int64_t j = 0; j < KB; j++) {
                const float p = j < allowed ? lg_exp(sr[j] - mx) : 0.f;
                sr[j] = p;
                sum += p;
            }
            l[r] = l[r] * corr + sum;
            m[r] = mx;
            if (corr != 1.f)
                for (int d = 0; d < D; d++) acc[r][d] *= corr;
        }
        /* acc += weights x value block: TR rows x TW dims a tile in registers */
        for (int64_t r0 = 0; r0 < rows; r0 += TR) {
            const int64_t nr = rows - r0 < TR ? rows - r0 : TR;
            for (int d0 = 0; d0 < D; d0 += TW) {
                vec a[TR][TV];
                for (int i = 0; i < TR; i++)
                    for (int c = 0; c < TV; c++) a[i][c] = loadv(&acc[r0 + (i < nr ? i : 0)][d0 + c * VL]);
                for (int64_t j = 0; j < nk; j++) {
                    const float *vr = values + (j0 + j) * D + d0;
                    vec vv[TV];
                    for (int c = 0; c < TV; c++) vv[c] = loadv(vr + c * VL);
                    for (int i = 0; i < TR; i++) {
                        const vec p = (vec){0} + s[r0 + (i < nr ? i : 0)][j];
                        for (int c = 0; c < TV; c++) a[i][c] += p * vv[c];
                    }
                }
                for (int64_t i = 0; i < nr; i++)
                    for (int c = 0; c < TV; c++) storev(&acc[r0 + i][d0 + c * VL], a[i][c]);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = out + ((q_row0 + r / group) * num_heads + kv_head * group + r % group) * D;
        const float inv = 1.f / l[r];
        for (int d = 0; d < D; d++) dst[d] = acc[r][d] * inv;
    }
}

/* query [T, num_heads, D]; key/value caches [num_kv_heads, num_slots, D] (blocks flattened);
 * per sequence n < num_seqs: its first query row, number of new tokens, context length (new
 * tokens included) and first cache slot. out [T, num_heads, D], the sequences' rows written.
 * Returns 0; 1 when out of memory; 2 for a shape it does not take (head size, group); 3 for a
 * sequence whose rows or slots fall outside query or cache (nothing is read or written). */
int lg_prefill_attention_f32(const float *query, int64_t num_tokens, const float *key_cache,
                             const float *value_cache, int64_t num_slots, const int64_t *q_starts, const int64_t *q_lens,
                             const int64_t *ctx_lens, const int64_t *first_slots, int64_t num_seqs,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                             float *out, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    if ((head_dim != 64 && head_dim != 128) || group < 1 || group > MAX_GROUP || group * num_kv_heads != num_heads)
        return 2;
    for (int64_t n = 0; n < num_seqs; n++)
        if (q_lens[n] < 1 || q_lens[n] > ctx_lens[n] || q_starts[n] < 0 || q_starts[n] + q_lens[n] > num_tokens
                || first_slots[n] < 0 || first_slots[n] + ctx_lens[n] > num_slots)
            return 3;
    /* work items: (sequence, query block, KV head), the blocks furthest down a context first */
    int64_t items = 0;
    for (int64_t n = 0; n < num_seqs; n++) items += (q_lens[n] + QB - 1) / QB * num_kv_heads;
    int64_t *work = malloc((size_t)(items > 0 ? items : 1) * 3 * sizeof(int64_t));
    if (!work) return 1;
    int64_t w = 0;
    for (int64_t n = 0; n < num_seqs; n++)
        for (int64_t b = (q_lens[n] + QB - 1) / QB - 1; b >= 0; b--)
            for (int64_t h = 0; h < num_kv_heads; h++) { work[w * 3] = n; work[w * 3 + 1] = b; work[w * 3 + 2] = h; w++; }
    const size_t scratch_floats = (size_t)(2 * MAX_ROWS * head_dim + head_dim * KB + MAX_ROWS * KB);
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scratch = aligned_alloc(64, scratch_floats * sizeof(float));
        if (!scratch) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!scratch) continue;
            const int64_t n = work[i * 3], b = work[i * 3 + 1], h = work[i * 3 + 2];
            const int64_t pos_start = ctx_lens[n] - q_lens[n];
            const int64_t i0 = b * QB, npos = q_lens[n] - i0 < QB ? q_lens[n] - i0 : QB;
            const float *keys = key_cache + (h * num_slots + first_slots[n]) * head_dim;
            const float *values = value_cache + (h * num_slots + first_slots[n]) * head_dim;
            if (head_dim == 64)
                attend_block(64, query, num_heads, h, group, keys, values, q_starts[n] + i0, pos_start + i0, npos,
                             scale, out, scratch);
            else
                attend_block(128, query, num_heads, h, group, keys, values, q_starts[n] + i0, pos_start + i0, npos,
                             scale, out, scratch);
        }
        free(scratch);
    }
    free(work);
    return failed;
}
