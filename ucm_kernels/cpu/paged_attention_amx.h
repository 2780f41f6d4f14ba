/* The bf16 prompt rows' two products on AMX tiles: attend_dpbf16 (paged_attention_dpbf16.h) with its scores and
 * P V computed by TDPBF16PS instead of VDPBF16PS, on CPUs with AMX.
 *
 * On a 2-core Xeon with AMX the VDPBF16PS body took ~20 ms a layer for SmolLM2's 2048-token prompt, against torch's
 * SDPA at 7.4 ms; SDPA cannot take bf16 prompts because it is not split-invariant (a row's bits change with the
 * chunk it is computed in), which the cache-hit oracle needs. Here the item, its online softmax (base 2, DKC keys
 * a step from key 0) and its bf16 rounding of P are attend_dpbf16's, and the products move to tiles:
 *   scores  S^T[16 keys][16 rows] += K[16 keys][32 d] x qT[16 d pairs][16 rows][2]   (K read in place)
 *   output  oT[16 cols][16 rows]  += V^T[16 cols][32 keys] x Pp[16 key pairs][16 rows][2]
 * qT and Pp already are VNNI tiles (dword pairs by row in the lanes); V^T is Vp's dword transpose. A tile
 * element's sum depends on its own row and column alone, so a row's bits do not depend on the other rows of
 * its item, nor on how its prompt was split. TDPBF16PS adds a tile's pairs in another order than VDPBF16PS (a
 * measured 43% of elements differ), so a row must always meet the same body: the caller sends a sequence's prompt
 * rows here (Problem.prompt_queries) and its generated rows to paged_attention_amx_rows.h (to the VDPBF16PS bodies
 * where ucm_amx_rows turned that off), in every step.
 *
 * With the products on tiles the softmax's vector work was what the item waited on (~0.9 TFLOP/s against the
 * GEMM's 2.5 on that Xeon), so this body's softmax does less of it (its own bits, as the products already are):
 * the scores stay unscaled until the weights' multiply-add (amx_mask_max), the weights take a degree-3 2^x
 * (exp2_short_ps: they are rounded to bf16 next), and a row's reference max moves only when its scores pass it by
 * 2^LAZY_MAX_LOG2, so the output's rescale, once nearly every chunk, runs in few. Xeon with AMX, builds
 * alternated: SmolLM2's prompt attention 0.80-0.81x at 128-4096 rows.
 *
 * Part of paged_attention.c's translation unit, included by paged_attention_dpbf16.h.
 */
#ifndef UCM_PAGED_ATTENTION_AMX_H
#define UCM_PAGED_ATTENTION_AMX_H

#include "amx_tiles.h"
#include "paged_attention_common.h"

#if defined(UCM_HAS_AMX) && defined(UCM_HAS_DPBF16)
#define UCM_HAS_AMX_ATTN 1

_Static_assert(DR == 32 && DKC % 32 == 0, "two 16-row tiles an item; whole 32-key tiles a step");

/* The tile work that a chunk's softmax runs beside (attend_dpbf16 with AMX): the P V of the chunk before it, then the
 * scores of the chunk after it, in steps of 16 output columns or 16 keys, one step every few iterations of the
 * softmax's vector loops (tile_step). Each chunk's softmax had waited on its own scores and its P V on its softmax,
 * and a chunk's tile work issued whole ahead of the vector work did not overlap it either (in-order retirement: the
 * long products at the head of the window stalled the vector instructions behind them); steps spread through the
 * vector loops keep both units busy. Every element's products and their order are as before: the same bits. One
 * 1536-token prompt's attention a layer, builds alternated on the 2-core Xeon with AMX: Llama-1B's heads 15.8-17.2 ->
 * 9.5-14.1 ms (1.22-1.60x), Qwen2.5-0.5B's 1.37x; a step every 32 keys of the max pass and every 4 key pairs of the
 * weights beat a step every 16 or 64 keys and 2, 3 or 8 pairs. */
