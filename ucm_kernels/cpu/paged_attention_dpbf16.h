/* The bf16 bodies of paged_attention.c on AVX-512 BF16: query rows (or keys) in vector lanes, products by VDPBF16PS.
 *
 * paged_attention_avx512.h keeps keys in the lanes: per row and 16 keys it pays a 45-shuffle horizontal sum of
 * its dot products, a horizontal max and sum, a scalar rescale and fp32 FMAs for P V: 194 GFLOPS on a 2048-token
 * prompt on the 2 cores of a Zen 5 EPYC whose bf16 GEMMs run at ~800. Here, as in paged_attention_lanes.h, an
 * item is DR = 32 query rows of ONE kv head (token-major: the GQA group's heads of ~32 / group consecutive
 * tokens) in the lanes of DV vectors, and both products are VDPBF16PS, which multiplies bf16 pairs exactly and
 * sums them into fp32 lanes:
 *   scores  S[j][rows] += (k_j[2c], k_j[2c+1]) . (q[rows][2c], q[rows][2c+1])   one broadcast dword of K a pair
 *   output  oT[c][rows] += (v_2i[c], v_2i+1[c]) . (p[rows][2i], p[rows][2i+1])  one broadcast dword of V pairs
 * A bf16 row's dword c already is the pair (x[2c], x[2c+1]), so K is read in place and q needs only a dword
 * transpose (once per item); V's pairs of keys are interleaved once per chunk of DKC keys (shared by the
 * item's 32 rows), and P is rounded to bf16 for its product with V, as flash attention does on GPUs; its
 * row sums stay fp32. The online softmax (base 2) is element-wise over the rows' lanes, once per DKC keys.
 *
 * A decode's rows (attend_dpbf16_cols) may take VDPBF16PS's products as pairs of fp32 FMAs instead, with the same
 * bits, where this CPU runs those faster (cols_products).
 *
 * Every bf16 row goes through this file, not only long prefills: a row's bits must not depend on how its prompt
 * was split (whole, in chunks, after a cache hit) or on whether it is a decode. (On CPUs with AMX, prompt rows
 * given as such run attend_dpbf16 with its products on tiles, paged_attention_amx.h, and every other row
 * paged_attention_amx_rows.h, in every step; ucm_amx_rows(0) sends those here again.) Items of fewer than DCOLS rows (a
 * decode's GQA group) run attend_dpbf16_cols, which does each row's operations in the same order with the keys or
 * the output columns in the lanes instead: bit for bit the same rows (tested). A decode is one item of all its kv
 * heads, so each chunk's block rows are read whole. Against the AVX-512 body, 2 threads: 8 decodes over 512
 * cached tokens 0.081-0.083 vs 0.078 ms a layer; 32 over 1200 (DRAM) 0.80-0.93 vs 0.73 ms.
 *
 * Part of paged_attention.c's translation unit (included after paged_attention_avx512.h, whose exp2_ps it uses).
 */
#ifndef UCM_PAGED_ATTENTION_DPBF16_H
#define UCM_PAGED_ATTENTION_DPBF16_H

#include <stdlib.h>
#include <time.h>

#include "paged_attention_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define UCM_HAS_DPBF16 1
#define DR 32         /* query rows per item, in lanes */
#define DV (DR / 16)  /* vectors of rows */
#define DKB 8         /* keys (scores) or output columns (P V) per register block: DKB * DV accumulators */
/* 8: 16 of the 32 registers accumulate, and a chunk's 64 keys and head_dim 64's columns split into whole blocks
 * (with 6, each ended in a block of 4 whose 8 chains waited on VDPBF16PS's latency). Same products, same order:
 * the bits did not change. Zen 5 EPYC, bf16, SmolLM2's heads: a 1024-token prompt 4.68 -> 4.35 ms a layer on 1
 * thread, 2.65 -> 2.55 on 2; 128 new tokens on 1152, 1.16 -> 1.07 and 0.68 -> 0.65 ms (the builds alternated). */
#define LAZY_MAX_LOG2 8.0f /* the AMX body's softmax reference lags its max by up to this (attend_dpbf16) */
#define DKC 64        /* keys per online-softmax step: the output's rescale and V's interleave, once per DKC keys */

#define DCOLS 8       /* an item with fewer rows per kv head (a decode: one token's GQA group): attend_dpbf16_cols */
#define DCOLS_HEADS 8 /* ... which takes up to this many kv heads at once (all of a decode's, where they fit) */

/* Whether a sequence's queries take this file's bodies: bf16 with head_dim a multiple of 16, whatever its row
 * count. All of a bf16 sequence's rows must: each row's result depends on the arithmetic, so a prompt computed
 * whole, in chunks, or after a cache hit (a short suffix) must meet one body. With the AVX-512 body for short
 * ones, 7 of 12 greedy continuations of a 500-token prompt after a 496-token prefix-cache hit differed from the
 * cold run (SmolLM2, bf16); the two bodies here agree bit for bit. */
static inline int dpbf16_take(const Problem *p, int32_t seq, int32_t dtype) {
    (void)seq;
    return dtype == UCM_DTYPE_BF16 && p->head_dim % 16 == 0;
}

/* Whether a bf16 sequence's `queries` (those the AMX prompt body leaves) are one item of every kv head (kv_head >=
 * num_kv_heads marks it; a lone decode's is cut by kv heads into Problem.head_parts items): few rows per head, as a
 * decode has, and heads that fit attend_dpbf16_cols. */
static inline int dpbf16_all_heads(const Problem *p, int32_t queries) {
    return queries * (p->num_q_heads / p->num_kv_heads) < DCOLS && p->num_kv_heads <= DCOLS_HEADS;
}

/* How attend_dpbf16_cols computes its products. VDPBF16PS is, by its definition, two fp32 FMAs (the odd elements'
 * product, then the even ones') that read denormal inputs as zero and flush denormal results (DAZ, FTZ); with MXCSR
 * set so, the two FMAs give its bits (tests/kernels/test_kernels_cols_products.py, denormals included). Where FMAs
 * outrun it the FMA form is faster, though each K and V dword is split into its two bf16 halves first (a shift and
 * a mask), and V is read in place, not interleaved: on the 2-core Xeon with AMX a VDPBF16PS took 0.55 ns, an FMA
 * 0.14 (two a cycle), and 8 decodes' attention over 550 keys, builds alternated in one process, ran Llama-1B's 16
 * layers in 9.9 -> 9.0 ms (K/V from memory) and 7.3 -> 6.3 (from L3), Qwen2.5-0.5B's 24 in 4.3 -> 4.0 and 3.2 ->
 * 2.9. Where VDPBF16PS does its 32 products in the time of two FMAs or less (AMD Zen 4 and 5), it stays. */
enum { COLS_UNDECIDED = 0, COLS_VDPBF16PS = 1, COLS_FMA = 2 };
static int cols_products_form = COLS_UNDECIDED;

/* Seconds for `rounds` rounds of 12 independent sums, a round one VDPBF16PS a sum or (fma) its two FMAs, on values of
 * magnitude [1, 2) (units do less on zeros). */
static double cols_products_seconds(const int fma, int64_t rounds) {
    const __m512i a = _mm512_set1_epi32(0x3fc13f93), b = _mm512_set1_epi32((int)0xbf8a3fb5u);
    const __m512i odd = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512 ah = _mm512_castsi512_ps(_mm512_and_si512(a, odd)), al = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
    const __m512 bh = _mm512_castsi512_ps(_mm512_and_si512(b, odd)), bl = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    __m512 acc[12];
    for (int j = 0; j < 12; j++) acc[j] = _mm512_setzero_ps();
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t i = 0; i < rounds; i++)
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++)
            acc[j] = fma ? _mm512_fmadd_ps(al, bl, _mm512_fmadd_ps(ah, bh, acc[j]))
                         : _mm512_dpbf16_ps(acc[j], (__m512bh)a, (__m512bh)b);
    for (int j = 0; j < 12; j++) __asm__ volatile("" : : "v"(acc[j])); /* the sums are used */
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
}

