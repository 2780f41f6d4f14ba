/* fp32 y = x @ W^T + b for the few rows of a decode step, streaming W once from a panel-packed copy.
 *
 * At decode a step multiplies a handful of token rows by every weight of the model, so its time is the time to
 * read the weights. The BLAS GEMM (MKL in the torch wheel) packs W on every call and, on the 2-core AVX2 EPYC
 * this was written on, reads SmolLM2-135M's 0.54 GB of fp32 weights in ~100 ms at 8 rows against ~42 ms here
 * (the memory reads ~17 GB/s). W is packed once at load into panels of NR=16 output columns: panel p is
 * [K][16] floats, zero-padded past N. For each panel, k chunk by k chunk (in L1), the MR=4-row blocks of x run over
 * it, each keeping a 4x16 tile of y in registers (8 AVX2 accumulators), one broadcast x value and two W vectors per k.
 * Panels are split across threads. Where the build has no AVX2+FMA the same loop runs in scalar C. Calls of more
 * rows take a blocked loop (below: x packed per call, GotoBLAS's blocking) that gives every row the same floats.
 *
 * Summation is in k order per output, with FMA: results differ from MKL's in the last bits (the dispatcher in
 * ucm_kernels/cpu/skinny_gemm.py uses this only for the row counts the start-up calibration measured faster).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entry_points.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SG_AVX2 1
#endif

#define NR 16
#define MR 4

int32_t ucm_skinny_gemm_vectorized(void) {
#ifdef SG_AVX2
    return 1;
#else
    return 0;
#endif
}

/* w [N, K] row-major -> wp [ceil(N / NR)][K][NR]. */
void ucm_pack_panels(const float *w, float *wp, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = wp + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                dst[kk * NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
    }
}

#ifdef SG_AVX2
/* A 4x16 tile's accumulators (named: an array of them is kept on the stack by gcc, a store per FMA), its rows x0..x3,
 * one k step against the panel row's two vectors, and the store. */
#define TILE_OPEN(out, first)                                                                  \
    __m256 a00, a01, a10, a11, a20, a21, a30, a31;                                            \
    if (first) {                                                                              \
        a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = _mm256_setzero_ps();                  \
    } else {                                                                                  \
        a00 = _mm256_loadu_ps(out[0]), a01 = _mm256_loadu_ps(out[0] + 8);                     \
        a10 = _mm256_loadu_ps(out[1]), a11 = _mm256_loadu_ps(out[1] + 8);                     \
        a20 = _mm256_loadu_ps(out[2]), a21 = _mm256_loadu_ps(out[2] + 8);                     \
        a30 = _mm256_loadu_ps(out[3]), a31 = _mm256_loadu_ps(out[3] + 8);                     \
    }
#define TILE_STEP(kk, w0, w1)                   \
    do {                                        \
        __m256 b = _mm256_broadcast_ss(x0 + kk); \
        a00 = _mm256_fmadd_ps(b, w0, a00);      \
        a01 = _mm256_fmadd_ps(b, w1, a01);      \
        b = _mm256_broadcast_ss(x1 + kk);       \
        a10 = _mm256_fmadd_ps(b, w0, a10);      \
        a11 = _mm256_fmadd_ps(b, w1, a11);      \
        b = _mm256_broadcast_ss(x2 + kk);       \
        a20 = _mm256_fmadd_ps(b, w0, a20);      \
        a21 = _mm256_fmadd_ps(b, w1, a21);      \
        b = _mm256_broadcast_ss(x3 + kk);       \
        a30 = _mm256_fmadd_ps(b, w0, a30);      \
        a31 = _mm256_fmadd_ps(b, w1, a31);      \
    } while (0)
#define TILE_CLOSE(out)                                                         \
    do {                                                                        \
        _mm256_storeu_ps(out[0], a00), _mm256_storeu_ps(out[0] + 8, a01);       \
        _mm256_storeu_ps(out[1], a10), _mm256_storeu_ps(out[1] + 8, a11);       \
        _mm256_storeu_ps(out[2], a20), _mm256_storeu_ps(out[2] + 8, a21);       \
        _mm256_storeu_ps(out[3], a30), _mm256_storeu_ps(out[3] + 8, a31);       \
    } while (0)
#endif

/* A tile's MR row pointers: rows past mr repeat row 0 (computed, never stored). */
#define TILE_ROWS(x, ldx, mr)                                                       \
    const float *x0 = x, *x1 = mr > 1 ? x + ldx : x, *x2 = mr > 2 ? x + 2 * ldx : x, \
                *x3 = mr > 3 ? x + 3 * ldx : x

/* The panel's bytes `ahead` past k row kk's (row_bytes a row) into L1, one line at a time: from the few-row loop's
 * first tile (the others read the chunk it brought), SG_PF_TILES; from the one-row loop, which reads four panels at a
 * time, SG_PF_ONE_ROW. A decode step's few rows spend a few cycles a panel row, and a thread reading one panel at a
 * time waited on each load (70% of the 4-row loop's samples on its weight loads; the hardware prefetchers did not run
 * far enough ahead). AVX2 build (-march=x86-64-v3) on the 2-core Xeon with AMX, Qwen2.5-0.5B's 24 layers' shapes,
 * builds alternated, 4 / 8 rows, none -> 2 KB ahead: bf16 panels 53.6 / 66.8 -> 39.4 / 50.2 ms, fp32 91.1 / 104.4 ->
 * 70.9 / 79.7, 4-bit 52.7 / 63.4 -> 29.7 / 53.7; 512 bytes ahead lost, 4 and 8 KB tied 2 KB, and a second panel read
 * alongside (two streams a thread, chunk by chunk) tied or lost. The same build on the 2-core Zen 4 EPYC, 2 KB for
 * both -> 256 bytes for one row and 4 KB for tiles, median of 8 alternated rounds, 1 / 2 / 4 / 8 rows: Llama-1B's
 * layers in bf16 panels 1.19 / 1.12 / 1.09 / 1.10x (one row at 256 alone 1.22x); SmolLM2's 4-bit layers 1.01 / 0.99 /
 * 0.99 / 0.99x, its 8-bit lm_head 1.03 / - / 1.01 / 0.98x, fp32 panels 1.02 / - / 1.05 / 1.03x. A hint: the sums do
 * not change. */