struct TileWork {
    /* P V: oT[c][0:DR] = oT[c][0:DR] * alpha + VT[c] . Pp over the chunk's n2 key pairs; pv_col < d: columns left */
    float *oT;
    uint32_t *Pp;
    const uint32_t *VT;
    __m512 alpha[DV];
    int n2, pv_col;
    /* scores: S[j][0:DR] = k_j . q[0:DR] for the chunk's keys j < nk from `start`; qk_key < nk: keys left */
    float *S;
    const uint32_t *qT;
    const uint32_t *const *kp;
    uint16_t *Kc;
    int64_t key_stride;
    int32_t start, bs;
    int nk, qk_key, d, dv;
    /* prefetch_pair's lines: the 16-key groups of the chunk after next (their first rows; ahead_keys keys) and this
     * chunk's V^T, which its P V reads during the next chunk */
    const char *ahead[DKC / 16];
    int ahead_keys;
    const char *vt_ahead;
};

/* Pair i's share of the lines the tile steps will read a chunk from now, into L1 (T0): two keys' K rows of the chunk
 * after next (the scores of the next chunk read theirs now) and a DKC / 2-th of this chunk's V^T. Every tile load of a
 * chunk's K had missed L1 (a 16-key group spans 16 KB of Llama-1B's cache, 8 kv heads a row, four pages, where the L2
 * streamer stops at each page's end), as had its V^T, built once a call for every item of the head; the loads sit on
 * the products' dependency chain (the next step's tiles wait for them). A 2048-token prompt's attention a layer,
 * builds alternated on the 2-core Xeon with AMX (after transpose_q): Llama-1B's heads 17.4 -> 15.8 ms with K, 16.2
 * with V^T; Qwen2.5-0.5B's (2 kv heads: a group within one page) lost with K (7.5 -> 7.6 ms) and gained with V^T
 * (7.3), so K is prefetched only where a group crosses pages (attend_dpbf16). With transpose_q, against neither:
 * Llama-1B 18.5 -> 15.0 ms, Qwen 7.1 -> 6.7, SmolLM2 4.3 -> 4.2, head_dim 128 15.1 -> 13.6. Hints: the same bits. */
ALWAYS_INLINE void prefetch_pair(const TileWork *t, int i) {
    const int j = 2 * i;
    if (j < t->ahead_keys) {
        const char *k = t->ahead[j / 16] + (int64_t)(j % 16) * t->key_stride;
        _mm_prefetch(k, _MM_HINT_T0);
        _mm_prefetch(k + 64, _MM_HINT_T0);
        _mm_prefetch(k + t->key_stride, _MM_HINT_T0);
        _mm_prefetch(k + t->key_stride + 64, _MM_HINT_T0);
    }
    if (i < DKC / 2) /* V^T's chunk: head_dim x DKC / 2 dwords */
        for (int b = 0; b < t->d * 4; b += 64) _mm_prefetch(t->vt_ahead + (int64_t)i * t->d * 4 + b, _MM_HINT_T0);
}

/* S[j][0:DR] = k_j . q[0:DR] (unscaled: dp_weights scales them) for keys j0 .. j0 + 15 of the chunk (S's rows from nk
 * to the next 16 are left undefined; nothing reads them). kp[j]: key j's head row. Sixteen keys of one cache block are
 * one tile load, key_stride bytes apart; a group that crosses a block's end is gathered into Kc, zeros past nk. With
 * head_dim 64 q's four tiles (two 32-dim halves x two row halves) are loaded once a chunk (its first group) into tiles
 * 4..7 instead of once a group (a 2048-token prompt's attention with Llama's heads took 8% less time on a 2-core Xeon
 * with AMX, with P kept likewise by pv_step). */
