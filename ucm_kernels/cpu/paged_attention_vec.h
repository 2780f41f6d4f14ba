/* The vector body of paged_attention.c: AVX2+FMA or NEON (head_dim % 16 == 0), one source in GCC vector
 * extensions; compiled out when the AVX-512 body is in, or on a CPU with neither. Its vector types and the
 * helpers the fp32 lanes body needs (paged_attention_lanes.h: vsplat, vfma, vselect, vexp2) are also defined,
 * 16 floats wide, with AVX-512 (UCM_VEC_TYPES), where that body runs instead of the AVX-512 one for fp32 prefill.
 *
 * Included once by paged_attention.c (one translation unit), which picks the body per head_dim in pick_item_fn.
 */
#ifndef UCM_PAGED_ATTENTION_VEC_H
#define UCM_PAGED_ATTENTION_VEC_H

#include "paged_attention_common.h"

/* ---------------------------------------------------------------- vector path: AVX2+FMA or NEON (head_dim % 16 == 0)
 *
 * Written once with GCC vector extensions (the compiler emits AVX2 or NEON), plus a few per-ISA helpers (fused
 * multiply-add: -std=c11 turns off fp contraction; an AVX2 8x8 transpose). The algorithm is the AVX-512 path's
 * (same items, online softmax in base 2), arranged as small matrix products so several query rows share every
 * K/V value they load: the rows of an item are grouped by kv head, each chunk of 16 keys is transposed once per
 * head into kT[d][16], and then
 *   scores  S[r][0:16] += q[r][c] * kT[c][0:16]   RB rows x 16 keys of accumulators, one kT row per c
 *   output  O[r][c:c+16] += w[r][j] * V[j][c:c+16] RB rows x 16 columns of accumulators, one V row per key
 * which is what a GEMM microkernel does (the torch path's prefill speed comes from its GEMMs). Dot products
 * with horizontal sums instead (the AVX-512 layout) load q and k for every FMA: at most half the FMA rate. */

#if defined(__AVX512F__)
#define UCM_VEC_TYPES 1 /* the types and the lanes body's helpers only: the AVX-512 body is the per-ISA one */
#define VBYTES 64
#elif (defined(__AVX2__) && defined(__FMA__)) || defined(__ARM_NEON)
#define UCM_VEC_TYPES 1
#define UCM_HAS_VEC 1
#if defined(__AVX2__)
#define VBYTES 32
#define VEC_NAME "avx2"
#else
#include <arm_neon.h>
#define VBYTES 16
#define VEC_NAME "neon"
#endif
#endif

#ifdef UCM_VEC_TYPES
#define VW (VBYTES / 4)  /* floats per vector */
#define NV (CHUNK / VW)  /* vectors per chunk of scores, and per 16-column step of the output */
#define RB 6             /* rows per register block: RB * NV accumulators + NV operands fit 16 ymm / 32 NEON regs */

typedef float vf __attribute__((vector_size(VBYTES)));
typedef int32_t vi __attribute__((vector_size(VBYTES)));
typedef uint32_t vu __attribute__((vector_size(VBYTES)));
typedef uint16_t vh __attribute__((vector_size(VBYTES / 2)));

ALWAYS_INLINE vf vsplat(float x) { /* not (vf){0} + x: that costs an add (-0.0 + 0 is +0.0) before the broadcast */
#if defined(__AVX512F__)
    return _mm512_set1_ps(x);
#elif defined(__AVX2__)
    return _mm256_set1_ps(x);
#else
    return vdupq_n_f32(x);
#endif
}

ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { /* a * b + c, one rounding */
#if defined(__AVX512F__)
    return _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX2__)
    return _mm256_fmadd_ps(a, b, c);
#else
    return vfmaq_f32(c, a, b);
#endif
}

ALWAYS_INLINE vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
#endif /* UCM_VEC_TYPES */

#ifdef UCM_HAS_VEC

/* VW consecutive elements from base[i] as fp32 (bf16: the 16 bits become the high half). */
ALWAYS_INLINE vf vload(const void *base, int64_t i, int dtype) {
    if (dtype == UCM_DTYPE_BF16) {
#if defined(__AVX2__) /* GCC widens a generic convert as two 128-bit halves plus an insert */
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
        return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
        vh h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
    }
    vf v;
    memcpy(&v, (const float *)base + i, sizeof v);
    return v;
}

