/* bf16 y = x @ W^T for prompt rows on CPUs with AMX, the same bits for a row whatever else the call holds.
 *
 * oneDNN's bf16 matmul on AMX picks its blocking by the call's row count: on a 2-core Xeon, SmolLM2's prompt
 * shapes gave a row other bits at 48-512 rows than at up to 32 or at 2048 (ucm_kernels/cpu/calibration.py,
 * bf16_linear_rows_invariant). The engine needs a row's bits to depend on the row alone, or a prompt continued
 * after a prefix-cache hit (its last rows a small call) stops giving the cold run's greedy tokens. Here every
 * output element is one AMX accumulator tile element that TDPBF16PS adds 32 k at a time, k blocks in order, and
 * rows past the call's end are zeros in a padded copy: the arithmetic of a row is fixed by K alone.
 *
 * Tiles (palette 1): C0..C3 = 2 x 2 blocks of 16 rows x 16 outputs (fp32), A0, A1 = 16 rows x 32 k of x, B0, B1 = 32 k
 * x 16 outputs of W in VNNI order (k pairs interleaved), 16-output panels of 32-k blocks of [16 pairs][16 out][2] in
 * layout_chunk's order, packed once at load (ucm_kernels/cpu/amx_gemm.py). Work is split over threads by blocks of MC
 * rows x NC outputs (a call of at most 16 rows: its 64-output units, claimed as in claim_unit), RG rows at a
 * time (all rows at once for a long K), which keeps a block's x and W in L2 (row groups: SmolLM2's four layer shapes at
 * 2048 rows 7.22 -> 6.75 ms, the builds alternated in one process on the Xeon with AMX). The accumulators go to fp32
 * scratch and out as bf16 (round to nearest even, as torch rounds).
 *
 * A row slice (32 rows x SLICE outputs) runs its k blocks KBC at a time over every block of the slice, so that the
 * slice's x and one block's W for those k stay in L1 (36 KB) instead of x being fetched from L2 again for every
 * block; a block's sums wait in fp32 scratch between the passes, which leaves its additions and their order as
 * they were. And a slice's epilogue (the rounding to bf16 and the stores into y) runs spread over the next slice's
 * tile work: run after its own tiles, the stores of y waited on their cache lines while the tiles idled. Measured
 * on the Xeon with AMX, builds alternated in one process, SmolLM2's shapes at 2048 rows: 0.73-0.96x the time,
 * bit-equal. Calls of up to SPLIT_ROWS rows keep one pass over k: over 30 layers' weights from memory, the k passes
 * cost 16 and 32 rows ~6% (their C tiles stored and loaded once more, no x to keep).
 *
 * A K past KCB k blocks (Qwen2.5-0.5B's down projection: 4864; Llama-1B's 8192 in KCB_PAST_L2's chunks, below) runs a
 * block in chunks of KCB k blocks, every row slice of the block over one chunk before the next, its sums waiting in
 * a per-thread fp32 scratch of the whole block: a block's W is NC x K bf16, 4 MB at K = 8192, past L2 (2 MB a
 * core), so one pass over K per 32-row slice streamed the block's W from L3 again for each of the block's 4 slices;
 * a chunk's W (1 MB) and x (512 KB) stay in L2 across them. The sums are stored and loaded as fp32 between
 * chunks, as between KBC passes: the same additions in the same order, bit for bit. Measured on the 2-core Xeon
 * with AMX (others' jobs running), old and new builds alternated in one process, best of 10, at 1536 rows: 2048 x
 * 8192 0.66x the time, Llama-1B's three 2048-k shapes 0.86-0.98x; a chunk of 64 k blocks gave 0.70x at 8192, one of
 * 128 lost to 64, one of 16 tied.
 */

#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "entry_points.h"
#include "silu_bf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define MC 128 /* rows per thread block */
#define NC 256 /* outputs per thread block */
#define RG 512 /* rows per group of a short K (a multiple of MC) */
/* Rows a group may hold past RG rather than leave them to a group of their own: a prompt chunk of RG rows with a
 * decode batch beside it (a mixed step) read every weight a second time for its few decode rows. Calls of up to
 * MID_ROWS + SLACK_ROWS rows keep MID_ROWS' order too (at 519 rows it ran Llama-1B's shapes 5-20% faster than the
 * k passes). */
