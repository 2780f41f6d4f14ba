/* The bf16 generated rows' body on CPUs with AMX: one query token's rows (its GQA groups) with both products on tiles.
 *
 * A decode's rows went through attend_dpbf16_cols (paged_attention_dpbf16.h), whose products are fp32 FMAs with the
 * keys or the output columns in the lanes: on the 2-core Xeon with AMX, 8 decodes' attention over ~600 keys took
 * ~3.7 ms a step of Qwen2.5-0.5B's 24 layers with K/V in cache and ~5.5 with K/V from memory, ~15% of the step, at
 * ~5800 cycles for each 64 keys of a kv head. Here, for each kv head:
 *   scores  S^T[16 keys][16 rows] = K[16 keys][32 d] x qT[16 d pairs][16 rows][2]   (K read in place, as the
 *                                                                                     prompt body reads it)
 *   output  o[16 rows][16 cols]  += P[16 rows][32 keys] x Vp[16 key pairs][16 cols][2]
 * the rows (the group's query heads) in the tiles' columns and the softmax's lanes; P's pairs are a dword transpose
 * of the weights' vectors and Vp is V's keys interleaved in pairs (interleave_v_pairs), both per chunk, so nothing
 * per chunk is as wide as the prompt body's V^T. Same online softmax as the other bf16 bodies (base 2, DKC keys a
 * step from key 0, P rounded to bf16 for its product, its sums in fp32), with its own arithmetic: the weights are
 * exp2_short_ps's and tiles sum their pairs in their own order, so a generated row has this body's bits, which
 * differ from the VDPBF16PS bodies' (and the prompt rows' AMX body's). A row must meet one body in every step, so
 * where this body is on (ucm_amx_rows) every bf16 row not passed as a prompt row comes here, one query token an
 * item: a decode's, and a recomputed sequence's generated rows (paged_attention.c: rest_items). Every tile element
 * and lane is its own row's alone, so a row's bits do not depend on the batch, the item's other kv heads or the
 * thread count (tested). 8 decodes over 612 keys, builds alternated on that Xeon: Qwen2.5-0.5B's 24 layers 5.1 -> 3.5
 * ms from memory, 4.0 -> 2.6 in cache; Llama-1B's 16 11.7 -> 10.6 and 7.7 -> 6.9 (its item waits on memory: the
 * prefetches stall on the core's miss buffers); SmolLM2's 30 at 32 decodes 31.6 -> 29.9. The engine's Qwen decode
 * step of 8: 37.9 / 38.2 -> 35.3 / 36.6 ms.
 *
 * Part of paged_attention.c's translation unit, included by paged_attention_dpbf16.h after paged_attention_amx.h.
 */
#ifndef UCM_PAGED_ATTENTION_AMX_ROWS_H
#define UCM_PAGED_ATTENTION_AMX_ROWS_H

#ifdef UCM_HAS_AMX_ATTN

#define AR_OUT_FLOATS 8192 /* the output accumulators a pass of kv heads keeps: 16 rows x head_dim a head, 32 KB */
#define AR_HEADS 8         /* at most this many kv heads a pass over the chunks (each chunk's block rows read once) */

/* Whether generated bf16 rows take this body: -1 where AMX is permitted (probed on first use), 0 off, 1 on
 * (ucm_amx_rows sets it; tests turn it off to reach the VDPBF16PS bodies on an AMX host). */
static int amx_rows_state = -1;

static inline int amx_rows_on(void) {
    const int s = __atomic_load_n(&amx_rows_state, __ATOMIC_RELAXED);
    return s < 0 ? amx_permitted() : s && amx_permitted();
}

/* Whether a call's generated rows take this body: bf16, whole 32-dim tiles, a group that fits the tiles' 16
 * columns. */
static inline int amx_rows_take(int32_t dtype, int32_t head_dim, int32_t num_q_heads, int32_t num_kv_heads) {
    return dtype == UCM_DTYPE_BF16 && head_dim % 32 == 0 && num_q_heads / num_kv_heads <= 16 && amx_rows_on();
}

/* One kv head's state over the chunks: its rows' q as B tiles (qT[c][r]: dword pair c of row r, rows past the
 * group 0) and their running max and weight sum (lanes). */
typedef struct {
    _Alignas(64) uint32_t qT[MAX_D / 2 * 16];
    __m512 m, l;
} RowsHead;

/* Scratch of one item's chunk work, per thread (on its stack). */
typedef struct {
    _Alignas(64) float S[DKC * 16];          /* S^T: a key a row, the rows in its lanes */
    _Alignas(64) uint32_t Pp[DKC / 2 * 16];  /* the weights' bf16 pairs: a key pair a row */
    _Alignas(64) uint32_t PT[16 * DKC / 2];  /* ... transposed: a row's key pairs, P's A tiles */
    _Alignas(64) uint32_t Vp[DKC / 2 * MAX_D];
    _Alignas(64) uint16_t Kc[DKC * MAX_D];   /* 16 keys a group, gathered where they cross a block's end */
} RowsScratch;

