/* The bf16 prefill body of paged_attention.c on AVX-512 BF16: query rows in vector lanes, products by VDPBF16PS.
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
 * Part of paged_attention.c's translation unit (included after paged_attention_avx512.h, whose exp2_ps it uses).
 */
#ifndef UCM_PAGED_ATTENTION_DPBF16_H
#define UCM_PAGED_ATTENTION_DPBF16_H

#include "paged_attention_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define UCM_HAS_DPBF16 1
#define DR 32         /* query rows per item, in lanes */
#define DV (DR / 16)  /* vectors of rows */
#define DKB 6         /* keys (scores) or output columns (P V) per register block: DKB * DV accumulators */
#define DKC 64        /* keys per online-softmax step: the output's rescale and V's interleave, once per DKC keys */

/* Whether a sequence's queries take this body: bf16, head_dim a multiple of 16, and a full item per kv head. */
static inline int dpbf16_take(const Problem *p, int32_t seq, int32_t dtype) {
    return dtype == UCM_DTYPE_BF16 && p->head_dim % 16 == 0 &&
           num_queries(p, seq) * (p->num_q_heads / p->num_kv_heads) >= DR;
}

/* S[j][0:DR] = scale * sum_c kp[j][c] . qT[c][0:DR] over the d2 dword pairs, for kb (<= DKB) keys. */
ALWAYS_INLINE void dp_qk(float *S, const uint32_t *qT, const uint32_t *const *kp, int kb, int d2, __m512 scale) {
    __m512 a[DKB][DV];
#pragma GCC unroll 6
    for (int j = 0; j < kb; j++)
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) a[j][v] = _mm512_setzero_ps();
    for (int c = 0; c < d2; c++) {
        __m512bh q[DV];
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) q[v] = (__m512bh)_mm512_load_si512(qT + c * DR + v * 16);
#pragma GCC unroll 6
        for (int j = 0; j < kb; j++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)kp[j][c]);
#pragma GCC unroll 2
            for (int v = 0; v < DV; v++) a[j][v] = _mm512_dpbf16_ps(a[j][v], q[v], b);
        }
    }
#pragma GCC unroll 6
    for (int j = 0; j < kb; j++)
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) _mm512_store_ps(S + j * DR + v * 16, _mm512_mul_ps(a[j][v], scale));
}

/* oT[c0 + i][0:DR] = oT[c0 + i][0:DR] * alpha + sum_j Vp[j][c0 + i] . Pp[j][0:DR] over n2 key pairs, for cb
 * (<= DKB) columns. */
ALWAYS_INLINE void dp_pv(float *oT, const uint32_t *Pp, const uint32_t *Vp, const __m512 *alpha, int n2, int c0,
                         int cb, int d) {
    __m512 a[DKB][DV];
#pragma GCC unroll 6
    for (int i = 0; i < cb; i++)
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) a[i][v] = _mm512_mul_ps(_mm512_load_ps(oT + (c0 + i) * DR + v * 16), alpha[v]);
    for (int j = 0; j < n2; j++) {
        __m512bh w[DV];
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) w[v] = (__m512bh)_mm512_load_si512(Pp + j * DR + v * 16);
        const uint32_t *vj = Vp + (int64_t)j * d + c0;
#pragma GCC unroll 6
        for (int i = 0; i < cb; i++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)vj[i]);
#pragma GCC unroll 2
            for (int v = 0; v < DV; v++) a[i][v] = _mm512_dpbf16_ps(a[i][v], w[v], b);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < cb; i++)
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) _mm512_store_ps(oT + (c0 + i) * DR + v * 16, a[i][v]);
}

/* Two fp32 vectors rounded to bf16 (nearest even) and interleaved: dword r = (lo[r], hi[r]), lo in the low half. */
ALWAYS_INLINE __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
    return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

_Static_assert(DKB == 6, "SWITCH_UP_TO_6 unrolls blocks of up to 6");