#define SLACK_ROWS 64
#define SLICE 128 /* outputs of a row slice, whose epilogue runs during the next slice's tiles */
#define KBC 9 /* k blocks (of 32) a pass: a slice's x and a block's W for them fit L1 (2 x 18 KB) */
/* A K from which a slice passes over a whole chunk (or its whole K) at once, not KBC blocks at a time: each pass
 * loads and stores its four sum tiles, 8 tile moves beside the pass's 4 products a k block, and with the long K's
 * tiles the products outlast them. 16 distinct weights, builds alternated in one process on the 2-core Xeon with AMX
 * (KCB_PAST_L2's chunks 8 -> 32 with it), TFLOP/s: Llama-1B's 2048 x 8192 at 160-4096 rows 1.72-2.18 -> 1.84-2.33
 * (1.05-1.12x), Qwen2.5-0.5B's 9728 x 896 and 1152 x 896 at 1536 rows 2.32 / 2.37 -> 2.51 / 2.46; SmolLM2's K of 576
 * lost 2-4% at 2048 rows (its x stays in L2 in row groups). */
#define ONE_PASS_K 768
#define SPLIT_ROWS 64 /* calls of more rows pass over k in KBC blocks (below ONE_PASS_K); fewer rows in one */
/* Calls of up to MID_ROWS rows (a decode batch, a chunk beside decodes, a prompt's tail after a cache hit) run each
 * 32-output pair over every row slice of the call in turn, one pass over k each: the pair's W (32 x K bf16, 128-512
 * KB) comes from memory once and from L2 for the other slices. The order below (row slice by row slice over a
 * thread's whole output block, k in passes and chunks) streamed the block's W (1-4 MB) from L3 or memory again for
 * each slice. Llama-1B's 16 layers' matmuls on the 2-core Xeon with AMX, best of 4: 64 rows 119 -> 97 ms, 96 rows
 * 154 -> 121, 128 rows 173 -> 150, 160-256 rows 0.95-1.15 s -> 0.19-0.28 s, 512 rows 575 -> 511 ms; from 1024 rows
 * on the two orders tie (1.09 / 1.07 ms a row). A 64-row prompt step of that model: 137 -> 116 ms. Prefetching the
 * next pair's W into L2 during the current pair's slices lost (99 -> 130 ms at 33-64 rows). Same additions in the
 * same order per element: the same bits. */
#define MID_ROWS 512
/* A K of ONE_PASS_K or more leaves that order from fewer rows, MID_ROWS_ONE_PASS + SLACK_ROWS, where it fits L2: its
 * slices take a whole chunk in one pass below, whose sums stay in tiles as long as the mid order's, and whose
 * epilogue runs beside the next slice's tiles. 16 distinct weights, builds alternated in one process on the 2-core
 * Xeon with AMX, TFLOP/s: Llama-1B's K = 2048 shapes at 256-640 rows 1.80-1.89 -> 1.92-2.16, at 1536-2048 rows
 * 1.65-2.20 -> 2.36-2.49 (qkv, o, gate_up 1.13-1.43x; oneDNN 1.89-2.07 beside them), 96-200 rows tied (0.96-1.03x);
 * Qwen2.5-0.5B's down projection (896 x 4864) tied at 1536 rows, 0.94-0.98x at 519. */
#define MID_ROWS_ONE_PASS 128
#define MID_L2_BYTES (2 << 20)
#define ONE_GROUP_K 768 /* a K from which all of a call's rows make one row group (see the groups in ucm_amx_gemm) */
/* k blocks ahead that a one-pass call of two W panels prefetches them: a decode step's matmuls of Llama-1B's 16 layers
 * (1.95 GB, past L3) at 1 and 4 rows, builds alternated in one process on the 2-core Xeon with AMX: 76.0 -> 71.7 and
 * 76.4 -> 71.2 ms (25.5 -> 27.2 GB/s); 2 and 8 blocks ahead did no better. Four panels at once (block_16x64) keep the
 * memory busy without it. */
#define PF_KB 4
/* A slice of at most 16 rows (a decode step's) skips the second row tile: its two products and tile loads, the
 * zeroing and storing of its sums, all of padding rows. A call of at most 16 rows also configures its tiles with the
 * call's row count (sums and x: `load_config_rows`), so each product computes those rows alone, and reads x in place
 * instead of a padded copy. The same products of the same values for every real row: the same bits. Llama-1B's 16
 * layers' matmuls (1.95 GB) at 1 and 8 rows, builds alternated on the 2-core Xeon with AMX: 77.7-78.4 -> 72.3-72.9 ms
 * (25.0 -> 26.9 GB/s, a streaming read 31-33 GB/s in the same runs); the row tile skip alone 74 ms. A further
 * prefetch 16 k blocks ahead into L2 lost (75.5 -> 77.8 ms). Such a call takes its outputs 64 at a time
 * (block_16x64), 32 only where n ends, claimed unit by unit (claim_unit). */