/* Store VW floats at base[i]; bf16 rounds to nearest even and keeps a NaN a NaN (as f32_to_bf16). */
ALWAYS_INLINE void vstore(void *base, int64_t i, vf y, int dtype) {
    if (dtype == UCM_DTYPE_BF16) {
        vu u = (vu)y;
        u += 0x7fffu + ((u >> 16) & 1u);
        const vi nan = y != y;
        u = (vu)(((vi)((vu)y | 0x400000u) & nan) | ((vi)u & ~nan));
        const vh h = __builtin_convertvector(u >> 16, vh);
        memcpy((uint16_t *)base + i, &h, sizeof h);
    } else {
        memcpy((float *)base + i, &y, sizeof y);
    }
}

ALWAYS_INLINE float vmax_lanes(vf v) {
#if defined(__AVX2__)
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
#else
    return vmaxvq_f32(v);
#endif
}

ALWAYS_INLINE float vsum_lanes(vf v) {
#if defined(__AVX2__)
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#else
    return vaddvq_f32(v);
#endif
}

#endif /* UCM_HAS_VEC */

#ifdef UCM_VEC_TYPES
/* 2^x for x <= 0, as exp2_ps above: round to nearest with the 1.5 * 2^23 trick (exact for |x| < 2^22), degree-7
 * Taylor of 2^f on [-0.5, 0.5], exponent bits for 2^n. x <= -127 gives exactly 0 (the exponent field is 0). */
ALWAYS_INLINE vf vexp2(vf x) {
    const vf lo = vsplat(-127.0f), magic = vsplat(12582912.0f);
    x = vselect(x < lo, lo, x);
    const vf n = (x + magic) - magic, f = x - n;
    vf y = vsplat(1.525273380405984e-05f);
    y = vfma(y, f, vsplat(1.5403530393381606e-04f));
    y = vfma(y, f, vsplat(1.3333558146428443e-03f));
    y = vfma(y, f, vsplat(9.618129107628477e-03f));
    y = vfma(y, f, vsplat(5.550410866482158e-02f));
    y = vfma(y, f, vsplat(2.402265069591007e-01f));
    y = vfma(y, f, vsplat(6.931471805599453e-01f));
    y = vfma(y, f, vsplat(1.0f));
    return y * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}
#endif /* UCM_VEC_TYPES */

#ifdef UCM_HAS_VEC

#if defined(__AVX2__)
ALWAYS_INLINE void transpose8x8(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
}
#endif

/* kT[c][j] = k_j[c] in fp32 for the nk keys at k (kstride elements apart); lanes j >= nk are 0. */
ALWAYS_INLINE void transpose_keys(float *kT, const void *k, int64_t kstride, int nk, int d, int dtype) {
#if defined(__AVX2__)
    if (nk == CHUNK) {
        for (int j0 = 0; j0 < CHUNK; j0 += 8)
            for (int c = 0; c < d; c += 8) {
                __m256 r[8];
                for (int t = 0; t < 8; t++) r[t] = vload(k, (j0 + t) * kstride + c, dtype);
                transpose8x8(r);
                for (int t = 0; t < 8; t++) _mm256_store_ps(kT + (c + t) * CHUNK + j0, r[t]);
            }
        return;
    }
#endif
    for (int j = 0; j < CHUNK; j++)
        for (int c = 0; c < d; c++) kT[c * CHUNK + j] = j < nk ? load_f(k, j * kstride + c, dtype) : 0.0f;
}

/* Scores of R rows (q: R rows of d, pre-scaled) against a transposed chunk: w[r][j] = q_r . k_j. */
ALWAYS_INLINE void qk_rows(float (*w)[CHUNK], const float *q, const float *kT, int R, int d) {
    vf a[RB][NV];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) a[r][v] = vsplat(0.0f);
    for (int c = 0; c < d; c++) {
        vf k[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) memcpy(&k[v], kT + c * CHUNK + v * VW, sizeof k[v]);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const vf b = vsplat(q[r * d + c]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) a[r][v] = vfma(b, k[v], a[r][v]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) memcpy(&w[r][v * VW], &a[r][v], sizeof a[r][v]);
}

/* o[r] = o[r] * alpha[r] + sum_j w[r][j] * v_j for R rows sharing one V head, 16 columns at a time. The
 * next chunk's prefetches are spread over the column steps. */
