/* What paged_attention.c's bodies share: the problem and work-item types, limits, status codes, row and cache
 * addressing, scalar dtype helpers and the spread-out prefetcher.
 *
 * Part of one translation unit: included by paged_attention.c and its per-ISA bodies
 * (paged_attention_avx512.h, paged_attention_vec.h), never compiled on its own; its functions are static.
 */
#ifndef UCM_PAGED_ATTENTION_COMMON_H
#define UCM_PAGED_ATTENTION_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"

#include "entry_points.h" /* UCM_DTYPE_* */

#if defined(__AVX512F__)
#define MAX_ROWS 32 /* rows per work item: a prefill chunk's tokens share the K/V they stream from L1/L2 */
#else
#define MAX_ROWS 64 /* the vector path: more rows share each transposed chunk of keys (paged_attention_vec.h) */
#endif
#define MAX_D 256   /* largest head_dim: per-row accumulators live on the stack */
#define CHUNK 16    /* keys per online-softmax step: one AVX-512 vector of scores, two AVX2, four NEON */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* CALL(N) with N = min(left, 6) as a constant, so a register block of up to 6 rows, keys or columns unrolls (the
 * bodies' RB and KB are 6). */
#define SWITCH_UP_TO_6(left, CALL)                                                                                   \
    switch ((left) < 6 ? (left) : 6) {                                                                               \
    case 6: CALL(6); break;                                                                                          \
    case 5: CALL(5); break;                                                                                          \
    case 4: CALL(4); break;                                                                                          \
    case 3: CALL(3); break;                                                                                          \
    case 2: CALL(2); break;                                                                                          \
    default: CALL(1); break;                                                                                         \
    }

/* The same up to 8 (the VDPBF16PS body's DKB: 8 keys or columns of 2 row vectors, 16 accumulators). */
#define SWITCH_UP_TO_8(left, CALL)                                                                                   \
    switch ((left) < 8 ? (left) : 8) {                                                                               \
    case 8: CALL(8); break;                                                                                          \
    case 7: CALL(7); break;                                                                                          \
    default: SWITCH_UP_TO_6(left, CALL); break;                                                                      \
    }

/* Error codes returned to Python (which turns them into ValueError with the sequence index). */
#define UCM_OK 0
#define UCM_ERR_QUERY_LONGER_THAN_CONTEXT 1
#define UCM_ERR_BLOCK_TABLE_TOO_NARROW 2
#define UCM_ERR_BLOCK_ID_OUT_OF_RANGE 3
#define UCM_ERR_BAD_QUERY_START_LOC 4
#define UCM_ERR_BAD_SHAPE 5
#define UCM_ERR_NO_MEMORY 6

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
    const int32_t *prompt_queries; /* per sequence, how many of its first queries are prompt tokens; NULL: none
                                      (where AMX is, they take paged_attention_amx.h's body) */
    const uint32_t *const *amx_vt; /* per sequence with AMX items: V's key pairs transposed, chunk by chunk
                                      (paged_attention_amx.h, amx_build_vt); NULL elsewhere */
    const int32_t *group_seqs; /* the members of shared-prefix decode items, group after group
                                  (paged_attention_shared.h); NULL: none */
    int32_t head_parts; /* items a lone decode's item of every kv head is cut into, by kv heads (1: one item) */
    int32_t cols_fma;   /* 1: the cols body's products as FMAs (paged_attention_dpbf16.h: cols_products) */
    int32_t amx_rows;   /* 1: the rows not passed as prompt rows take paged_attention_amx_rows.h's body, a token an
                           item (kv_head num_kv_heads + part, as a decode's cols items) */
} Problem;

typedef struct {
    int32_t seq, row0; /* row0: first row (token * num_q_heads + query head) of the item */
    int32_t kv_head;   /* -1: the per-ISA body's item; >= 0: a lanes item of this kv head, row0 = token * group +
                          head in group (paged_attention_lanes.h); num_kv_heads + i: part i of a bf16 decode's item
                          of every kv head (dpbf16_all_heads, Problem.head_parts) */
    int32_t amx_end;   /* > 0: an AMX prompt item of that kv head, its rows row0 .. min(row0 + 32, amx_end) - 1 */
    int32_t group_at, group_len, group_keys; /* group_len > 0: decodes Problem.group_seqs[group_at ..] sharing
                                                their first group_keys keys (paged_attention_shared.h) */
    int32_t row_end; /* > 0: the per-ISA item's rows end here (a part of a lone decode, Problem.head_parts) */
} Item;

/* One item's rows, resolved: where each row's query and output live, its kv head and last visible key. */
typedef struct {
    int32_t n, len, nrows;
    int64_t q_off[MAX_ROWS], o_off[MAX_ROWS];
    int32_t kv_head[MAX_ROWS], pos[MAX_ROWS];
} Rows;