#define KCB 64 /* k blocks (of 32) a chunk of a long K: a block's W (NC x 2048) and x (MC x 2048) share L2 */
/* A K whose row block's x and one pair's W are past L2 (Llama-1B's down projection, K = 8192) takes row blocks of
 * MC_PAST_L2 rows and chunks of KCB_PAST_L2 k blocks (the block's x chunk, 256 x 512 bf16, W chunk, NC x 512, and
 * sums, 256 x NC fp32, share L2): each W chunk read from memory serves twice the rows. In that shape the k chunks beat
 * the one-pass order from MID_ROWS_PAST_L2 + SLACK_ROWS rows on, not MID_ROWS'. 16 distinct weights, builds alternated
 * in one process on the 2-core Xeon with AMX, TFLOP/s: 160-384 rows 1.43-1.65 -> 1.77-2.07, a 512-token prompt beside 7
 * decodes (519 rows) 1.63-1.66 -> 1.87-1.96, 768-2048 rows 1.96-2.17 -> 2.21-2.45; 64 and 128 rows kept the one-pass
 * order (tied). 256-row blocks with 32-block chunks gained half that; every K that fits L2 did better in 128-row blocks
 * (gate_up at 2048 rows 2.01 -> 1.88 in 256). The call's last rows are padded once a call, not once a chunk: a padded
 * 7-row slice at K = 8192 had copied 32 x 8192 bf16 for each of its block's 16 chunks. A call of up to WHOLE_PAST_L2
 * rows (a 512-token prompt beside decodes) makes one row block, so that each W chunk comes from memory once a call (16
 * weights of 2048 x 8192, builds alternated: 384-576 rows +7-13%, a 519-token prompt step of Llama-1B 600 -> 585 ms);
 * its x chunk then overflows L2, and still chunks of 32 k blocks each taken in one pass (ONE_PASS_K) beat chunks of 8
 * there (519 rows 1.83 -> 2.03 TFLOP/s). With W laid out in these chunks (layout_chunk), 16 beat 32 on every row count
 * (another machine of that Xeon, 6 weights of 2048 x 8192, builds alternated, TFLOP/s, in 4 KB / 2 MB pages): 160-256
 * rows 1.55-1.75 -> 1.71-1.96, 519 rows 1.87-1.90 -> 1.98-2.03, 1024-4096 rows 1.86-1.98 -> 2.04-2.25; 8, 12, 24 and 64
 * lost to 16; 1-8 rows (a decode's one pass over the chunks) tied. The same bits. */
#define MID_ROWS_PAST_L2 64
#define MC_PAST_L2 256
#define KCB_PAST_L2 16
#define WHOLE_PAST_L2 576

#ifdef UCM_HAS_SILU16
/* silu16 of every bf16 bit pattern, as bf16 (2 more entries: the gather reads 4 bytes at each 2-byte one): the SiLU
 * epilogue looks a gate up instead of computing its exp and division, the vector work the tiles waited on. silu
 * depends on the bf16 gate alone, so the table gives silu16's bits for every gate (and elementwise.c's
 * silu_and_mul's, which computes them: tests/kernels/test_kernels_amx_gemm.py compares the two on every finite
 * gate). Qwen2.5-0.5B's gate_up (9728 x 896) at 1536 rows, builds alternated on the 2-core Xeon with AMX: 1.82 ->
 * 2.43 TFLOP/s (2.44 with no SiLU at all). Filled when the library loads: 4096 calls of silu16. */
static uint16_t silu_of_bf16[65536 + 2] __attribute__((aligned(64)));

__attribute__((constructor)) static void fill_silu_of_bf16(void) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int32_t h = 0; h < 65536; h += 16) {
        const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(h), lane), 16));
        const __m512i s = _mm512_srli_epi32(_mm512_castps_si512(silu16(g)), 16);
        _mm256_store_si256((__m256i *)(silu_of_bf16 + h), _mm512_cvtepi32_epi16(s));
    }
}

/* silu_mul16 by the table: bf16(silu(g)) * u in fp32. */
static inline __m512 silu_mul16_looked_up(__m512 g, __m512 u) {
    const __m512i s = _mm512_i32gather_epi32(_mm512_srli_epi32(_mm512_castps_si512(g), 16), silu_of_bf16, 2);
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(s, 16)), u);
}
#endif