#define SG_PF_TILES 4096
#define SG_PF_ONE_ROW 256
#define SG_PREFETCH(row, kk, row_bytes, on, ahead)                                                                     \
    do {                                                                                                               \
        if ((on) && ((kk) * (row_bytes)) % 64 == 0) __builtin_prefetch((const char *)(row) + (ahead), 0, 3);          \
    } while (0)

/* One 4x16 tile over k in [0, kc): rows 0..mr of x (row stride ldx) against panel chunk wp [kc][16];
 * out[r][j] = (first ? 0 : out[r][j]) + sum_k x[r][k] * wp[k][j], one FMA chain per output in k order, so a tile
 * run chunk by chunk gives the floats of one run over all of k. */
static inline void tile_chunk(const float *x, int64_t ldx, int64_t kc, int64_t mr, const float *wp, float out[MR][NR],
                              int first, int prefetch) {
    TILE_ROWS(x, ldx, mr);
#ifdef SG_AVX2
    TILE_OPEN(out, first);
    for (int64_t kk = 0; kk < kc; kk++) {
        SG_PREFETCH(wp + kk * NR, kk, NR * 4, prefetch, SG_PF_TILES);
        const __m256 w0 = _mm256_loadu_ps(wp + kk * NR), w1 = _mm256_loadu_ps(wp + kk * NR + 8);
        TILE_STEP(kk, w0, w1);
    }
    TILE_CLOSE(out);
#else
    (void)prefetch;
    const float *rows[MR] = {x0, x1, x2, x3};
    if (first)
        for (int64_t r = 0; r < MR; r++)
            for (int64_t j = 0; j < NR; j++) out[r][j] = 0.0f;
    for (int64_t kk = 0; kk < kc; kk++)
        for (int64_t r = 0; r < MR; r++)
            for (int64_t j = 0; j < NR; j++) out[r][j] += rows[r][kk] * wp[kk * NR + j];
#endif
}

/* ---------------------------------------------------------------- 4-bit weights (ucm_kernels/cpu/q4_panels.py)
 *
 * A weight whose every 32-wide block of a row is exactly d * q + m (q in 0..15, fp32 mul then add: GGUF's
 * Q4_1, which the embedded model's layers are) is packed as 4-bit panels: qp [panels][K][8] bytes, byte j of
 * row k holding output j's q in its low nibble and output j + 8's in its high one, and dm [panels][K / 32][32]
 * floats, the 16 outputs' d then their m for each block of 32 k. Expanded with the same two roundings, a weight
 * is the float the fp32 panels hold, so results are bit-identical to ucm_skinny_gemm on the fp32 weight, for 0.16x
 * the memory reads (a decode step streams every weight). A few-row tile expands each k's 16 weights in registers as
 * it goes (tile_chunk_expanding); the blocked loop, and the scalar build, expand a panel's k chunk into scratch and
 * run the fp32 tiles over it. */

#define QB 32 /* k per scale block */

#ifdef SG_AVX2
/* A 4-bit block's 16 d and 16 m, and one k row of it as its 16 weights, w0 (outputs 0-7) and w1 (8-15). */
typedef struct {
    __m256 d0, d1, m0, m1;
} q4_scales;

static inline q4_scales q4_scales_at(const float *dm) {
    return (q4_scales){_mm256_loadu_ps(dm), _mm256_loadu_ps(dm + 8), _mm256_loadu_ps(dm + NR),
                       _mm256_loadu_ps(dm + NR + 8)};
}

static inline void q4_row(const uint8_t *q, const q4_scales *s, __m256 *w0, __m256 *w1) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    *w0 = _mm256_add_ps(_mm256_mul_ps(q0, s->d0), s->m0);
    *w1 = _mm256_add_ps(_mm256_mul_ps(q1, s->d1), s->m1);
}
#endif

static void expand_q4_panel(const uint8_t *qp, const float *dm, int64_t k, float *dst) {
    for (int64_t kb = 0; kb < k / QB; kb++) {
        const float *d = dm + kb * 2 * NR;
        const uint8_t *q = qp + kb * QB * (NR / 2);
        float *w = dst + kb * QB * NR;
#ifdef SG_AVX2
        const q4_scales sc = q4_scales_at(d);
        for (int64_t kk = 0; kk < QB; kk++) {
            __m256 w0, w1;
            q4_row(q + kk * (NR / 2), &sc, &w0, &w1);
            _mm256_storeu_ps(w + kk * NR, w0);
            _mm256_storeu_ps(w + kk * NR + 8, w1);
        }
#else
        const float *mn = d + NR;
        for (int64_t kk = 0; kk < QB; kk++)
            for (int64_t j = 0; j < NR / 2; j++) {
                const uint8_t byte = q[kk * (NR / 2) + j];
                w[kk * NR + j] = (float)(byte & 0xF) * d[j] + mn[j];
                w[kk * NR + j + NR / 2] = (float)(byte >> 4) * d[j + NR / 2] + mn[j + NR / 2];
            }
#endif
    }
}