/* S^T rows j0 .. j0 + 15 = keys j0 .. j0 + 15 (A: their K rows, a_stride bytes apart) . q, unscaled, for a head_dim
 * other than 64 (ar_scores64): q's tiles loaded one by one into tile 2. */
ALWAYS_INLINE void ar_scores(float *S, const void *a, int64_t a_stride, const uint32_t *qT, int d) {
    _tile_zero(0);
    for (int kb = 0; kb < d / 32; kb++) {
        _tile_loadd(1, (const char *)a + kb * 64, a_stride);
        _tile_loadd(2, qT + kb * 16 * 16, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, S, 64);
}

/* A share of the next chunk's key rows (K and V, whole rows of the pass's kv heads) into L2, a few lines at a time
 * through the softmax's loops: a decode's blocks come from memory in table order, which the hardware prefetchers do
 * not follow, and the share issued at once (256 prefetches a head for Llama-1B's heads) stalled on the core's miss
 * buffers (paged_attention_common.h: prefetch_some). at: element offsets of the rows, rows [row, rows). */
typedef struct {
    const char *k, *v;
    const int64_t *at;
    int64_t bytes, b;
    int row, rows;
} RowsPrefetch;

ALWAYS_INLINE void ar_prefetch(RowsPrefetch *pf, int lines) {
    for (; lines > 0 && pf->row < pf->rows; lines--) {
        _mm_prefetch(pf->k + pf->at[pf->row] * 2 + pf->b, _MM_HINT_T1);
        _mm_prefetch(pf->v + pf->at[pf->row] * 2 + pf->b, _MM_HINT_T1);
        pf->b += 64;
        if (pf->b >= pf->bytes) {
            pf->b = 0;
            pf->row++;
        }
    }
}

/* ar_scores for head_dim 64, two groups of 16 keys at once (two == 0: only the first) on two sets of tiles, so that
 * one group's products run while the other's wait (a tile's products wait on its last ones: the groups one after
 * another on one set of tiles ran each chain's latency). q's tiles are 2 and 3 (ar_chunk loads them). */
ALWAYS_INLINE void ar_scores64(float *S, const void *const *a, const int64_t *st, const int two) {
    _tile_zero(0);
    _tile_loadd(1, a[0], st[0]);
    _tile_loadd(4, (const char *)a[0] + 64, st[0]);
    if (two) {
        _tile_zero(5);
        _tile_loadd(6, a[1], st[1]);
        _tile_loadd(7, (const char *)a[1] + 64, st[1]);
    }
    _tile_dpbf16ps(0, 1, 2);
    if (two) _tile_dpbf16ps(5, 6, 2);
    _tile_dpbf16ps(0, 4, 3);
    if (two) _tile_dpbf16ps(5, 7, 3);
    _tile_stored(0, S, 64);
    if (two) _tile_stored(5, S + 256, 64);
}

/* One DKC-key chunk (from `start`, nk keys; at[j]: key j's cache offset, kv head h lies h * d elements on) for one kv
 * head's rows: scores, the online softmax's step, P V into o[16][d]. */
ALWAYS_INLINE void ar_chunk(const Problem *p, RowsHead *hs, float *o, const int64_t *at, int nk, int32_t start,
                            int32_t h, int d, int32_t group, __m512 scale, RowsScratch *w, RowsPrefetch *pf) {
    const uint16_t *const kbase = (const uint16_t *)p->k_cache, *const vbase = (const uint16_t *)p->v_cache;
    const int64_t key_stride = (int64_t)p->num_kv_heads * d * 2, head = (int64_t)h * d;
    const int32_t bs = p->block_size;
    const int n2 = (nk + 1) / 2, n2r = (n2 + 15) & ~15;
    if (d == 64) {
        _tile_loadd(2, hs->qT, 64);
        _tile_loadd(3, hs->qT + 16 * 16, 64);
    }
    const void *a[DKC / 16];
    int64_t a_stride[DKC / 16];
    for (int g = 0, j0 = 0; j0 < nk; g++, j0 += 16) {
        if ((start + j0) % bs + 16 <= bs) { /* 16 keys of one block: a tile load in place */
            a[g] = kbase + at[j0] + head;
            a_stride[g] = key_stride;
            continue;
        }
        uint16_t *kc = w->Kc + g * 16 * d; /* else gathered, zeros past nk */
        for (int i = 0; i < 16; i++)
            if (j0 + i < nk) memcpy(kc + i * d, kbase + at[j0 + i] + head, (size_t)d * 2);
            else memset(kc + i * d, 0, (size_t)d * 2);
        a[g] = kc;
        a_stride[g] = (int64_t)d * 2;
    }
    if (d == 64)
        for (int g = 0; g < (nk + 15) / 16; g += 2)
            ar_scores64(w->S + g * 256, a + g, a_stride + g, g + 1 < (nk + 15) / 16);
    else
        for (int g = 0; g < (nk + 15) / 16; g++) ar_scores(w->S + g * 256, a[g], a_stride[g], hs->qT, d);
    /* the softmax's step, the rows in the lanes (rows past the group compute on zero q and are never stored) */
    __m512 raw = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < nk; j++) {
        ar_prefetch(pf, 1);
        raw = _mm512_max_ps(raw, _mm512_load_ps(w->S + j * 16));
    }
    const __m512 mx = _mm512_max_ps(hs->m, _mm512_mul_ps(raw, scale));
    const __m512 alpha = exp2_ps(_mm512_sub_ps(hs->m, mx)); /* first chunk: m = -inf, on a zero output and sum */
    const __m512 nm = _mm512_sub_ps(_mm512_setzero_ps(), mx);
    hs->m = mx;
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < n2; i++) {
        ar_prefetch(pf, 2);
        const __m512 pe = exp2_short_ps(_mm512_fmadd_ps(_mm512_load_ps(w->S + 2 * i * 16), scale, nm), 1);
        const __m512 po = 2 * i + 1 < nk
                              ? exp2_short_ps(_mm512_fmadd_ps(_mm512_load_ps(w->S + (2 * i + 1) * 16), scale, nm), 1)
                              : _mm512_setzero_ps();
        sum = _mm512_add_ps(sum, _mm512_add_ps(pe, po));
        _mm512_store_si512(w->Pp + i * 16, bf16_pairs(pe, po));
    }
    hs->l = _mm512_add_ps(_mm512_mul_ps(hs->l, alpha), sum);
    for (int i = n2; i < n2r; i++) _mm512_store_si512(w->Pp + i * 16, _mm512_setzero_si512());
    for (int b = 0; b < n2r; b += 16) { /* P's A tiles: a row's pairs b .. b + 15 */
        __m512i t[16];
        for (int i = 0; i < 16; i++) t[i] = _mm512_load_si512(w->Pp + (b + i) * 16);
        transpose16x16_epi32(t);
        for (int r = 0; r < 16; r++) _mm512_store_si512(w->PT + r * (DKC / 2) + b, t[r]);
    }
    const uint16_t *vp[DKC];
    for (int j = 0; j < nk; j++) vp[j] = vbase + at[j] + head;
    interleave_v_pairs(w->Vp, vp, nk, d);
    ar_prefetch(pf, pf->rows * (int)(pf->bytes / 64)); /* the share's rest */
    for (int i = n2; i < n2r; i++) memset(w->Vp + (int64_t)i * d, 0, (size_t)d * 4); /* 0 x stale bits: NaN */
    /* o = o * alpha + P V, a row's alpha exactly 1 where its max did not move (x * 1 == x: skipped) */
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) & ((1u << group) - 1u)) {
        _Alignas(64) float a[16];
        _mm512_store_ps(a, alpha);
        for (int32_t r = 0; r < group; r++)
            for (int c = 0; c < d; c += 16)
                _mm512_store_ps(o + r * d + c, _mm512_mul_ps(_mm512_load_ps(o + r * d + c), _mm512_set1_ps(a[r])));
    }
    _tile_loadd(5, w->PT, DKC / 2 * 4);
    if (n2r > 16) _tile_loadd(6, w->PT + 16, DKC / 2 * 4);
    if (d == 64) { /* the four column blocks' sums in tiles 0..3 at once (q's tiles are done), V in 4 and 7 */
        const int64_t vs = d * 4;
        _tile_loadd(0, o, vs);
        _tile_loadd(1, o + 16, vs);
        _tile_loadd(2, o + 32, vs);
        _tile_loadd(3, o + 48, vs);
        _tile_loadd(4, w->Vp, vs);
        _tile_loadd(7, w->Vp + 16, vs);
        _tile_dpbf16ps(0, 5, 4);
        _tile_dpbf16ps(1, 5, 7);
        _tile_loadd(4, w->Vp + 32, vs);
        _tile_loadd(7, w->Vp + 48, vs);
        _tile_dpbf16ps(2, 5, 4);
        _tile_dpbf16ps(3, 5, 7);
        if (n2r > 16) {
            _tile_loadd(4, w->Vp + 16 * d, vs);
            _tile_loadd(7, w->Vp + 16 * d + 16, vs);
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(1, 6, 7);
            _tile_loadd(4, w->Vp + 16 * d + 32, vs);
            _tile_loadd(7, w->Vp + 16 * d + 48, vs);
            _tile_dpbf16ps(2, 6, 4);
            _tile_dpbf16ps(3, 6, 7);
        }
        _tile_stored(0, o, vs);
        _tile_stored(1, o + 16, vs);
        _tile_stored(2, o + 32, vs);
        _tile_stored(3, o + 48, vs);
        return;
    }
    for (int c0 = 0; c0 < d; c0 += 16) {
        _tile_loadd(0, o + c0, d * 4);
        _tile_loadd(7, w->Vp + c0, d * 4);
        _tile_dpbf16ps(0, 5, 7);
        if (n2r > 16) {
            _tile_loadd(7, w->Vp + 16 * d + c0, d * 4);
            _tile_dpbf16ps(0, 6, 7);
        }
        _tile_stored(0, o + c0, d * 4);
    }
}