/* Whether this build has the kernel and the OS lets this process use AMX. */
int32_t ucm_amx_available(void) {
#ifdef UCM_HAS_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* k blocks a chunk of the packed W's layout takes for in-features k (amx_gemm.py's pack lays W out so): the chunks
 * of the k passes below, KCB where a row block's x and a pair's W fit L2, else KCB_PAST_L2. Chunk after chunk, every
 * 16-output panel's k blocks of the chunk in turn: [chunk][N / 16][its k blocks][16 pairs][16 out][2], so that the
 * W a block's slices share over a chunk is one run of memory. In panel order (each panel's whole K, then the next)
 * the panels of Llama-1B's down projection (K = 8192) lay 256 KB apart, and in physically contiguous memory (a
 * model loaded into a new process, or huge pages) a chunk's 16 panels fell in the same L2 sets: 16 distinct weights
 * of 2048 x 8192 in 2 MB pages at 1536 rows, on the 2-core Xeon with AMX, 1.60 TFLOP/s in panel order, 2.26 in
 * chunks (2.22 / 2.26 in 4 KB pages); the engine's own weights ran that shape at 1.4-1.5 in a prompt step. */
static inline int fits_l2(int64_t k) { return (MC + 32) * k * 2 <= MID_L2_BYTES; } /* a row block's x and a pair's W */
static inline int64_t layout_chunk(int64_t k) { return fits_l2(k) ? KCB : KCB_PAST_L2; }

int64_t ucm_amx_layout_chunk(int64_t k) { return layout_chunk(k); }

#ifdef UCM_HAS_AMX
/* W's k block kb of panel nb (512 bf16) in layout_chunk's order, p16 = N / 16 panels. */
static inline const uint16_t *w_block(const uint16_t *wp, int64_t p16, int64_t kbs, int64_t kc, int64_t nb,
                                      int64_t kb) {
    const int64_t c0 = kb / kc * kc, len = kbs - c0 < kc ? kbs - c0 : kc;
    return wp + (c0 * p16 + nb * len + (kb - c0)) * 512;
}

/* 32 rows of x (ldx apart) x 32 outputs (panels nb, nb + 1 of p16), k blocks kb0 .. kb1 - 1 -> c[32][32] fp32: from
 * zero when kb0 is 0, else on top of the earlier k blocks' sums in c (exact: fp32 tiles stored and loaded, so the
 * same additions in the same order as one pass over every k block). */