/* ---------------------------------------------------------------- 8-bit weights (ucm_kernels/cpu/q8_panels.py)
 *
 * A weight whose every 32-wide block of a row is exactly d * q (q in -127..127, fp32 product: GGUF's Q8_0, which
 * the embedded model's tied embedding and lm_head are) is packed as qp [panels][K][16] int8, the 16 outputs' q at
 * each k, and d [panels][K / 32][16] floats. Expanding a panel (one exact product per weight) gives the floats the
 * fp32 panels hold, so results are bit-identical to ucm_skinny_gemm for 0.27x the memory reads. */

#ifdef SG_AVX2
/* One k row of an 8-bit block as its 16 weights, given the block's 16 d as d0 (outputs 0-7) and d1 (8-15). */
static inline void q8_row(const int8_t *q, __m256 d0, __m256 d1, __m256 *w0, __m256 *w1) {
    *w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))), d0);
    *w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)))), d1);
}
#endif

static void expand_q8_panel(const uint8_t *qp_bytes, const float *d, int64_t k, float *dst) {
    const int8_t *qp = (const int8_t *)qp_bytes;
    for (int64_t kb = 0; kb < k / QB; kb++) {
        const float *dd = d + kb * NR;
        const int8_t *q = qp + kb * QB * NR;
        float *w = dst + kb * QB * NR;
#ifdef SG_AVX2
        const __m256 d0 = _mm256_loadu_ps(dd), d1 = _mm256_loadu_ps(dd + 8);
        for (int64_t kk = 0; kk < QB; kk++) {
            __m256 w0, w1;
            q8_row(q + kk * NR, d0, d1, &w0, &w1);
            _mm256_storeu_ps(w + kk * NR, w0);
            _mm256_storeu_ps(w + kk * NR + 8, w1);
        }
#else
        for (int64_t kk = 0; kk < QB; kk++)
            for (int64_t j = 0; j < NR; j++) w[kk * NR + j] = (float)q[kk * NR + j] * dd[j];
#endif
    }
}

/* ---------------------------------------------------------------- bf16 weights (ucm_kernels/cpu/bf16_panels.py)
 *
 * A weight whose every value is exactly a bf16 (a bf16 checkpoint served in fp32, on a CPU without bf16 arithmetic)
 * is packed as bp [panels][K][16] bf16, each float's upper half, and expanded by putting it back there: the fp32
 * panels' floats, so results are bit-identical to ucm_skinny_gemm for half the memory reads. A k row's 16 values
 * are stored in BF16_SLOT's order, so that interleaving the row with zeros (one shuffle per 8 weights in AVX2, in
 * 128-bit lanes) gives outputs 0-7 and 8-15 in order. */

static const int8_t BF16_SLOT[NR] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15}; /* slot -> output */

#ifdef SG_AVX2
/* One k row of bf16 panel as its 16 weights, w0 (outputs 0-7) and w1 (8-15). */
static inline void bf16_row(const uint16_t *b, __m256 *w0, __m256 *w1) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)b), zero = _mm256_setzero_si256();
    *w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    *w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}
#endif

static void expand_bf16_panel(const uint16_t *bp, int64_t k, float *dst) {
    for (int64_t kk = 0; kk < k; kk++) {
#ifdef SG_AVX2
        __m256 w0, w1;
        bf16_row(bp + kk * NR, &w0, &w1);
        _mm256_storeu_ps(dst + kk * NR, w0);
        _mm256_storeu_ps(dst + kk * NR + 8, w1);
#else
        for (int64_t s = 0; s < NR; s++) {
            const uint32_t bits = (uint32_t)bp[kk * NR + s] << 16;
            memcpy(dst + kk * NR + BF16_SLOT[s], &bits, sizeof bits);
        }
#endif
    }
}

/* w [N, K] row-major fp32 -> bp [ceil(N / NR)][K][NR] bf16 in BF16_SLOT order, zero-padded past N. Returns 0, or -1
 * where some value is not exactly a bf16 (its low 16 bits not all zero: bp is then partly written, not to be used). */
int32_t ucm_pack_panels_bf16(const float *w, uint16_t *bp, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR;
    int32_t inexact = 0;
#pragma omp parallel for schedule(static) reduction(| : inexact)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = bp + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t s = 0; s < NR; s++) {
                const int64_t col = p * NR + BF16_SLOT[s];
                uint32_t bits = 0;
                if (col < n) memcpy(&bits, w + col * k + kk, sizeof bits);
                inexact |= (bits & 0xFFFFu) != 0;
                dst[kk * NR + s] = (uint16_t)(bits >> 16);
            }
    }
    return inexact ? -1 : 0;
}

typedef enum { PANEL_FP32, PANEL_Q4, PANEL_Q8, PANEL_BF16 } panel_format;

