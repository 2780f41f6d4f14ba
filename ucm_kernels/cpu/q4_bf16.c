/* bf16 y = x @ W^T for the rows a decode step generates, W a Q4_1 weight read as 4-bit panels, on AVX-512 BF16.
 *
 * A decode step's few rows read every weight of the model once; oneDNN's bf16 matmul (what prompt rows use,
 * engine/models/dense.py) streams 2 bytes a weight. The embedded model's layers are Q4_1 (w = d * q + m per 32 k,
 * q in 0..15), so this kernel reads half a byte a weight plus the block scales (ucm_kernels/cpu/q4_bf16.py packs them).
 *
 * Outputs are in the vector lanes, 16 to a panel. qp [panels][K / 2][16]: byte o of pair j holds q of output o at
 * k = 2j (low nibble) and 2j + 1 (high). One load, a zero-extend, a shift and a ternary logic op put the two
 * nibbles in the two 16-bit halves of lane o; a word permute turns each 0..15 into its bf16 value; VDPBF16PS adds
 * the lane's two products with the row's pair (x[2j], x[2j + 1]) broadcast, even and odd pairs into two sums.
 * Per 32 k (a Q4_1 block) a row's
 * block sum s = sum q * x is then scaled: acc += d * s, acc += m * (sum of the row's 32 x). So y = sum over blocks
 * of d * sum(q x) + m * sum(x) = x . w exactly as written, with the products exact and the sums in fp32.
 *
 * Where the OS grants AMX, every call takes panel_amx instead: the same weight pairs as a VNNI tile, each block's
 * sums by TDPBF16PS (other bits than VDPBF16PS's, so never the two in one process).
 *
 * A plain bf16 weight (a bf16 checkpoint, on a CPU without AMX) takes a loop of its own over bf16 panels, wp [panels]
 * [K / 2][16]: lane o of pair j holds output o's (w[2j], w[2j + 1]), one load a pair, no scales, one sum a row and
 * panel (`dp_pairs`). oneDNN's bf16 matmul reads such a weight at 19-30 GB/s at 1-8 rows on a 2-core Zen 4 EPYC whose
 * memory streams at 36-58.
 *
 * Every row goes through the same instructions in the same order, whatever else the call holds (rows are padded to
 * MR, or MR_AMX, with zeros; panels are split over threads): a row's bits depend on its own x only. The engine relies on that:
 * a generated token's row goes through this kernel in every step it is computed in.
 */

#define _GNU_SOURCE /* syscall(), for the AMX permission (amx_tiles.h) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16.h"
#include "entry_points.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define Q4B_DPBF16 1
#endif

#define QB 32 /* k per scale block (Q4_1) */
#define NR 16 /* outputs per panel */
#define MR 8  /* x rows per pass */
#define MR_MAX 16 /* the most rows a pass of either body holds */

int32_t ucm_q4_bf16_available(void) {
#ifdef Q4B_DPBF16
    return 1;
#else
    return 0;
#endif
}

#ifdef Q4B_DPBF16

#include <immintrin.h>

/* A row's pair (x[2j], x[2j + 1]) in every lane, broadcast from memory (not through a general register). */
static inline __attribute__((always_inline)) __m512bh pair(const uint32_t *src) {
    return (__m512bh)_mm512_broadcastss_ps(_mm_load_ss((const float *)src));
}

/* 16 lanes of (q at k = 2j, q at 2j + 1) as bf16 pairs, from the 16 bytes of pair j. */
static inline __attribute__((always_inline)) __m512bh weights(const uint8_t *src, __m512i table, __m512i nibbles) {
    __m512i byte = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    /* (byte | byte << 12) & 0x000f000f: low nibble in the low word, high nibble in the high word */
    __m512i q = _mm512_ternarylogic_epi32(byte, _mm512_slli_epi32(byte, 12), nibbles, 0xa8);
    return (__m512bh)_mm512_permutexvar_epi16(q, table);
}

