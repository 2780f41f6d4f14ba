/* The AVX-512 body of paged_attention.c (head_dim % 32 == 0); compiled out unless -march enables AVX-512F.
 *
 * Included once by paged_attention.c (one translation unit), which picks the body per head_dim in pick_item_fn.
 */
#ifndef UCM_PAGED_ATTENTION_AVX512_H
#define UCM_PAGED_ATTENTION_AVX512_H

#include "paged_attention_common.h"

/* ---------------------------------------------------------------- AVX-512 path (head_dim % 32 == 0) */

#ifdef __AVX512F__

ALWAYS_INLINE int has_bf16_dot(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

ALWAYS_INLINE __m512 load16(const void *base, int64_t i, int dtype) {
    return dtype == UCM_DTYPE_BF16 ? bf16x16_to_f32((const uint16_t *)base + i) : _mm512_loadu_ps((const float *)base + i);
}

/* Round 16 floats to bf16, nearest even, NaN kept a NaN. */
ALWAYS_INLINE void store_bf16x16(uint16_t *dst, __m512 y) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(y));
#else
    f32x16_store_bf16(dst, y);
#endif
}

/* x = n + f for 2^x = 2^f * 2^n: n the nearest integer (returned), |f| <= 0.5. clamp (a constant): x is first
 * raised to -127, below which 2^x is ~0 either way, so that a -inf lane does not make f a NaN (-inf - -inf). */
ALWAYS_INLINE __m512 exp2_split(__m512 x, __m512 *f, const int clamp) {
    if (clamp) x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    *f = _mm512_sub_ps(x, n);
    return n;
}

/* 2^x for x <= 0: degree-7 Taylor of 2^f on [-0.5, 0.5] (relative error < 1e-8), scalef adds the exponent.
 * Callers zero masked lanes themselves. */
ALWAYS_INLINE __m512 exp2_ps(__m512 x) {
    __m512 f;
    const __m512 n = exp2_split(x, &f, 1);
    __m512 y = _mm512_set1_ps(1.525273380405984e-05f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.5403530393381606e-04f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146428443e-03f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.618129107628477e-03f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550410866482158e-02f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.402265069591007e-01f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931471805599453e-01f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* 2^x for x <= 0 as exp2_ps, with a degree-3 polynomial fitted for relative error (< 7.6e-5): for weights that
 * are rounded to bf16 next (a bf16 ulp is 2^-7 of the value), where the four multiply-adds it saves are a fifth
 * of the AMX prompt body's vector work a score. finite (a constant): no lane is -inf, so no clamp is needed
 * (scalef takes any exponent to 0 or a denormal). */
ALWAYS_INLINE __m512 exp2_short_ps(__m512 x, const int finite) {
    __m512 f;
    const __m512 n = exp2_split(x, &f, !finite);
    __m512 y = _mm512_set1_ps(5.517090594437039e-02f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4260952690589277e-01f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.932609624309474e-01f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999281740133682e-01f));
    return _mm512_scalef_ps(y, n);
}

/* Lane j of the result = sum of the 16 lanes of v[j]: a transpose-and-add tree, 45 shuffles/adds for 16
 * dot products instead of 16 separate horizontal reductions. */
ALWAYS_INLINE __m512 hsum16x16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Raw scores q . k_j for the nk keys at k (consecutive keys kstride elements apart); lanes >= nk are 0.
 * qf is q in fp32 (unused when bf16 dot products run natively). */
ALWAYS_INLINE __m512 qk_chunk(const void *q, const float *qf, const void *k, int64_t kstride, int nk, int d,
                              int dtype) {
    __m512 acc[CHUNK];
#pragma GCC unroll 16
    for (int j = 0; j < CHUNK; j++) {
        acc[j] = _mm512_setzero_ps();
        if (j < nk) {
#if defined(__AVX512BF16__)
            if (dtype == UCM_DTYPE_BF16) {
                /* bf16 x bf16 products are exact in fp32: dpbf16 loses nothing against converting first. */
                const uint16_t *kj = (const uint16_t *)k + j * kstride, *qh = (const uint16_t *)q;
                for (int c = 0; c < d; c += 32)
                    acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(qh + c),
                                              (__m512bh)_mm512_loadu_si512(kj + c));
                continue;
            }
#endif
            for (int c = 0; c < d; c += 16)
                acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + c), load16(k, j * kstride + c, dtype), acc[j]);
        }
    }
    (void)q;
    (void)qf;
    return hsum16x16(acc);
}