/* ---------------------------------------------------------------- many rows (prefill chunks)
 *
 * Past a few row blocks, streaming every row of x over a whole panel (panel_rows) reads x from the last-level cache
 * once per panel. Here x is packed per call, MC rows by KC k at a time, into micro-panels of BM = 6 rows ([kc][6],
 * the 6 values of one k side by side, in L2), and each panel's [kc][16] chunk (in L1; a quantized panel's chunk
 * expanded into scratch first) runs against every micro-panel: a 6x16 tile is 12 AVX2 accumulators, 2 weight loads
 * and 6 broadcasts per k (GotoBLAS's blocking). A tile's sums run in k order from 0 with FMA and take the bias
 * after the last k, its partial sums parked in y between chunks: the same floats as `tile` gives, so a row's
 * result does not depend on which of the two loops ran its call. */

#define BM 6
#define KC 256 /* k per chunk at most: a [KC][16] chunk of a panel is 16 KB, in L1 */
#define MC 144 /* rows of x packed at a time: [MC][KC] floats, 144 KB, in L2 */
/* Calls of at least this many rows take blocked_gemm. A model's worth of 4-bit layers (SmolLM2's 30 x 4 shapes),
 * 2 threads, 2-core AMD EPYC Zen 3 (AVX2), against the few-row loop that expanded chunks into scratch: the same
 * time at 1-8 rows, 0.73x at 12, 0.67-0.55x from 24 to 512; against its tiles expanding in registers (paired runs,
 * each 4-bit shape alone): 0.86-0.97x at 12, 0.87-0.93x at 16, so the switch stayed at 12. */
#define MANY_ROWS 12
/* ... but 8-bit panels from this many: the 8-bit lm_head ([49152 x 576]) took 0.82x the blocked loop's time in the
 * few-row loop (its tiles expanding in registers) at 12 and 16 rows, and tied it at 24 (same host, 2 threads). */
#define MANY_ROWS_Q8 24
#define FEW_TILES 3  /* MR-row tiles over one chunk at a time in panel_rows: every row of a call under MANY_ROWS */
#define FEW_KC 128   /* k per chunk in panel_rows: [128][16] floats, 8 KB, in L1 beside the rows' 128 k */

/* Where a panel's fp32 values come from: the fp32 panels themselves, or 4/8-bit or bf16 panels expanded chunk by
 * chunk (bf16: no scales). */
typedef struct {
    panel_format format;
    const float *fp32;             /* PANEL_FP32: [panels][k][16] */
    const uint8_t *q;              /* quantized panels: panel p at q + p * q_panel_bytes */
    int64_t q_panel_bytes, q_k_bytes; /* bytes per panel, per k of a panel */
    const float *scales;           /* panel p's at scales + p * scale_panel_floats */
    int64_t scale_panel_floats, scale_block_floats; /* floats per panel, per QB k of a panel */
} panel_source;

static const uint8_t *panel_q(const panel_source *src, int64_t p, int64_t k0) {
    return src->q + p * src->q_panel_bytes + k0 * src->q_k_bytes;
}

static const float *panel_scales(const panel_source *src, int64_t p, int64_t k0) {
    return src->scales + p * src->scale_panel_floats + (k0 / QB) * src->scale_block_floats;
}

/* Panel p's k in [k0, k0 + kc) as [kc][16] floats: in place for fp32 panels, else expanded into scratch. */
static const float *panel_chunk(const panel_source *src, int64_t k, int64_t p, int64_t k0, int64_t kc,
                                float *scratch) {
    if (src->format == PANEL_FP32) return src->fp32 + (p * k + k0) * NR;
    if (src->format == PANEL_BF16) {
        expand_bf16_panel((const uint16_t *)panel_q(src, p, k0), kc, scratch);
        return scratch;
    }
    (src->format == PANEL_Q4 ? expand_q4_panel : expand_q8_panel)(panel_q(src, p, k0), panel_scales(src, p, k0), kc,
                                                                   scratch);
    return scratch;
}

#ifdef SG_AVX2
/* tile_chunk over a quantized panel's chunk (k0 at a scale block, kc whole blocks), each k's 16 weights expanded in
 * registers as the tile takes them, so the expansion's conversions and adds run beside the tile's FMAs. The weights
 * are the floats expand_q4_panel / expand_q8_panel give (the same q4_row / q8_row), so the sums are tile_chunk's.
 * Against expanding each chunk into scratch first (2-core AMD EPYC Zen 3, AVX2, 2 threads, paired runs): SmolLM2's
 * 4-bit layer shapes 0.63-0.70x at 1 row, 0.75-0.80x at 8, 0.81-0.97x at 11; the 8-bit lm_head 0.54x, 0.64x, 0.68x. */