/* The form this core runs faster: the best of 5 alternated runs of each (under a millisecond in all); FMA where its
 * time is at most 2/3 of VDPBF16PS's, a margin for the split's integer operations. */
static int cols_products_probe(void) {
    double dp = 1e30, fma = 1e30;
    for (int i = 0; i < 5; i++) {
        const double t = cols_products_seconds(0, 4096), u = cols_products_seconds(1, 4096);
        dp = t < dp ? t : dp;
        fma = u < fma ? u : fma;
    }
    return 3.0 * fma <= 2.0 * dp ? COLS_FMA : COLS_VDPBF16PS;
}

/* The form in force (probed on first use; ucm_cols_products may set it). */
static inline int cols_products(void) {
    int form = __atomic_load_n(&cols_products_form, __ATOMIC_RELAXED);
    if (form == COLS_UNDECIDED) {
        form = cols_products_probe();
        __atomic_store_n(&cols_products_form, form, __ATOMIC_RELAXED);
    }
    return form;
}

/* S[j][0:DR] = scale * sum_c kp[j][c] . qT[c][0:DR] over the d2 dword pairs, for kb (<= DKB) keys. */
ALWAYS_INLINE void dp_qk(float *S, const uint32_t *qT, const uint32_t *const *kp, int kb, int d2, __m512 scale) {
    __m512 a[DKB][DV];
#pragma GCC unroll 8
    for (int j = 0; j < kb; j++)
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) a[j][v] = _mm512_setzero_ps();
    for (int c = 0; c < d2; c++) {
        __m512bh q[DV];
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) q[v] = (__m512bh)_mm512_load_si512(qT + c * DR + v * 16);
#pragma GCC unroll 8
        for (int j = 0; j < kb; j++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)kp[j][c]);
#pragma GCC unroll 2
            for (int v = 0; v < DV; v++) a[j][v] = _mm512_dpbf16_ps(a[j][v], q[v], b);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < kb; j++)
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) _mm512_store_ps(S + j * DR + v * 16, _mm512_mul_ps(a[j][v], scale));
}

/* oT[c0 + i][0:DR] = oT[c0 + i][0:DR] * alpha + sum_j Vp[j][c0 + i] . Pp[j][0:DR] over n2 key pairs, for cb
 * (<= DKB) columns. */
ALWAYS_INLINE void dp_pv(float *oT, const uint32_t *Pp, const uint32_t *Vp, const __m512 *alpha, int n2, int c0,
                         int cb, int d) {
    __m512 a[DKB][DV];
#pragma GCC unroll 8
    for (int i = 0; i < cb; i++)
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) a[i][v] = _mm512_mul_ps(_mm512_load_ps(oT + (c0 + i) * DR + v * 16), alpha[v]);
    for (int j = 0; j < n2; j++) {
        __m512bh w[DV];
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) w[v] = (__m512bh)_mm512_load_si512(Pp + j * DR + v * 16);
        const uint32_t *vj = Vp + (int64_t)j * d + c0;
#pragma GCC unroll 8
        for (int i = 0; i < cb; i++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)vj[i]);
#pragma GCC unroll 2
            for (int v = 0; v < DV; v++) a[i][v] = _mm512_dpbf16_ps(a[i][v], w[v], b);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < cb; i++)
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) _mm512_store_ps(oT + (c0 + i) * DR + v * 16, a[i][v]);
}

/* Two fp32 vectors rounded to bf16 (nearest even) and interleaved: dword r = (lo[r], hi[r]), lo in the low half. */
ALWAYS_INLINE __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* lo's 16 words, then hi's */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(pairs, words);
}

/* V's keys in pairs for one chunk: Vp[i][c] = (v_2i[c], v_2i+1[c]), read one broadcast dword at a time. */
ALWAYS_INLINE void interleave_v_pairs(uint32_t *Vp, const uint16_t *const *vp, int nk, int d) {
    static const uint16_t zeros[MAX_D]; /* the odd partner of a chunk's last key when nk is odd */
    /* word 2c of the 32 dwords for columns c0 .. c0 + 31 is ve[c], word 2c + 1 is vo[c] (vo's words are 32..63) */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int i = 0; i < (nk + 1) / 2; i++) {
        const uint16_t *ve = vp[2 * i], *vo = 2 * i + 1 < nk ? vp[2 * i + 1] : zeros;
        int c = 0;
        for (; c + 32 <= d; c += 32) {
            const __m512i e = _mm512_loadu_si512(ve + c), o = _mm512_loadu_si512(vo + c);
            _mm512_store_si512(Vp + (int64_t)i * d + c, _mm512_permutex2var_epi16(e, lo, o));
            _mm512_store_si512(Vp + (int64_t)i * d + c + 16, _mm512_permutex2var_epi16(e, hi, o));
        }
        for (; c < d; c += 16) {
            const __m512i e = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(ve + c)));
            const __m512i o = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vo + c)));
            _mm512_store_si512(Vp + (int64_t)i * d + c, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
        }
    }
}

_Static_assert(DKB == 8, "SWITCH_UP_TO_8 unrolls blocks of up to 8");

/* 16 x 16 dwords transposed in registers: r[i][j] -> r[j][i]. */
ALWAYS_INLINE void transpose16x16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) { /* 128-bit lanes: [a0 b0 a2 b2] and [a1 b1 a3 b3] over rows i and i + 4 */
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], _MM_SHUFFLE(2, 0, 2, 0));
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], _MM_SHUFFLE(3, 1, 3, 1));
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], _MM_SHUFFLE(2, 0, 2, 0));
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], _MM_SHUFFLE(3, 1, 3, 1));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], _MM_SHUFFLE(2, 0, 2, 0));
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], _MM_SHUFFLE(3, 1, 3, 1));
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], _MM_SHUFFLE(2, 0, 2, 0));
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* qT[c][r] = dword c (dims 2c, 2c + 1) of row r's q, r < DR, c < d2: 16 x 16 blocks of dwords transposed, the last
 * d2 % 16 columns one at a time. It had been a 4-byte copy a dword and a scalar store a float to zero oT, both per row:
 * ~10% of the AMX prompt body's time (Llama-1B's and Qwen2.5-0.5B's heads, 2048 tokens, 2-core Xeon with AMX). */
ALWAYS_INLINE void transpose_q(uint32_t *qT, const uint16_t *const *qrow, int d2) {
    for (int r0 = 0; r0 < DR; r0 += 16) {
        int c0 = 0;
        for (; c0 + 16 <= d2; c0 += 16) {
            __m512i t[16];
            for (int i = 0; i < 16; i++) t[i] = _mm512_loadu_si512(qrow[r0 + i] + 2 * c0);
            transpose16x16_epi32(t);
            for (int c = 0; c < 16; c++) _mm512_store_si512(qT + (c0 + c) * DR + r0, t[c]);
        }
        for (int r = r0; r < r0 + 16; r++)
            for (int c = c0; c < d2; c++) memcpy(qT + c * DR + r, qrow[r] + 2 * c, 4);
    }
}

typedef struct TileWork TileWork; /* paged_attention_amx.h: the tile work the AMX body's softmax runs beside */
#include "paged_attention_amx.h"
#ifndef UCM_HAS_AMX_ATTN
struct TileWork {
    int none;
};
ALWAYS_INLINE void tile_step(TileWork *t) { (void)t; }
ALWAYS_INLINE void prefetch_pair(const TileWork *t, int i) { (void)t, (void)i; }
#endif

/* One chunk's weights p = 2^(s - m) of every row (lanes): their sum added pair by pair into sum, the pairs
 * rounded to bf16 into Pp. all_live (a constant where inlined): no key of the chunk is masked and nk is even, so
 * the masks that zero a masked key's weight (exp2_ps clamps at 2^-127: a denormal, not 0) would keep every lane.
 * amx (a constant): S holds unscaled scores and p = 2^(s * scale - m) by exp2_short_ps, the AMX body's weights
 * (its own bits: no other body computes a prompt row on a CPU with AMX). */