/* 16 lanes of (q at k = 2j, q at 2j + 1) as bf16 pairs for a Q8_0 panel, from pair j's 32 bytes. */
static inline __attribute__((always_inline)) __m512bh weights_q8(const int8_t *src) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + NR))));
    return (__m512bh)_mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                                              _mm512_castps_si512(hi));
}

static inline __attribute__((always_inline)) __m512i nibble_table(void) {
    return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
                            0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                            0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80,
                            0x0000); /* word i (and i + 16): bf16(i) */
}

/* The sum of a Q4_1 block's 32 x (bf16): the two halves lane by lane, then the lanes in the reduction's fixed
 * order. It runs on one thread before the panels' parallel loop, once a block and row: scalar, it was ~5% of a decode
 * step on the Xeon with AMX while the other thread waited. */
static inline __attribute__((always_inline)) float block_sum(const uint16_t *xb) {
    return _mm512_reduce_add_ps(_mm512_add_ps(bf16x16_to_f32(xb), bf16x16_to_f32(xb + 16)));
}

/* One panel (16 outputs) for mr rows (1, 2, 4 or MR; a constant where inlined): xp[r][j] is row r's pair j as one 32-bit word, sx[r][b] its block sums.
 * q8 (a constant where it is inlined): the Q8_0 twin (w = d * q, q in -127..127 per 32 k: the embedded model's tied
 * embedding, its lm_head), qp [K / 2][32] bytes (pair j's 16 bytes of q at k = 2j, then its 16 at 2j + 1) and
 * dm [K / 32][16] (d only). An int8 is exact in bf16, which is fp32's top half: the even k's fp32 shifted down and
 * the odd k's blended over it make lane o's bf16 pair; the block sums are d-scaled with no m term. */
static inline __attribute__((always_inline)) void panel(const uint32_t *xp, const float *sx, int64_t k,
                                                        const void *qp, const float *dm, __m512 *out, const int q8,
                                                        const int mr) {
    const __m512i table = nibble_table(), nibbles = _mm512_set1_epi32(0x000f000f);
    const int64_t pairs = k / 2, blocks = k / QB;
    __m512 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        /* Two sums per row, even and odd pairs, added at the block's end: twice the independent VDPBF16PS chains,
         * which is what bounds this loop (each waits for its previous result). */
        __m512 even[MR], odd[MR];
        for (int r = 0; r < mr; r++) even[r] = odd[r] = _mm512_setzero_ps();
        for (int64_t j = b * (QB / 2); j < (b + 1) * (QB / 2); j += 2) {
            __m512bh w[2];
            for (int h = 0; h < 2; h++)
                w[h] = q8 ? weights_q8((const int8_t *)qp + (j + h) * 2 * NR)
                          : weights((const uint8_t *)qp + (j + h) * NR, table, nibbles);
            for (int r = 0; r < mr; r++) {
                even[r] = _mm512_dpbf16_ps(even[r], w[0], pair(xp + r * pairs + j));
                odd[r] = _mm512_dpbf16_ps(odd[r], w[1], pair(xp + r * pairs + j + 1));
            }
        }
        const __m512 d = _mm512_loadu_ps(dm + b * (q8 ? 1 : 2) * NR);
        for (int r = 0; r < mr; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), d, acc[r]);
            if (!q8) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(dm + b * 2 * NR + NR), _mm512_set1_ps(sx[r * blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) out[r] = acc[r];
}

/* `panel` for a pass of `rows` rows: 1, 2, 4 or MR of them computed, not always MR (the pass's rows past the call's
 * are zero, and cost as much as real ones: VDPBF16PS bounds this loop). A row's operations are the same whichever
 * count it is computed in, so are its bits. SmolLM2-135M's 30 Q4_1 layers and Q8_0 lm_head, 2 threads, builds
 * alternated, 8 rounds' median on the 2-core Zen 4 EPYC: 1 / 2 / 4 / 8 rows 2.64 / 2.18 / 1.56 / 1.00x. */