/* One item: rows row0 .. row0 + DR - 1 of kv head h of sequence seq, row = token * group + head in group. */
ALWAYS_INLINE void attend_dpbf16(const Problem *p, int32_t seq, int32_t h, int32_t row0, int d) {
    const int32_t group = p->num_q_heads / p->num_kv_heads, n = num_queries(p, seq), len = p->seq_lens[seq];
    const int32_t q0 = p->query_start_loc ? p->query_start_loc[seq] : seq, bs = p->block_size;
    const int32_t nrows = n * group - row0 < DR ? n * group - row0 : DR, d2 = d / 2;
    const int32_t *table = table_of(p, seq);
    if (len == 0) { /* a padding sequence (a decode row of a wide GQA group): the kernels' contract is 0 */
        for (int32_t r = 0; r < nrows; r++) {
            const int32_t row = row0 + r, head = h * group + row % group;
            memset((uint16_t *)p->out + ((int64_t)(q0 + row / group) * p->num_q_heads + head) * d, 0, (size_t)d * 2);
        }
        return;
    }
    _Alignas(64) uint32_t qT[MAX_D / 2 * DR], Pp[DKC / 2 * DR], Vp[DKC / 2 * MAX_D];
    _Alignas(64) float oT[MAX_D * DR], S[DKC * DR];
    const uint32_t *kp[DKC];
    const uint16_t *vp[DKC];
    _Alignas(64) int32_t pos[DR];
    /* Rows past the sequence's last (the item's tail) copy the last real row and are never stored. */
    for (int32_t r = 0; r < DR; r++) {
        const int32_t row = row0 + (r < nrows ? r : nrows - 1), tok = row / group, head = h * group + row % group;
        const uint16_t *q = (const uint16_t *)p->q + (int64_t)(q0 + tok) * p->q_stride_tok +
                            (int64_t)head * p->q_stride_head;
        for (int c = 0; c < d2; c++) memcpy(qT + c * DR + r, q + 2 * c, 4);
        for (int c = 0; c < d; c++) oT[c * DR + r] = 0.0f;
        pos[r] = len - n + tok;
    }
    __m512 m[DV], l[DV], alpha[DV];
    __m512i posv[DV];
#pragma GCC unroll 2
    for (int v = 0; v < DV; v++) {
        m[v] = _mm512_set1_ps(-INFINITY);
        l[v] = _mm512_setzero_ps();
        posv[v] = _mm512_load_si512(pos + v * 16);
    }
    const __m512 scale = _mm512_set1_ps(p->scale_log2);
    const int32_t first = pos[0], last = pos[DR - 1]; /* token-major rows: positions ascend */
    const uint16_t *const kbase = (const uint16_t *)p->k_cache, *const vbase = (const uint16_t *)p->v_cache;
    static const uint16_t zeros[MAX_D]; /* the odd partner of a chunk's last key when nk is odd */
    for (int32_t start = 0; start <= last; start += DKC) {
        const int nk = last - start + 1 < DKC ? last - start + 1 : DKC, n2 = (nk + 1) / 2;
        for (int32_t j = 0, blk = start / bs, off = start % bs; j < nk; j++) { /* no division per key */
            const int64_t at = cache_offset(p, table[blk], off, h);
            kp[j] = (const uint32_t *)(kbase + at);
            vp[j] = vbase + at;
            if (++off == bs) off = 0, blk++;
        }
        for (int j = 0; j < nk; j += DKB) {
#define QK(N) dp_qk(S + j * DR, qT, kp + j, N, d2, scale)
            SWITCH_UP_TO_6(nk - j, QK)
#undef QK
        }
        /* V's keys in pairs: Vp[i][c] = (v_2i[c], v_2i+1[c]), read by dp_pv one broadcast dword at a time. */
        for (int i = 0; i < n2; i++) {
            const uint16_t *ve = vp[2 * i], *vo = 2 * i + 1 < nk ? vp[2 * i + 1] : zeros;
            for (int c = 0; c < d; c += 16) {
                const __m512i e = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(ve + c)));
                const __m512i o = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vo + c)));
                _mm512_store_si512(Vp + (int64_t)i * d + c, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
            }
        }
        if (start + nk - 1 > first) /* some row stops inside this chunk: mask the keys past it */
            for (int j = 0; j < nk; j++) {
                const __m512i key = _mm512_set1_epi32(start + j);
#pragma GCC unroll 2
                for (int v = 0; v < DV; v++) {
                    const __mmask16 past = _mm512_cmpgt_epi32_mask(key, posv[v]);
                    _mm512_mask_store_ps(S + j * DR + v * 16, past, _mm512_set1_ps(-INFINITY));
                }
            }
        __m512 mx[DV], sum[DV];
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) mx[v] = m[v];
        for (int j = 0; j < nk; j++)