ALWAYS_INLINE void dp_weights(const float *S, uint32_t *Pp, const __m512 *m, __m512 *sum, int n2, int nk,
                              const int all_live, const int amx, __m512 scale, const int dv, TileWork *tw) {
    for (int i = 0; i < n2; i++) {
        if (amx && i % 4 == 3) tile_step(tw);
        if (amx) prefetch_pair(tw, i);
#pragma GCC unroll 2
        for (int v = 0; v < dv; v++) {
            const __m512 se = _mm512_load_ps(S + 2 * i * DR + v * 16);
            const __m512 so = 2 * i + 1 < nk ? _mm512_load_ps(S + (2 * i + 1) * DR + v * 16)
                                             : _mm512_set1_ps(-INFINITY);
            __m512 pe, po;
            if (amx) {
                const __m512 nm = _mm512_sub_ps(_mm512_setzero_ps(), m[v]);
                pe = exp2_short_ps(_mm512_fmadd_ps(se, scale, nm), all_live);
                po = exp2_short_ps(_mm512_fmadd_ps(so, scale, nm), all_live);
            } else {
                pe = exp2_ps(_mm512_sub_ps(se, m[v]));
                po = exp2_ps(_mm512_sub_ps(so, m[v]));
            }
            if (!all_live) {
                pe = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(se, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), pe);
                po = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(so, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), po);
            }
            sum[v] = _mm512_add_ps(sum[v], _mm512_add_ps(pe, po));
            _mm512_store_si512(Pp + i * DR + v * 16, bf16_pairs(pe, po));
        }
    }
}

/* The head-h rows of keys start .. start + nk - 1 of a sequence (block table `table`): kp[j] key j's K (AMX with
 * blocks of a multiple of 16 keys: the first of each 16, which qk_step reads in place), vp[j] its V (not with AMX). */
ALWAYS_INLINE void chunk_keys(const Problem *p, const int32_t *table, int32_t start, int nk, int32_t h, const int amx,
                              const uint32_t **kp, const uint16_t **vp, int64_t *at) {
    const uint16_t *const kbase = (const uint16_t *)p->k_cache, *const vbase = (const uint16_t *)p->v_cache;
#ifdef UCM_HAS_AMX_ATTN
    const int32_t bs = p->block_size;
    if (amx && bs % 16 == 0) {
        for (int j0 = 0; j0 < nk; j0 += 16)
            kp[j0] = (const uint32_t *)(kbase + cache_offset(p, table[(start + j0) / bs], (start + j0) % bs, h));
        return;
    }
#else
    (void)amx;
#endif
    key_offsets(p, table, start, nk, h, at);
    for (int j = 0; j < nk; j++) {
        kp[j] = (const uint32_t *)(kbase + at[j]);
        vp[j] = vbase + at[j];
    }
}

/* One item: rows row0 .. min(row0 + DR, row_end) - 1 of kv head h of sequence seq, row = token * group + head in
 * group. amx (a constant): the products on AMX tiles (paged_attention_amx.h), for prompt rows. */