static inline __attribute__((always_inline)) void panel_rows(const uint32_t *xp, const float *sx, int64_t k,
                                                             const void *qp, const float *dm, __m512 *out,
                                                             const int q8, int64_t rows) {
    if (rows == 1) panel(xp, sx, k, qp, dm, out, q8, 1);
    else if (rows == 2) panel(xp, sx, k, qp, dm, out, q8, 2);
    else if (rows <= 4) panel(xp, sx, k, qp, dm, out, q8, 4);
    else panel(xp, sx, k, qp, dm, out, q8, MR);
}

/* Bytes ahead of a pair's weights that a whole-K pass (panel_bf16) of 2-4 rows prefetches into L1 in each of its
 * streams: their slower pass leaves the hardware's L2 streams time to fetch ahead. Llama-1B's 16 layers, 2 threads,
 * builds alternated in one process, the rounds' median ratio against 1024: 2 rows at 256 1.03x; 3 / 4 rows at 256 1.23
 * / 1.20x (0, 128 and 192 the same; 384 1.17x, 512 1.11x), on the 2-core Zen 4 EPYC while its memory streamed at 34-53
 * GB/s. A pass of 1 row prefetches nothing: each prefetch holds one of the core's L1 miss buffers, which its fast pass
 * needs for its own loads. Same host, 8 of Llama-1B's layers, builds alternated, each beside the read: 1 row with no
 * prefetch 49.7-52.7 GB/s against 44.5-47.3 at 1024 (256: 49.6-51.1) while memory streamed at 60-64 GB/s, 34 against
 * 33-34 at 36; Qwen2.5-0.5B's 24 layers 43-44 against 31-39 at 53-62 and 34 against 31-32 at 37-38; in the engine's
 * decode steps at batch 1 (roofline) Qwen2.5-0.5B 73-74% of the read against 63%, Llama-1B 88% (both ~90% at 35
 * GB/s). */
#define PF_BF16_ROWS 256
/* Bytes ahead that `panels_bf16_rows8` prefetches into L2 (its first half; the second reads the same lines): its
 * 8 rows take long enough over a chunk that the L2 streams alone fell behind. Same host and runs: 8 rows 1.22-1.25x
 * against none (2 KB 0.97x of 4, 8 KB 0.96x). */
#define PF_L2_ROWS8 4096
/* Pairs of a chunk in `panels_bf16_rows8`: four panels' chunk (2 KB) is in L1 for the second half of the rows. */
#define CHUNK_PAIRS 8
enum { PF_BOTH = 3, PF_FIRST = 1, PF_SECOND = 2 }; /* which of a step's two weight lines `dp_pairs` prefetches */

/* Pairs [j0, j1) of `pp` bf16 panels, `stride` pairs apart, for `mr` rows (constants where inlined: 1, 2, 4 or MR
 * rows, the pass's rows past the call's zero; pp 4 or 1), added to the sums in io [pp][MR], one sum a row and panel.
 * Several panels at once are several read streams, which a core reads faster than one; 4 panels of 4 rows are 16
 * sums, so every pass of up to 4 rows reads four streams (eight panels a pass, at 1-2 rows and in passes of 2 rows,
 * read Llama-1B's layer weights ~10% slower on the 2-core Zen 4). A row's operations depend on neither mr nor pp nor
 * on where the range is cut, so its bits do not depend on how many rows the call has, on which panels share a pass,
 * nor on the chunks. `pf` of a step's two lines are prefetched `pf_ahead` bytes on into L1, both `l2` bytes on into L2
 * (0: none). */
