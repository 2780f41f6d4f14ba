/* Paged attention on the CPU, reading K/V in place from the paged cache (no gather into a dense copy).
 *
 * Plain C11 without torch headers so it builds in about a second on first use (kernels/cpu/native.py).
 *
 * Layout (all contiguous):
 *   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], bf16 (as uint16) or fp32
 *   q                 [T, num_q_heads, head_dim] with any token/head stride, head_dim contiguous; same dtype
 *   out               [T, num_q_heads, head_dim] contiguous; same dtype
 * Sequence b owns query rows query_start_loc[b] .. query_start_loc[b+1]; with n of them and L = seq_lens[b],
 * query token i sits at position L - n + i and attends keys 0..L-n+i (causal over a cached prefix). A NULL
 * query_start_loc means decode: sequence b has exactly one query, row b. Sequences with L == 0 (padding) get
 * zeros.
 *
 * Work item = (sequence, up to MAX_ROWS consecutive "rows"), a row being one (query token, query head) pair in
 * token-major order. A decode item therefore holds every head of its sequence: each chunk of keys is one
 * contiguous stretch of a block (all kv heads), read once, sequentially, and prefetched a chunk ahead (random
 * block order defeats the hardware prefetchers). Items of one kv head each, reading a third of every block,
 * measured 1.25x slower with DRAM-resident caches (SmolLM2 shapes, 32 sequences, 30 layers' caches: 1015 vs
 * 808 us a layer). Rows of one GQA group share each V row they read.
 * Keys are streamed in chunks of up to 16 (never crossing a block) with an online softmax in fp32, base 2.
 *
 * Three bodies, picked at compile time by what -march=native enables: AVX-512 (head_dim % 32 == 0), AVX2+FMA or
 * NEON (head_dim % 16 == 0; one source in GCC vector extensions, see "vector path") and a scalar loop for the
 * rest. Whether the engine calls this kernel or the torch path at all is measured per machine
 * (kernels/cpu/calibration.py).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"

#define UCM_DTYPE_F32 0
#define UCM_DTYPE_BF16 1

#if defined(__AVX512F__)
#define MAX_ROWS 32 /* rows per work item: a prefill chunk's tokens share the K/V they stream from L1/L2 */
#else
#define MAX_ROWS 64 /* the vector path: more rows share each transposed chunk of keys (below) */
#endif
#define MAX_D 256   /* largest head_dim: per-row accumulators live on the stack */
#define CHUNK 16    /* keys per online-softmax step: one AVX-512 vector of scores, two AVX2, four NEON */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Error codes returned to Python (which turns them into ValueError with the sequence index). */
#define UCM_OK 0
#define UCM_ERR_QUERY_LONGER_THAN_CONTEXT 1
#define UCM_ERR_BLOCK_TABLE_TOO_NARROW 2
#define UCM_ERR_BLOCK_ID_OUT_OF_RANGE 3
#define UCM_ERR_BAD_QUERY_START_LOC 4
#define UCM_ERR_BAD_SHAPE 5

static const float LOG2E = 1.4426950408889634f;

typedef struct {
    const void *q;
    int64_t q_stride_tok, q_stride_head; /* elements */
    const void *k_cache, *v_cache;
    void *out;
    const int32_t *query_start_loc, *seq_lens, *block_tables;
    int64_t block_table_stride;
    int32_t num_q_heads, num_kv_heads, head_dim, block_size;
    float scale_log2;           /* softmax scale folded with log2(e): scores live in base 2 */
    int32_t skip_whole_prompts; /* leave sequences whose queries are their whole context (n == L > 1) alone */
} Problem;

typedef struct {
    int32_t seq, row0; /* row0: first row (token * num_q_heads + query head) of the item */
} Item;

/* One item's rows, resolved: where each row's query and output live, its kv head and last visible key. */
typedef struct {
    int32_t n, len, nrows;
    int64_t q_off[MAX_ROWS], o_off[MAX_ROWS];
    int32_t kv_head[MAX_ROWS], pos[MAX_ROWS];
} Rows;

static inline int32_t num_queries(const Problem *p, int32_t seq) {
    return p->query_start_loc ? p->query_start_loc[seq + 1] - p->query_start_loc[seq] : 1;
}