/* The kv heads *lo .. *hi - 1 of part `part` of a lone decode cut into p->head_parts (whole heads, in order). */
static inline void head_part(const Problem *p, int32_t part, int32_t *lo, int32_t *hi) {
    *lo = part * p->num_kv_heads / p->head_parts;
    *hi = (part + 1) * p->num_kv_heads / p->head_parts;
}

static inline int32_t num_queries(const Problem *p, int32_t seq) {
    return p->query_start_loc ? p->query_start_loc[seq + 1] - p->query_start_loc[seq] : 1;
}

static void resolve_rows(const Problem *p, const Item *it, Rows *r) {
    const int32_t q0 = p->query_start_loc ? p->query_start_loc[it->seq] : it->seq;
    const int32_t hq = p->num_q_heads, group = hq / p->num_kv_heads;
    r->n = num_queries(p, it->seq);
    r->len = p->seq_lens[it->seq];
    const int32_t end = it->row_end > 0 ? it->row_end : r->n * hq;
    r->nrows = end - it->row0 < MAX_ROWS ? end - it->row0 : MAX_ROWS;
    for (int32_t i = 0; i < r->nrows; i++) {
        const int32_t row = it->row0 + i, tok = row / hq, head = row % hq;
        r->q_off[i] = (int64_t)(q0 + tok) * p->q_stride_tok + (int64_t)head * p->q_stride_head;
        r->o_off[i] = ((int64_t)(q0 + tok) * hq + head) * p->head_dim;
        r->kv_head[i] = head / group;
        r->pos[i] = r->len - r->n + tok;
    }
}

/* Rows row0 .. row0 + nrows - 1 of kv head h (row = token * group + head in group) of the sequence whose queries
 * start at q0, zeroed: the lanes bodies' padding sequences (seq_len 0), whose contract is 0, not NaN. */
static inline void zero_lane_rows(const Problem *p, int32_t q0, int32_t h, int32_t row0, int32_t nrows, int esize) {
    const int32_t group = p->num_q_heads / p->num_kv_heads;
    for (int32_t r = 0; r < nrows; r++) {
        const int32_t row = row0 + r, head = h * group + row % group;
        const int64_t at = ((int64_t)(q0 + row / group) * p->num_q_heads + head) * p->head_dim;
        memset((char *)p->out + at * esize, 0, (size_t)p->head_dim * esize);
    }
}

static inline const int32_t *table_of(const Problem *p, int32_t seq) {
    return p->block_tables + (int64_t)seq * p->block_table_stride;
}

/* Element offset of (token t of block, kv head) inside a cache. */
static inline int64_t cache_offset(const Problem *p, int32_t block, int32_t t, int32_t kv_head) {
    return (((int64_t)block * p->block_size + t) * p->num_kv_heads + kv_head) * p->head_dim;
}

/* at[j] = cache_offset of key start + j's row of kv head h, j < nk, for the sequence whose block table is `table`:
 * the block and offset advance key by key, with no division per key. Every body that gathers a chunk's key rows
 * walks the table through here. */
static inline void key_offsets(const Problem *p, const int32_t *table, int32_t start, int nk, int32_t h, int64_t *at) {
    const int32_t bs = p->block_size;
    for (int32_t j = 0, blk = start / bs, off = start % bs; j < nk; j++) {
        at[j] = cache_offset(p, table[blk], off, h);
        if (++off == bs) off = 0, blk++;
    }
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
 * pages: a burst 1516 us a layer, spread out 668, no prefetch 1773). Into L2 (`prefetcht1`), not L1: a chunk
 * ahead is more than L1 holds beside the chunk at work. 8 decodes with Llama-1B's heads, fp32, 16 layers' caches
 * from DRAM, builds alternated on the 2-core Xeon with AMX: 544 keys 13.2-14.3 -> 12.6-13.0 ms, 2048 keys
 * 51.0-51.9 -> 49.6-50.2; SmolLM2's heads 0.97x; the AVX2 build (the vec body) 0.94-0.98x. */
typedef struct {
    const char *k, *v;
    int64_t stride, bytes; /* bytes between key rows, bytes per key row */
    int rows, row;
    int64_t at;
} Prefetch;

ALWAYS_INLINE void prefetch_some(Prefetch *pf, int lines) {
    for (; lines > 0 && pf->row < pf->rows; lines--) {
        __builtin_prefetch(pf->k + pf->row * pf->stride + pf->at, 0, 2); /* prefetcht1 on x86 */
        __builtin_prefetch(pf->v + pf->row * pf->stride + pf->at, 0, 2);
        pf->at += 64;
        if (pf->at >= pf->bytes) {
            pf->at = 0;
            pf->row++;
        }
    }
}

#endif /* UCM_PAGED_ATTENTION_COMMON_H */
