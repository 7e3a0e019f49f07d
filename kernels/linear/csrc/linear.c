/* Dense projections on the CPU in float32: y[M][N] = x[M][K] W^T (+ bias), W [N][K] packed
 * once into panels of 32 output columns ([ceil(N/32)][K][32], zeros past N), so that one
 * step of the inner loop reads 32 weights in a row and each x value is broadcast once
 * against them. A tile of 6 rows x two panels keeps 24 vector accumulators in registers
 * (GCC's vector types: 2 zmm per row and panel on AVX-512, 4 ymm on AVX2; a lone last panel
 * takes 8 rows x 32); K runs in blocks of 512 so a panel's block stays in L2 while every
 * row of the chunk passes over it. Work is shared out over torch's OpenMP threads by (two
 * panels, chunk of 60 rows), panel-major, so a thread keeps its panels.
 *
 * Why not oneDNN (torch.ops.mkldnn._linear_pointwise): it spends a fixed cost per call before
 * any arithmetic (primitive lookup, descriptors) and a larger one the first time it meets each
 * new row count, which on the small shapes of a decode step outweighs the arithmetic; this
 * kernel has no per-call setup at any row count and keeps up with oneDNN on large ones.
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

/* One row's 32 columns of a panel into y (`ncols` of them real): stored when `first` (plus the
 * panel's bias, NULL: none), else added to what is there. */
static inline __attribute__((always_inline)) void finish_row(
    float *y, v16 lo, v16 hi, int64_t ncols, int first, const float *bias)
{
    float part[NR];
    float *dst = ncols == NR ? y : part;   /* a last, partial panel: via `part` */
    if (ncols != NR) {
        for (int64_t j = 0; j < NR; j++) part[j] = (!first && j < ncols) ? y[j] : 0.f;
    }
    if (first) {
        if (bias) { lo += load16(bias); hi += load16(bias + 16); }
    } else {
        lo += load16(dst);
        hi += load16(dst + 16);
    }
    store16(dst, lo);
    store16(dst + 16, hi);
    if (ncols != NR) memcpy(y, part, (size_t)ncols * sizeof(float));
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
    for (int r = 0; r < mr; r++) finish_row(y + r * ldy, acc0[r], acc1[r], ncols, first, bias);
}

/* As `tile` over two panels at once (6 rows x 64 columns: 24 vector accumulators, each x
 * value broadcast once against 64 weights where an 8 x 32 tile's meets 32).
 * The two panels' outputs go to ya and yb (adjacent, or apart in the pairs layout). */
#define MR2 6
static inline __attribute__((always_inline)) void tile2(
    const int mr, const float *x, int64_t ldx, int64_t kc, const float *wa, const float *wb,
    float *ya, float *yb, int64_t ldy, int64_t na, int64_t nb, int first, const float *ba, const float *bb)
{
    v16 a0[MR2], a1[MR2], b0[MR2], b1[MR2];
    for (int r = 0; r < mr; r++) { a0[r] = a1[r] = b0[r] = b1[r] = (v16){0}; }
    for (int64_t i = 0; i < kc; i++) {
        const v16 wa0 = load16(wa + i * NR), wa1 = load16(wa + i * NR + 16);
        const v16 wb0 = load16(wb + i * NR), wb1 = load16(wb + i * NR + 16);
        for (int r = 0; r < mr; r++) {
            const v16 v = (v16){0} + x[r * ldx + i];
            a0[r] += v * wa0; a1[r] += v * wa1;
            b0[r] += v * wb0; b1[r] += v * wb1;
        }
    }
    for (int r = 0; r < mr; r++) {
        finish_row(ya + r * ldy, a0[r], a1[r], na, first, ba);
        finish_row(yb + r * ldy, b0[r], b1[r], nb, first, bb);
    }
}

/* y [m][n] = x [m][k] (contiguous) times the packed weight, plus bias [n] (NULL: none).
 * inter 0: the plain panels; inter > 0: the pairs layout of a [gate; up] weight, n = 2 inter.
 * Units of work: two adjacent panels (one where the count is odd) x a chunk of MC2 rows. */
#define MC2 60        /* rows per unit of work: whole 6-row tiles */

/* panel p's first output column, and how many of its 32 are real */
static inline int64_t panel_col(int64_t p, int64_t n, int64_t inter) {
    return inter ? (p & 1) * inter + (p >> 1) * NR : p * NR;
}
static inline int64_t panel_cols(int64_t p, int64_t n, int64_t inter) {
    const int64_t col = panel_col(p, n, inter), end = inter ? (p & 1) * inter + inter : n;
    return end - col < NR ? end - col : NR;
}