static void tile_chunk_expanding(const float *x, int64_t ldx, int64_t kc, int64_t mr, const panel_source *src,
                                 int64_t p, int64_t k0, float out[MR][NR], int first, int first_tile) {
    TILE_ROWS(x, ldx, mr);
    TILE_OPEN(out, first);
    const uint8_t *q = panel_q(src, p, k0);
    if (src->format == PANEL_BF16) {
        for (int64_t kk = 0; kk < kc; kk++) {
            __m256 w0, w1;
            SG_PREFETCH(q + kk * NR * 2, kk, NR * 2, first_tile, SG_PF_TILES);
            bf16_row((const uint16_t *)q + kk * NR, &w0, &w1);
            TILE_STEP(kk, w0, w1);
        }
        TILE_CLOSE(out);
        return;
    }
    const float *sc = panel_scales(src, p, k0);
    for (int64_t kb = 0; kb < kc; kb += QB, q += QB * src->q_k_bytes, sc += src->scale_block_floats) {
        if (src->format == PANEL_Q4) {
            const q4_scales s = q4_scales_at(sc);
            for (int64_t kk = kb; kk < kb + QB; kk++) {
                __m256 w0, w1;
                SG_PREFETCH(q + (kk - kb) * (NR / 2), kk, NR / 2, first_tile, SG_PF_TILES);
                q4_row(q + (kk - kb) * (NR / 2), &s, &w0, &w1);
                TILE_STEP(kk, w0, w1);
            }
        } else {
            const __m256 d0 = _mm256_loadu_ps(sc), d1 = _mm256_loadu_ps(sc + 8);
            for (int64_t kk = kb; kk < kb + QB; kk++) {
                __m256 w0, w1;
                SG_PREFETCH(q + (kk - kb) * NR, kk, NR, first_tile, SG_PF_TILES);
                q8_row((const int8_t *)q + (kk - kb) * NR, d0, d1, &w0, &w1);
                TILE_STEP(kk, w0, w1);
            }
        }
    }
    TILE_CLOSE(out);
}
#endif

#ifdef SG_AVX2
/* Panel p's 16 weights at k row kk as w0 (outputs 0-7) and w1 (8-15), the floats panel_chunk gives; `s`: the panel's
 * scales of kk's block (4-bit: d and m; 8-bit: d in d0, d1). Inlined with `format` a constant, each one-row loop
 * below keeps only its format's branch. */
static inline __attribute__((always_inline)) void weights_at(const panel_source *src, panel_format format, int64_t k,
                                                             int64_t p, int64_t kk, const q4_scales *s, __m256 *w0,
                                                             __m256 *w1) {
    if (format == PANEL_FP32) {
        const float *w = src->fp32 + (p * k + kk) * NR;
        *w0 = _mm256_loadu_ps(w), *w1 = _mm256_loadu_ps(w + 8);
    } else if (format == PANEL_BF16) {
        bf16_row((const uint16_t *)panel_q(src, p, kk), w0, w1);
    } else if (format == PANEL_Q4) {
        q4_row(panel_q(src, p, kk), s, w0, w1);
    } else {
        q8_row((const int8_t *)panel_q(src, p, kk), s->d0, s->d1, w0, w1);
    }
}

/* Where panel p's k row kk starts, and its bytes (the row one_row prefetches ahead of). */
static inline __attribute__((always_inline)) const char *panel_row(const panel_source *src, panel_format format,
                                                                   int64_t k, int64_t p, int64_t kk) {
    return format == PANEL_FP32 ? (const char *)(src->fp32 + (p * k + kk) * NR) : (const char *)panel_q(src, p, kk);
}

static inline int64_t panel_row_bytes(panel_format format) {
    return format == PANEL_FP32 ? NR * 4 : format == PANEL_BF16 ? NR * 2 : format == PANEL_Q4 ? NR / 2 : NR;
}

static inline __attribute__((always_inline)) q4_scales block_scales(const panel_source *src, panel_format format,
                                                                     int64_t p, int64_t k0) {
    if (format == PANEL_Q4) return q4_scales_at(panel_scales(src, p, k0));
    const __m256 zero = _mm256_setzero_ps();
    if (format == PANEL_Q8) {
        const float *d = panel_scales(src, p, k0);
        return (q4_scales){_mm256_loadu_ps(d), _mm256_loadu_ps(d + 8), zero, zero};
    }
    return (q4_scales){zero, zero, zero, zero};
}

/* One row's call: a 4-row tile would run 8 FMA chains for it, 6 of them on copies of the row, and take as long as 4
 * rows (the 2-core Xeon as an AVX2-only host: 8.8 ms a row against 9.0 for 4 over two of Llama-1B's gate_up weights
 * in bf16 panels, oneDNN 8.1 on the fp32 weights). Here the row's 8 chains run over WIDE panels at once instead
 * (bf16 panels then 5.3 ms): each output's sum is the same FMA chain in k order from 0, over the same weights, and
 * the bias (or 0) is added after it as panel_rows adds it, so the floats are the tile's. */