static inline __attribute__((always_inline)) void dp_pairs(const uint32_t *xp, int64_t pairs, int64_t j0, int64_t j1,
                                                           const uint32_t *wp, int64_t stride, __m512 *io,
                                                           const int mr, const int pp, const int pf,
                                                           const int64_t pf_ahead, const int64_t l2) {
    __m512 sum[4][MR];
    for (int q = 0; q < pp; q++)
        for (int r = 0; r < mr; r++) sum[q][r] = io[q * MR + r];
    for (int64_t j = j0; j < j1; j += 2) {
        for (int q = 0; q < pp; q++) {
            const uint32_t *w = wp + q * stride + j * NR;
            if (pf & PF_FIRST) _mm_prefetch((const char *)w + pf_ahead, _MM_HINT_T0);
            if (pf & PF_SECOND) _mm_prefetch((const char *)w + pf_ahead + 64, _MM_HINT_T0);
            if (l2) {
                _mm_prefetch((const char *)w + l2, _MM_HINT_T1);
                _mm_prefetch((const char *)w + l2 + 64, _MM_HINT_T1);
            }
            const __m512bh w0 = (__m512bh)_mm512_load_si512(w), w1 = (__m512bh)_mm512_load_si512(w + NR);
            for (int r = 0; r < mr; r++) {
                sum[q][r] = _mm512_dpbf16_ps(sum[q][r], w0, pair(xp + r * pairs + j));
                sum[q][r] = _mm512_dpbf16_ps(sum[q][r], w1, pair(xp + r * pairs + j + 1));
            }
        }
    }
    for (int q = 0; q < pp; q++)
        for (int r = 0; r < mr; r++) io[q * MR + r] = sum[q][r];
}

/* x . w over the whole K of `pp` panels for `mr` rows (dp_pairs): out [pp][MR]. */
static inline __attribute__((always_inline)) void panel_bf16(const uint32_t *xp, int64_t k, const uint32_t *wp,
                                                             int64_t stride, __m512 *out, const int mr,
                                                             const int pp) {
    for (int i = 0; i < pp * MR; i++) out[i] = _mm512_setzero_ps();
    dp_pairs(xp, k / 2, 0, k / 2, wp, stride, out, mr, pp, mr == 1 ? 0 : PF_BOTH, PF_BF16_ROWS, 0);
}

/* Four panels for 5-8 rows, the rows in halves of 4 chunk by chunk (8 rows of four panels would want 32 sums, all
 * the registers): the second half reads the chunk from L1 while each half prefetches one of a step's two lines a
 * chunk on, so memory streams all the time. Llama-1B's layer weights on a 2-core Zen 4 (2 threads, builds
 * alternated), GB/s at 1 / 4 / 8 rows: two sums a row and panel (even and odd pairs; 4 rows then took two panels a
 * pass) and each half of 8 rows over the whole K in turn, the second from L2: 8 rows 23.4-24.8; the halves in chunks
 * of 64 pairs: 32.7 / 29.0 / 26.4; one sum a row and panel, chunks of 8 pairs: 33.3 / 31.8 / 28.3 (16: 27.0 at 8
 * rows, 32: 23.8, 64: 26.4). */
static void panels_bf16_rows8(const uint32_t *xp, int64_t k, const uint32_t *w, int64_t stride, __m512 *out) {
    const int64_t pairs = k / 2, ahead = CHUNK_PAIRS * NR * 4;
    __m512 half[2][4 * MR]; /* [half][panel * MR + row] */
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 4 * MR; i++) half[h][i] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < pairs; j0 += CHUNK_PAIRS) {
        const int64_t j1 = pairs - j0 < CHUNK_PAIRS ? pairs : j0 + CHUNK_PAIRS;
        dp_pairs(xp, pairs, j0, j1, w, stride, half[0], 4, 4, PF_FIRST, ahead, PF_L2_ROWS8);
        dp_pairs(xp + 4 * pairs, pairs, j0, j1, w, stride, half[1], 4, 4, PF_SECOND, ahead, 0);
    }
    for (int h = 0; h < 2; h++)
        for (int q = 0; q < 4; q++)
            for (int r = 0; r < 4; r++) out[q * MR + 4 * h + r] = half[h][q * MR + r];
}