ALWAYS_INLINE void attend_dpbf16(const Problem *p, int32_t seq, int32_t h, int32_t row0, int32_t row_end, int d,
                                 const int amx, const int dv) {
    const int32_t group = p->num_q_heads / p->num_kv_heads, n = num_queries(p, seq), len = p->seq_lens[seq];
    const int32_t q0 = p->query_start_loc ? p->query_start_loc[seq] : seq, bs = p->block_size;
    const int32_t nrows = row_end - row0 < DR ? row_end - row0 : DR, d2 = d / 2;
    const int32_t *table = table_of(p, seq);
    if (len == 0) { /* a padding sequence (a decode row of a wide GQA group) */
        zero_lane_rows(p, q0, h, row0, nrows, 2);
        return;
    }
    _Alignas(64) uint32_t qT[MAX_D / 2 * DR], Pp2[2][DKC / 2 * DR], Vp[DKC / 2 * MAX_D];
    _Alignas(64) float oT[MAX_D * DR], S2[2][DKC * DR];
#ifdef UCM_HAS_AMX_ATTN
    _Alignas(64) uint16_t Kc[16 * MAX_D];
    const int64_t key_stride = (int64_t)p->num_kv_heads * d * 2;
    const int k_ahead = 16 * key_stride > 4096 && bs % 16 == 0; /* prefetch_pair's K: a 16-key group crosses pages */
    if (amx) amx_load_config();
    /* The item a thread likely takes next (ucm_paged_attention runs them in descending order; AMX items go kv head
     * by kv head): its q rows into L2. Each item's first reads of q (8 token rows, a qkv row apart) missed every
     * cache and came to 11% of the prompt body's samples; prefetched, Llama's 2048-token prompt 3-6% faster on the
     * 2-core Xeon with AMX. A hint: nothing computed changes. */
    if (amx && row0 >= DR) {
        const int32_t lo = row0 - (row0 >= 2 * DR ? 2 * DR : DR);
        for (int32_t tok = lo / group; tok <= (row0 - 1) / group; tok++) {
            const char *q = (const char *)((const uint16_t *)p->q + (int64_t)(q0 + tok) * p->q_stride_tok +
                                           (int64_t)h * group * p->q_stride_head);
            for (int64_t b = 0; b < ((int64_t)(group - 1) * p->q_stride_head + d) * 2; b += 64)
                _mm_prefetch(q + b, _MM_HINT_T1);
        }
    }
#endif
    const uint32_t *kp[DKC];
    const uint16_t *vp[DKC];
    int64_t at[DKC];
    _Alignas(64) int32_t pos[DR];
    /* Rows past the sequence's last (the item's tail) copy the last real row and are never stored. */
    const uint16_t *qrow[DR];
    for (int32_t r = 0; r < DR; r++) {
        const int32_t row = row0 + (r < nrows ? r : nrows - 1), tok = row / group, head = h * group + row % group;
        qrow[r] = (const uint16_t *)p->q + (int64_t)(q0 + tok) * p->q_stride_tok + (int64_t)head * p->q_stride_head;
        pos[r] = len - n + tok;
    }
    transpose_q(qT, qrow, d2);
    for (int i = 0; i < d * DR; i += 16) _mm512_store_ps(oT + i, _mm512_setzero_ps());
    __m512 m[DV], l[DV], alpha[DV];
    __m512i posv[DV];
#pragma GCC unroll 2
    for (int v = 0; v < dv; v++) {
        m[v] = _mm512_set1_ps(-INFINITY);
        l[v] = _mm512_setzero_ps();
        posv[v] = _mm512_load_si512(pos + v * 16);
    }
    const __m512 scale = _mm512_set1_ps(p->scale_log2);
    const int32_t first = pos[0], last = pos[DR - 1]; /* token-major rows: positions ascend */
    TileWork tw = {0};
#ifdef UCM_HAS_AMX_ATTN
    if (amx) { /* the first chunk's scores; each chunk's softmax runs beside the next one's (TileWork) */
        tw = (TileWork){.oT = oT, .qT = qT, .kp = kp, .Kc = Kc, .key_stride = key_stride, .bs = bs, .d = d, .dv = dv};
        tw.pv_col = d; /* no P V waits */
        tw.S = S2[0];
        tw.nk = last + 1 < DKC ? last + 1 : DKC;
        chunk_keys(p, table, 0, tw.nk, h, amx, kp, vp, at);
        tile_drain(&tw);
    }
#endif
    for (int32_t start = 0, i = 0; start <= last; start += DKC, i++) {
        const int nk = last - start + 1 < DKC ? last - start + 1 : DKC, n2 = (nk + 1) / 2;
        float *const S = S2[i & 1];
        uint32_t *const Pp = Pp2[i & 1];
#ifdef UCM_HAS_AMX_ATTN
        if (amx) { /* the next chunk's scores, as tile steps (the last chunk's P V is set before them, below) */
            const int32_t next = start + DKC;
            tw.S = S2[(i + 1) & 1];
            tw.start = next;
            tw.qk_key = 0;
            tw.nk = next <= last ? (last - next + 1 < DKC ? last - next + 1 : DKC) : 0;
            if (tw.nk) chunk_keys(p, table, next, tw.nk, h, amx, kp, vp, at);
            const int32_t after = next + DKC; /* prefetch_pair's lines */
            tw.ahead_keys = !k_ahead || after > last ? 0 : last - after + 1 < DKC ? last - after + 1 : DKC;
            for (int g = 0; g * 16 < tw.ahead_keys; g++)
                tw.ahead[g] = (const char *)((const uint16_t *)p->k_cache +
                                             cache_offset(p, table[(after + g * 16) / bs], (after + g * 16) % bs, h));
            tw.vt_ahead = (const char *)amx_vt_chunk(p, seq, h, start / DKC);
        } else
#endif
        {
            chunk_keys(p, table, start, nk, h, amx, kp, vp, at);
            for (int j = 0; j < nk; j += DKB) {
#define QK(N) dp_qk(S + j * DR, qT, kp + j, N, d2, scale)
                SWITCH_UP_TO_8(nk - j, QK)
#undef QK
            }
        }
        if (!amx) interleave_v_pairs(Vp, vp, nk, d); /* AMX: the call's V^T (amx_build_vt) */
        __m512 mx[DV], sum[DV];
#pragma GCC unroll 2
        for (int v = 0; v < dv; v++) mx[v] = m[v];
        const int diag = start + nk - 1 > first; /* some row stops inside this chunk: mask the keys past it */
#ifdef UCM_HAS_AMX_ATTN
        if (amx) amx_mask_max(S, nk, start, diag, posv, scale, mx, dv, &tw);
        else
#endif
        {
            if (diag)
                for (int j = 0; j < nk; j++) {
                    const __m512i key = _mm512_set1_epi32(start + j);
#pragma GCC unroll 2
                    for (int v = 0; v < dv; v++) {
                        const __mmask16 past = _mm512_cmpgt_epi32_mask(key, posv[v]);
                        _mm512_mask_store_ps(S + j * DR + v * 16, past, _mm512_set1_ps(-INFINITY));
                    }
                }
            for (int j = 0; j < nk; j++)
#pragma GCC unroll 2
                for (int v = 0; v < dv; v++) mx[v] = _mm512_max_ps(mx[v], _mm512_load_ps(S + j * DR + v * 16));
        }
#pragma GCC unroll 2
        for (int v = 0; v < dv; v++) {
            /* AMX: a row's reference rises only past its max by more than LAZY_MAX_LOG2 (weights up to 2^that, in
             * fp32 and bf16 alike), so that the output's rescale (pv_step) runs only in the few chunks where
             * some row's does; elsewhere m is the running max. */
            if (amx) {
                const __m512 lagged = _mm512_add_ps(m[v], _mm512_set1_ps(LAZY_MAX_LOG2));
                mx[v] = _mm512_mask_mov_ps(m[v], _mm512_cmp_ps_mask(mx[v], lagged, _CMP_GT_OQ), mx[v]);
            }
            /* first chunk: m = -inf, alpha ~ 0 on a zero output (every row sees key 0, so mx is finite) */
            alpha[v] = exp2_ps(_mm512_sub_ps(m[v], mx[v]));
            m[v] = mx[v];
            sum[v] = _mm512_setzero_ps();
        }
        if (!diag && nk == DKC) /* no masked key, no odd partner */
            dp_weights(S, Pp, m, sum, n2, nk, 1, amx, scale, dv, &tw);
        else dp_weights(S, Pp, m, sum, n2, nk, 0, amx, scale, dv, &tw);
#pragma GCC unroll 2
        for (int v = 0; v < dv; v++) l[v] = _mm512_add_ps(_mm512_mul_ps(l[v], alpha[v]), sum[v]);
#ifdef UCM_HAS_AMX_ATTN
        if (amx) { /* the steps left, then this chunk's P V waits for the next chunk's softmax */
            tile_drain(&tw);
            tw.Pp = Pp;
            tw.VT = amx_vt_chunk(p, seq, h, start / DKC);
            tw.n2 = n2;
            tw.pv_col = 0;
#pragma GCC unroll 2
            for (int v = 0; v < dv; v++) tw.alpha[v] = alpha[v];
        } else
#endif
            for (int c = 0; c < d; c += DKB) {
#define PV(N) dp_pv(oT, Pp, Vp, alpha, n2, c, N, d)
                SWITCH_UP_TO_8(d - c, PV)
#undef PV
            }
    }
#ifdef UCM_HAS_AMX_ATTN
    if (amx) {
        tile_drain(&tw); /* the last chunk's P V */
        _tile_release();
    }
#endif
    _Alignas(64) float inv[DR];
#pragma GCC unroll 2
    for (int v = 0; v < dv; v++) _mm512_store_ps(inv + v * 16, _mm512_div_ps(_mm512_set1_ps(1.0f), l[v]));
    for (int32_t r0 = 0; r0 < nrows; r0 += 16) /* oT's 16 x 16 blocks turned to rows: o[c] = bf16(oT[c][r] * inv[r]) */
        for (int c0 = 0; c0 < d; c0 += 16) {
            __m512i t[16];
            for (int c = 0; c < 16; c++) t[c] = _mm512_load_si512(oT + (c0 + c) * DR + r0);
            transpose16x16_epi32(t);
            for (int32_t r = 0; r < 16 && r0 + r < nrows; r++) {
                const int32_t row = row0 + r0 + r, tok = row / group, head = h * group + row % group;
                uint16_t *o = (uint16_t *)p->out + ((int64_t)(q0 + tok) * p->num_q_heads + head) * d + c0;
                const __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(t[r]), _mm512_set1_ps(inv[r0 + r]));
                _mm256_storeu_si256((__m256i *)o, bf16x16_pack(x));
            }
        }
}

/* The P V accumulators of dp_cols_pv and dp_cols_pv_fma: nv vectors of columns from c of every row's output, scaled
 * by the row's alpha (the online softmax's rescale), and back into o. Inlined with nrows and nv constant, the
 * accumulators stay in registers. */
ALWAYS_INLINE void pv_acc_rescaled(__m512 a[DCOLS][4], const float *o, const float *alpha, const int32_t nrows, int d,
                                   int c, const int nv) {
#pragma GCC unroll 8
    for (int32_t r = 0; r < nrows; r++)
#pragma GCC unroll 4
        for (int b = 0; b < nv; b++)
            a[r][b] = _mm512_mul_ps(_mm512_load_ps(o + r * d + c + 16 * b), _mm512_set1_ps(alpha[r]));
}

ALWAYS_INLINE void pv_acc_store(__m512 a[DCOLS][4], float *o, const int32_t nrows, int d, int c, const int nv) {
#pragma GCC unroll 8
    for (int32_t r = 0; r < nrows; r++)
#pragma GCC unroll 4
        for (int b = 0; b < nv; b++) _mm512_store_ps(o + r * d + c + 16 * b, a[r][b]);
}

/* dp_cols_rows' P V for output columns c .. c + 16 * nb - 1 of every row (nb, nrows: constants where it is
 * inlined): o[r][cols] = o[r][cols] * alpha[r] + sum over the n2 key pairs of P16's pair . Vp's pair, in order. */
ALWAYS_INLINE void dp_cols_pv(const uint32_t *Vp, const uint16_t *P16, float *o, const float *alpha,
                              const int32_t nrows, int n2, int d, int c, const int nb) {
    __m512 a[DCOLS][4];
    pv_acc_rescaled(a, o, alpha, nrows, d, c, nb);
    for (int i = 0; i < n2; i++) {
        __m512bh vc[4];
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) vc[b] = (__m512bh)_mm512_load_si512(Vp + (int64_t)i * d + c + 16 * b);
#pragma GCC unroll 8
        for (int32_t r = 0; r < nrows; r++) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(P16 + r * (DKC + 16)))[i]);
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++) a[r][b] = _mm512_dpbf16_ps(a[r][b], pr, vc[b]);
        }
    }
    pv_acc_store(a, o, nrows, d, c, nb);
}

/* dp_cols_pv in FMA form (cols_products): output columns c .. c + 32 * nb - 1, each 32 of them kept as their 16 even
 * columns then their 16 odd ones (a V row's bf16 dwords split by a shift and a mask: no interleave), or (nb 0) the
 * 16 columns from c in order; each key pair's VDPBF16PS is its two FMAs, the odd key's first. vp: each key's V row of
 * this kv head; Pf: P16 as fp32. */