ALWAYS_INLINE void pv_rows_vec(float *o, const float (*w)[CHUNK], const float *alpha, int R, const void *v,
                               int64_t vstride, int nk, int d, int dtype, Prefetch *pf, int pf_step) {
    for (int c = 0; c < d; c += CHUNK) {
        prefetch_some(pf, pf_step);
        vf a[RB][NV];
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const vf s = vsplat(alpha[r]);
#pragma GCC unroll 4
            for (int u = 0; u < NV; u++) {
                memcpy(&a[r][u], o + r * d + c + u * VW, sizeof a[r][u]);
                a[r][u] *= s;
            }
        }
        for (int j = 0; j < nk; j++) {
            vf x[NV];
#pragma GCC unroll 4
            for (int u = 0; u < NV; u++) x[u] = vload(v, j * vstride + c + u * VW, dtype);
#pragma GCC unroll 6
            for (int r = 0; r < R; r++) {
                const vf b = vsplat(w[r][j]);
#pragma GCC unroll 4
                for (int u = 0; u < NV; u++) a[r][u] = vfma(b, x[u], a[r][u]);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int u = 0; u < NV; u++) memcpy(o + r * d + c + u * VW, &a[r][u], sizeof a[r][u]);
    }
}

/* Online-softmax step of one row over its chunk scores w (vis of them visible): w becomes the weights. */
ALWAYS_INLINE void softmax_row(float *w, float *m, float *l, float *alpha, int vis) {
    vf s[NV], mx = vsplat(-INFINITY);
#pragma GCC unroll 4
    for (int u = 0; u < NV; u++) {
        vi lane;
        for (int i = 0; i < VW; i++) lane[i] = u * VW + i;
        memcpy(&s[u], w + u * VW, sizeof s[u]);
        s[u] = vselect(lane < vis, s[u], vsplat(-INFINITY));
        mx = vselect(s[u] > mx, s[u], mx);
    }
    const float m_old = *m, m_max = vmax_lanes(mx), m_new = m_max > m_old ? m_max : m_old;
    *alpha = vexp2(vsplat(m_old - m_new))[0]; /* m_old = -inf (first chunk): 0 */
    vf sum = vsplat(0.0f);
#pragma GCC unroll 4
    for (int u = 0; u < NV; u++) {
        const vf e = vexp2(s[u] - m_new); /* masked lanes: -inf -> exactly 0 */
        sum += e;
        memcpy(w + u * VW, &e, sizeof e);
    }
    *l = *l * *alpha + vsum_lanes(sum);
    *m = m_new;
}

_Static_assert(RB == 6, "SWITCH_UP_TO_6 unrolls blocks of up to 6");

