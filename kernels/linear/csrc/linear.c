/* Dense projections on the CPU in float32: y[M][N] = x[M][K] W^T (+ bias), W [N][K] packed
 * once into panels of 32 output columns ([ceil(N/32)][K][32], zeros past N), so that one
 * step of the inner loop reads 32 weights in a row and each x value is broadcast once
 * against them. A tile of 8 rows x 32 columns keeps 16 vector accumulators in registers
 * (GCC's vector types: 2 zmm per row on AVX-512, 4 ymm on AVX2); K runs in blocks of 512
 * so a panel's block stays in L2 while every row of the chunk passes over it. Work is
 * shared out over torch's OpenMP threads by (panel, chunk of 64 rows), panel-major, so a
 * thread keeps its panels.
 *
 * Why not oneDNN (torch.ops.mkldnn._linear_pointwise, the previous path): on the small
 * shapes of a decode step it spends ~25 us a call before any arithmetic (primitive lookup,
 * descriptors) and ~0.5-1 ms the first time it meets each new row count; this kernel starts
 * in a few microseconds at any row count (measured on a 2-core AMD EPYC, 2026-12-03: 256 x
 * 256 at 8 rows 11 vs 32 us; 1408 x 256 at 8 rows 38 vs 51 us; at 2048 rows within ~10%).
 *
 * A gated MLP's gate/up projection ([gate; up], 2 x inter outputs) may be packed in pairs:
 * gate's panel i, then up's panel i (each half padded to whole panels on its own), so that
 * one unit of work holds a row's gate and up columns together: lg_linear_silu_mul_f32 then
 * writes silu(gate) * up straight from the registers (no [rows, 2 x inter] tensor), and
 * lg_linear_f32 still serves the plain product (`inter` > 0 says the layout is pairs).
 *
 * Multiply-adds are contracted into FMAs here (unlike the pointwise kernels, whose results
 * are bit for bit torch's): the sums run in another order than MKL's anyway, so results
 * agree with F.linear within float32 rounding, not bit for bit.
 */
#pragma GCC optimize("fp-contract=fast")
#include <stdint.h>
#include <string.h>

#include "lg_exp.h"

typedef float v16 __attribute__((vector_size(64)));

#define NR 32      /* output columns per panel: two vectors of 16 */
#define MR 8       /* rows per register tile */
#define KC 512     /* the K block a tile runs over before storing */
#define MC 64      /* rows per unit of work */

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* w [N][K] -> out [ceil(N/32)][K][32]: panel p, row k holds W[32p .. 32p+31][k]. */
void lg_linear_pack_f32(const float *w, int64_t n, int64_t k, float *out)
{
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < NR; j++) {
            const int64_t col = p * NR + j;
            float *dst = out + p * k * NR + j;
            if (col < n) {
                const float *src = w + col * k;
                for (int64_t i = 0; i < k; i++) dst[i * NR] = src[i];
            } else {
                for (int64_t i = 0; i < k; i++) dst[i * NR] = 0.f;
            }
        }
}

/* w [2 x inter][K] (gate rows, then up rows) -> out [ceil(inter/32)][2][K][32]: pair i holds
 * gate's panel i then up's panel i, each zero past inter. */
void lg_linear_pack_pairs_f32(const float *w, int64_t inter, int64_t k, float *out)
{
    const int64_t pairs = (inter + NR - 1) / NR;
    for (int64_t i = 0; i < pairs; i++)
        for (int half = 0; half < 2; half++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = i * NR + j;
                float *dst = out + ((i * 2 + half) * k) * NR + j;
                if (col < inter) {
                    const float *src = w + (half * inter + col) * k;
                    for (int64_t c = 0; c < k; c++) dst[c * NR] = src[c];
                } else {
                    for (int64_t c = 0; c < k; c++) dst[c * NR] = 0.f;
                }
            }
}

/* `mr` rows of x (row stride ldx) over `kc` of K against one panel block w [kc][32]; into y
 * (row stride ldy, `ncols` valid columns): stored when `first` (plus the bias), else added. */
static inline __attribute__((always_inline)) void tile(
    const int mr, const float *x, int64_t ldx, int64_t kc, const float *w,
    float *y, int64_t ldy, int64_t ncols, int first, const float *bias)
{
    v16 acc0[MR], acc1[MR];
    for (int r = 0; r < mr; r++) { acc0[r] = (v16){0}; acc1[r] = (v16){0}; }
    for (int64_t i = 0; i < kc; i++) {
        const v16 w0 = load16(w + i * NR), w1 = load16(w + i * NR + 16);
        for (int r = 0; r < mr; r++) {
            const v16 b = (v16){0} + x[r * ldx + i];
            acc0[r] += b * w0;
            acc1[r] += b * w1;
        }
    }
    for (int r = 0; r < mr; r++) {
        float part[NR];
        float *dst = ncols == NR ? y + r * ldy : part;   /* a last, partial panel: via `part` */
        if (ncols != NR) {
            for (int64_t j = 0; j < NR; j++) part[j] = (!first && j < ncols) ? y[r * ldy + j] : 0.f;
        }
        if (first) {
            if (bias) { acc0[r] += load16(bias); acc1[r] += load16(bias + 16); }
        } else {
            acc0[r] += load16(dst);
            acc1[r] += load16(dst + 16);
        }
        store16(dst, acc0[r]);
        store16(dst + 16, acc1[r]);
        if (ncols != NR) memcpy(y + r * ldy, part, (size_t)ncols * sizeof(float));
    }
}