ALWAYS_INLINE void dp_cols_pv_fma(const uint16_t *const *vp, const float *Pf, float *o, const float *alpha,
                                  const int32_t nrows, int nk, int n2, int d, int c, const int nb) {
    static const uint16_t zeros[MAX_D]; /* the odd partner of a chunk's last key when nk is odd */
    const __m512i odd = _mm512_set1_epi32((int)0xFFFF0000u);
    const int nv = nb ? 2 * nb : 1; /* vectors of columns */
    __m512 a[DCOLS][4];
    pv_acc_rescaled(a, o, alpha, nrows, d, c, nv);
    for (int i = 0; i < n2; i++)
#pragma GCC unroll 2
        for (int e = 1; e >= 0; e--) {
            const int j = 2 * i + e;
            const uint16_t *vr = j < nk ? vp[j] + c : zeros;
            __m512 vh[4];
            if (nb == 0) vh[0] = bf16x16_to_f32(vr);
#pragma GCC unroll 2
            for (int b = 0; b < nb; b++) {
                const __m512i vv = _mm512_loadu_si512(vr + 32 * b);
                vh[2 * b] = _mm512_castsi512_ps(_mm512_slli_epi32(vv, 16));
                vh[2 * b + 1] = _mm512_castsi512_ps(_mm512_and_si512(vv, odd));
            }
#pragma GCC unroll 8
            for (int32_t r = 0; r < nrows; r++) {
                const __m512 pr = _mm512_set1_ps(Pf[r * (DKC + 16) + j]);
#pragma GCC unroll 4
                for (int b = 0; b < nv; b++) a[r][b] = _mm512_fmadd_ps(pr, vh[b], a[r][b]);
            }
        }
    pv_acc_store(a, o, nrows, d, c, nv);
}

/* attend_dpbf16_cols' work on one chunk for the rows of one kv head: scores (each Kt vector loaded once for the
 * rows), the online softmax's step, P V (each Vp vector loaded once for the rows). */
ALWAYS_INLINE void dp_cols_rows(const uint32_t *Kt, const uint32_t *Vp, const uint32_t *const *qrow, const int32_t *pos,
                                float *m, float *l, float *o, float *w, uint16_t *P16, const int32_t nrows, int32_t start,
                                int nk, int n2, int ng, int d2, int d, __m512 scale, __m512 ninf, __m512i lane_ids,
                                const int fma, const uint16_t *const *vp) {
    /* nrows is a constant here (dp_cols_rows_n), and every loop over rows or key groups has a constant bound, so
     * the accumulators stay in registers: with a run-time row count they lived on the stack, and each VDPBF16PS
     * waited on a store and a load. Groups past ng compute on stale Kt and are never read. */
    __m512 acc[DCOLS][DKC / 16];
#pragma GCC unroll 8
    for (int32_t r = 0; r < nrows; r++)
#pragma GCC unroll 4
        for (int g = 0; g < DKC / 16; g++) acc[r][g] = _mm512_setzero_ps();
    _Alignas(64) float qf[DCOLS * MAX_D];      /* fma: the rows' q as fp32 */
    _Alignas(64) float Pf[DCOLS * (DKC + 16)]; /* fma: P16 as fp32 */
    if (fma) { /* each Kt dword split into its keys' odd and even elements; the odd product first, as VDPBF16PS */
        const __m512i odd = _mm512_set1_epi32((int)0xFFFF0000u);
#pragma GCC unroll 8
        for (int32_t r = 0; r < nrows; r++)
            for (int c = 0; c < d; c += 16) _mm512_store_ps(qf + r * d + c, bf16x16_to_f32((const uint16_t *)qrow[r] + c));
        const int gp = nrows <= 5 ? 4 : 2; /* key groups a pass: gp * nrows sums in registers, not spilled */
#pragma GCC unroll 2
        for (int g0 = 0; g0 < DKC / 16; g0 += gp) {
            for (int c = 0; c < d2; c++) {
#pragma GCC unroll 4
                for (int g = g0; g < g0 + gp; g++) {
                    const __m512i kv = _mm512_load_si512(Kt + c * DKC + 16 * g);
                    const __m512 kh = _mm512_castsi512_ps(_mm512_and_si512(kv, odd));
                    const __m512 kl = _mm512_castsi512_ps(_mm512_slli_epi32(kv, 16));
#pragma GCC unroll 8
                    for (int32_t r = 0; r < nrows; r++) {
                        const __m512 high = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * d + 2 * c + 1]), kh, acc[r][g]);
                        acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * d + 2 * c]), kl, high);
                    }
                }
            }
        }
    } else
        for (int c = 0; c < d2; c++) {
            __m512bh kc[DKC / 16];
#pragma GCC unroll 4
            for (int g = 0; g < DKC / 16; g++) kc[g] = (__m512bh)_mm512_load_si512(Kt + c * DKC + 16 * g);
#pragma GCC unroll 8
            for (int32_t r = 0; r < nrows; r++) {
                const __m512bh qc = (__m512bh)_mm512_set1_epi32((int)qrow[r][c]);
#pragma GCC unroll 4
                for (int g = 0; g < DKC / 16; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qc, kc[g]);
            }
        }
    float alpha[DCOLS];
#pragma GCC unroll 8
    for (int32_t r = 0; r < nrows; r++) {
        __m512 mxv = _mm512_set1_ps(m[r]);
        __mmask16 live[DKC / 16];
#pragma GCC unroll 4
        for (int g = 0; g < DKC / 16; g++) {
            if (g >= ng) break;
            const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(start + 16 * g), lane_ids);
            const int in_chunk = nk - 16 * g < 16 ? nk - 16 * g : 16;
            live[g] = (__mmask16)(_mm512_cmple_epi32_mask(key, _mm512_set1_epi32(pos[r])) &
                                  ((1u << in_chunk) - 1u));
            acc[r][g] = _mm512_mask_blend_ps(live[g], ninf, _mm512_mul_ps(acc[r][g], scale));
            mxv = _mm512_max_ps(mxv, acc[r][g]);
        }
        const float mx = _mm512_reduce_max_ps(mxv);
        alpha[r] = _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(m[r] - mx)));
        m[r] = mx;
        float *wr = w + r * (DKC + 16);
#pragma GCC unroll 4
        for (int g = 0; g < DKC / 16; g++) {
            if (g >= ng) break;
            const __m512 pg = _mm512_maskz_mov_ps(live[g], exp2_ps(_mm512_sub_ps(acc[r][g], _mm512_set1_ps(mx))));
            _mm512_store_ps(wr + 16 * g, pg);
            const __m256i pb = (__m256i)_mm512_cvtneps_pbh(pg);
            if (fma)
                _mm512_store_ps(Pf + r * (DKC + 16) + 16 * g,
                                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
            else
                _mm256_store_si256((__m256i *)(P16 + r * (DKC + 16) + 16 * g), pb);
        }
        wr[nk] = 0.0f; /* the odd partner past the chunk's last key (there: a masked key, weight 0) */
        if (fma) Pf[r * (DKC + 16) + nk] = 0.0f;
        else P16[r * (DKC + 16) + nk] = 0;
    }
    /* Each row's weights summed pair by pair in order, as attend_dpbf16 sums them; the rows' chains of dependent
     * adds side by side instead of one after another. */
    float sum[DCOLS];
#pragma GCC unroll 8
    for (int32_t r = 0; r < nrows; r++) sum[r] = 0.0f;
    for (int i = 0; i < n2; i++)
#pragma GCC unroll 8
        for (int32_t r = 0; r < nrows; r++) sum[r] = sum[r] + (w[r * (DKC + 16) + 2 * i] + w[r * (DKC + 16) + 2 * i + 1]);