#pragma GCC unroll 2
            for (int v = 0; v < DV; v++) mx[v] = _mm512_max_ps(mx[v], _mm512_load_ps(S + j * DR + v * 16));
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) {
            /* first chunk: m = -inf, alpha ~ 0 on a zero output (every row sees key 0, so mx is finite) */
            alpha[v] = exp2_ps(_mm512_sub_ps(m[v], mx[v]));
            m[v] = mx[v];
            sum[v] = _mm512_setzero_ps();
        }
        for (int i = 0; i < n2; i++)
#pragma GCC unroll 2
            for (int v = 0; v < DV; v++) {
                const __m512 se = _mm512_load_ps(S + 2 * i * DR + v * 16);
                const __m512 so = 2 * i + 1 < nk ? _mm512_load_ps(S + (2 * i + 1) * DR + v * 16)
                                                 : _mm512_set1_ps(-INFINITY);
                /* exp2_ps clamps at 2^-127: a masked key's weight is a denormal that bf16 rounding flushes to 0 */
                const __m512 pe = exp2_ps(_mm512_sub_ps(se, m[v])), po = exp2_ps(_mm512_sub_ps(so, m[v]));
                const __mmask16 live_e = _mm512_cmp_ps_mask(se, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                const __mmask16 live_o = _mm512_cmp_ps_mask(so, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                sum[v] = _mm512_add_ps(sum[v], _mm512_add_ps(_mm512_maskz_mov_ps(live_e, pe),
                                                             _mm512_maskz_mov_ps(live_o, po)));
                _mm512_store_si512(Pp + i * DR + v * 16,
                                   bf16_pairs(_mm512_maskz_mov_ps(live_e, pe), _mm512_maskz_mov_ps(live_o, po)));
            }
#pragma GCC unroll 2
        for (int v = 0; v < DV; v++) l[v] = _mm512_add_ps(_mm512_mul_ps(l[v], alpha[v]), sum[v]);
        for (int c = 0; c < d; c += DKB) {
#define PV(N) dp_pv(oT, Pp, Vp, alpha, n2, c, N, d)
            SWITCH_UP_TO_6(d - c, PV)
#undef PV
        }
    }
    _Alignas(64) float inv[DR];
#pragma GCC unroll 2
    for (int v = 0; v < DV; v++) _mm512_store_ps(inv + v * 16, _mm512_div_ps(_mm512_set1_ps(1.0f), l[v]));
    for (int32_t r = 0; r < nrows; r++) {
        const int32_t row = row0 + r, tok = row / group, head = h * group + row % group;
        uint16_t *o = (uint16_t *)p->out + ((int64_t)(q0 + tok) * p->num_q_heads + head) * d;
        for (int c = 0; c < d; c++) o[c] = f32_to_bf16(oT[c * DR + r] * inv[r]);
    }
}

/* One instance for SmolLM2's head_dim so its loops unroll; any other head_dim (a multiple of 16) the generic. */
static void dpbf16_d64(const Problem *p, int32_t seq, int32_t h, int32_t row0) { attend_dpbf16(p, seq, h, row0, 64); }
static void dpbf16_any(const Problem *p, int32_t seq, int32_t h, int32_t row0) {
    attend_dpbf16(p, seq, h, row0, p->head_dim);
}
#endif /* __AVX512F__ && __AVX512BF16__ */

#endif /* UCM_PAGED_ATTENTION_DPBF16_H */