static void resolve_rows(const Problem *p, const Item *it, Rows *r) {
    const int32_t q0 = p->query_start_loc ? p->query_start_loc[it->seq] : it->seq;
    const int32_t hq = p->num_q_heads, group = hq / p->num_kv_heads;
    r->n = num_queries(p, it->seq);
    r->len = p->seq_lens[it->seq];
    r->nrows = r->n * hq - it->row0 < MAX_ROWS ? r->n * hq - it->row0 : MAX_ROWS;
    for (int32_t i = 0; i < r->nrows; i++) {
        const int32_t row = it->row0 + i, tok = row / hq, head = row % hq;
        r->q_off[i] = (int64_t)(q0 + tok) * p->q_stride_tok + (int64_t)head * p->q_stride_head;
        r->o_off[i] = ((int64_t)(q0 + tok) * hq + head) * p->head_dim;
        r->kv_head[i] = head / group;
        r->pos[i] = r->len - r->n + tok;
    }
}

static inline const int32_t *table_of(const Problem *p, int32_t seq) {
    return p->block_tables + (int64_t)seq * p->block_table_stride;
}

/* Element offset of (token t of block, kv head) inside a cache. */
static inline int64_t cache_offset(const Problem *p, int32_t block, int32_t t, int32_t kv_head) {
    return (((int64_t)block * p->block_size + t) * p->num_kv_heads + kv_head) * p->head_dim;
}

/* ---------------------------------------------------------------- dtype helpers (scalar) */

