/* fp32 y = x @ W^T + b for the few rows of a decode step, streaming W once from a panel-packed copy.
 *
 * At decode a step multiplies a handful of token rows by every weight of the model, so its time is the time to
 * read the weights. The BLAS GEMM (MKL in the torch wheel) packs W on every call and, on the 2-core AVX2 EPYC
 * this was written on, reads SmolLM2-135M's 0.54 GB of fp32 weights in ~100 ms at 8 rows against ~42 ms here
 * (the memory reads ~17 GB/s). W is packed once at load into panels of NR=16 output columns: panel p is
 * [K][16] floats, zero-padded past N. For each panel the MR=4-row blocks of x run over it while it sits in L1/L2,
 * each keeping a 4x16 tile of y in registers (8 AVX2 accumulators), one broadcast x value and two W vectors per k.
 * Panels are split across threads. Where the build has no AVX2+FMA the same loop runs in scalar C.
 *
 * Summation is in k order per output, with FMA: results differ from MKL's in the last bits (the dispatcher in
 * kernels/cpu/skinny_gemm.py uses this only for the row counts the start-up calibration measured faster).
 */

#include <stdint.h>
#include <stdlib.h>

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

/* One 4x16 tile: rows r0..r0+mr of x against panel wp; tile[r][j] = sum_k x[r][k] * wp[k][j]. */
static inline void tile(const float *x, int64_t k, int64_t mr, const float *wp, float out[MR][NR]) {
    const float *x0 = x, *x1 = mr > 1 ? x + k : x, *x2 = mr > 2 ? x + 2 * k : x, *x3 = mr > 3 ? x + 3 * k : x;
#ifdef SG_AVX2
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256 w0 = _mm256_loadu_ps(wp + kk * NR), w1 = _mm256_loadu_ps(wp + kk * NR + 8);
        __m256 b = _mm256_broadcast_ss(x0 + kk);
        a00 = _mm256_fmadd_ps(b, w0, a00);
        a01 = _mm256_fmadd_ps(b, w1, a01);
        b = _mm256_broadcast_ss(x1 + kk);
        a10 = _mm256_fmadd_ps(b, w0, a10);
        a11 = _mm256_fmadd_ps(b, w1, a11);
        b = _mm256_broadcast_ss(x2 + kk);
        a20 = _mm256_fmadd_ps(b, w0, a20);
        a21 = _mm256_fmadd_ps(b, w1, a21);
        b = _mm256_broadcast_ss(x3 + kk);
        a30 = _mm256_fmadd_ps(b, w0, a30);
        a31 = _mm256_fmadd_ps(b, w1, a31);
    }
    _mm256_storeu_ps(out[0], a00);
    _mm256_storeu_ps(out[0] + 8, a01);
    _mm256_storeu_ps(out[1], a10);
    _mm256_storeu_ps(out[1] + 8, a11);
    _mm256_storeu_ps(out[2], a20);
    _mm256_storeu_ps(out[2] + 8, a21);
    _mm256_storeu_ps(out[3], a30);
    _mm256_storeu_ps(out[3] + 8, a31);
#else
    const float *rows[MR] = {x0, x1, x2, x3};
    for (int64_t r = 0; r < MR; r++)
        for (int64_t j = 0; j < NR; j++) out[r][j] = 0.0f;
    for (int64_t kk = 0; kk < k; kk++)
        for (int64_t r = 0; r < MR; r++)
            for (int64_t j = 0; j < NR; j++) out[r][j] += rows[r][kk] * wp[kk * NR + j];
#endif
}

/* y[:, panel p] = x @ panel (+ bias): every MR-row block of x over one [K][16] panel in cache. */
static void panel_rows(const float *x, int64_t m, int64_t k, const float *panel, int64_t p, int64_t n,
                       const float *bias, float *y) {
    const int64_t n0 = p * NR, valid = n - n0 < NR ? n - n0 : NR;
    float out[MR][NR];
    for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const int64_t mr = m - m0 < MR ? m - m0 : MR;
        tile(x + m0 * k, k, mr, panel, out);
        for (int64_t r = 0; r < mr; r++) {
            float *row = y + (m0 + r) * n + n0;
            for (int64_t j = 0; j < valid; j++) row[j] = out[r][j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
}

/* x [m, k] contiguous, wp from ucm_pack_panels(W [n, k]), bias [n] or NULL, y [m, n] contiguous. */
void ucm_skinny_gemm(const float *x, int64_t m, int64_t k, const float *wp, int64_t n, const float *bias, float *y,
                     int32_t num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) panel_rows(x, m, k, wp + p * k * NR, p, n, bias, y);
}

/* ---------------------------------------------------------------- 4-bit weights (kernels/cpu/q4_panels.py)
 *
 * A weight whose every 32-wide block of a row is exactly d * q + m (q in 0..15, fp32 mul then add: GGUF's
 * Q4_1, which the embedded model's layers are) is packed as 4-bit panels: qp [panels][K][8] bytes, byte j of
 * row k holding output j's q in its low nibble and output j + 8's in its high one, and dm [panels][K / 32][32]
 * floats, the 16 outputs' d then their m for each block of 32 k. A thread expands one panel at a time into
 * fp32 in a scratch panel (the same two roundings, so the same floats as the fp32 panels hold) and runs the
 * fp32 tiles over it: results are bit-identical to ucm_skinny_gemm on the fp32 weight, for 0.16x the memory
 * reads (a decode step streams every weight). */

#define QB 32 /* k per scale block */

static void expand_q4_panel(const uint8_t *qp, const float *dm, int64_t k, float *dst) {
    for (int64_t kb = 0; kb < k / QB; kb++) {
        const float *d = dm + kb * 2 * NR, *mn = d + NR;
        const uint8_t *q = qp + kb * QB * (NR / 2);
        float *w = dst + kb * QB * NR;
#ifdef SG_AVX2
        const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
        const __m256 m0 = _mm256_loadu_ps(mn), m1 = _mm256_loadu_ps(mn + 8);
        const __m256i low = _mm256_set1_epi32(0xF);
        for (int64_t kk = 0; kk < QB; kk++) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + kk * (NR / 2))));
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
            const __m256 q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
            _mm256_storeu_ps(w + kk * NR, _mm256_add_ps(_mm256_mul_ps(q0, d0), m0));
            _mm256_storeu_ps(w + kk * NR + 8, _mm256_add_ps(_mm256_mul_ps(q1, d1), m1));
        }