/* Panels [p0, p0 + count) of a bf16 weight for `rows` rows: out [count][MR]. */
static void panels_bf16(const uint32_t *xp, int64_t k, const uint32_t *wp, int64_t p0, int count, int64_t rows,
                        __m512 *out) {
    const int64_t stride = k / 2 * NR;
    const uint32_t *w = wp + p0 * stride;
    if (count == 4 && rows == 1) panel_bf16(xp, k, w, stride, out, 1, 4);
    else if (count == 4 && rows == 2) panel_bf16(xp, k, w, stride, out, 2, 4);
    else if (count == 4 && rows <= 4) panel_bf16(xp, k, w, stride, out, 4, 4);
    else if (count == 4) panels_bf16_rows8(xp, k, w, stride, out);
    else
        for (int q = 0; q < count; q++) {
            if (rows == 1) panel_bf16(xp, k, w + q * stride, stride, out + q * MR, 1, 1);
            else if (rows == 2) panel_bf16(xp, k, w + q * stride, stride, out + q * MR, 2, 1);
            else if (rows <= 4) panel_bf16(xp, k, w + q * stride, stride, out + q * MR, 4, 1);
            else panel_bf16(xp, k, w + q * stride, stride, out + q * MR, MR, 1);
        }
}

#ifdef UCM_HAS_AMX
#define MR_AMX 16 /* x rows per pass on AMX: one A tile */

/* Bytes ahead of a round that panel_amx prefetches its panel's weights and scales: the panel's stream is one of each
 * per thread, which the hardware prefetchers did not keep ahead of. SmolLM2-135M's 30 layers (Q4_1) and its Q8_0
 * lm_head on the 2-core Xeon with AMX, builds alternated: 1 row 8.63 -> 7.55 ms, 8 rows 9.42 -> 8.21 (2 KB ahead
 * tied, 512 bytes 8.63). */
#define PF_AHEAD 1024

/* `panel` on AMX tiles, for MR_AMX rows (xp and sx hold that many): a block's 16 weight pairs (the vectors `panel`
 * feeds VDPBF16PS) are stored as one VNNI B tile, the rows' 32 x of the block are an A tile, and one TDPBF16PS
 * gives every row's block sum s, scaled as there. ~2.7x fewer instructions than 8 rows of VDPBF16PS, which bound
 * `panel` on a Xeon with AMX (135 GFLOP/s at 8 rows). TDPBF16PS sums a tile's pairs in another order than
 * VDPBF16PS, so a process whose OS grants AMX runs this for every call (amx_permitted), never `panel`. Two blocks
 * a round (tiles 0-1: sums, 4-5: x, 6-7: weights). */