static inline void block_32x32(const uint16_t *x, int64_t ldx, int64_t k, const uint16_t *wp, int64_t nb,
                               int64_t p16, float *c, int64_t kb0, int64_t kb1, int half) {
    const int64_t kbs = k / 32, kc = layout_chunk(k);
    if (kb0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        if (!half) {
            _tile_zero(2);
            _tile_zero(3);
        }
    } else {
        _tile_loadd(0, c, 128);
        _tile_loadd(1, c + 16, 128);
        _tile_loadd(2, c + 16 * 32, 128);
        _tile_loadd(3, c + 16 * 32 + 16, 128);
    }
    const int one_pass = kb1 - kb0 == kbs; /* few rows: W streams from memory, read once, k in one pass */
    for (int64_t s = kb0; s < kb1;) { /* the layout's chunks that kb0 .. kb1 - 1 cross: within one, a panel's run */
        const int64_t c0 = s / kc * kc, len = kbs - c0 < kc ? kbs - c0 : kc, e = c0 + len < kb1 ? c0 + len : kb1;
        const uint16_t *b0 = w_block(wp, p16, kbs, kc, nb, c0) - c0 * 512, *b1 = b0 + len * 512;
        for (int64_t kb = s; kb < e; kb++) {
            if (one_pass && kb + PF_KB < kb1) { /* the panels' next k blocks, ahead of the tile loads waiting on them */
                const int ahead = kb + PF_KB < e;
                const char *p0 = (const char *)(ahead ? b0 + (kb + PF_KB) * 512
                                                      : w_block(wp, p16, kbs, kc, nb, kb + PF_KB));
                const char *p1 = (const char *)(ahead ? b1 + (kb + PF_KB) * 512
                                                      : w_block(wp, p16, kbs, kc, nb + 1, kb + PF_KB));
                for (int i = 0; i < 1024; i += 64) {
                    _mm_prefetch(p0 + i, _MM_HINT_T0);
                    _mm_prefetch(p1 + i, _MM_HINT_T0);
                }
            }
            _tile_loadd(4, x + kb * 32, ldx * 2);
            _tile_loadd(6, b0 + kb * 512, 64);
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (!half) {
                _tile_loadd(5, x + 16 * ldx + kb * 32, ldx * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        s = e;
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (!half) {
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
    }
}

/* A call of at most 16 rows (load_config_rows): its rows x 64 outputs (panels nb .. nb + 3 of p16), one pass over k ->
 * c[2][16][32] (the pairs' sums apart). Four W panels a k block, not two: a core reads memory faster with more
 * streams in flight (a 2 GB buffer read by two threads, each its share as 1, 2 or 4 streams: 27-28, 30 and 31-32 GB/s
 * on the 2-core Xeon with AMX), and with four the prefetch ahead (PF_KB) no longer matters (off, 2 and 4 tied; 8 lost).
 * Builds alternated in one process, decode matmuls at 1 / 4 / 8 rows: Llama-1B's 16 layers 67.6 / 69.2 / 69.0 -> 64.9
 * / 65.8 / 65.6 ms (28.2 -> 29.7 GB/s at 8), its 49152-output lm_head 57.1 -> 54.0, Qwen2.5-0.5B's 24 layers 27.7 ->
 * 25.8. Tiles: sums 0-3, x 4, W 5-7 (5 again for the fourth panel, once its product has read it). Each output's
 * products are block_32x32's in the same order: the same bits. */
static inline void block_16x64(const uint16_t *x, int64_t ldx, int64_t k, const uint16_t *wp, int64_t nb, int64_t p16,
                               float *c) {
    const int64_t kbs = k / 32, kc = layout_chunk(k);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c0 = 0; c0 < kbs; c0 += kc) { /* the layout's chunks: a panel's k blocks one run in each */
        const int64_t len = kbs - c0 < kc ? kbs - c0 : kc, run = len * 512;
        const uint16_t *b = w_block(wp, p16, kbs, kc, nb, c0) - c0 * 512; /* panel nb + j's runs follow: b + j * run */
        for (int64_t kb = c0; kb < c0 + len; kb++) {
            _tile_loadd(4, x + kb * 32, ldx * 2);
            _tile_loadd(5, b + kb * 512, 64);
            _tile_loadd(6, b + run + kb * 512, 64);
            _tile_loadd(7, b + 2 * run + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 3 * run + kb * 512, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
}

/* amx_load_config, but the sums' tiles (0-3) and x's first (4) of `rows` rows: a call of at most 16 rows. */
static inline void load_config_rows(int rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t <= 4 ? (uint8_t)rows : 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* A block's c[rows][32] (panels o0 / 16 and o0 / 16 + 1) into y through `epilogue`, rounded to bf16 as torch
 * rounds (nearest even). */
static inline void store_block(const float *c, int64_t rows, uint16_t *y, int64_t ldy, int64_t n, int64_t r0,
                               int64_t o0, int32_t epilogue) {
    for (int64_t r = 0; r < rows; r++) {
        const __m512 lo = _mm512_load_ps(c + r * 32), hi = _mm512_load_ps(c + r * 32 + 16);
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        uint16_t *row = y + (r0 + r) * ldy;
        if (epilogue == EPI_PLAIN) {
            _mm512_storeu_si512((void *)(row + o0), both);
            continue;
        }
        const __m256i gate = _mm512_castsi512_si256(both), up = _mm512_extracti64x4_epi64(both, 1);
        if (epilogue == EPI_PAIRS) {
            _mm256_storeu_si256((__m256i *)(row + o0 / 2), gate);
            _mm256_storeu_si256((__m256i *)(row + n / 2 + o0 / 2), up);
        } else {
            const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(gate), 16));
            const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(up), 16));
            f32x16_store_bf16(row + o0 / 2, silu_mul16_looked_up(g, u));
        }
    }
}

/* A row slice whose sums wait in scratch for their epilogue: rows r0 .. r0 + rows - 1, outputs s0 .. s_end - 1. */
typedef struct {
    const float *c;
    int64_t rows, r0, s0, s_end;
} Pending;

/* The epilogue of the pending slice's rows lo .. hi - 1, every block of it. */
static inline void store_rows(const Pending *p, int64_t lo, int64_t hi, uint16_t *y, int64_t ldy, int64_t n,
                              int32_t epilogue) {
    for (int64_t o0 = p->s0; o0 < p->s_end && hi > lo; o0 += 32)
        store_block(p->c + (o0 - p->s0) * 32 + lo * 32, hi - lo, y, ldy, n, p->r0 + lo, o0, epilogue);
}

/* A thread's share of a few-row call's 64-output units: [front, back) in one word, so that its owner (taking the front)
 * and a thread done with its own share (taking the back) each claim a unit by one compare-and-swap. A decode step's
 * matmuls are split into equal shares, and each call waits for its slower thread: with another process on one of
 * the two cores, that thread's share waited for the core. Now a thread done first takes the other's last units.
 * Qwen2.5-0.5B's 24 layers at 8 rows, builds alternated in one process on the 2-core Xeon with AMX: 26.3 -> 26.0 ms,
 * beside a Python busy loop 55.1 -> 48.0; Llama-1B's 16 layers 67.2 -> 67.0; the engine's Qwen decode step of 8,
 * alternated twice, 37.4 / 37.1 -> 36.9 / 36.8 ms. Who computes a unit never changes how: the same bits. */
typedef struct {
    uint64_t range;
    char pad[56]; /* a share a cache line: claims on one do not contend with the other's */
} Share;

static inline uint64_t share_range(int64_t front, int64_t back) { return (uint64_t)front << 32 | (uint64_t)back; }

/* The front (from_back 0) or back unit of share s, claimed; -1 once it is empty. */
static inline int64_t claim_unit(Share *s, int from_back) {
    uint64_t w = __atomic_load_n(&s->range, __ATOMIC_ACQUIRE);
    for (;;) {
        const int64_t front = (int64_t)(w >> 32), back = (int64_t)(uint32_t)w;
        if (front >= back) return -1;
        const uint64_t next = from_back ? share_range(front, back - 1) : share_range(front + 1, back);
        if (__atomic_compare_exchange_n(&s->range, &w, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return from_back ? back - 1 : front;
    }
}

/* Unit u of a call of m <= 16 rows: outputs 64u .. 64u + 63 (block_16x64), or 32 where n ends there. */
static inline void few_rows_unit(const uint16_t *x, int64_t m, int64_t k, int64_t lda, const uint16_t *wp, int64_t n,
                                 uint16_t *y, int64_t ldy, int32_t epilogue, int64_t u, float *c) {
    const int64_t o0 = u * 64, p16 = n / 16;
    if (o0 + 64 <= n) {
        block_16x64(x, lda, k, wp, o0 / 16, p16, c);
        store_block(c, m, y, ldy, n, 0, o0, epilogue);
        store_block(c + 16 * 32, m, y, ldy, n, 0, o0 + 32, epilogue);
    } else {
        block_32x32(x, lda, k, wp, o0 / 16, p16, c, 0, k / 32, 1);
        store_block(c, m, y, ldy, n, 0, o0, epilogue);
    }
}
#endif

/* y[m][n] (bf16) = x[m][k] (bf16, rows lda apart) @ W^T, W packed by ucm_kernels/cpu/amx_gemm.py, through `epilogue`
 * (EPI_*), y's rows ldy apart (amx_gemm.py pads both off 4 KB strides, where a tile's 16 rows would share an L1 set).
 * pad: a scratch of 32 * k bf16 per thread for a last block of fewer than 32 rows. Returns 0, or 1 where this build
 * or the OS has no AMX, 2 for a shape, strides or epilogue it does not take (k or n not a multiple of 32, a row
 * stride shorter than its row), 3 where the scratch of a long K could not be allocated. */
int32_t ucm_amx_gemm(const uint16_t *x, int64_t m, int64_t k, int64_t lda, const uint16_t *wp, int64_t n, uint16_t *y,
                     int64_t ldy, uint16_t *pad, int32_t num_threads, int32_t epilogue) {
#if !defined(UCM_HAS_AMX) || !defined(UCM_HAS_SILU16)
    (void)x, (void)m, (void)k, (void)lda, (void)wp, (void)n, (void)y, (void)ldy, (void)pad, (void)num_threads;
    (void)epilogue;
    return 1;
#else
    if (!amx_permitted()) return 1;
    if (k % 32 || n % 32 || k <= 0 || n <= 0 || epilogue < EPI_PLAIN || epilogue > EPI_SILU) return 2;
    if (lda < k || ldy < (epilogue == EPI_SILU ? n / 2 : n)) return 2;
    if (m <= 0) return 0;
    if (num_threads < 1) num_threads = 1;
    /* Row groups of about RG rows, one after another, of equal size in 32-row slices (up to SLACK_ROWS more rows
     * join the groups instead of making one of their own): a group's x stays in L2 while every output block passes
     * over it. A K of ONE_GROUP_K or more makes one group: each group reads every weight once more, which cost more
     * than x kept in L2 saved. 16 distinct weights of a shape, builds alternated on the 2-core Xeon with AMX, at 1543
     * rows: Llama-1B's K = 8192 1.53-1.62 -> 1.68-1.73 TFLOP/s, its gate_up 1.86-1.96 -> 2.04-2.11, at 1024 and 2048
     * rows +2-4%; Qwen2.5-0.5B's K = 896 at 1543 and 2048 rows +3-8% (qkv 1.69-2.21 -> 2.02-2.38); SmolLM2's K = 576
     * lost up to 8% at 2048 rows. Row blocks are of equal size in slices too, at most MC rows. Which rows share a
     * block never changes a row's arithmetic. */
    const int64_t slices = (m + 31) / 32, past_slack = slices - SLACK_ROWS / 32;
    const int64_t groups = k >= ONE_GROUP_K || past_slack <= RG / 32 ? 1 : (past_slack + RG / 32 - 1) / (RG / 32);
    const int64_t widest = (slices + groups - 1) / groups; /* slices of the largest group */
    const int64_t kbs = k / 32; /* k blocks */
    const int in_l2 = fits_l2(k);
    const int mid = m <= (k < ONE_PASS_K ? MID_ROWS : in_l2 ? MID_ROWS_ONE_PASS : MID_ROWS_PAST_L2) + SLACK_ROWS;
    const int64_t chunk = layout_chunk(k); /* the packed W's chunks, which the k passes follow */
    const int chunked = !mid && m > SPLIT_ROWS && kbs > chunk;
    const int past_l2 = chunked && !in_l2;
    const int64_t mc = !past_l2 ? MC : m <= WHOLE_PAST_L2 ? (m + 31) / 32 * 32 : MC_PAST_L2; /* rows a block */
    const int64_t kcb = chunked ? chunk : kbs; /* k blocks a chunk takes (all: one chunk) */
    /* k blocks a pass over a slice takes: see KBC and ONE_PASS_K */
    const int64_t kbc = m <= SPLIT_ROWS || k >= ONE_PASS_K ? kcb : KBC;
    const int64_t mblocks = (widest + mc / 32 - 1) / (mc / 32); /* row blocks of a group */
    /* Output blocks of about NC outputs and of equal size, in 32-output panels: 576 outputs cut as 256 + 256 + 64
     * gave one of two threads twice the other's work under the static schedule (a 2048-row prompt: 23% of its
     * samples in this kernel on one thread, 14% on the other). A call of one row block (tens of rows) has its outputs
     * split finer so every thread gets a share. The split changes who computes an element, never how. */
    const int64_t panels = n / 32;
    int64_t nblocks = (panels + NC / 32 - 1) / (NC / 32);
    while (nblocks < panels && mblocks * nblocks < 4 * num_threads) nblocks *= 2;
    if (nblocks > panels) nblocks = panels;
    const int few = m <= 16;
    const int64_t block_floats = 32 * SLICE * (mc / 32) * (NC / SLICE); /* a block's slices, each its own sums */
    float *block_scratch = chunked ? aligned_alloc(64, sizeof(float) * (size_t)(block_floats * num_threads)) : NULL;
    if (chunked && block_scratch == NULL) return 3;
    const int64_t units = (n + 63) / 64; /* a few-row call's, in equal shares */
    Share shares[few ? num_threads : 1] __attribute__((aligned(64)));
    for (int32_t t = 0; few && t < num_threads; t++)
        shares[t].range = share_range(units * t / num_threads, units * (t + 1) / num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        if (few)
            load_config_rows((int)m);
        else
            amx_load_config();
        float c[2][32 * SLICE] __attribute__((aligned(64))); /* this slice's sums and the pending one's */
        Pending pending = {c[1], 0, 0, 0, 0};
#ifdef _OPENMP
        int tid = omp_get_thread_num();
#else
        int tid = 0;
#endif
        /* chunked: every slice of a block has its own sums (a block's slices are all open until its last chunk) */
        float *block_c = chunked ? block_scratch + tid * block_floats : NULL;
        uint16_t *mypad = pad + (int64_t)tid * 32 * k;
        if (!few && m % 32) { /* the call's last rows, zeros below them: every thread pads the same slice once */
            for (int64_t r = 0; r < m % 32; r++) memcpy(mypad + r * k, x + (m / 32 * 32 + r) * lda, (size_t)k * 2);
            memset(mypad + m % 32 * k, 0, (size_t)((32 - m % 32) * k) * 2);
        }
        if (few) {
            for (int64_t u; (u = claim_unit(&shares[tid], 0)) >= 0;)
                few_rows_unit(x, m, k, lda, wp, n, y, ldy, epilogue, u, c[0]);
            /* then the others' from their ends; every share, owned or not (a team may be smaller than num_threads) */
            for (int32_t v = 1; v < num_threads; v++)
                for (int64_t u; (u = claim_unit(&shares[(tid + v) % num_threads], 1)) >= 0;)
                    few_rows_unit(x, m, k, lda, wp, n, y, ldy, epilogue, u, c[0]);
        }
        for (int64_t g = 0; g < groups && !few; g++) {
            const int64_t gs0 = g * slices / groups, gs = (g + 1) * slices / groups - gs0; /* the group's slices */
#pragma omp for collapse(2) schedule(static)
            for (int64_t bn = 0; bn < nblocks; bn++) {
                for (int64_t bm = 0; bm < mblocks; bm++) {
                    const int64_t n_begin = bn * panels / nblocks * 32, n_end = (bn + 1) * panels / nblocks * 32;
                    const int64_t m_begin = (gs0 + bm * gs / mblocks) * 32;
                    const int64_t m_stop = (gs0 + (bm + 1) * gs / mblocks) * 32;
                    const int64_t m_end = m_stop < m ? m_stop : m;
                    if (mid) { /* one pass over k per (pair, slice), pairs outermost: see MID_ROWS */
                        for (int64_t o0 = n_begin; o0 < n_end; o0 += 32)
                            for (int64_t r0 = m_begin; r0 < m_end; r0 += 32) {
                                const int64_t rows = m_end - r0 < 32 ? m_end - r0 : 32;
                                const int padded = rows < 32;
                                block_32x32(padded ? mypad : x + r0 * lda, padded ? k : lda, k, wp, o0 / 16,
                                            panels * 2, c[0], 0, kbs, rows <= 16);
                                store_block(c[0], rows, y, ldy, n, r0, o0, epilogue);
                            }
                        continue;
                    }
                    if (chunked) { /* the block's slots are all written before its last chunk: nothing may wait */
                        store_rows(&pending, 0, pending.rows, y, ldy, n, epilogue);
                        pending.rows = 0;
                    }
                    for (int64_t kc0 = 0; kc0 < kbs; kc0 += kcb) {
                        const int64_t kc1 = kc0 + kcb < kbs ? kc0 + kcb : kbs;
                        const int last_chunk = kc1 == kbs;
                        for (int64_t r0 = m_begin; r0 < m_end; r0 += 32) {
                            const int64_t rows = m_end - r0 < 32 ? m_end - r0 : 32;
                            const uint16_t *xs = x + r0 * lda;
                            int64_t ldx = lda;
                            if (rows < 32) { /* the call's last rows, padded above: the same arithmetic per row */
                                xs = mypad;
                                ldx = k;
                            }
                            for (int64_t s0 = n_begin; s0 < n_end; s0 += SLICE) {
                                const int64_t s_end = s0 + SLICE < n_end ? s0 + SLICE : n_end;
                                float *sums = chunked ? block_c + ((r0 - m_begin) / 32 * (NC / SLICE) + (s0 - n_begin) / SLICE) * 32 * SLICE
                                                      : pending.c == c[0] ? c[1] : c[0];
                                /* the pending slice's rows go out in even shares, one after each block's pass */
                                const int64_t passes = (kc1 - kc0 + kbc - 1) / kbc * ((s_end - s0) / 32);
                                int64_t pass = 0;
                                for (int64_t kb0 = kc0; kb0 < kc1; kb0 += kbc)
                                    for (int64_t o0 = s0; o0 < s_end; o0 += 32, pass++) {
                                        block_32x32(xs, ldx, k, wp, o0 / 16, panels * 2, sums + (o0 - s0) * 32, kb0,
                                                    kb0 + kbc < kc1 ? kb0 + kbc : kc1, 0);
                                        store_rows(&pending, pass * pending.rows / passes,
                                                   (pass + 1) * pending.rows / passes, y, ldy, n, epilogue);
                                    }
                                if (last_chunk) pending = (Pending){sums, rows, r0, s0, s_end};
                            }
                        }
                    }
                }
            }
        }
        store_rows(&pending, 0, pending.rows, y, ldy, n, epilogue);
        _tile_release();
    }
    free(block_scratch);
    return 0;
#endif
}