#else
        for (int64_t kk = 0; kk < QB; kk++)
            for (int64_t j = 0; j < NR / 2; j++) {
                const uint8_t byte = q[kk * (NR / 2) + j];
                w[kk * NR + j] = (float)(byte & 0xF) * d[j] + mn[j];
                w[kk * NR + j + NR / 2] = (float)(byte >> 4) * d[j + NR / 2] + mn[j + NR / 2];
            }
#endif
    }
}

/* ---------------------------------------------------------------- 8-bit weights (kernels/cpu/q8_panels.py)
 *
 * A weight whose every 32-wide block of a row is exactly d * q (q in -127..127, fp32 product: GGUF's Q8_0, which
 * the embedded model's tied embedding and lm_head are) is packed as qp [panels][K][16] int8, the 16 outputs' q at
 * each k, and d [panels][K / 32][16] floats. Expanding a panel (one exact product per weight) gives the floats the
 * fp32 panels hold, so results are bit-identical to ucm_skinny_gemm for 0.27x the memory reads. */

static void expand_q8_panel(const uint8_t *qp_bytes, const float *d, int64_t k, float *dst) {
    const int8_t *qp = (const int8_t *)qp_bytes;
    for (int64_t kb = 0; kb < k / QB; kb++) {
        const float *dd = d + kb * NR;
        const int8_t *q = qp + kb * QB * NR;
        float *w = dst + kb * QB * NR;
#ifdef SG_AVX2
        const __m256 d0 = _mm256_loadu_ps(dd), d1 = _mm256_loadu_ps(dd + 8);
        for (int64_t kk = 0; kk < QB; kk++) {
            const __m256i b0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + kk * NR)));
            const __m256i b1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + kk * NR + 8)));
            _mm256_storeu_ps(w + kk * NR, _mm256_mul_ps(_mm256_cvtepi32_ps(b0), d0));
            _mm256_storeu_ps(w + kk * NR + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(b1), d1));
        }
#else
        for (int64_t kk = 0; kk < QB; kk++)
            for (int64_t j = 0; j < NR; j++) w[kk * NR + j] = (float)q[kk * NR + j] * dd[j];
#endif
    }
}

typedef void (*expand_panel_fn)(const uint8_t *q, const float *scales, int64_t k, float *dst);

/* ucm_skinny_gemm over quantized panels: each thread expands a panel at a time into fp32 in its scratch panel and
 * runs the fp32 tiles over it. Panel p's bytes start at q + p * q_panel_bytes, its scales at
 * scales + p * scale_panel_floats. Returns 0, or -1 if no scratch memory. */
static int32_t quantized_gemm(const float *x, int64_t m, int64_t k, const uint8_t *q, int64_t q_panel_bytes,
                              const float *scales, int64_t scale_panel_floats, expand_panel_fn expand, int64_t n,
                              const float *bias, float *y, int32_t num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    int32_t status = 0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc((size_t)(k * NR) * sizeof *scratch);
        if (scratch == NULL) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (scratch == NULL) continue;
            expand(q + p * q_panel_bytes, scales + p * scale_panel_floats, k, scratch);
            panel_rows(x, m, k, scratch, p, n, bias, y);
        }
        free(scratch);
    }
    return status;
}

/* As ucm_skinny_gemm, W given as 4-bit panels (k a multiple of 32). Returns 0, or -1 if no scratch memory. */
int32_t ucm_skinny_gemm_q4(const float *x, int64_t m, int64_t k, const uint8_t *qp, const float *dm, int64_t n,
                           const float *bias, float *y, int32_t num_threads) {
    return quantized_gemm(x, m, k, qp, k * (NR / 2), dm, (k / QB) * 2 * NR, expand_q4_panel, n, bias, y,
                          num_threads);
}

/* As ucm_skinny_gemm, W given as 8-bit panels (k a multiple of 32). Returns 0, or -1 if no scratch memory. */
int32_t ucm_skinny_gemm_q8(const float *x, int64_t m, int64_t k, const int8_t *qp, const float *d, int64_t n,
                           const float *bias, float *y, int32_t num_threads) {
    return quantized_gemm(x, m, k, (const uint8_t *)qp, k * NR, d, (k / QB) * NR, expand_q8_panel, n, bias, y,
                          num_threads);
}