#define WIDE 4
static inline __attribute__((always_inline)) void one_row(const float *x, int64_t k, const panel_source *src,
                                                          panel_format format, int64_t p0, int64_t count, int64_t n,
                                                          const float *bias, float *y) {
    const int64_t p1 = count > 1 ? p0 + 1 : p0, p2 = count > 2 ? p0 + 2 : p0, p3 = count > 3 ? p0 + 3 : p0;
    __m256 c00, c01, c10, c11, c20, c21, c30, c31;
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = _mm256_setzero_ps();
    /* each panel prefetched ahead, as the few-row tiles are (at 2 KB, on the Xeon: bf16 panels 32.6 -> 29.5 ms a row
     * over Qwen2.5-0.5B's 24 layers, fp32 52.3 -> 50.1, 4-bit tied); SG_PF_ONE_ROW since */
    const int64_t rb = panel_row_bytes(format);
    for (int64_t k0 = 0; k0 < k; k0 += QB) {
        const int64_t kend = k - k0 < QB ? k : k0 + QB;
        const q4_scales s0 = block_scales(src, format, p0, k0), s1 = block_scales(src, format, p1, k0),
                        s2 = block_scales(src, format, p2, k0), s3 = block_scales(src, format, p3, k0);
        for (int64_t kk = k0; kk < kend; kk++) {
            SG_PREFETCH(panel_row(src, format, k, p0, kk), kk, rb, 1, SG_PF_ONE_ROW);
            SG_PREFETCH(panel_row(src, format, k, p1, kk), kk, rb, 1, SG_PF_ONE_ROW);
            SG_PREFETCH(panel_row(src, format, k, p2, kk), kk, rb, 1, SG_PF_ONE_ROW);
            SG_PREFETCH(panel_row(src, format, k, p3, kk), kk, rb, 1, SG_PF_ONE_ROW);
            const __m256 xv = _mm256_broadcast_ss(x + kk);
            __m256 w0, w1;
            weights_at(src, format, k, p0, kk, &s0, &w0, &w1);
            c00 = _mm256_fmadd_ps(xv, w0, c00), c01 = _mm256_fmadd_ps(xv, w1, c01);
            weights_at(src, format, k, p1, kk, &s1, &w0, &w1);
            c10 = _mm256_fmadd_ps(xv, w0, c10), c11 = _mm256_fmadd_ps(xv, w1, c11);
            weights_at(src, format, k, p2, kk, &s2, &w0, &w1);
            c20 = _mm256_fmadd_ps(xv, w0, c20), c21 = _mm256_fmadd_ps(xv, w1, c21);
            weights_at(src, format, k, p3, kk, &s3, &w0, &w1);
            c30 = _mm256_fmadd_ps(xv, w0, c30), c31 = _mm256_fmadd_ps(xv, w1, c31);
        }
    }
    float out[WIDE][NR];
    _mm256_storeu_ps(out[0], c00), _mm256_storeu_ps(out[0] + 8, c01);
    _mm256_storeu_ps(out[1], c10), _mm256_storeu_ps(out[1] + 8, c11);
    _mm256_storeu_ps(out[2], c20), _mm256_storeu_ps(out[2] + 8, c21);
    _mm256_storeu_ps(out[3], c30), _mm256_storeu_ps(out[3] + 8, c31);
    for (int64_t i = 0; i < count; i++) {
        const int64_t n0 = (p0 + i) * NR, valid = n - n0 < NR ? n - n0 : NR;
        for (int64_t j = 0; j < valid; j++) y[n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

/* one_row over panels [p0, p0 + count), the format a constant in each call. */
static void one_row_of(const float *x, int64_t k, const panel_source *src, int64_t p0, int64_t count, int64_t n,
                       const float *bias, float *y) {
    switch (src->format) {
    case PANEL_FP32: one_row(x, k, src, PANEL_FP32, p0, count, n, bias, y); break;
    case PANEL_BF16: one_row(x, k, src, PANEL_BF16, p0, count, n, bias, y); break;
    case PANEL_Q4: one_row(x, k, src, PANEL_Q4, p0, count, n, bias, y); break;
    default: one_row(x, k, src, PANEL_Q8, p0, count, n, bias, y); break;
    }
}
#endif

/* x rows [mb][k0 .. k0 + kc) (row stride k) into micro-panels of BM rows, [kc][BM] each; missing rows as 0. */
static void pack_rows(const float *x, int64_t k, int64_t mb, int64_t kc, float *dst) {
    for (int64_t r0 = 0; r0 < mb; r0 += BM, dst += BM * kc)
        for (int64_t r = 0; r < BM; r++) {
            const float *row = r0 + r < mb ? x + (r0 + r) * k : NULL;
            for (int64_t kk = 0; kk < kc; kk++) dst[kk * BM + r] = row ? row[kk] : 0.0f;
        }
}

/* y[:, panel p] = x @ panel p (+ bias) for few rows: the panel's k chunks in turn, every MR-row tile of up to
 * FEW_TILES at a time over each chunk while it is in L1 (a quantized chunk expanded by each tile as it goes, or, in
 * the scalar build, into scratch first), their partial sums parked between chunks (the same floats as one pass
 * over k). */
static void panel_rows(const float *x, int64_t m, int64_t k, const panel_source *src, int64_t p, int64_t n,
                       const float *bias, float *y, float *scratch) {
    const int64_t n0 = p * NR, valid = n - n0 < NR ? n - n0 : NR;
    float out[FEW_TILES][MR][NR];
    for (int64_t g0 = 0; g0 < m; g0 += FEW_TILES * MR) {
        const int64_t gm = m - g0 < FEW_TILES * MR ? m - g0 : FEW_TILES * MR, tiles = (gm + MR - 1) / MR;
        for (int64_t k0 = 0; k0 < k; k0 += FEW_KC) {
            const int64_t kc = k - k0 < FEW_KC ? k - k0 : FEW_KC;
#ifdef SG_AVX2
            /* Every tile expands a quantized chunk itself: re-expanding for a second tile took 0.84-0.86x the time
             * of keeping the first tile's expansion in scratch for it (8 rows, SmolLM2's 4-bit shapes and 8-bit
             * lm_head, 2-core AMD EPYC Zen 3): the expansion is nearly free beside the FMAs, the stores are not. */
            if (src->format != PANEL_FP32) {
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t m0 = g0 + t * MR;
                    tile_chunk_expanding(x + m0 * k + k0, k, kc, m - m0 < MR ? m - m0 : MR, src, p, k0, out[t],
                                         k0 == 0, t == 0);
                }
                continue;
            }
#endif
            const float *b = panel_chunk(src, k, p, k0, kc, scratch);
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t m0 = g0 + t * MR;
                tile_chunk(x + m0 * k + k0, k, kc, m - m0 < MR ? m - m0 : MR, b, out[t], k0 == 0, t == 0);
            }
        }
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t r = 0; r < MR && g0 + t * MR + r < m; r++) {
                float *row = y + (g0 + t * MR + r) * n + n0;
                for (int64_t j = 0; j < valid; j++) row[j] = out[t][r][j] + (bias ? bias[n0 + j] : 0.0f);
            }
    }
}