void lg_linear_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                   const float *bias, float *y, int64_t inter, int num_threads)
{
    const int64_t panels = inter ? 2 * ((inter + NR - 1) / NR) : (n + NR - 1) / NR;
    const int64_t groups = (panels + 1) / 2, chunks = (m + MC2 - 1) / MC2;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (m * n * k > 32768)
    for (int64_t unit = 0; unit < groups * chunks; unit++) {
        const int64_t g = unit / chunks, c = unit % chunks;
        const int64_t pa = 2 * g, pb = 2 * g + 1 < panels ? 2 * g + 1 : -1;
        const int64_t ca = panel_col(pa, n, inter), na = panel_cols(pa, n, inter);
        const int64_t cb = pb >= 0 ? panel_col(pb, n, inter) : 0, nb = pb >= 0 ? panel_cols(pb, n, inter) : 0;
        float bias_a[NR], bias_b[NR];
        const float *ba = NULL, *bb = NULL;
        if (bias) {
            for (int64_t j = 0; j < NR; j++) bias_a[j] = j < na ? bias[ca + j] : 0.f;
            for (int64_t j = 0; j < NR; j++) bias_b[j] = j < nb ? bias[cb + j] : 0.f;
            ba = bias_a;
            bb = bias_b;
        }
        const int64_t row_end = (c + 1) * MC2 < m ? (c + 1) * MC2 : m;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kc = k - k0 < KC ? k - k0 : KC;
            const float *wa = packed + (pa * k + k0) * NR;
            const float *wb = pb >= 0 ? packed + (pb * k + k0) * NR : NULL;
            const int first = k0 == 0;
            int64_t r = c * MC2;
            if (wb) {
                for (; r + MR2 <= row_end; r += MR2)
                    tile2(MR2, x + r * k + k0, k, kc, wa, wb, y + r * n + ca, y + r * n + cb, n, na, nb, first, ba, bb);
                const float *xr = x + r * k + k0;
                float *yra = y + r * n + ca, *yrb = y + r * n + cb;
                switch (row_end - r) {   /* constant row counts: the accumulators stay in registers */
                case 5: tile2(5, xr, k, kc, wa, wb, yra, yrb, n, na, nb, first, ba, bb); break;
                case 4: tile2(4, xr, k, kc, wa, wb, yra, yrb, n, na, nb, first, ba, bb); break;
                case 3: tile2(3, xr, k, kc, wa, wb, yra, yrb, n, na, nb, first, ba, bb); break;
                case 2: tile2(2, xr, k, kc, wa, wb, yra, yrb, n, na, nb, first, ba, bb); break;
                case 1: tile2(1, xr, k, kc, wa, wb, yra, yrb, n, na, nb, first, ba, bb); break;
                default: break;
                }
                continue;
            }
            for (; r + MR <= row_end; r += MR)
                tile(MR, x + r * k + k0, k, kc, wa, y + r * n + ca, n, na, first, ba);
            const float *xr = x + r * k + k0;
            float *yr = y + r * n + ca;
            switch (row_end - r) {
            case 7: tile(7, xr, k, kc, wa, yr, n, na, first, ba); break;
            case 6: tile(6, xr, k, kc, wa, yr, n, na, first, ba); break;
            case 5: tile(5, xr, k, kc, wa, yr, n, na, first, ba); break;
            case 4: tile(4, xr, k, kc, wa, yr, n, na, first, ba); break;
            case 3: tile(3, xr, k, kc, wa, yr, n, na, first, ba); break;
            case 2: tile(2, xr, k, kc, wa, yr, n, na, first, ba); break;
            case 1: tile(1, xr, k, kc, wa, yr, n, na, first, ba); break;
            default: break;
            }
        }
    }
}

/* out [m][inter] = silu(x W_gate^T) * (x W_up^T), W packed in pairs (lg_linear_pack_pairs_f32):
 * a gated MLP's activation from the registers that computed it. silu(g) = g / (1 + e^-g), as
 * the pointwise kernel computes it. Tiles of 6 rows x (32 gate + 32 up) columns (24 vector
 * accumulators, so that each load of weights serves 6 rows rather than 4)
 * over the whole of K (the gate and up sums must be complete before the activation). */
#define MR_PAIR 6
#define MC_PAIR 60   /* rows per unit of work: whole tiles */
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
    const int64_t pairs = (inter + NR - 1) / NR, chunks = (m + MC_PAIR - 1) / MC_PAIR;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (m * inter * k > 16384)
    for (int64_t unit = 0; unit < pairs * chunks; unit++) {
        const int64_t p = unit / chunks, c = unit % chunks;
        const int64_t col = p * NR, ncols = inter - col < NR ? inter - col : NR;
        const float *wg = packed + (p * 2) * k * NR, *wu = wg + k * NR;
        const int64_t row_end = (c + 1) * MC_PAIR < m ? (c + 1) * MC_PAIR : m;
        int64_t r = c * MC_PAIR;
        for (; r + MR_PAIR <= row_end; r += MR_PAIR)
            pair_tile(MR_PAIR, x + r * k, k, wg, wu, out + r * inter + col, inter, ncols);
        const float *xr = x + r * k;
        float *orow = out + r * inter + col;
        switch (row_end - r) {
        case 5: pair_tile(5, xr, k, wg, wu, orow, inter, ncols); break;
        case 4: pair_tile(4, xr, k, wg, wu, orow, inter, ncols); break;
        case 3: pair_tile(3, xr, k, wg, wu, orow, inter, ncols); break;
        case 2: pair_tile(2, xr, k, wg, wu, orow, inter, ncols); break;
        case 1: pair_tile(1, xr, k, wg, wu, orow, inter, ncols); break;
        default: break;
        }
    }
}