#pragma GCC unroll 8
    for (int32_t r = 0; r < nrows; r++) l[r] = l[r] * alpha[r] + sum[r];
    /* P V for every row: each Vp vector loaded once for the item's rows; 4 column blocks at once, so that
     * 4 * nrows sums are in flight instead of nrows (each element's sum still runs over the pairs in order). */
    int c = 0;
    if (fma) {
        if (nrows <= 5)
            for (; c + 64 <= d; c += 64) dp_cols_pv_fma(vp, Pf, o, alpha, nrows, nk, n2, d, c, 2);
        for (; c + 32 <= d; c += 32) dp_cols_pv_fma(vp, Pf, o, alpha, nrows, nk, n2, d, c, 1);
        for (; c < d; c += 16) dp_cols_pv_fma(vp, Pf, o, alpha, nrows, nk, n2, d, c, 0);
        return;
    }
    for (; c + 64 <= d; c += 64) dp_cols_pv(Vp, P16, o, alpha, nrows, n2, d, c, 4);
    for (; c < d; c += 16) dp_cols_pv(Vp, P16, o, alpha, nrows, n2, d, c, 1);
}

_Static_assert(DCOLS == 8, "dp_cols_rows_n instantiates row counts 1 .. 8");

/* dp_cols_rows with its row count a constant, one instance per count. */
ALWAYS_INLINE void dp_cols_rows_n(const uint32_t *Kt, const uint32_t *Vp, const uint32_t *const *qrow,
                                  const int32_t *pos, float *m, float *l, float *o, float *w, uint16_t *P16,
                                  int32_t nrows, int32_t start, int nk, int n2, int ng, int d2, int d, __m512 scale,
                                  __m512 ninf, __m512i lane_ids, const int fma, const uint16_t *const *vp) {
#define ROWS(N) dp_cols_rows(Kt, Vp, qrow, pos, m, l, o, w, P16, N, start, nk, n2, ng, d2, d, scale, ninf, lane_ids, fma, vp)
    switch (nrows) {
    case 1: ROWS(1); break;
    case 2: ROWS(2); break;
    case 3: ROWS(3); break;
    case 4: ROWS(4); break;
    case 5: ROWS(5); break;
    case 6: ROWS(6); break;
    case 7: ROWS(7); break;
    default: ROWS(8); break;
    }
#undef ROWS
}

/* at[j] = the cache offset of key start + j's row (kv head 0 of the item: later heads are d elements on), for the
 * DKC-key chunk from `start` up to key `last`; returns how many keys that is (0 past `last`). One walk of the block
 * table per chunk, shared by the chunk's prefetch (a chunk ahead) and its work. */
ALWAYS_INLINE int chunk_offsets(const Problem *p, const int32_t *table, int32_t start, int32_t last, int64_t *at,
                                int32_t h_lo) {
    const int nk = start > last ? 0 : last - start + 1 < DKC ? last - start + 1 : DKC;
    key_offsets(p, table, start, nk, h_lo, at);
    return nk;
}

/* One sequence's rows in attend_dpbf16_cols: where its queries are, their positions and their online softmax's
 * state (o: the caller's [nh][DCOLS][d] floats). */
typedef struct {
    const int32_t *table;
    const uint32_t *qrow[DCOLS_HEADS][DCOLS];
    float m[DCOLS_HEADS][DCOLS], l[DCOLS_HEADS][DCOLS];
    int32_t pos[DCOLS];
    int32_t seq, q0, row0, nrows, h_lo, nh, last;
    float *o;
} ColsRows;

/* s for rows row0.. of sequence seq, kv heads h_lo .. h_hi - 1; 0 when there is nothing to compute (a padding
 * sequence's rows are zeroed here). */
static inline int cols_begin(const Problem *p, int32_t seq, int32_t h_lo, int32_t h_hi, int32_t row0, int d, float *o,
                             ColsRows *s) {
    const int32_t group = p->num_q_heads / p->num_kv_heads, n = num_queries(p, seq), len = p->seq_lens[seq];
    const int32_t q0 = p->query_start_loc ? p->query_start_loc[seq] : seq;
    const int32_t nrows = n * group - row0 < DR ? n * group - row0 : DR, nh = h_hi - h_lo;
    if (nrows <= 0 || nrows > DCOLS || nh <= 0 || nh > DCOLS_HEADS) return 0; /* items are made within these */
    if (len == 0) { /* a padding sequence */
        for (int32_t h = h_lo; h < h_hi; h++) zero_lane_rows(p, q0, h, row0, nrows, 2);
        return 0;
    }
    *s = (ColsRows){.table = table_of(p, seq), .seq = seq, .q0 = q0, .row0 = row0, .nrows = nrows, .h_lo = h_lo,
                    .nh = nh, .o = o};
    for (int32_t r = 0; r < nrows; r++) s->pos[r] = len - n + (row0 + r) / group;
    for (int32_t hh = 0; hh < nh; hh++)
        for (int32_t r = 0; r < nrows; r++) {
            const int32_t row = row0 + r, tok = row / group, head = (h_lo + hh) * group + row % group;
            s->qrow[hh][r] = (const uint32_t *)((const uint16_t *)p->q + (int64_t)(q0 + tok) * p->q_stride_tok +
                                                (int64_t)head * p->q_stride_head);
            s->m[hh][r] = -INFINITY;
            s->l[hh][r] = 0.0f;
            for (int c = 0; c < d; c++) o[(hh * DCOLS + r) * d + c] = 0.0f;
        }
    s->last = s->pos[nrows - 1];
    return 1;
}

/* One chunk's keys of kv head h (rows `at`, nk of them) as the cols body reads them: Kt[c][keys] (dword pairs by
 * key, zeros past nk) and V's pairs (Vp); the next chunk's rows (next_at, next_nk) are prefetched meanwhile. */
ALWAYS_INLINE void cols_chunk_kv(const Problem *p, const int64_t *at, int nk, const int64_t *next_at, int next_nk,
                                 int32_t hh, int32_t nh, int d, uint32_t *Kt, uint32_t *Vp, const int fma,
                                 const uint16_t **vp) {
    const uint16_t *const kbase = (const uint16_t *)p->k_cache, *const vbase = (const uint16_t *)p->v_cache;
    const uint32_t *kp[DKC];
    const int d2 = d / 2, ng = (nk + 15) / 16;
    const int pf_lo = hh * next_nk / nh, pf_n = (hh + 1) * next_nk / nh - pf_lo; /* this head's share, below */
    const int64_t row_bytes = (int64_t)nh * d * 2;
    for (int j = 0; j < nk; j++) {
        kp[j] = (const uint32_t *)(kbase + at[j] + (int64_t)hh * d);
        vp[j] = vbase + at[j] + (int64_t)hh * d;
    }
    for (int g = 0; g < ng; g++) { /* Kt[c][16g + i] = dword pair c of key 16g + i; keys past nk are 0 */
        /* A share of the next chunk's key rows into L2 while this group is transposed: a decode's KV comes from
         * DRAM in random block order, which the hardware prefetchers do not follow. Whole rows of the item's kv
         * heads (K and V), in address order, the chunk's rows spread evenly over its heads' groups: prefetching
         * only this head's 128 bytes of the next chunk's rows into L1 (`prefetcht0`), one kv head at a time, read
         * Llama-1B's 8 decodes (16 layers' caches from DRAM, 544 keys) at 13-14 GB/s; this way 9.9-10.3 -> 9.2-9.4
         * ms, at 2048 keys 41.5-41.9 -> 38.0-38.5, 16 decodes 21.5-21.7 -> 20.5-20.7, Qwen2.5-0.5B's and SmolLM2's
         * heads at 2048 keys 0.89-0.95x; a lone decode (its head parts) at 4096 keys 1.03x for Llama's heads, 0.98x
         * for Qwen's (2-core Xeon with AMX, builds alternated in one process). Into L1 instead lost, as did every
         * other line (the adjacent-line prefetch does not cover the rest) and the whole next chunk over the first
         * half or quarter of the heads. A hint: the same bits. */
        for (int i = pf_lo + g * pf_n / ng; i < pf_lo + (g + 1) * pf_n / ng; i++) {
            const char *kr = (const char *)(kbase + next_at[i]), *vr = (const char *)(vbase + next_at[i]);
            for (int64_t b = 0; b < row_bytes; b += 64) {
                _mm_prefetch(kr + b, _MM_HINT_T1);
                _mm_prefetch(vr + b, _MM_HINT_T1);
            }
        }
        for (int c0 = 0; c0 < d2; c0 += 16) {
            const int nc = d2 - c0 < 16 ? d2 - c0 : 16;
            const __mmask16 cols = (__mmask16)((1u << nc) - 1u);
            __m512i t[16];
            for (int i = 0; i < 16; i++)
                t[i] = 16 * g + i < nk ? _mm512_maskz_loadu_epi32(cols, kp[16 * g + i] + c0) : _mm512_setzero_si512();
            transpose16x16_epi32(t);
            for (int c = 0; c < nc; c++) _mm512_store_si512(Kt + (c0 + c) * DKC + 16 * g, t[c]);
        }
    }
    if (!fma) interleave_v_pairs(Vp, vp, nk, d);
}