/* y's 6x16 tile (mr rows, valid columns) += the micro-panel a [kc][6] times chunk b [kc][16]; `first`: start from 0,
 * `last`: add the bias and store the result, else park the partial sums. */
static void tile6(int64_t kc, const float *a, const float *b, float *y, int64_t ldy, int64_t mr, int64_t valid,
                  int first, int last, const float *bias) {
    float t[BM][NR];
#ifdef SG_AVX2
    const int whole = mr == BM && valid == NR;
    const int fill = !whole || first; /* a whole tile's parked sums load straight from y */
#else
    const int fill = 1;
#endif
    if (fill)
        for (int64_t r = 0; r < BM; r++)
            for (int64_t j = 0; j < NR; j++) t[r][j] = first || r >= mr || j >= valid ? 0.0f : y[r * ldy + j];
#ifdef SG_AVX2
    /* Named accumulators: an array of them is kept on the stack by gcc, a store per FMA. */
    const float *y0 = whole && !first ? y : t[0];
    const int64_t ld = whole && !first ? ldy : NR;
    __m256 c00 = _mm256_loadu_ps(y0), c01 = _mm256_loadu_ps(y0 + 8);
    __m256 c10 = _mm256_loadu_ps(y0 + ld), c11 = _mm256_loadu_ps(y0 + ld + 8);
    __m256 c20 = _mm256_loadu_ps(y0 + 2 * ld), c21 = _mm256_loadu_ps(y0 + 2 * ld + 8);
    __m256 c30 = _mm256_loadu_ps(y0 + 3 * ld), c31 = _mm256_loadu_ps(y0 + 3 * ld + 8);
    __m256 c40 = _mm256_loadu_ps(y0 + 4 * ld), c41 = _mm256_loadu_ps(y0 + 4 * ld + 8);
    __m256 c50 = _mm256_loadu_ps(y0 + 5 * ld), c51 = _mm256_loadu_ps(y0 + 5 * ld + 8);
    for (int64_t kk = 0; kk < kc; kk++, a += BM, b += NR) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#define ROW_FMA(r, lo, hi)                        \
    do {                                          \
        const __m256 x = _mm256_broadcast_ss(a + r); \
        lo = _mm256_fmadd_ps(x, b0, lo);          \
        hi = _mm256_fmadd_ps(x, b1, hi);          \
    } while (0)
        ROW_FMA(0, c00, c01);
        ROW_FMA(1, c10, c11);
        ROW_FMA(2, c20, c21);
        ROW_FMA(3, c30, c31);
        ROW_FMA(4, c40, c41);
        ROW_FMA(5, c50, c51);
#undef ROW_FMA
    }
    const __m256 c[BM][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int r = 0; r < BM; r++) {
        __m256 lo = c[r][0], hi = c[r][1];
        if (last && bias && valid == NR) {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
        }
        _mm256_storeu_ps(whole ? y + r * ldy : t[r], lo);
        _mm256_storeu_ps(whole ? y + r * ldy + 8 : t[r] + 8, hi);
    }
    if (whole) return;
    if (last && bias && valid < NR)
        for (int64_t r = 0; r < mr; r++)
            for (int64_t j = 0; j < valid; j++) t[r][j] += bias[j];
#else
    for (int64_t kk = 0; kk < kc; kk++)
        for (int64_t r = 0; r < BM; r++)
            for (int64_t j = 0; j < NR; j++) t[r][j] += a[kk * BM + r] * b[kk * NR + j];
    if (last && bias)
        for (int64_t r = 0; r < mr; r++)
            for (int64_t j = 0; j < valid; j++) t[r][j] += bias[j];
#endif
    for (int64_t r = 0; r < mr; r++)
        for (int64_t j = 0; j < valid; j++) y[r * ldy + j] = t[r][j];
}

/* y = x @ W^T + bias for many rows, W's panels from `src`; each thread takes a run of panels. Returns 0, or -1 if
 * no memory for x's packed rows. */
static int32_t blocked_gemm(const float *x, int64_t m, int64_t k, const panel_source *src, int64_t n,
                            const float *bias, float *y, int32_t num_threads) {
    const int64_t panels = (n + NR - 1) / NR, chunks = (k + KC - 1) / KC;
    /* Equal chunks, whole QB blocks each (a quantized chunk starts at a scale block; k is a multiple of QB there). */
    int64_t kc0 = (k + chunks - 1) / chunks;
    kc0 = (kc0 + QB - 1) / QB * QB;
    if (kc0 > k) kc0 = k;
    int32_t status = 0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        const int64_t mcap = m < MC ? (m + BM - 1) / BM * BM : MC;
        float *packed = malloc((size_t)(mcap * kc0) * sizeof *packed);
        /* 16 KB on the stack, as in quantized_gemm (which says why); kc0 <= KC since KC is a multiple of QB */
        _Static_assert(KC % QB == 0, "a chunk rounded up to whole scale blocks must still fit the scratch");
        _Alignas(64) float scratch[KC * NR];
        if (packed == NULL) {
#pragma omp atomic write
            status = -1;
        } else if (p0 < p1) {
            for (int64_t k0 = 0; k0 < k; k0 += kc0) {
                const int64_t kc = k - k0 < kc0 ? k - k0 : kc0;
                const int first = k0 == 0, last = k0 + kc == k;
                for (int64_t i0 = 0; i0 < m; i0 += MC) {
                    const int64_t mb = m - i0 < MC ? m - i0 : MC;
                    pack_rows(x + i0 * k + k0, k, mb, kc, packed);
                    for (int64_t p = p0; p < p1; p++) {
                        const float *b = panel_chunk(src, k, p, k0, kc, scratch);
                        const int64_t valid = n - p * NR < NR ? n - p * NR : NR;
                        for (int64_t r0 = 0; r0 < mb; r0 += BM)
                            tile6(kc, packed + r0 * kc, b, y + (i0 + r0) * n + p * NR, n,
                                  mb - r0 < BM ? mb - r0 : BM, valid, first, last, bias ? bias + p * NR : NULL);
                    }
                }
            }
        }
        free(packed);
    }
    return status;
}