static inline __attribute__((always_inline)) void panel_amx(const uint32_t *xp, const float *sx, int64_t k,
                                                            const void *qp, const float *dm, __m512 *out, int rows,
                                                            uint32_t *wbuf, float *cbuf, const int q8) {
    const __m512i table = nibble_table(), nibbles = _mm512_set1_epi32(0x000f000f);
    const int64_t pairs = k / 2, blocks = k / QB;
    __m512 acc[MR_AMX];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
        const int nb = blocks - b < 2 ? 1 : 2;
        { /* the round's weight bytes and scales PF_AHEAD on into L1 (a hint: the sums do not change) */
            const char *wq = (const char *)qp + b * (QB / 2) * (q8 ? 2 * NR : NR);
            const char *ws = (const char *)(dm + b * (q8 ? 1 : 2) * NR);
            for (int64_t o = 0; o < 2 * (QB / 2) * (q8 ? 2 * NR : NR); o += 64)
                _mm_prefetch(wq + o + PF_AHEAD, _MM_HINT_T0);
            _mm_prefetch(ws + PF_AHEAD, _MM_HINT_T0);
            _mm_prefetch(ws + PF_AHEAD + 64, _MM_HINT_T0);
        }
        for (int h = 0; h < nb; h++)
            for (int j = 0; j < QB / 2; j++) {
                const int64_t jj = (b + h) * (QB / 2) + j;
                const __m512bh w = q8 ? weights_q8((const int8_t *)qp + jj * 2 * NR)
                                      : weights((const uint8_t *)qp + jj * NR, table, nibbles);
                _mm512_store_si512(wbuf + h * 256 + j * 16, (__m512i)w);
            }
        for (int h = 0; h < nb; h++) { /* written out per tile: the tile numbers must be constants */
            if (h == 0) {
                _tile_zero(0);
                _tile_loadd(4, xp + b * (QB / 2), pairs * 4);
                _tile_loadd(6, wbuf, 64);
                _tile_dpbf16ps(0, 4, 6);
            } else {
                _tile_zero(1);
                _tile_loadd(5, xp + (b + 1) * (QB / 2), pairs * 4);
                _tile_loadd(7, wbuf + 256, 64);
                _tile_dpbf16ps(1, 5, 7);
            }
        }
        _tile_stored(0, cbuf, 64);
        if (nb == 2) _tile_stored(1, cbuf + 256, 64);
        for (int h = 0; h < nb; h++) {
            const __m512 d = _mm512_loadu_ps(dm + (b + h) * (q8 ? 1 : 2) * NR);
            for (int r = 0; r < rows; r++) {
                acc[r] = _mm512_fmadd_ps(_mm512_load_ps(cbuf + h * 256 + r * 16), d, acc[r]);
                if (!q8)
                    acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(dm + (b + h) * 2 * NR + NR),
                                             _mm512_set1_ps(sx[r * blocks + b + h]), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) out[r] = acc[r];
}
#endif

#endif

enum { KIND_Q4 = 0, KIND_Q8 = 1, KIND_BF16 = 2 }; /* the panels' format */

/* The three entry points: rows in passes of MR (missing rows zero), panels over the threads. KIND_Q8: Q8_0 panels
 * (qp int8, dm the d of each block); KIND_Q4: Q4_1 (`panel`); KIND_BF16: bf16 pairs, dm unused (`panel_bf16`, never
 * on tiles). */
static int32_t decode_matmul(const uint16_t *x, int64_t m, int64_t k, const void *qp, const float *dm, int64_t n,
                             uint16_t *y, int32_t num_threads, int kind) {
#ifndef Q4B_DPBF16
    (void)x, (void)m, (void)k, (void)qp, (void)dm, (void)n, (void)y, (void)num_threads, (void)kind;
    return -1;
#else
    if (k % QB) return -2;
    const int q8 = kind == KIND_Q8, bf16 = kind == KIND_BF16;
    const int64_t panels = (n + NR - 1) / NR, pairs = k / 2, blocks = k / QB;
#ifdef UCM_HAS_AMX
    const int amx = !bf16 && amx_permitted();
    const int64_t mr = amx ? MR_AMX : MR;
#else
    const int amx = 0;
    const int64_t mr = MR;
#endif
    for (int64_t r0 = 0; r0 < m; r0 += mr) {
        const int64_t rows = m - r0 < mr ? m - r0 : mr;
        uint32_t *xp = aligned_alloc(64, ((mr * pairs * 4 + 63) / 64) * 64);
        float *sx = aligned_alloc(64, ((mr * blocks * 4 + 63) / 64) * 64);
        if (xp == NULL || sx == NULL) {
            free(xp);
            free(sx);
            return -3;
        }
        memcpy(xp, x + r0 * k, rows * k * 2); /* bf16 pairs are the row's 32-bit words; missing rows are 0 */
        memset(xp + rows * pairs, 0, (mr - rows) * pairs * 4);
        memset(sx, 0, mr * blocks * 4);
        for (int64_t r = 0; r < rows && kind == KIND_Q4; r++) /* Q4_1's m term needs each block's sum of x */
            for (int64_t b = 0; b < blocks; b++)
                sx[r * blocks + b] = block_sum((const uint16_t *)(xp + r * pairs) + b * QB);
#pragma omp parallel num_threads(num_threads)
        {
#ifdef UCM_HAS_AMX
            _Alignas(64) uint32_t wbuf[2 * 256];
            _Alignas(64) float cbuf[2 * 256];
            if (amx) amx_load_config();
#endif
            if (bf16) { /* panels in groups of four: four read streams a thread */
#pragma omp for schedule(static)
                for (int64_t g = 0; g < (panels + 3) / 4; g++) {
                    __m512 out[4 * MR];
                    const int count = panels - 4 * g < 4 ? (int)(panels - 4 * g) : 4;
                    panels_bf16(xp, k, (const uint32_t *)qp, 4 * g, count, rows, out);
                    for (int q = 0; q < count; q++) {
                        const int64_t p = 4 * g + q, cols = n - p * NR < NR ? n - p * NR : NR;
                        const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
                        for (int64_t r = 0; r < rows; r++)
                            _mm256_mask_storeu_epi16(y + (r0 + r) * n + p * NR, mask, bf16x16_pack(out[q * MR + r]));
                    }
                }
            } else
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                __m512 out[MR_MAX];
                const void *pq = q8 ? (const void *)((const int8_t *)qp + p * pairs * 2 * NR)
                                    : (const void *)((const uint8_t *)qp + p * pairs * NR);
                const float *pd = dm + p * blocks * (q8 ? 1 : 2) * NR;
                /* One body per process and format (amx), each instance with q8 and mr constants. */
#ifdef UCM_HAS_AMX
                if (amx && q8) panel_amx(xp, sx, k, pq, pd, out, (int)rows, wbuf, cbuf, 1);
                else if (amx) panel_amx(xp, sx, k, pq, pd, out, (int)rows, wbuf, cbuf, 0);
                else
#endif
                if (q8) panel_rows(xp, sx, k, pq, pd, out, 1, rows);
                else panel_rows(xp, sx, k, pq, pd, out, 0, rows);
                const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
                const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
                for (int64_t r = 0; r < rows; r++)
                    _mm256_mask_storeu_epi16(y + (r0 + r) * n + p * NR, mask,
                                             bf16x16_pack(out[r]));
            }
#ifdef UCM_HAS_AMX
            if (amx) _tile_release();
#endif
        }
        free(xp);
        free(sx);
    }
    (void)amx;
    return 0;
#endif
}