/* cols_chunk_rows' work (below) for head_dim d and the product form fma, constants where inlined. */
ALWAYS_INLINE void cols_rows_on(ColsRows *s, const uint32_t *Kt, const uint32_t *Vp, int32_t hh, int32_t start, int nk,
                                int d, float *w, uint16_t *P16, __m512 scale, const int fma, const uint16_t *const *vp) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i lane_ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    dp_cols_rows_n(Kt, Vp, s->qrow[hh], s->pos, s->m[hh], s->l[hh], s->o + hh * DCOLS * d, w, P16, s->nrows, start, nk,
                   (nk + 1) / 2, (nk + 15) / 16, d / 2, d, scale, ninf, lane_ids, fma, vp);
}
/* cols_rows_on out of line, one instance per product form and head_dim class (its 8 row counts each). Inlined at
 * every call site (whole items and head parts, shared-prefix groups, both forms), paged_attention.c took 113 s to
 * compile on the 2-core Xeon with AMX (54 s before the FMA form), past native.py's BUILD_TIMEOUT_S for the whole
 * library; so, 15 s. A call a chunk and kv head: the same bits, and 8 decodes' attention (Llama-1B, Qwen2.5-0.5B
 * shapes, builds alternated) ran 8.9 / 3.8 ms inlined, 8.7 / 3.6 out of line. */
#define COLS_ROWS_INSTANCE(NAME, D, FMA)                                                                                \
    __attribute__((noinline)) static void NAME(ColsRows *s, const uint32_t *Kt, const uint32_t *Vp, int32_t hh,       \
                                               int32_t start, int nk, int d, float *w, uint16_t *P16, __m512 scale, \
                                               const uint16_t *const *vp) {                                          \
        cols_rows_on(s, Kt, Vp, hh, start, nk, D, w, P16, scale, FMA, vp);                                              \
    }
COLS_ROWS_INSTANCE(cols_rows_d64, 64, 0)
COLS_ROWS_INSTANCE(cols_rows_d64_fma, 64, 1)
COLS_ROWS_INSTANCE(cols_rows_any, d, 0)
COLS_ROWS_INSTANCE(cols_rows_any_fma, d, 1)
#undef COLS_ROWS_INSTANCE

/* s's rows on the chunk from key `start` (nk keys) of kv head slot hh, whose Kt and Vp (or vp) cols_chunk_kv built. */
ALWAYS_INLINE void cols_chunk_rows(ColsRows *s, const uint32_t *Kt, const uint32_t *Vp, int32_t hh, int32_t start,
                                   int nk, int d, float *w, uint16_t *P16, __m512 scale, const int fma,
                                   const uint16_t *const *vp) {
    if (d == 64) (fma ? cols_rows_d64_fma : cols_rows_d64)(s, Kt, Vp, hh, start, nk, d, w, P16, scale, vp);
    else (fma ? cols_rows_any_fma : cols_rows_any)(s, Kt, Vp, hh, start, nk, d, w, P16, scale, vp);
}

/* s's chunks from key `from` (a multiple of DKC) to its last row's position, on its own block table. */
ALWAYS_INLINE void cols_run(const Problem *p, ColsRows *s, int32_t from, int d, const int fma) {
    const uint16_t *vp[DKC];
    _Alignas(64) uint32_t Kt[MAX_D / 2 * DKC], Vp[DKC / 2 * MAX_D];
    _Alignas(64) float w[DCOLS * (DKC + 16)];
    _Alignas(64) uint16_t P16[DCOLS * (DKC + 16)];
    int64_t offsets[2][DKC]; /* a chunk's key rows (kv head h_lo) and the next chunk's, walked once each */
    const __m512 scale = _mm512_set1_ps(p->scale_log2);
    int64_t *at = offsets[0], *next_at = offsets[1];
    int nk = chunk_offsets(p, s->table, from, s->last, at, s->h_lo);
    for (int32_t start = from; start <= s->last; start += DKC) {
        const int next_nk = chunk_offsets(p, s->table, start + DKC, s->last, next_at, s->h_lo);
        for (int32_t hh = 0; hh < s->nh; hh++) {
            cols_chunk_kv(p, at, nk, next_at, next_nk, hh, s->nh, d, Kt, Vp, fma, vp);
            cols_chunk_rows(s, Kt, Vp, hh, start, nk, d, w, P16, scale, fma, vp);
        }
        int64_t *const done = at; /* the next chunk's rows become this one's: no copy, no second walk */
        at = next_at;
        next_at = done;
        nk = next_nk;
    }
}

/* s's outputs: o[c] / l, rounded to bf16, into the call's out rows (fma: each 32 columns' even ones, then their odd
 * ones, put back in order). */
static inline void cols_end(const Problem *p, const ColsRows *s, int d, const int fma) {
    const int32_t group = p->num_q_heads / p->num_kv_heads;
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int32_t hh = 0; hh < s->nh; hh++)
        for (int32_t r = 0; r < s->nrows; r++) {
            const int32_t row = s->row0 + r, tok = row / group, head = (s->h_lo + hh) * group + row % group;
            uint16_t *out = (uint16_t *)p->out + ((int64_t)(s->q0 + tok) * p->num_q_heads + head) * d;
            const float *o = s->o + (hh * DCOLS + r) * d;
            const __m512 inv = _mm512_set1_ps(1.0f / s->l[hh][r]);
            int c = 0;
            if (fma)
                for (; c + 32 <= d; c += 32) {
                    const __m512 even = _mm512_load_ps(o + c), odd = _mm512_load_ps(o + c + 16);
                    f32x16_store_bf16(out + c, _mm512_mul_ps(_mm512_permutex2var_ps(even, first, odd), inv));
                    f32x16_store_bf16(out + c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even, second, odd), inv));
                }
            for (; c < d; c += 16) f32x16_store_bf16(out + c, _mm512_mul_ps(_mm512_load_ps(o + c), inv));
        }
}

/* An item of fewer than DCOLS rows per kv head (a decode: one token's GQA group), row by row with the keys
 * (scores) or the output columns (P V) in the lanes instead of the rows, so that 3 live rows do not pay for 32
 * lanes. Every row goes through attend_dpbf16's operations in its order, lane for lane: the same dword-pair
 * products summed by VDPBF16PS over the pairs in order, the same DKC-key steps from key 0 (the item's last row
 * bounds them, as there), the same exp2_ps, the weights' sum added pair by pair in fp32, the same bf16 rounding
 * of P; so a row's output is bit for bit what the rows-in-lanes body gives it. K is transposed per chunk into
 * dword pairs by key (Kt[c][keys]); V's pairs are interleaved as there, or read in place (fma: the FMA form of the
 * products, cols_products). Kv heads h_lo .. h_hi - 1 in one item (a decode's: all of them, so each chunk's block
 * rows are read whole, as the AVX-512 body reads them). */
ALWAYS_INLINE void attend_dpbf16_cols(const Problem *p, int32_t seq, int32_t h_lo, int32_t h_hi, int32_t row0,
                                      int d, const int fma) {
    _Alignas(64) float o[DCOLS_HEADS * DCOLS * MAX_D];
    ColsRows s;
    if (!cols_begin(p, seq, h_lo, h_hi, row0, d, o, &s)) return;
    cols_run(p, &s, 0, d, fma);
    cols_end(p, &s, d, fma);
}