/* The calls under the blocked loop's rows (or where its memory is missing), any panel format: one row over WIDE
 * panels at a time (one_row), more in MR-row tiles panel by panel (panel_rows). */
static void few_row_gemm(const float *x, int64_t m, int64_t k, const panel_source *src, int64_t n, const float *bias,
                         float *y, int32_t num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        /* The scalar build's expanded chunk (8 KB), on the thread's stack, not malloc'd per call: on the 2-core AMD
         * EPYC Zen 3 (AVX2), before the few-row tiles expanded in registers, a malloc'd chunk made the few-row 4-bit
         * calls 1.1-1.3x slower (paired runs), an aligned_alloc'd one still up to 1.16x, and the blocked loop's
         * (16-64 rows) 1.06-1.13x. fp32 panels are read in place and leave it unused. */
        _Alignas(64) float scratch[FEW_KC * NR];
#ifdef SG_AVX2
        if (m == 1) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p += WIDE)
                one_row_of(x, k, src, p, panels - p < WIDE ? panels - p : WIDE, n, bias, y);
        } else
#endif
        {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) panel_rows(x, m, k, src, p, n, bias, y, scratch);
        }
    }
}

/* x [m, k] contiguous, wp from ucm_pack_panels(W [n, k]), bias [n] or NULL, y [m, n] contiguous. */
void ucm_skinny_gemm(const float *x, int64_t m, int64_t k, const float *wp, int64_t n, const float *bias, float *y,
                     int32_t num_threads) {
    const panel_source src = {.format = PANEL_FP32, .fp32 = wp};
    if (m >= MANY_ROWS && blocked_gemm(x, m, k, &src, n, bias, y, num_threads) == 0) return;
    few_row_gemm(x, m, k, &src, n, bias, y, num_threads);
}

/* ucm_skinny_gemm over quantized or bf16 panels, expanded to fp32 as the tiles take them. Panel p's bytes start at
 * q + p * q_panel_bytes, its scales (none for bf16) at scales + p * scale_panel_floats. Returns 0 (the blocked loop's
 * memory missing: the few-row loop runs the call). */
static int32_t quantized_gemm(const float *x, int64_t m, int64_t k, const uint8_t *q, int64_t q_panel_bytes,
                              const float *scales, int64_t scale_panel_floats, panel_format format, int64_t n,
                              const float *bias, float *y, int32_t num_threads, int64_t q_k_bytes,
                              int64_t scale_block_floats) {
    const panel_source src = {format, NULL, q, q_panel_bytes, q_k_bytes, scales, scale_panel_floats,
                              scale_block_floats};
    const int64_t many_rows = format == PANEL_Q8 ? MANY_ROWS_Q8 : MANY_ROWS;
    if (m >= many_rows && blocked_gemm(x, m, k, &src, n, bias, y, num_threads) == 0) return 0;
    few_row_gemm(x, m, k, &src, n, bias, y, num_threads);
    return 0;
}

/* As ucm_skinny_gemm, W given as bf16 panels (ucm_pack_panels_bf16). Returns 0. */
int32_t ucm_skinny_gemm_bf16(const float *x, int64_t m, int64_t k, const uint16_t *bp, int64_t n, const float *bias,
                             float *y, int32_t num_threads) {
    return quantized_gemm(x, m, k, (const uint8_t *)bp, k * NR * 2, NULL, 0, PANEL_BF16, n, bias, y, num_threads,
                          NR * 2, 0);
}

/* As ucm_skinny_gemm, W given as 4-bit panels (k a multiple of 32). Returns 0. */
int32_t ucm_skinny_gemm_q4(const float *x, int64_t m, int64_t k, const uint8_t *qp, const float *dm, int64_t n,
                           const float *bias, float *y, int32_t num_threads) {
    return quantized_gemm(x, m, k, qp, k * (NR / 2), dm, (k / QB) * 2 * NR, PANEL_Q4, n, bias, y,
                          num_threads, NR / 2, 2 * NR);
}

/* As ucm_skinny_gemm, W given as 8-bit panels (k a multiple of 32). Returns 0. */
int32_t ucm_skinny_gemm_q8(const float *x, int64_t m, int64_t k, const int8_t *qp, const float *d, int64_t n,
                           const float *bias, float *y, int32_t num_threads) {
    return quantized_gemm(x, m, k, (const uint8_t *)qp, k * NR, d, (k / QB) * NR, PANEL_Q8, n, bias, y,
                          num_threads, NR, NR);
}