/* o[r] = o[r] * alpha[r] + sum_j w[r][j] * v_j for NR consecutive rows sharing one V head, two 16-float
 * column slices at a time so 2 * NR independent FMA chains hide the FMA latency. */
ALWAYS_INLINE void pv_rows(float *o, const float (*w)[CHUNK], const float *alpha, int r0, int NR, const void *v,
                           int64_t vstride, int nk, int d, int dtype) {
    for (int c = 0; c < d; c += 32) {
        __m512 a0[4], a1[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m512 s = _mm512_set1_ps(alpha[r0 + r]);
            a0[r] = _mm512_mul_ps(_mm512_load_ps(o + (r0 + r) * d + c), s);
            a1[r] = _mm512_mul_ps(_mm512_load_ps(o + (r0 + r) * d + c + 16), s);
        }
        for (int j = 0; j < nk; j++) {
            const __m512 v0 = load16(v, j * vstride + c, dtype), v1 = load16(v, j * vstride + c + 16, dtype);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const __m512 wj = _mm512_set1_ps(w[r0 + r][j]);
                a0[r] = _mm512_fmadd_ps(wj, v0, a0[r]);
                a1[r] = _mm512_fmadd_ps(wj, v1, a1[r]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            _mm512_store_ps(o + (r0 + r) * d + c, a0[r]);
            _mm512_store_ps(o + (r0 + r) * d + c + 16, a1[r]);
        }
    }
}

ALWAYS_INLINE void attend_item_avx512(const Problem *p, const Item *it, int d, int dtype) {
    Rows r;
    resolve_rows(p, it, &r);
    if (r.nrows <= 0) return; /* items are made with row0 < n * num_q_heads; this only tells the compiler */
    if (r.len == 0) {         /* padding row: the kernels' contract is 0, not NaN */
        store_zero_rows(p, &r, dtype);
        return;
    }
    const int esize = dtype == UCM_DTYPE_BF16 ? 2 : 4;
    const int32_t bs = p->block_size, nrows = r.nrows;
    const int32_t *table = table_of(p, it->seq);
    const int64_t kstride = (int64_t)p->num_kv_heads * d; /* elements between consecutive keys of a block */
    int32_t h_lo = r.kv_head[0], h_hi = r.kv_head[0]; /* the kv heads to prefetch */
    for (int32_t i = 1; i < nrows; i++) {
        h_lo = r.kv_head[i] < h_lo ? r.kv_head[i] : h_lo;
        h_hi = r.kv_head[i] > h_hi ? r.kv_head[i] : h_hi;
    }
    const int64_t pf_bytes = (int64_t)(h_hi - h_lo + 1) * d * esize;
    _Alignas(64) float o[MAX_ROWS * MAX_D];
    _Alignas(64) float qf[MAX_ROWS * MAX_D];
    _Alignas(64) float w[MAX_ROWS][CHUNK];
    float m[MAX_ROWS], l[MAX_ROWS], alpha[MAX_ROWS];
    const void *qrow[MAX_ROWS];
    const int native_dot = dtype == UCM_DTYPE_BF16 && has_bf16_dot();
    for (int32_t i = 0; i < nrows; i++) {
        qrow[i] = (const char *)p->q + r.q_off[i] * esize;
        m[i] = -INFINITY;
        l[i] = 0.0f;
        for (int c = 0; c < d; c += 16) {
            _mm512_store_ps(o + i * d + c, _mm512_setzero_ps());
            if (!native_dot) _mm512_store_ps(qf + i * d + c, load16(qrow[i], c, dtype));
        }
    }
    const int32_t last = r.pos[nrows - 1]; /* rows are in position order: the last row sees the most keys */
    int32_t first_live = 0;                /* rows before it have seen all their keys */
    int nk;
    for (int32_t start = 0; start <= last; start += nk) {
        /* a chunk never straddles a block: its keys are equally spaced in memory */
        const int32_t off = start % bs;
        nk = last - start + 1 < CHUNK ? last - start + 1 : CHUNK;
        if (nk > bs - off) nk = bs - off;
        const int64_t base = cache_offset(p, table[start / bs], off, 0);
        const char *kc = (const char *)p->k_cache + base * esize, *vc = (const char *)p->v_cache + base * esize;
        /* One chunk ahead is enough (measured: 2 or 4 ahead, or into L2 only, were slower). */
        const int32_t next = start + nk;
        Prefetch pf = {0};
        if (next <= last) {
            int nn = last - next + 1 < CHUNK ? last - next + 1 : CHUNK;
            if (nn > bs - next % bs) nn = bs - next % bs;
            const int64_t nb = cache_offset(p, table[next / bs], next % bs, h_lo) * esize;
            pf = (Prefetch){(const char *)p->k_cache + nb, (const char *)p->v_cache + nb, kstride * esize, pf_bytes,
                            nn, 0, 0};
        }
        while (first_live < nrows && r.pos[first_live] < start) first_live++;
        const int32_t live_rows = nrows - first_live; /* >= 1: the last row sees this chunk */
        const int pf_step = (int)((pf.rows * (pf_bytes / 64) + live_rows - 1) / live_rows);
        for (int32_t i = first_live; i < nrows; i++) {
            prefetch_some(&pf, pf_step);
            const int vis = r.pos[i] - start + 1 < nk ? r.pos[i] - start + 1 : nk; /* keys row i may see */
            const __mmask16 live = (__mmask16)((1u << vis) - 1u);
            const char *ki = kc + (int64_t)r.kv_head[i] * d * esize;
            __m512 s = _mm512_mul_ps(qk_chunk(qrow[i], qf + i * d, ki, kstride, nk, d, dtype),
                                     _mm512_set1_ps(p->scale_log2));
            s = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), s);
            const float m_new = fmaxf(_mm512_reduce_max_ps(s), m[i]);
            alpha[i] = _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(m[i] - m_new)));
            const __m512 e = _mm512_maskz_mov_ps(live, exp2_ps(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
            l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(e);
            m[i] = m_new;
            _mm512_store_ps(w[i], e);
        }
        /* Runs of consecutive rows with one kv head share each V row, up to 4 at a time. */
        for (int32_t i = first_live; i < nrows;) {
            int32_t run = 1;
            while (i + run < nrows && run < 4 && r.kv_head[i + run] == r.kv_head[i]) run++;
            const char *vi = vc + (int64_t)r.kv_head[i] * d * esize;
            const float (*wc)[CHUNK] = (const float (*)[CHUNK])w;
            switch (run) {
            case 4: pv_rows(o, wc, alpha, i, 4, vi, kstride, nk, d, dtype); break;
            case 3: pv_rows(o, wc, alpha, i, 3, vi, kstride, nk, d, dtype); break;
            case 2: pv_rows(o, wc, alpha, i, 2, vi, kstride, nk, d, dtype); break;
            default: pv_rows(o, wc, alpha, i, 1, vi, kstride, nk, d, dtype); break;
            }
            i += run;
        }
    }
    for (int32_t i = 0; i < nrows; i++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
        for (int c = 0; c < d; c += 16) {
            const __m512 y = _mm512_mul_ps(_mm512_load_ps(o + i * d + c), inv);
            if (dtype == UCM_DTYPE_BF16) store_bf16x16((uint16_t *)p->out + r.o_off[i] + c, y);
            else _mm512_storeu_ps((float *)p->out + r.o_off[i] + c, y);
        }
    }
}

/* One instance per (dtype, head_dim) so the head_dim loops unroll; other head_dims use the generic body. */
static void item_bf16_d64(const Problem *p, const Item *it) { attend_item_avx512(p, it, 64, UCM_DTYPE_BF16); }
static void item_bf16_d128(const Problem *p, const Item *it) { attend_item_avx512(p, it, 128, UCM_DTYPE_BF16); }
static void item_bf16_any(const Problem *p, const Item *it) { attend_item_avx512(p, it, p->head_dim, UCM_DTYPE_BF16); }
static void item_f32_d64(const Problem *p, const Item *it) { attend_item_avx512(p, it, 64, UCM_DTYPE_F32); }
static void item_f32_d128(const Problem *p, const Item *it) { attend_item_avx512(p, it, 128, UCM_DTYPE_F32); }
static void item_f32_any(const Problem *p, const Item *it) { attend_item_avx512(p, it, p->head_dim, UCM_DTYPE_F32); }
#endif /* __AVX512F__ */

#endif /* UCM_PAGED_ATTENTION_AVX512_H */
