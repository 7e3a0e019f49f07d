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

/* Vectors as wide as the machine's registers: AVX-512's zmm (16 floats) or AVX2's ymm (8).
 * A vector type wider than the registers is lowered through the stack: the 64-byte vectors of
 * an AVX-512 build ran ~25x slower than sgemm on an AVX2 machine. */
#if defined(__AVX512F__)
#define VL 16
#define WIDE 1
#else
#define VL 8
#define WIDE 0
#endif
typedef float vec __attribute__((vector_size(VL * 4)));

#define NR 32          /* output columns per panel */
#define NV (NR / VL)   /* vectors per panel row: 2 zmm or 4 ymm */
/* rows per register tile: 8 x 2 zmm (16 of 32 registers) or 3 x 4 ymm (12 of 16) */
#define MR (WIDE ? 8 : 3)
#define KC 512         /* the K block a tile runs over before storing */

static inline __attribute__((always_inline)) vec loadv(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline __attribute__((always_inline)) void storev(float *p, vec v) { memcpy(p, &v, sizeof v); }

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
    float *y, const vec *acc, int64_t ncols, int first, const float *bias)
{
    float part[NR];
    float *dst = ncols == NR ? y : part;   /* a last, partial panel: via `part` */
    if (ncols != NR) {
        for (int64_t j = 0; j < NR; j++) part[j] = (!first && j < ncols) ? y[j] : 0.f;
    }
    for (int v = 0; v < NV; v++) {
        vec a = acc[v];
        if (first) {
            if (bias) a += loadv(bias + v * VL);
        } else {
            a += loadv(dst + v * VL);
        }
        storev(dst + v * VL, a);
    }
    if (ncols != NR) memcpy(y, part, (size_t)ncols * sizeof(float));
}

/* `mr` rows of x (row stride ldx) over `kc` of K against one panel block w [kc][32]; into y
 * (row stride ldy, `ncols` valid columns): stored when `first` (plus the bias), else added. */
static inline __attribute__((always_inline)) void tile(
    const int mr, const float *x, int64_t ldx, int64_t kc, const float *w,
    float *y, int64_t ldy, int64_t ncols, int first, const float *bias)
{
    vec acc[MR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = (vec){0};
    for (int64_t i = 0; i < kc; i++) {
        vec wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = loadv(w + i * NR + v * VL);
        for (int r = 0; r < mr; r++) {
            const vec b = (vec){0} + x[r * ldx + i];
            for (int v = 0; v < NV; v++) acc[r][v] += b * wv[v];
        }
    }
    for (int r = 0; r < mr; r++) finish_row(y + r * ldy, acc[r], ncols, first, bias);
}

/* AVX-512: as `tile` over two panels at once (6 rows x 64 columns: 24 vector accumulators,
 * each x value broadcast once against 64 weights where an 8 x 32 tile's meets 32).
 * The two panels' outputs go to ya and yb (adjacent, or apart in the pairs layout). */
#define MR2 6
static inline __attribute__((always_inline)) void tile2(
    const int mr, const float *x, int64_t ldx, int64_t kc, const float *wa, const float *wb,
    float *ya, float *yb, int64_t ldy, int64_t na, int64_t nb, int first, const float *ba, const float *bb)
{
    vec a[MR2][NV], b[MR2][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) a[r][v] = b[r][v] = (vec){0};
    for (int64_t i = 0; i < kc; i++) {
        vec wav[NV], wbv[NV];
        for (int v = 0; v < NV; v++) {
            wav[v] = loadv(wa + i * NR + v * VL);
            wbv[v] = loadv(wb + i * NR + v * VL);
        }
        for (int r = 0; r < mr; r++) {
            const vec xv = (vec){0} + x[r * ldx + i];
            for (int v = 0; v < NV; v++) { a[r][v] += xv * wav[v]; b[r][v] += xv * wbv[v]; }
        }
    }
    for (int r = 0; r < mr; r++) {
        finish_row(ya + r * ldy, a[r], na, first, ba);
        finish_row(yb + r * ldy, b[r], nb, first, bb);
    }
}

/* y [m][n] = x [m][k] (contiguous) times the packed weight, plus bias [n] (NULL: none).
 * inter 0: the plain panels; inter > 0: the pairs layout of a [gate; up] weight, n = 2 inter.
 * Units of work: two adjacent panels (one where the count is odd) x a chunk of MC2 rows. */
#define MC2 60        /* rows per unit of work: whole 6-row (and 3-row) tiles */

/* panel p's first output column, and how many of its 32 are real */
static inline int64_t panel_col(int64_t p, int64_t n, int64_t inter) {
    return inter ? (p & 1) * inter + (p >> 1) * NR : p * NR;
}
static inline int64_t panel_cols(int64_t p, int64_t n, int64_t inter) {
    const int64_t col = panel_col(p, n, inter), end = inter ? (p & 1) * inter + inter : n;
    return end - col < NR ? end - col : NR;
}

/* rows [r, row_end) of x over one panel block w [kc][32] into y's columns from `col` (`ncols`
 * real), in tiles of MR rows and one of the rest (constant row counts: the accumulators stay
 * in registers) */
static void panel_rows(const float *x, int64_t k, int64_t k0, int64_t kc, const float *w, float *y,
                       int64_t n, int64_t col, int64_t ncols, int64_t r, int64_t row_end, int first,
                       const float *bias)
{
    for (; r + MR <= row_end; r += MR)
        tile(MR, x + r * k + k0, k, kc, w, y + r * n + col, n, ncols, first, bias);
    const float *xr = x + r * k + k0;
    float *yr = y + r * n + col;
    switch (row_end - r) {
#if WIDE
    case 7: tile(7, xr, k, kc, w, yr, n, ncols, first, bias); break;
    case 6: tile(6, xr, k, kc, w, yr, n, ncols, first, bias); break;
    case 5: tile(5, xr, k, kc, w, yr, n, ncols, first, bias); break;
    case 4: tile(4, xr, k, kc, w, yr, n, ncols, first, bias); break;
    case 3: tile(3, xr, k, kc, w, yr, n, ncols, first, bias); break;
#endif
    case 2: tile(2, xr, k, kc, w, yr, n, ncols, first, bias); break;
    case 1: tile(1, xr, k, kc, w, yr, n, ncols, first, bias); break;
    default: break;
    }
}

/* AVX-512: rows [r, row_end) over two panels at once in `tile2`s */
static void panel_pair_rows(const float *x, int64_t k, int64_t k0, int64_t kc, const float *wa,
                            const float *wb, float *y, int64_t n, int64_t ca, int64_t cb, int64_t na,
                            int64_t nb, int64_t r, int64_t row_end, int first, const float *ba,
                            const float *bb)
{
    for (; r + MR2 <= row_end; r += MR2)
        tile2(MR2, x + r * k + k0, k, kc, wa, wb, y + r * n + ca, y + r * n + cb, n, na, nb, first, ba, bb);
    const float *xr = x + r * k + k0;
    float *yra = y + r * n + ca, *yrb = y + r * n + cb;
    switch (row_end - r) {
    case 5: tile2(5, xr, k, kc, wa, wb, yra, yrb, n, na, nb, first, ba, bb); break;
    case 4: tile2(4, xr, k, kc, wa, wb, yra, yrb, n, na, nb, first, ba, bb); break;
    case 3: tile2(3, xr, k, kc, wa, wb, yra, yrb, n, na, nb, first, ba, bb); break;
    case 2: tile2(2, xr, k, kc, wa, wb, yra, yrb, n, na, nb, first, ba, bb); break;
    case 1: tile2(1, xr, k, kc, wa, wb, yra, yrb, n, na, nb, first, ba, bb); break;
    default: break;
    }
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
            const int first = k0 == 0, r = c * MC2;
            if (WIDE && wb) {
                panel_pair_rows(x, k, k0, kc, wa, wb, y, n, ca, cb, na, nb, r, row_end, first, ba, bb);
                continue;
            }
            panel_rows(x, k, k0, kc, wa, y, n, ca, na, r, row_end, first, ba);
            if (wb)      /* AVX2: the second panel on its own */
                panel_rows(x, k, k0, kc, wb, y, n, cb, nb, r, row_end, first, bb);
        }
    }
}