ALWAYS_INLINE void qk_step(TileWork *t) {
    const int j0 = t->qk_key, d = t->d, dv = t->dv, q_kept = d == 64;
    const uint32_t *qT = t->qT;
    if (q_kept && j0 == 0) {
        _tile_loadd(4, qT, DR * 4);
        _tile_loadd(5, qT + 16 * DR, DR * 4);
        if (dv == 2) {
            _tile_loadd(6, qT + 16, DR * 4);
            _tile_loadd(7, qT + 16 * DR + 16, DR * 4);
        }
    }
    const void *a = t->kp[j0];
    int64_t a_stride = t->key_stride;
    if ((t->start + j0) % t->bs + 16 > t->bs) {
        const int kn = t->nk - j0 < 16 ? t->nk - j0 : 16;
        for (int i = 0; i < 16; i++)
            if (i < kn) memcpy(t->Kc + i * d, t->kp[j0 + i], (size_t)d * 2);
            else memset(t->Kc + i * d, 0, (size_t)d * 2);
        a = t->Kc;
        a_stride = (int64_t)d * 2;
    }
    _tile_zero(0);
    if (dv == 2) _tile_zero(1);
    if (q_kept) {
        _tile_loadd(2, a, a_stride);
        _tile_loadd(3, (const char *)a + 64, a_stride);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(0, 3, 5);
        if (dv == 2) {
            _tile_dpbf16ps(1, 2, 6);
            _tile_dpbf16ps(1, 3, 7);
        }
    } else
        for (int kb = 0; kb < d / 32; kb++) {
            _tile_loadd(2, (const char *)a + kb * 64, a_stride);
            _tile_loadd(3, qT + kb * 16 * DR, DR * 4);
            _tile_dpbf16ps(0, 2, 3);
            if (dv == 2) {
                _tile_loadd(4, qT + kb * 16 * DR + 16, DR * 4);
                _tile_dpbf16ps(1, 2, 4);
            }
        }
    _tile_stored(0, t->S + j0 * DR, DR * 4);
    if (dv == 2) _tile_stored(1, t->S + j0 * DR + 16, DR * 4);
    t->qk_key += 16;
}

/* Dwords of one kv head's V^T for sequence seq (Problem.amx_vt): every DKC-key chunk up to its last key. */
static inline int64_t amx_vt_head_dwords(const Problem *p, int32_t seq) {
    return (int64_t)((p->seq_lens[seq] + DKC - 1) / DKC) * p->head_dim * (DKC / 2);
}

/* Where chunk `chunk` of kv head h's V^T lies in Problem.amx_vt (one block a sequence: head after head, chunk
 * after chunk). */
static inline uint32_t *amx_vt_chunk(const Problem *p, int32_t seq, int32_t h, int32_t chunk) {
    return (uint32_t *)p->amx_vt[seq] + amx_vt_head_dwords(p, seq) * h + (int64_t)chunk * p->head_dim * (DKC / 2);
}

/* Chunk `chunk` of kv head h's V for sequence seq as P V's A tiles: VT[c][i] = (v_2i[c], v_2i+1[c]) for the
 * chunk's DKC / 2 key pairs, zeros past the sequence's last key. Every prompt item of the head reads every chunk
 * up to its last row, so the call builds each chunk once (paged_attention.c) instead of each item building its
 * own: that took a third of the body's time on a 2048-token prompt. */
static void amx_build_vt(const Problem *p, int32_t seq, int32_t h, int32_t chunk, uint32_t *VT) {
    const int d = p->head_dim;
    const int32_t len = p->seq_lens[seq], start = chunk * DKC;
    const int nk = len - start < DKC ? len - start : DKC, n2 = (nk + 1) / 2;
    const int32_t *table = table_of(p, seq);
    const uint16_t *vp[DKC];
    int64_t at[DKC];
    key_offsets(p, table, start, nk, h, at);
    for (int j = 0; j < nk; j++) vp[j] = (const uint16_t *)p->v_cache + at[j];
    _Alignas(64) uint32_t Vp[DKC / 2 * MAX_D];
    interleave_v_pairs(Vp, vp, nk, d);
    for (int i0 = 0; i0 < DKC / 2; i0 += 16)
        for (int c0 = 0; c0 < d; c0 += 16) {
            __m512i t[16];
            for (int i = 0; i < 16; i++)
                t[i] = i0 + i < n2 ? _mm512_load_si512(Vp + (int64_t)(i0 + i) * d + c0) : _mm512_setzero_si512();
            transpose16x16_epi32(t);
            for (int c = 0; c < 16; c++) _mm512_store_si512(VT + (c0 + c) * (DKC / 2) + i0, t[c]);
        }
}

/* Columns pv_col .. pv_col + 15 of oT[c][0:DR] = oT[c][0:DR] * alpha + sum over the chunk's n2 key pairs of VT[c][i] .
 * Pp[i][0:DR]; VT: the chunk's amx_build_vt. Its first step zeroes Pp's pairs past n2 up to the next 16 (VT's may be
 * later keys), rescales oT where a row's max moved, and loads Pp (at most two 16-pair tiles a row half) into tiles
 * 4..7, once a chunk rather than once per 16 columns. */