/* Query token `tok` of sequence seq, kv heads h_lo .. h_hi - 1: each head's group rows, from key 0 to the token's
 * position in DKC-key chunks, AR_HEADS heads (at most) a pass so that each chunk's block rows are read whole. */
ALWAYS_INLINE void attend_amx_rows(const Problem *p, int32_t seq, int32_t tok, int32_t h_lo, int32_t h_hi, int d) {
    const int32_t group = p->num_q_heads / p->num_kv_heads, n = num_queries(p, seq), len = p->seq_lens[seq];
    const int32_t q0 = p->query_start_loc ? p->query_start_loc[seq] : seq;
    if (len == 0) { /* a padding sequence */
        for (int32_t h = h_lo; h < h_hi; h++) zero_lane_rows(p, q0, h, tok * group, group, 2);
        return;
    }
    const int32_t last = len - n + tok, *table = table_of(p, seq);
    const int32_t per_pass = AR_OUT_FLOATS / (16 * d) < AR_HEADS ? AR_OUT_FLOATS / (16 * d) : AR_HEADS;
    const __m512 scale = _mm512_set1_ps(p->scale_log2);
    RowsHead hs[AR_HEADS];
    RowsScratch w;
    _Alignas(64) float o[AR_OUT_FLOATS];
    int64_t offsets[2][DKC];
    amx_load_config();
    for (int32_t hb = h_lo; hb < h_hi; hb += per_pass) {
        const int32_t nh = h_hi - hb < per_pass ? h_hi - hb : per_pass;
        for (int32_t hh = 0; hh < nh; hh++) {
            const uint16_t *q = (const uint16_t *)p->q + (int64_t)(q0 + tok) * p->q_stride_tok +
                                (int64_t)(hb + hh) * group * p->q_stride_head;
            for (int c = 0; c < d / 2; c++)
                for (int r = 0; r < 16; r++) {
                    uint32_t pair = 0;
                    if (r < group) memcpy(&pair, q + (int64_t)r * p->q_stride_head + 2 * c, 4);
                    hs[hh].qT[c * 16 + r] = pair;
                }
            hs[hh].m = _mm512_set1_ps(-INFINITY);
            hs[hh].l = _mm512_setzero_ps();
        }
        memset(o, 0, (size_t)nh * 16 * d * sizeof(float));
        int64_t *at = offsets[0], *next_at = offsets[1];
        int nk = chunk_offsets(p, table, 0, last, at, hb);
        const int64_t row_bytes = (int64_t)nh * d * 2;
        for (int32_t start = 0; start <= last; start += DKC) {
            const int next_nk = chunk_offsets(p, table, start + DKC, last, next_at, hb);
            for (int32_t hh = 0; hh < nh; hh++) {
                RowsPrefetch pf = {.k = (const char *)p->k_cache, .v = (const char *)p->v_cache, .at = next_at,
                                   .bytes = row_bytes, .row = hh * next_nk / nh, .rows = (hh + 1) * next_nk / nh};
                ar_chunk(p, &hs[hh], o + hh * 16 * d, at, nk, start, hh, d, group, scale, &w, &pf);
            }
            int64_t *const done = at;
            at = next_at;
            next_at = done;
            nk = next_nk;
        }
        for (int32_t hh = 0; hh < nh; hh++) {
            _Alignas(64) float l[16];
            _mm512_store_ps(l, hs[hh].l);
            for (int32_t r = 0; r < group; r++) {
                const int32_t qh = (hb + hh) * group + r;
                uint16_t *out = (uint16_t *)p->out + ((int64_t)(q0 + tok) * p->num_q_heads + qh) * d;
                const float *orow = o + (hh * 16 + r) * d;
                const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
                for (int c = 0; c < d; c += 16)
                    f32x16_store_bf16(out + c, _mm512_mul_ps(_mm512_load_ps(orow + c), inv));
            }
        }
    }
    _tile_release();
}

#endif /* UCM_HAS_AMX_ATTN */
#endif /* UCM_PAGED_ATTENTION_AMX_ROWS_H */