/* out [m][inter] = silu(x W_gate^T) * (x W_up^T), W packed in pairs (lg_linear_pack_pairs_f32):
 * a gated MLP's activation from the registers that computed it. silu(g) = g / (1 + e^-g), as
 * the pointwise kernel computes it. Over the whole of K (the gate and up sums must be complete
 * before the activation): on AVX-512, tiles of 6 rows x (32 gate + 32 up) columns (24 vector
 * accumulators, so that each load of weights serves 6 rows rather than 4); on AVX2, 3 rows'
 * gate sums then their up sums (12 accumulators each), the same sums in the same order. */
#define MR_PAIR (WIDE ? 6 : 3)
#define MC_PAIR 60   /* rows per unit of work: whole tiles */

static inline __attribute__((always_inline)) void pair_tile(
    const int mr, const float *x, int64_t k, const float *wg, const float *wu,
    float *out, int64_t inter, int64_t ncols)
{
    float g[MR_PAIR][NR], u[MR_PAIR][NR];
#if WIDE
    vec g0[MR_PAIR][NV], u0[MR_PAIR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) g0[r][v] = u0[r][v] = (vec){0};
    for (int64_t i = 0; i < k; i++) {
        vec a[NV], b[NV];
        for (int v = 0; v < NV; v++) { a[v] = loadv(wg + i * NR + v * VL); b[v] = loadv(wu + i * NR + v * VL); }
        for (int r = 0; r < mr; r++) {
            const vec xv = (vec){0} + x[r * k + i];
            for (int v = 0; v < NV; v++) { g0[r][v] += xv * a[v]; u0[r][v] += xv * b[v]; }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) { storev(g[r] + v * VL, g0[r][v]); storev(u[r] + v * VL, u0[r][v]); }
#else
    /* each sum over the whole of K in one tile (no bias, nothing to add to) */
    tile(mr, x, k, k, wg, g[0], NR, NR, 1, NULL);
    tile(mr, x, k, k, wu, u[0], NR, NR, 1, NULL);
#endif
    for (int r = 0; r < mr; r++) {
        float o[NR];
        #pragma omp simd
        for (int j = 0; j < NR; j++) o[j] = g[r][j] / (1.0f + lg_exp(-g[r][j])) * u[r][j];
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
#if WIDE
        case 5: pair_tile(5, xr, k, wg, wu, orow, inter, ncols); break;
        case 4: pair_tile(4, xr, k, wg, wu, orow, inter, ncols); break;
        case 3: pair_tile(3, xr, k, wg, wu, orow, inter, ncols); break;
#endif
        case 2: pair_tile(2, xr, k, wg, wu, orow, inter, ncols); break;
        case 1: pair_tile(1, xr, k, wg, wu, orow, inter, ncols); break;
        default: break;
        }
    }
}