_Static_assert(DKC <= 64, "pv_step keeps a chunk's P in four tiles: at most 32 key pairs");
ALWAYS_INLINE void pv_step(TileWork *t) {
    const int c0 = t->pv_col, dv = t->dv, n2r = (t->n2 + 15) & ~15;
    float *oT = t->oT;
    if (c0 == 0) {
        uint32_t *Pp = t->Pp;
        for (int i = t->n2; i < n2r; i++)
#pragma GCC unroll 2
            for (int v = 0; v < dv; v++) _mm512_store_si512(Pp + i * DR + v * 16, _mm512_setzero_si512());
        __mmask16 moved = 0; /* rows whose running max rose: alpha == 1 exactly elsewhere, and x * 1 == x */
#pragma GCC unroll 2
        for (int v = 0; v < dv; v++) moved |= _mm512_cmp_ps_mask(t->alpha[v], _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);
        if (moved)
            for (int c = 0; c < t->d; c++)
#pragma GCC unroll 2
                for (int v = 0; v < dv; v++)
                    _mm512_store_ps(oT + c * DR + v * 16,
                                    _mm512_mul_ps(_mm512_load_ps(oT + c * DR + v * 16), t->alpha[v]));
        _tile_loadd(4, Pp, DR * 4);
        if (dv == 2) _tile_loadd(5, Pp + 16, DR * 4);
        if (n2r > 16) {
            _tile_loadd(6, Pp + 16 * DR, DR * 4);
            if (dv == 2) _tile_loadd(7, Pp + 16 * DR + 16, DR * 4);
        }
    }
    _tile_loadd(0, oT + c0 * DR, DR * 4);
    if (dv == 2) _tile_loadd(1, oT + c0 * DR + 16, DR * 4);
    _tile_loadd(2, t->VT + c0 * (DKC / 2), DKC / 2 * 4);
    _tile_dpbf16ps(0, 2, 4);
    if (dv == 2) _tile_dpbf16ps(1, 2, 5);
    if (n2r > 16) {
        _tile_loadd(3, t->VT + c0 * (DKC / 2) + 16, DKC / 2 * 4);
        _tile_dpbf16ps(0, 3, 6);
        if (dv == 2) _tile_dpbf16ps(1, 3, 7);
    }
    _tile_stored(0, oT + c0 * DR, DR * 4);
    if (dv == 2) _tile_stored(1, oT + c0 * DR + 16, DR * 4);
    t->pv_col += 16;
}

/* The next step of the chunk's tile work, if any: P V's columns first (its P and the next q share tiles 4..7). */
ALWAYS_INLINE void tile_step(TileWork *t) {
    if (t->pv_col < t->d) pv_step(t);
    else if (t->qk_key < t->nk) qk_step(t);
}

/* Every step left. */
ALWAYS_INLINE void tile_drain(TileWork *t) {
    while (t->pv_col < t->d) pv_step(t);
    while (t->qk_key < t->nk) qk_step(t);
}

/* Keys past a row's position -inf in qk_step's scores where some row stops inside the chunk (diag), and
 * mx[v] = max(mx[v], every score * scale): the VDPBF16PS body's mask and max passes in one. The scores stay
 * unscaled (dp_weights scales them inside its multiply-add): scaling by a positive number commutes with max. */
ALWAYS_INLINE void amx_mask_max(float *S, int nk, int32_t start, int diag, const __m512i *posv, __m512 scale,
                                __m512 *mx, const int dv, TileWork *tw) {
    __m512 raw[DV];
#pragma GCC unroll 2
    for (int v = 0; v < dv; v++) raw[v] = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < nk; j++) {
        if (j % 32 == 31) tile_step(tw);
        const __m512i key = _mm512_set1_epi32(start + j);
#pragma GCC unroll 2
        for (int v = 0; v < dv; v++) {
            __m512 s = _mm512_load_ps(S + j * DR + v * 16);
            if (diag) {
                const __mmask16 past = _mm512_cmpgt_epi32_mask(key, posv[v]);
                s = _mm512_mask_mov_ps(s, past, _mm512_set1_ps(-INFINITY));
                _mm512_mask_store_ps(S + j * DR + v * 16, past, s);
            }
            raw[v] = _mm512_max_ps(raw[v], s);
        }
    }
#pragma GCC unroll 2
    for (int v = 0; v < dv; v++) mx[v] = _mm512_max_ps(mx[v], _mm512_mul_ps(raw[v], scale));
}
#endif

#endif /* UCM_PAGED_ATTENTION_AMX_H */
