/* The fp32 prefill body of paged_attention.c (AVX-512, AVX2+FMA or NEON): query rows in vector lanes.
 *
 * paged_attention_vec.h keeps keys in the lanes: it transposes every 16-key chunk of K for each work item and
 * pays for every 16 keys, per row, a horizontal max and sum, a scalar rescale of the row's output and a vector
 * exp2 for that one scalar. On a long prefill that is most of the time: 36 GFLOPS on one core of a Zen 3 EPYC
 * whose FMA peak is 95. Here an item is LR = 16 query rows of ONE kv head (token-major: the GQA group's heads
 * of ~16 / group consecutive tokens), and the rows sit in the lanes of LV vectors:
 *   scores  S[j][rows] += k_j[c] * qT[c][rows]    KB keys x LV vectors of accumulators, one broadcast per key
 *   output  oT[c][rows] += v_j[c] * P[j][rows]    KB columns x LV vectors, one broadcast per V element
 * K and V are read in place from the paged cache (no transposition), the online softmax's max, sum and rescale
 * are element-wise over the rows' lanes (no horizontal reductions), and it runs once per KC keys instead of 16.
 * Only q (once per item) and the output (once) change layout.
 *
 * Part of paged_attention.c's translation unit (included after paged_attention_vec.h, whose helpers it uses).
 */
#ifndef UCM_PAGED_ATTENTION_LANES_H
#define UCM_PAGED_ATTENTION_LANES_H

#include "paged_attention_common.h"

#ifdef UCM_VEC_TYPES
#define UCM_HAS_LANES 1
#define LR 16          /* query rows per item, in lanes */
#define LV (LR / VW)   /* vectors of rows: 1 on AVX-512, 2 on AVX2, 4 on NEON */
#define KB 6           /* keys (scores) or output columns (P V) per register block: KB * LV accumulators */
#define KC 64          /* keys per online-softmax step: the rescale of the output is paid once per KC keys */

/* Whether a sequence's queries take this body: fp32, and at least one full item of rows per kv head. */
static inline int lanes_take(const Problem *p, int32_t seq, int32_t dtype) {
    return dtype == UCM_DTYPE_F32 && num_queries(p, seq) * (p->num_q_heads / p->num_kv_heads) >= LR;
}

/* Items of a lanes sequence: each kv head's n * group rows, LR at a time. */
static inline int32_t lanes_items_per_head(const Problem *p, int32_t seq) {
    return (num_queries(p, seq) * (p->num_q_heads / p->num_kv_heads) + LR - 1) / LR;
}

/* S[j][0:LR] = sum_c kp[j][c] * qT[c][0:LR] for kb (<= KB) keys. */
ALWAYS_INLINE void lanes_qk(float *S, const float *qT, const float *const *kp, int kb, int d) {
    vf a[KB][LV];
#pragma GCC unroll 6
    for (int j = 0; j < kb; j++)
#pragma GCC unroll 4
        for (int v = 0; v < LV; v++) a[j][v] = vsplat(0.0f);
    for (int c = 0; c < d; c++) {
        vf q[LV];
#pragma GCC unroll 4
        for (int v = 0; v < LV; v++) memcpy(&q[v], qT + c * LR + v * VW, sizeof q[v]);
#pragma GCC unroll 6
        for (int j = 0; j < kb; j++) {
            const vf b = vsplat(kp[j][c]);
#pragma GCC unroll 4
            for (int v = 0; v < LV; v++) a[j][v] = vfma(b, q[v], a[j][v]);
        }
    }
#pragma GCC unroll 6
    for (int j = 0; j < kb; j++)
#pragma GCC unroll 4
        for (int v = 0; v < LV; v++) memcpy(S + j * LR + v * VW, &a[j][v], sizeof a[j][v]);
}

