/* bf16 y = x @ W^T + b for the rows a decode step generates, on AVX-512 BF16, reading W in place.
 *
 * A decode step's few rows multiply every weight of the model once, so its matmuls should take the time to read
 * the weights. oneDNN's bf16 matmul (what prefill chunks use, engine/models/dense.py) ran SmolLM2-135M's layers
 * at 8 rows at 28-38 GB/s on the 2-core AMD EPYC (Zen 5, AVX-512 BF16) where 1 row reads 50-59 GB/s.
 *
 * Here the keys of the dot product are in the vector lanes: W stays [N, K] row-major, one 512-bit load is 32 of
 * a column's k, and VDPBF16PS adds their 16 pair products into 16 fp32 lanes against the same 32 k of one x row.
 * A tile of MR rows x NC columns keeps MR * NC = 16 accumulators; each sums its k in one fixed order (lane l holds
 * k = 32 i + 2 l, 2 l + 1 over i, then the same tree over the lanes, all 16 at once), so an output's bits do not depend on how many rows
 * the call has, where it sits in them, or the thread count. The engine relies on that: a generated token's row
 * goes through this kernel in every step it is computed in (kernels/cpu/skinny_bf16.py).
 * Columns are split over threads in tiles of NC; a tile's NC rows of W (NC * K * 2 bytes) stay in L1 while every
 * row block of x passes over them.
 */

#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SB_DPBF16 1
#endif

#define MR 4 /* x rows per tile */
#define NC 4 /* W columns per tile */

int32_t ucm_skinny_bf16_available(void) {
#ifdef SB_DPBF16
    return 1;
#else
    return 0;
#endif
}

#ifdef SB_DPBF16

/* The 16 accumulators' sums as one vector (lane i: accumulator i), each summed by the same tree: adjacent lanes
 * in pairs, then adjacent pair sums, four rounds. Pairs of vectors go through each round together (two permutes
 * and an add make [a0+a1, .., a14+a15, b0+b1, .., b14+b15]), so the tree never depends on a lane's tile position. */
static inline __attribute__((always_inline)) __m512 sum_lanes(__m512 v[16]) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int n = 16; n > 1; n /= 2)
        for (int i = 0; i < n / 2; i++)
            v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], even, v[2 * i + 1]),
                                 _mm512_permutex2var_ps(v[2 * i], odd, v[2 * i + 1]));
    return v[0];
}

/* acc[r][c] over all of K for rows x[0..mr), columns w[0..nc), then y[r][c] = bf16(sum + bias[c]); `next` (or
 * NULL) is the next tile's W, fetched into the caches meanwhile. mr and nc are compile-time constants at every call
 * (the switch below), so acc lives in registers; missing rows and columns sum zeros through the same tree. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k,
                                                       const uint16_t *bias, uint16_t *y, int64_t ldy,
                                                       const uint16_t *next, int mr, int nc) {
    __m512 acc[MR * NC];
    for (int i = 0; i < MR * NC; i++) acc[i] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (; kk + 32 <= k; kk += 32) {
        __m512i wv[NC];
        for (int c = 0; c < nc; c++) wv[c] = _mm512_loadu_si512(w + c * k + kk);
        if (next)
            for (int c = 0; c < NC; c++) _mm_prefetch((const char *)(next + c * k + kk), _MM_HINT_T0);
        for (int r = 0; r < mr; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + kk);
            for (int c = 0; c < nc; c++) acc[r * NC + c] = _mm512_dpbf16_ps(acc[r * NC + c], xv, (__m512bh)wv[c]);
        }
    }
    if (kk < k) { /* the last k < 32: masked loads give zeros, whose products add nothing */
        const __mmask32 m = (__mmask32)((1ull << (k - kk)) - 1);
        __m512i wv[NC];
        for (int c = 0; c < nc; c++) wv[c] = _mm512_maskz_loadu_epi16(m, w + c * k + kk);
        for (int r = 0; r < mr; r++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * ldx + kk);
            for (int c = 0; c < nc; c++) acc[r * NC + c] = _mm512_dpbf16_ps(acc[r * NC + c], xv, (__m512bh)wv[c]);
        }
    }
    __m512 sums = sum_lanes(acc);
    if (bias) {
        uint16_t b[NC] = {0};
        for (int c = 0; c < nc; c++) b[c] = bias[c];
        const __m512 bc = bf16x16_to_f32((const uint16_t[16]){b[0], b[1], b[2], b[3], b[0], b[1], b[2], b[3], b[0],
                                                              b[1], b[2], b[3], b[0], b[1], b[2], b[3]});
        sums = _mm512_add_ps(sums, bc);
    }
    uint16_t out[MR * NC];
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(bf16x16_bits(sums)));
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) y[r * ldy + c] = out[r * NC + c];
}

#define TILE_CASE(MRV, NCV) tile(x, k, w, k, bias, y, n, m0 == 0 ? next : NULL, MRV, NCV)
#define ROWS_SWITCH(NCV)             \
    switch (mr) {                    \
    case 4: TILE_CASE(4, NCV); break; \
    case 3: TILE_CASE(3, NCV); break; \
    case 2: TILE_CASE(2, NCV); break; \
    default: TILE_CASE(1, NCV); break; \
    }

/* Rows m0.. of every column tile c0..c0+nc; arguments already offset to (m0, c0). */
static void column_tile(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int64_t nc,
                        const uint16_t *bias, uint16_t *y, const uint16_t *next) {
    for (int64_t m0 = 0; m0 < m; m0 += MR, x += MR * k, y += MR * n) {
        const int64_t mr = m - m0 < MR ? m - m0 : MR;
        switch (nc) {
        case 4: ROWS_SWITCH(4); break;
        case 3: ROWS_SWITCH(3); break;
        case 2: ROWS_SWITCH(2); break;
        default: ROWS_SWITCH(1); break;
        }
    }
}
#endif

/* x [m, k] bf16 contiguous, w [n, k] bf16 contiguous, bias [n] bf16 or NULL, y [m, n] bf16 contiguous.
 * Returns 0, or -1 when this build has no AVX-512 BF16 (the caller checks ucm_skinny_bf16_available first). */
int32_t ucm_skinny_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                        const uint16_t *bias, uint16_t *y, int32_t num_threads) {
#ifdef SB_DPBF16
    const int64_t tiles = (n + NC - 1) / NC;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t c0 = t * NC, nc = n - c0 < NC ? n - c0 : NC;
        /* the next tile is this thread's next one (a static schedule gives each thread a contiguous range) */
        const uint16_t *next = t + 1 < tiles ? w + (c0 + NC) * k : NULL;
        column_tile(x, m, k, w + c0 * k, n, nc, bias ? bias + c0 : NULL, y + c0, next);
    }
    return 0;
#else
    (void)x, (void)m, (void)k, (void)w, (void)n, (void)bias, (void)y, (void)num_threads;
    return -1;
#endif
}