/* Decodes whose sequences begin with the same cache blocks (a shared prompt prefix: the prefix cache hands them
 * the same physical blocks), one item (paged_attention_shared.h): each chunk of the first `shared` keys, which
 * every member's table maps to the same blocks and every member attends whole, is read and laid out (Kt, Vp) once
 * and run for every member's rows; then each member's own chunks as attend_dpbf16_cols runs them. A chunk's Kt and
 * Vp are the same bytes whichever table they came through and every row keeps its own state and order of
 * operations, so each row's bits are what its own item gives (tested). seqs: the members, all-heads decode items;
 * the first one's table is read for the shared chunks. Without memory for the members' state, one by one. */
ALWAYS_INLINE void attend_dpbf16_cols_shared(const Problem *p, const int32_t *seqs, int32_t count, int32_t shared,
                                             int d, const int fma) {
    const int32_t nh = p->num_kv_heads;
    ColsRows *s = malloc((size_t)count * sizeof *s);
    float *o = aligned_alloc(64, (size_t)count * nh * DCOLS * d * sizeof(float));
    if (s == NULL || o == NULL) {
        free(s), free(o);
        for (int32_t i = 0; i < count; i++) attend_dpbf16_cols(p, seqs[i], 0, nh, 0, d, fma);
        return;
    }
    int32_t live = 0; /* members with rows (padding sequences were zeroed by cols_begin) */
    for (int32_t i = 0; i < count; i++)
        live += cols_begin(p, seqs[i], 0, nh, 0, d, o + (int64_t)i * nh * DCOLS * d, &s[live]);
    if (live > 0) {
        _Alignas(64) uint32_t Kt[MAX_D / 2 * DKC], Vp[DKC / 2 * MAX_D];
        _Alignas(64) float w[DCOLS * (DKC + 16)];
        _Alignas(64) uint16_t P16[DCOLS * (DKC + 16)];
        int64_t offsets[2][DKC];
        const uint16_t *vp[DKC];
        const __m512 scale = _mm512_set1_ps(p->scale_log2);
        int64_t *at = offsets[0], *next_at = offsets[1];
        int nk = chunk_offsets(p, s[0].table, 0, shared - 1, at, 0);
        for (int32_t start = 0; start < shared; start += DKC) {
            const int next_nk = chunk_offsets(p, s[0].table, start + DKC, shared - 1, next_at, 0);
            for (int32_t hh = 0; hh < nh; hh++) {
                cols_chunk_kv(p, at, nk, next_at, next_nk, hh, nh, d, Kt, Vp, fma, vp);
                for (int32_t i = 0; i < live; i++)
                    cols_chunk_rows(&s[i], Kt, Vp, hh, start, nk, d, w, P16, scale, fma, vp);
            }
            int64_t *const done = at;
            at = next_at;
            next_at = done;
            nk = next_nk;
        }
        for (int32_t i = 0; i < live; i++) {
            cols_run(p, &s[i], shared, d, fma);
            cols_end(p, &s[i], d, fma);
        }
    }
    free(s), free(o);
}

#include "paged_attention_amx_rows.h"
#ifdef UCM_HAS_AMX_ATTN
/* attend_amx_rows out of line: one instance for head_dim 64, one for any other multiple of 32. */
__attribute__((noinline)) static void amx_rows_d64(const Problem *p, int32_t seq, int32_t tok, int32_t lo, int32_t hi) {
    attend_amx_rows(p, seq, tok, lo, hi, 64);
}
__attribute__((noinline)) static void amx_rows_any(const Problem *p, int32_t seq, int32_t tok, int32_t lo, int32_t hi) {
    attend_amx_rows(p, seq, tok, lo, hi, p->head_dim);
}
#endif

/* An item's body by its row count; one instance for SmolLM2's head_dim so its loops unroll, one for any other
 * head_dim (a multiple of 16). */
ALWAYS_INLINE void attend_dpbf16_item(const Problem *p, int32_t seq, int32_t h, int32_t row0, int d, const int fma) {
    const int32_t rows = num_queries(p, seq) * (p->num_q_heads / p->num_kv_heads) - row0;
    if (h >= p->num_kv_heads) { /* dpbf16_all_heads: part h - num_kv_heads of head_parts */
        int32_t lo, hi;
        head_part(p, h - p->num_kv_heads, &lo, &hi);
#ifdef UCM_HAS_AMX_ATTN
        if (p->amx_rows) { /* a generated token's rows (paged_attention_amx_rows.h) */
            (d == 64 ? amx_rows_d64 : amx_rows_any)(p, seq, row0 / (p->num_q_heads / p->num_kv_heads), lo, hi);
            return;
        }
#endif
        attend_dpbf16_cols(p, seq, lo, hi, row0, d, fma);
    }
    else if (rows < DCOLS) attend_dpbf16_cols(p, seq, h, h + 1, row0, d, fma);
    else attend_dpbf16(p, seq, h, row0, num_queries(p, seq) * (p->num_q_heads / p->num_kv_heads), d, 0, DV);
}
/* The item functions: each runs its body with MXCSR's DAZ and FTZ set (run_item), and is not inlined there, so that no
 * floating-point operation of the body moves across the mode's change. */
__attribute__((noinline)) static void dpbf16_d64(const Problem *p, int32_t seq, int32_t h, int32_t row0) {
    if (p->cols_fma) attend_dpbf16_item(p, seq, h, row0, 64, 1);
    else attend_dpbf16_item(p, seq, h, row0, 64, 0);
}
__attribute__((noinline)) static void dpbf16_any(const Problem *p, int32_t seq, int32_t h, int32_t row0) {
    if (p->cols_fma) attend_dpbf16_item(p, seq, h, row0, p->head_dim, 1);
    else attend_dpbf16_item(p, seq, h, row0, p->head_dim, 0);
}
__attribute__((noinline)) static void dpbf16_shared_d64(const Problem *p, const Item *it) {
    const int32_t *seqs = p->group_seqs + it->group_at;
    if (p->cols_fma) attend_dpbf16_cols_shared(p, seqs, it->group_len, it->group_keys, 64, 1);
    else attend_dpbf16_cols_shared(p, seqs, it->group_len, it->group_keys, 64, 0);
}
__attribute__((noinline)) static void dpbf16_shared_any(const Problem *p, const Item *it) {
    const int32_t *seqs = p->group_seqs + it->group_at;
    if (p->cols_fma) attend_dpbf16_cols_shared(p, seqs, it->group_len, it->group_keys, p->head_dim, 1);
    else attend_dpbf16_cols_shared(p, seqs, it->group_len, it->group_keys, p->head_dim, 0);
}
#ifdef UCM_HAS_AMX_ATTN
/* A prompt item on AMX: rows row0 .. min(row0 + DR, row_end) - 1 of kv head h; an item of at most 16 rows (a
 * repeated prompt's last token: its kv head's 3 rows) with one tile and one vector of rows, half the work. A row's
 * bits are the same either way: every tile element and softmax lane is its own row's alone. */
ALWAYS_INLINE void amx_item(const Problem *p, int32_t seq, int32_t h, int32_t row0, int32_t row_end, int d) {
    if (row_end - row0 <= 16) attend_dpbf16(p, seq, h, row0, row_end, d, 1, 1);
    else attend_dpbf16(p, seq, h, row0, row_end, d, 1, DV);
}
/* Out of line, as the item functions above: run_item sets MXCSR's mode around them. */
__attribute__((noinline)) static void amx_d64(const Problem *p, int32_t seq, int32_t h, int32_t row0, int32_t row_end) {
    amx_item(p, seq, h, row0, row_end, 64);
}
__attribute__((noinline)) static void amx_any(const Problem *p, int32_t seq, int32_t h, int32_t row0, int32_t row_end) {
    amx_item(p, seq, h, row0, row_end, p->head_dim);
}
#endif
#endif /* __AVX512F__ && __AVX512BF16__ */

#endif /* UCM_PAGED_ATTENTION_DPBF16_H */