/* y [m][n] = x [m][k] (contiguous) times the packed weight, plus bias [n] (NULL: none).
 * inter 0: the plain panels; inter > 0: the pairs layout of a [gate; up] weight, n = 2 inter. */
void lg_linear_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                   const float *bias, float *y, int64_t inter, int num_threads)
{
    const int64_t panels = inter ? 2 * ((inter + NR - 1) / NR) : (n + NR - 1) / NR;
    const int64_t chunks = (m + MC - 1) / MC;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (m * n * k > 32768)
    for (int64_t unit = 0; unit < panels * chunks; unit++) {
        const int64_t p = unit / chunks, c = unit % chunks;
        /* the panel's first output column, and how many of its 32 are real */
        const int64_t col = inter ? (p & 1) * inter + (p >> 1) * NR : p * NR;
        const int64_t end = inter ? (p & 1) * inter + inter : n;
        const int64_t ncols = end - col < NR ? end - col : NR;
        float panel_bias[NR];
        const float *b = NULL;
        if (bias) {
            for (int64_t j = 0; j < NR; j++) panel_bias[j] = j < ncols ? bias[col + j] : 0.f;
            b = panel_bias;
        }
        const int64_t row_end = (c + 1) * MC < m ? (c + 1) * MC : m;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kc = k - k0 < KC ? k - k0 : KC;
            const float *w = packed + (p * k + k0) * NR;
            const int first = k0 == 0;
            int64_t r = c * MC;
            for (; r + MR <= row_end; r += MR)
                tile(MR, x + r * k + k0, k, kc, w, y + r * n + col, n, ncols, first, b);
            const float *xr = x + r * k + k0;
            float *yr = y + r * n + col;
            switch (row_end - r) {   /* constant row counts: the accumulators stay in registers */
            case 7: tile(7, xr, k, kc, w, yr, n, ncols, first, b); break;
            case 6: tile(6, xr, k, kc, w, yr, n, ncols, first, b); break;
            case 5: tile(5, xr, k, kc, w, yr, n, ncols, first, b); break;
            case 4: tile(4, xr, k, kc, w, yr, n, ncols, first, b); break;
            case 3: tile(3, xr, k, kc, w, yr, n, ncols, first, b); break;
            case 2: tile(2, xr, k, kc, w, yr, n, ncols, first, b); break;
            case 1: tile(1, xr, k, kc, w, yr, n, ncols, first, b); break;
            default: break;
            }
        }
    }
}

/* out [m][inter] = silu(x W_gate^T) * (x W_up^T), W packed in pairs (lg_linear_pack_pairs_f32):
 * a gated MLP's activation from the registers that computed it. silu(g) = g / (1 + e^-g), as
 * the pointwise kernel computes it. Tiles of 4 rows x (32 gate + 32 up) columns over the whole
 * of K (the gate and up sums must be complete before the activation). */
#define MR_PAIR 4
static inline __attribute__((always_inline)) void pair_tile(
    const int mr, const float *x, int64_t k, const float *wg, const float *wu,
    float *out, int64_t inter, int64_t ncols)
{
    v16 g0[MR_PAIR], g1[MR_PAIR], u0[MR_PAIR], u1[MR_PAIR];
    for (int r = 0; r < mr; r++) { g0[r] = g1[r] = u0[r] = u1[r] = (v16){0}; }
    for (int64_t i = 0; i < k; i++) {
        const v16 a0 = load16(wg + i * NR), a1 = load16(wg + i * NR + 16);
        const v16 b0 = load16(wu + i * NR), b1 = load16(wu + i * NR + 16);
        for (int r = 0; r < mr; r++) {
            const v16 xv = (v16){0} + x[r * k + i];
            g0[r] += xv * a0; g1[r] += xv * a1;
            u0[r] += xv * b0; u1[r] += xv * b1;
        }
    }
    for (int r = 0; r < mr; r++) {
        float g[NR], u[NR], o[NR];
        store16(g, g0[r]); store16(g + 16, g1[r]);
        store16(u, u0[r]); store16(u + 16, u1[r]);
        #pragma omp simd
        for (int j = 0; j < NR; j++) o[j] = g[j] / (1.0f + lg_exp(-g[j])) * u[j];
        memcpy(out + r * inter, o, (size_t)ncols * sizeof(float));
    }
}

void lg_linear_silu_mul_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t inter,
                            float *out, int num_threads)
{
    const int64_t pairs = (inter + NR - 1) / NR, chunks = (m + MC - 1) / MC;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (m * inter * k > 16384)
    for (int64_t unit = 0; unit < pairs * chunks; unit++) {
        const int64_t p = unit / chunks, c = unit % chunks;
        const int64_t col = p * NR, ncols = inter - col < NR ? inter - col : NR;
        const float *wg = packed + (p * 2) * k * NR, *wu = wg + k * NR;
        const int64_t row_end = (c + 1) * MC < m ? (c + 1) * MC : m;
        int64_t r = c * MC;
        for (; r + MR_PAIR <= row_end; r += MR_PAIR)
            pair_tile(MR_PAIR, x + r * k, k, wg, wu, out + r * inter + col, inter, ncols);
        const float *xr = x + r * k;
        float *orow = out + r * inter + col;
        switch (row_end - r) {
        case 3: pair_tile(3, xr, k, wg, wu, orow, inter, ncols); break;
        case 2: pair_tile(2, xr, k, wg, wu, orow, inter, ncols); break;
        case 1: pair_tile(1, xr, k, wg, wu, orow, inter, ncols); break;
        default: break;
        }
    }
}