ALWAYS_INLINE void attend_item_vec(const Problem *p, const Item *it, int d, int dtype) {
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
    const int64_t kstride = (int64_t)p->num_kv_heads * d;
    /* Rows in kv-head order, stable (so positions ascend within a head): group g is rows glo[g] .. glo[g+1]-1,
     * all reading head ghead[g]. Everything below is indexed in this order; order[] maps back. */
    int32_t order[MAX_ROWS], pos[MAX_ROWS], ghead[MAX_ROWS], glo[MAX_ROWS + 1], live[MAX_ROWS], ng = 0, n = 0;
    int32_t h_lo = r.kv_head[0], h_hi = r.kv_head[0];
    for (int32_t i = 1; i < nrows; i++) {
        h_lo = r.kv_head[i] < h_lo ? r.kv_head[i] : h_lo;
        h_hi = r.kv_head[i] > h_hi ? r.kv_head[i] : h_hi;
    }
    for (int32_t h = h_lo; h <= h_hi; h++) {
        const int32_t first = n;
        for (int32_t i = 0; i < nrows; i++)
            if (r.kv_head[i] == h) order[n++] = i;
        if (n > first) {
            ghead[ng] = h;
            glo[ng] = live[ng] = first;
            ng++;
        }
    }
    glo[ng] = n;
    _Alignas(64) float qf[MAX_ROWS * MAX_D]; /* q in fp32, pre-multiplied by scale * log2(e) */
    _Alignas(64) float o[MAX_ROWS * MAX_D];
    _Alignas(64) float w[MAX_ROWS][CHUNK];
    _Alignas(64) float kT[MAX_D * CHUNK];
    _Alignas(64) float vf32[CHUNK * MAX_D];
    float m[MAX_ROWS], l[MAX_ROWS], alpha[MAX_ROWS];
    const vf scale = vsplat(p->scale_log2);
    for (int32_t s = 0; s < nrows; s++) {
        pos[s] = r.pos[order[s]];
        m[s] = -INFINITY;
        l[s] = 0.0f;
        for (int c = 0; c < d; c += VW) {
            const vf x = vload(p->q, r.q_off[order[s]] + c, dtype) * scale, z = vsplat(0.0f);
            memcpy(qf + s * d + c, &x, sizeof x);
            memcpy(o + s * d + c, &z, sizeof z);
        }
    }
    const int64_t pf_bytes = (int64_t)(h_hi - h_lo + 1) * d * esize;
    const int32_t last = r.pos[nrows - 1]; /* token-major rows: the last row sees the most keys */
    int nk;
    for (int32_t start = 0; start <= last; start += nk) {
        /* a chunk never straddles a block: its keys are equally spaced in memory */
        const int32_t off = start % bs;
        nk = last - start + 1 < CHUNK ? last - start + 1 : CHUNK;
        if (nk > bs - off) nk = bs - off;
        const int64_t base = cache_offset(p, table[start / bs], off, 0);
        const char *kc = (const char *)p->k_cache + base * esize, *vc = (const char *)p->v_cache + base * esize;
        /* Rows whose last key is before this chunk are done: a prefix of each group. */
        int calls = 0;
        for (int32_t g = 0; g < ng; g++) {
            while (live[g] < glo[g + 1] && pos[live[g]] < start) live[g]++;
            calls += (glo[g + 1] - live[g] + RB - 1) / RB * (d / CHUNK);
        }
        Prefetch pf = {0};
        const int32_t next = start + nk;
        if (next <= last) {
            int nn = last - next + 1 < CHUNK ? last - next + 1 : CHUNK;
            if (nn > bs - next % bs) nn = bs - next % bs;
            const int64_t nb = cache_offset(p, table[next / bs], next % bs, h_lo) * esize;
            pf = (Prefetch){(const char *)p->k_cache + nb, (const char *)p->v_cache + nb, kstride * esize, pf_bytes,
                            nn, 0, 0};
        }
        const int pf_step = calls ? (int)((pf.rows * (pf_bytes / 64) + calls - 1) / calls) : 0;
        for (int32_t g = 0; g < ng; g++) {
            const int32_t lo = live[g], hi = glo[g + 1];
            if (lo == hi) continue;
            const int64_t head_off = (int64_t)ghead[g] * d * esize;
            transpose_keys(kT, kc + head_off, kstride, nk, d, dtype);
            for (int32_t s = lo; s < hi; s += RB) {
#define QK(R) qk_rows(w + s, qf + s * d, kT, R, d)
                SWITCH_UP_TO_6(hi - s, QK)
#undef QK
            }
            for (int32_t s = lo; s < hi; s++) {
                const int vis = pos[s] - start + 1 < nk ? pos[s] - start + 1 : nk; /* keys row s may see */
                softmax_row(w[s], &m[s], &l[s], &alpha[s], vis);
            }
            /* bf16 V read by several register blocks: widen it to fp32 once (as the keys above). */
            const void *vrows = vc + head_off;
            int64_t vstride = kstride;
            int vtype = dtype;
            if (dtype == UCM_DTYPE_BF16 && hi - lo > RB) {
                for (int j = 0; j < nk; j++)
                    for (int c = 0; c < d; c += VW) {
                        const vf x = vload(vrows, j * kstride + c, dtype);
                        memcpy(vf32 + j * d + c, &x, sizeof x);
                    }
                vrows = vf32, vstride = d, vtype = UCM_DTYPE_F32;
            }
            for (int32_t s = lo; s < hi; s += RB) {
#define PV(R)                                                                                                        \
    pv_rows_vec(o + s * d, (const float (*)[CHUNK])(w + s), alpha + s, R, vrows, vstride, nk, d, vtype, &pf, pf_step)
                SWITCH_UP_TO_6(hi - s, PV)
#undef PV
            }
        }
    }
    for (int32_t s = 0; s < nrows; s++) {
        const vf inv = vsplat(1.0f / l[s]);
        for (int c = 0; c < d; c += VW) {
            vf y;
            memcpy(&y, o + s * d + c, sizeof y);
            vstore(p->out, r.o_off[order[s]] + c, y * inv, dtype);
        }
    }
}

/* One instance per (dtype, head_dim) so the head_dim loops unroll; other multiples of 16 use the generic body. */
static void item_vec_bf16_d64(const Problem *p, const Item *it) { attend_item_vec(p, it, 64, UCM_DTYPE_BF16); }
static void item_vec_bf16_d128(const Problem *p, const Item *it) { attend_item_vec(p, it, 128, UCM_DTYPE_BF16); }
static void item_vec_bf16_any(const Problem *p, const Item *it) { attend_item_vec(p, it, p->head_dim, UCM_DTYPE_BF16); }
static void item_vec_f32_d64(const Problem *p, const Item *it) { attend_item_vec(p, it, 64, UCM_DTYPE_F32); }
static void item_vec_f32_d128(const Problem *p, const Item *it) { attend_item_vec(p, it, 128, UCM_DTYPE_F32); }
static void item_vec_f32_any(const Problem *p, const Item *it) { attend_item_vec(p, it, p->head_dim, UCM_DTYPE_F32); }
#endif /* vector path */

#endif /* UCM_PAGED_ATTENTION_VEC_H */