/* x [M, K] bf16 row-major, qp / dm from ucm_kernels/cpu/q4_bf16.py (n padded to panels of 16), y [M, N] bf16.
 * 0: done; -1: not built for this CPU; -2: K not a multiple of 32; -3: no memory. */
int32_t ucm_q4_bf16(const uint16_t *x, int64_t m, int64_t k, const uint8_t *qp, const float *dm, int64_t n,
                    uint16_t *y, int32_t num_threads) {
    return decode_matmul(x, m, k, qp, dm, n, y, num_threads, KIND_Q4);
}

/* The same for a Q8_0 weight: qp [panels][K / 2][32] int8, d [panels][K / 32][16] (ucm_kernels/cpu/q4_bf16.py). */
int32_t ucm_q8_bf16(const uint16_t *x, int64_t m, int64_t k, const int8_t *qp, const float *d, int64_t n,
                    uint16_t *y, int32_t num_threads) {
    return decode_matmul(x, m, k, qp, d, n, y, num_threads, KIND_Q8);
}

/* The same for a plain bf16 weight: wp [panels][K / 2][16] bf16 pairs (ucm_kernels/cpu/q4_bf16.py: pack_bf16). */
int32_t ucm_bf16_dp(const uint16_t *x, int64_t m, int64_t k, const uint32_t *wp, int64_t n, uint16_t *y,
                    int32_t num_threads) {
    return decode_matmul(x, m, k, wp, NULL, n, y, num_threads, KIND_BF16);
}