/* oT[c0 + i][0:LR] = oT[c0 + i][0:LR] * alpha + sum_j vp[j][c0 + i] * P[j][0:LR] for cb (<= KB) columns. */
ALWAYS_INLINE void lanes_pv(float *oT, const float *P, const float *const *vp, const vf *alpha, int nk, int c0,
                            int cb) {
    vf a[KB][LV];
#pragma GCC unroll 6
    for (int i = 0; i < cb; i++)
#pragma GCC unroll 4
        for (int v = 0; v < LV; v++) {
            memcpy(&a[i][v], oT + (c0 + i) * LR + v * VW, sizeof a[i][v]);
            a[i][v] *= alpha[v];
        }
    for (int j = 0; j < nk; j++) {
        vf w[LV];
#pragma GCC unroll 4
        for (int v = 0; v < LV; v++) memcpy(&w[v], P + j * LR + v * VW, sizeof w[v]);
        const float *vj = vp[j] + c0;
#pragma GCC unroll 6
        for (int i = 0; i < cb; i++) {
            const vf b = vsplat(vj[i]);
#pragma GCC unroll 4
            for (int v = 0; v < LV; v++) a[i][v] = vfma(b, w[v], a[i][v]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < cb; i++)
#pragma GCC unroll 4
        for (int v = 0; v < LV; v++) memcpy(oT + (c0 + i) * LR + v * VW, &a[i][v], sizeof a[i][v]);
}

_Static_assert(KB == 6, "SWITCH_UP_TO_6 unrolls blocks of up to 6");

/* One item: rows row0 .. row0 + LR - 1 of kv head h of sequence seq, row = token * group + head in group. */
ALWAYS_INLINE void attend_lanes(const Problem *p, int32_t seq, int32_t h, int32_t row0, int d) {
    const int32_t group = p->num_q_heads / p->num_kv_heads, n = num_queries(p, seq), len = p->seq_lens[seq];
    const int32_t q0 = p->query_start_loc ? p->query_start_loc[seq] : seq;
    const int32_t nrows = n * group - row0 < LR ? n * group - row0 : LR;
    const int32_t *table = table_of(p, seq);
    if (len == 0) { /* a padding sequence (a decode row of a wide GQA group) */
        zero_lane_rows(p, q0, h, row0, nrows, 4);
        return;
    }
    _Alignas(64) float qT[MAX_D * LR], oT[MAX_D * LR], S[KC * LR];
    const float *kp[KC], *vp[KC];
    int64_t at[KC];
    int32_t pos[LR];
    /* Rows past the sequence's last (the item's tail) copy the last real row and are never stored. */
    for (int32_t r = 0; r < LR; r++) {
        const int32_t row = row0 + (r < nrows ? r : nrows - 1), tok = row / group, head = h * group + row % group;
        const float *q = (const float *)p->q + (int64_t)(q0 + tok) * p->q_stride_tok + (int64_t)head * p->q_stride_head;
        for (int c = 0; c < d; c++) {
            qT[c * LR + r] = q[c] * p->scale_log2;
            oT[c * LR + r] = 0.0f;
        }
        pos[r] = len - n + tok;
    }
    vf m[LV], l[LV], alpha[LV];
    vi posv[LV];
#pragma GCC unroll 4
    for (int v = 0; v < LV; v++) {
        m[v] = vsplat(-INFINITY);
        l[v] = vsplat(0.0f);
        memcpy(&posv[v], pos + v * VW, sizeof posv[v]);
    }
    const int32_t first = pos[0], last = pos[LR - 1]; /* token-major rows: positions ascend */
    const float *const kbase = (const float *)p->k_cache, *const vbase = (const float *)p->v_cache;
    for (int32_t start = 0; start <= last; start += KC) {
        const int nk = last - start + 1 < KC ? last - start + 1 : KC;
        key_offsets(p, table, start, nk, h, at);
        for (int j = 0; j < nk; j++) {
            kp[j] = kbase + at[j];
            vp[j] = vbase + at[j];
        }
        for (int j = 0; j < nk; j += KB) {
#define QK(N) lanes_qk(S + j * LR, qT, kp + j, N, d)
            SWITCH_UP_TO_6(nk - j, QK)
#undef QK
        }
        if (start + nk - 1 > first) /* some row stops inside this chunk: mask the keys past it */
            for (int j = 0; j < nk; j++) {
                const vi key = (vi){0} + (start + j);
#pragma GCC unroll 4
                for (int v = 0; v < LV; v++) {
                    vf s;
                    memcpy(&s, S + j * LR + v * VW, sizeof s);
                    s = vselect(key > posv[v], vsplat(-INFINITY), s);
                    memcpy(S + j * LR + v * VW, &s, sizeof s);
                }
            }
        vf mx[LV], sum[LV];
#pragma GCC unroll 4
        for (int v = 0; v < LV; v++) mx[v] = m[v];
        for (int j = 0; j < nk; j++)
#pragma GCC unroll 4
            for (int v = 0; v < LV; v++) {
                vf s;
                memcpy(&s, S + j * LR + v * VW, sizeof s);
                mx[v] = vselect(s > mx[v], s, mx[v]);
            }
#pragma GCC unroll 4
        for (int v = 0; v < LV; v++) {
            alpha[v] = vexp2(m[v] - mx[v]); /* first chunk: -inf -> 0 (every row sees key 0, so mx is finite) */
            m[v] = mx[v];
            sum[v] = vsplat(0.0f);
        }
        for (int j = 0; j < nk; j++)
#pragma GCC unroll 4
            for (int v = 0; v < LV; v++) {
                vf s;
                memcpy(&s, S + j * LR + v * VW, sizeof s);
                s = vexp2(s - m[v]); /* masked: -inf -> exactly 0 */
                sum[v] += s;
                memcpy(S + j * LR + v * VW, &s, sizeof s);
            }
#pragma GCC unroll 4
        for (int v = 0; v < LV; v++) l[v] = l[v] * alpha[v] + sum[v];
        for (int c = 0; c < d; c += KB) {
#define PV(N) lanes_pv(oT, S, vp, alpha, nk, c, N)
            SWITCH_UP_TO_6(d - c, PV)
#undef PV
        }
    }
    float inv[LR];
#pragma GCC unroll 4
    for (int v = 0; v < LV; v++) {
        const vf x = vsplat(1.0f) / l[v];
        memcpy(inv + v * VW, &x, sizeof x);
    }
    for (int32_t r = 0; r < nrows; r++) {
        const int32_t row = row0 + r, tok = row / group, head = h * group + row % group;
        float *o = (float *)p->out + ((int64_t)(q0 + tok) * p->num_q_heads + head) * d;
        for (int c = 0; c < d; c++) o[c] = oT[c * LR + r] * inv[r];
    }
}

/* One instance for SmolLM2's head_dim so its loops unroll; any other head_dim uses the generic body. */
static void lanes_f32_d64(const Problem *p, int32_t seq, int32_t h, int32_t row0) { attend_lanes(p, seq, h, row0, 64); }
static void lanes_f32_any(const Problem *p, int32_t seq, int32_t h, int32_t row0) {
    attend_lanes(p, seq, h, row0, p->head_dim);
}
#endif /* UCM_VEC_TYPES */

#endif /* UCM_PAGED_ATTENTION_LANES_H */