static inline float load_f(const void *base, int64_t i, int dtype) {
    return dtype == UCM_DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static void store_zero_rows(const Problem *p, const Rows *r, int dtype) {
    const int esize = dtype == UCM_DTYPE_BF16 ? 2 : 4;
    for (int32_t i = 0; i < r->nrows; i++) memset((char *)p->out + r->o_off[i] * esize, 0, (size_t)p->head_dim * esize);
}

/* The cache lines of the next chunk, handed to the prefetcher a few at a time between rows: a burst of a
 * few hundred prefetches at once stalls on the core's miss buffers (measured with DRAM-resident caches on huge
 * pages: a burst 1516 us a layer, spread out 668, no prefetch 1773). */
typedef struct {
    const char *k, *v;
    int64_t stride, bytes; /* bytes between key rows, bytes per key row */
    int rows, row;
    int64_t at;
} Prefetch;

ALWAYS_INLINE void prefetch_some(Prefetch *pf, int lines) {
    for (; lines > 0 && pf->row < pf->rows; lines--) {
        __builtin_prefetch(pf->k + pf->row * pf->stride + pf->at, 0, 3); /* prefetcht0 on x86 */
        __builtin_prefetch(pf->v + pf->row * pf->stride + pf->at, 0, 3);
        pf->at += 64;
        if (pf->at >= pf->bytes) {
            pf->at = 0;
            pf->row++;
        }
    }
}

/* ---------------------------------------------------------------- portable path (any head_dim, any CPU) */

static void attend_item_scalar(const Problem *p, const Item *it, int dtype) {
    Rows r;
    resolve_rows(p, it, &r);
    if (r.len == 0) { /* padding row: the kernels' contract is 0, not NaN */
        store_zero_rows(p, &r, dtype);
        return;
    }
    const int32_t d = p->head_dim, bs = p->block_size;
    const int32_t *table = table_of(p, it->seq);
    float qv[MAX_D], acc[MAX_D];
    for (int32_t i = 0; i < r.nrows; i++) {
        for (int32_t k = 0; k < d; k++) {
            qv[k] = load_f(p->q, r.q_off[i] + k, dtype);
            acc[k] = 0.0f;
        }
        float m = -INFINITY, l = 0.0f;
        for (int32_t j = 0; j <= r.pos[i]; j++) {
            const int64_t kv = cache_offset(p, table[j / bs], j % bs, r.kv_head[i]);
            float s = 0.0f;
            for (int32_t k = 0; k < d; k++) s += qv[k] * load_f(p->k_cache, kv + k, dtype);
            s *= p->scale_log2;
            const float m_new = s > m ? s : m;
            const float alpha = exp2f(m - m_new), w = exp2f(s - m_new);
            l = l * alpha + w;
            for (int32_t k = 0; k < d; k++) acc[k] = acc[k] * alpha + w * load_f(p->v_cache, kv + k, dtype);
            m = m_new;
        }
        for (int32_t k = 0; k < d; k++) {
            const float o = acc[k] / l;
            if (dtype == UCM_DTYPE_BF16) ((uint16_t *)p->out)[r.o_off[i] + k] = f32_to_bf16(o);
            else ((float *)p->out)[r.o_off[i] + k] = o;
        }
    }
}

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

/* 2^x for x <= 0: round, degree-7 Taylor of 2^f on [-0.5, 0.5] (relative error < 1e-8), scalef adds the
 * exponent. Below -127 the result is ~0 either way; callers zero masked lanes themselves. */
ALWAYS_INLINE __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
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

#if !defined(__AVX512F__) && ((defined(__AVX2__) && defined(__FMA__)) || defined(__ARM_NEON))
#define UCM_HAS_VEC 1

#if defined(__AVX2__)
#define VBYTES 32
#define VEC_NAME "avx2"
#else
#include <arm_neon.h>
#define VBYTES 16
#define VEC_NAME "neon"
#endif
#define VW (VBYTES / 4)  /* floats per vector */
#define NV (CHUNK / VW)  /* vectors per chunk of scores, and per 16-column step of the output */
#define RB 6             /* rows per register block: RB * NV accumulators + NV operands fit 16 ymm / 32 NEON regs */

typedef float vf __attribute__((vector_size(VBYTES)));
typedef int32_t vi __attribute__((vector_size(VBYTES)));
typedef uint32_t vu __attribute__((vector_size(VBYTES)));
typedef uint16_t vh __attribute__((vector_size(VBYTES / 2)));

ALWAYS_INLINE vf vsplat(float x) { /* not (vf){0} + x: that costs an add (-0.0 + 0 is +0.0) before the broadcast */
#if defined(__AVX2__)
    return _mm256_set1_ps(x);
#else
    return vdupq_n_f32(x);
#endif
}

ALWAYS_INLINE vf vfma(vf a, vf b, vf c) { /* a * b + c, one rounding */
#if defined(__AVX2__)
    return _mm256_fmadd_ps(a, b, c);
#else
    return vfmaq_f32(c, a, b);
#endif
}

ALWAYS_INLINE vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

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

/* CALL(R) with R = min(rows, RB) as a constant, so the register blocks unroll. */
#define RB_SWITCH(rows, CALL)                                                                                        \
    switch ((rows) < RB ? (rows) : RB) {                                                                                                     \
    case 6: CALL(6); break;                                                                                          \
    case 5: CALL(5); break;                                                                                          \
    case 4: CALL(4); break;                                                                                          \
    case 3: CALL(3); break;                                                                                          \
    case 2: CALL(2); break;                                                                                          \
    default: CALL(1); break;                                                                                         \
    }

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
                RB_SWITCH(hi - s, QK)
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
                RB_SWITCH(hi - s, PV)
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

static void item_bf16_scalar(const Problem *p, const Item *it) { attend_item_scalar(p, it, UCM_DTYPE_BF16); }
static void item_f32_scalar(const Problem *p, const Item *it) { attend_item_scalar(p, it, UCM_DTYPE_F32); }

typedef void (*ItemFn)(const Problem *, const Item *);

static ItemFn pick_item_fn(int32_t d, int32_t dtype) {
#ifdef __AVX512F__
    if (d % 32 == 0) {
        if (dtype == UCM_DTYPE_BF16) return d == 64 ? item_bf16_d64 : d == 128 ? item_bf16_d128 : item_bf16_any;
        return d == 64 ? item_f32_d64 : d == 128 ? item_f32_d128 : item_f32_any;
    }
#endif
#ifdef UCM_HAS_VEC
    if (d % CHUNK == 0) {
        if (dtype == UCM_DTYPE_BF16)
            return d == 64 ? item_vec_bf16_d64 : d == 128 ? item_vec_bf16_d128 : item_vec_bf16_any;
        return d == 64 ? item_vec_f32_d64 : d == 128 ? item_vec_f32_d128 : item_vec_f32_any;
    }
#endif
    (void)d;
    return dtype == UCM_DTYPE_BF16 ? item_bf16_scalar : item_f32_scalar;
}

/* ---------------------------------------------------------------- entry points */

/* 1 when this build has the AVX-512 path (tests use it to know which path a head_dim takes). */
int ucm_has_avx512(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Which vector path head_dims that are multiples of 16 (32 for AVX-512) take in this build. */
const char *ucm_vector_path(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(UCM_HAS_VEC)
    return VEC_NAME;
#else
    return "scalar";
#endif
}

int ucm_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Whether sequence seq gets no work here: no queries, or a whole prompt the caller computes elsewhere. */
static inline int skipped(const Problem *p, int32_t seq) {
    const int32_t n = num_queries(p, seq);
    return n == 0 || (p->skip_whole_prompts && n > 1 && n == p->seq_lens[seq]);
}

static inline int32_t items_of(const Problem *p, int32_t seq) {
    return (num_queries(p, seq) * p->num_q_heads + MAX_ROWS - 1) / MAX_ROWS;
}

/* Checks every sequence before any work so a bad batch fails whole, with the first bad sequence in *err_seq;
 * counts the work items and the skipped whole prompts. */
static int validate(const Problem *p, int32_t num_seqs, int32_t num_tokens, int32_t max_blocks_per_seq,
                    int64_t num_blocks, int32_t *err_seq, int64_t *num_items, int32_t *num_skipped) {
    int64_t items = 0;
    int32_t skips = 0;
    for (int32_t b = 0; b < num_seqs; b++) {
        *err_seq = b;
        if (p->query_start_loc) {
            const int32_t lo = p->query_start_loc[b], hi = p->query_start_loc[b + 1];
            if (lo < 0 || hi < lo || hi > num_tokens) return UCM_ERR_BAD_QUERY_START_LOC;
        } else if (b >= num_tokens) {
            return UCM_ERR_BAD_QUERY_START_LOC;
        }
        const int32_t n = num_queries(p, b), len = p->seq_lens[b];
        if (skipped(p, b)) {
            skips += n > 0;
            continue;
        }
        if (len < 0 || (len > 0 && n > len) || (len == 0 && n > 1)) return UCM_ERR_QUERY_LONGER_THAN_CONTEXT;
        const int32_t used = (len + p->block_size - 1) / p->block_size;
        if (used > max_blocks_per_seq) return UCM_ERR_BLOCK_TABLE_TOO_NARROW;
        const int32_t *table = table_of(p, b);
        for (int32_t i = 0; i < used; i++)
            if (table[i] < 0 || table[i] >= num_blocks) return UCM_ERR_BLOCK_ID_OUT_OF_RANGE;
        items += items_of(p, b);
    }
    *err_seq = -1;
    *num_items = items;
    *num_skipped = skips;
    return UCM_OK;
}

/* Varlen causal paged attention (see the file comment). dtype: 0 fp32, 1 bf16. num_threads > 1 splits the
 * work items over OpenMP threads when the build has OpenMP (it shares the process's libgomp with torch).
 * With skip_whole_prompts, sequences whose queries are their whole context are left out (their output rows
 * untouched) and counted in *num_skipped. Returns UCM_OK or an UCM_ERR_* code with the sequence in *err_seq. */
int ucm_paged_attention(const void *q, int64_t q_stride_tok, int64_t q_stride_head, const void *k_cache,
                        const void *v_cache, void *out, const int32_t *query_start_loc, const int32_t *seq_lens,
                        const int32_t *block_tables, int64_t block_table_stride, int32_t max_blocks_per_seq,
                        int64_t num_blocks, int32_t num_seqs, int32_t num_tokens, int32_t num_q_heads,
                        int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int32_t dtype, float scale,
                        int32_t skip_whole_prompts, int32_t num_threads, int32_t *err_seq,
                        int32_t *num_skipped) {
    *err_seq = -1;
    *num_skipped = 0;
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || head_dim <= 0 || head_dim > MAX_D ||
        block_size <= 0 || (dtype != UCM_DTYPE_F32 && dtype != UCM_DTYPE_BF16))
        return UCM_ERR_BAD_SHAPE;
    const Problem p = {q, q_stride_tok, q_stride_head, k_cache, v_cache, out, query_start_loc, seq_lens,
                       block_tables, block_table_stride, num_q_heads, num_kv_heads, head_dim, block_size,
                       scale * LOG2E, skip_whole_prompts};
    int64_t num_items = 0;
    const int rc = validate(&p, num_seqs, num_tokens, max_blocks_per_seq, num_blocks, err_seq, &num_items, num_skipped);
    if (rc != UCM_OK) return rc;
    const ItemFn fn = pick_item_fn(head_dim, dtype);
#ifdef _OPENMP
    if (num_threads > 1 && num_items > 1) {
        Item *items = malloc((size_t)num_items * sizeof *items);
        if (items) {
            int64_t k = 0;
            for (int32_t b = 0; b < num_seqs; b++) {
                if (skipped(&p, b)) continue;
                for (int32_t i = 0; i < items_of(&p, b); i++) items[k++] = (Item){b, i * MAX_ROWS};
            }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
            for (int64_t i = 0; i < num_items; i++) fn(&p, &items[i]);
            free(items);
            return UCM_OK;
        }
    }
#endif
    (void)num_threads;
    for (int32_t b = 0; b < num_seqs; b++) {
        if (skipped(&p, b)) continue;
        for (int32_t i = 0; i < items_of(&p, b); i++) {
            const Item it = {b, i * MAX_ROWS};
            fn(&p, &it);
        }
    }
    return UCM_OK;
}

/* Reshape-and-cache: key/value token t (num_kv_heads * head_dim contiguous elements, token_stride apart) goes
 * to cache slot slot_mapping[t] (block * block_size + offset); slot -1 skips. Checks every slot first and
 * returns the first bad token + 1 (0: all written). */
int64_t ucm_write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                     void *v_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_slots,
                     int64_t row_bytes) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return t + 1;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy((char *)k_cache + slot * row_bytes, (const char *)key + t * key_stride, (size_t)row_bytes);
        memcpy((char *)v_cache + slot * row_bytes, (const char *)value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
