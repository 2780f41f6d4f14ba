/* Paged attention on the CPU, reading K/V in place from the paged cache (no gather into a dense copy).
 *
 * Plain C11 without torch headers so it builds in about a second on first use (ucm_kernels/cpu/native.py).
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
 * Four bodies, picked at compile time by what -march=native enables: AVX-512 (head_dim % 32 == 0,
 * paged_attention_avx512.h), AVX2+FMA or NEON (head_dim % 16 == 0; one source in GCC vector extensions,
 * paged_attention_vec.h) and a scalar loop for the rest (below); and two prefill bodies with the query rows in
 * vector lanes, whose items are rows of one kv head instead: fp32 on the AVX2/NEON path (any head_dim, LR rows;
 * paged_attention_lanes.h) and bf16 with AVX-512 BF16 (head_dim % 16 == 0, DR rows, every bf16 row: decodes too,
 * so that a row's bits never depend on the body; paged_attention_dpbf16.h). Where the CPU has AMX, a bf16 sequence's
 * prompt rows, when the caller says which they are (prompt_queries), take that body with its products on AMX tiles
 * instead (head_dim % 32 == 0; paged_attention_amx.h), and the other bf16 rows, a generated token's, a body of their
 * own with both products on tiles too (paged_attention_amx_rows.h): a row's class, not its step, picks the body. They
 * are one translation unit: this file includes them, keeps the scalar body, the dispatch (pick_item_fn,
 * item_at) and the exported entry points; the types they share are in paged_attention_common.h. Whether the
 * engine calls this kernel or the torch path at all is measured per machine
 * (ucm_kernels/cpu/calibration.py).
 */

#define _GNU_SOURCE /* syscall(), for the AMX permission (amx_tiles.h) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"
#include "paged_attention_common.h"

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

#include "paged_attention_avx512.h"

#include "paged_attention_vec.h"

#include "paged_attention_lanes.h"

#include "paged_attention_dpbf16.h"

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

/* Query rows per item of the fp32 prefill body with rows in vector lanes (paged_attention_lanes.h): a sequence
 * takes it when each kv head has at least this many rows. 0: this build has no such body. */
int ucm_lanes_rows(void) {
#ifdef UCM_HAS_LANES
    return LR;
#else
    return 0;
#endif
}

/* Rows per item of the bf16 bodies with AVX-512 BF16 (paged_attention_dpbf16.h), which every bf16 sequence takes
 * (items of fewer than DCOLS rows run with the columns in lanes). 0: this build has none. */
int ucm_bf16_lanes_rows(void) {
#ifdef UCM_HAS_DPBF16
    return DR;
#else
    return 0;
#endif
}

/* The form of the bf16 cols body's products (paged_attention_dpbf16.h: cols_products): `set` 1 (VDPBF16PS) or 2 (its
 * two FMAs) fixes it for this process, 0 probes again, -1 leaves it; returns the form in force (probed on first use),
 * or -1 where this build has no such body. Both forms give the same bits (tests compare them). */
int32_t ucm_cols_products(int32_t set) {
#ifdef UCM_HAS_DPBF16
    if (set >= 0 && set <= COLS_FMA) __atomic_store_n(&cols_products_form, (int)set, __ATOMIC_RELAXED);
    return cols_products();
#else
    (void)set;
    return -1;
#endif
}

/* Whether bf16 rows not passed as prompt rows take the AMX rows body (paged_attention_amx_rows.h) where a call's
 * shapes allow: `set` 0 turns it off for this process, 1 on (where the OS permits AMX), -1 leaves it; returns 1 on,
 * 0 off, -1 where this build has no such body. */
int32_t ucm_amx_rows(int32_t set) {
#ifdef UCM_HAS_AMX_ATTN
    if (set == 0 || set == 1) __atomic_store_n(&amx_rows_state, (int)set, __ATOMIC_RELAXED);
    return amx_rows_on();
#else
    (void)set;
    return -1;
#endif
}

/* 1 when bf16 prompt rows passed as such (prompt_queries) take the AMX body here: this build has it and the OS
 * lets the process use AMX (paged_attention_amx.h). */
int ucm_amx_attention_available(void) {
#ifdef UCM_HAS_AMX_ATTN
    return amx_permitted();
#else
    return 0;
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

/* Rows per item when a sequence's rows go to a body with rows in vector lanes (fp32 prefill on the vector path:
 * LR; bf16 prefill with AVX-512 BF16: DR) instead of the per-ISA one; 0 when they do not. */
static inline int32_t lane_rows(const Problem *p, int32_t seq, int32_t dtype) {
#ifdef UCM_HAS_LANES
    if (lanes_take(p, seq, dtype)) return LR;
#endif
#ifdef UCM_HAS_DPBF16
    if (dpbf16_take(p, seq, dtype)) return DR;
#endif
    (void)p, (void)seq, (void)dtype;
    return 0;
}

/* How many of sequence seq's first queries take the AMX prompt body: its prompt tokens (Problem.prompt_queries)
 * where this build and the OS have AMX and the head_dim is whole tiles; else 0. */
static inline int32_t amx_queries(const Problem *p, int32_t seq, int32_t dtype) {
#ifdef UCM_HAS_AMX_ATTN
    if (p->prompt_queries && dtype == UCM_DTYPE_BF16 && p->head_dim % 32 == 0 && amx_permitted()) {
        const int32_t n = num_queries(p, seq), k = p->prompt_queries[seq];
        return k < 0 ? 0 : k > n ? n : k;
    }
#endif
    (void)p, (void)seq, (void)dtype;
    return 0;
}

/* The AMX prompt items of sequence seq, all kv heads: DR rows each. */
static inline int32_t amx_items(const Problem *p, int32_t seq, int32_t dtype) {
#ifdef UCM_HAS_AMX_ATTN
    const int32_t rows = amx_queries(p, seq, dtype) * (p->num_q_heads / p->num_kv_heads);
    return p->num_kv_heads * ((rows + DR - 1) / DR);
#else
    (void)p, (void)seq, (void)dtype;
    return 0;
#endif
}

/* Whether a per-ISA item of every head's row (one query, at most MAX_ROWS heads) is cut into head_parts items. */
static inline int lone_decode_parts(const Problem *p, int32_t queries) {
    return p->head_parts > 1 && queries == 1 && p->num_q_heads <= MAX_ROWS;
}

/* The items of the queries the AMX body leaves (all of them where it takes none), from query `first` on. */
static inline int32_t rest_items(const Problem *p, int32_t seq, int32_t dtype, int32_t first) {
    const int32_t queries = num_queries(p, seq) - first;
    if (queries == 0) return 0;
    if (p->amx_rows) return queries * p->head_parts; /* a token's kv heads (its part) an item */
#ifdef UCM_HAS_DPBF16
    if (dtype == UCM_DTYPE_BF16 && dpbf16_take(p, seq, dtype) && dpbf16_all_heads(p, queries)) return p->head_parts;
#endif
    const int32_t lr = lane_rows(p, seq, dtype);
    if (lr) return p->num_kv_heads * ((queries * (p->num_q_heads / p->num_kv_heads) + lr - 1) / lr);
    if (lone_decode_parts(p, queries)) return p->head_parts;
    return (queries * p->num_q_heads + MAX_ROWS - 1) / MAX_ROWS;
}

static inline int32_t items_of(const Problem *p, int32_t seq, int32_t dtype) {
    return amx_items(p, seq, dtype) + rest_items(p, seq, dtype, amx_queries(p, seq, dtype));
}

/* Item i of sequence seq (0 <= i < items_of): the AMX prompt items first, then the rest's; lanes and AMX items go
 * kv head by kv head. Only bf16 bodies with rows of one kv head follow AMX ones, so the rest's rows start at
 * first * group (the per-ISA items, token * num_q_heads + head, never have an AMX part before them). */
static inline Item item_at(const Problem *p, int32_t seq, int32_t i, int32_t dtype) {
    const int32_t group = p->num_q_heads / p->num_kv_heads, first = amx_queries(p, seq, dtype);
    const int32_t amx = amx_items(p, seq, dtype);
    if (i < amx) {
        const int32_t per_head = amx / p->num_kv_heads;
        return (Item){.seq = seq, .row0 = i % per_head * 32, .kv_head = i / per_head, .amx_end = first * group};
    }
    i -= amx;
    if (p->amx_rows) /* token first + i / head_parts, its part i % head_parts */
        return (Item){.seq = seq, .row0 = (first + i / p->head_parts) * group,
                      .kv_head = p->num_kv_heads + i % p->head_parts};
#ifdef UCM_HAS_DPBF16
    if (dtype == UCM_DTYPE_BF16 && dpbf16_take(p, seq, dtype) && dpbf16_all_heads(p, num_queries(p, seq) - first))
        return (Item){.seq = seq, .row0 = first * group, .kv_head = p->num_kv_heads + i}; /* part i of every kv head */
#endif
    const int32_t lr = lane_rows(p, seq, dtype);
    if (lr) {
        const int32_t per_head = rest_items(p, seq, dtype, first) / p->num_kv_heads;
        return (Item){.seq = seq, .row0 = first * group + i % per_head * lr, .kv_head = i / per_head};
    }
    if (lone_decode_parts(p, num_queries(p, seq) - first)) { /* part i: its kv heads' query heads */
        int32_t lo, hi;
        head_part(p, i, &lo, &hi);
        return (Item){.seq = seq, .row0 = lo * group, .kv_head = -1, .row_end = hi * group};
    }
    return (Item){.seq = seq, .row0 = i * MAX_ROWS, .kv_head = -1};
}

#ifdef UCM_HAS_DPBF16
/* MXCSR with DAZ and FTZ set, VDPBF16PS's own mode, for a bf16 item of paged_attention_dpbf16.h's bodies; returns the
 * caller's MXCSR to restore. The FMA form of the cols body's products needs it for VDPBF16PS's bits (cols_products),
 * and every such item runs in it, its softmax too, so that a row's bits do not depend on which body or form computed
 * it. The AMX prompt body runs in it for speed: weights past 2^-126 below a row's reference had been denormals in its
 * fp32 sums, a microcode assist each (random q x 16, scores 23 log2 units a standard deviation: a 2048-token prompt's
 * attention with Llama-1B's heads 61.6 ms against 16.9 in this mode, 2-core Xeon with AMX; 16.5 both at q x 1). Its
 * bits stay: the bf16 rounding of the weights and the tile products flush denormals whatever MXCSR says, and a row's
 * weight sum is >= 1 (the key that set its reference weighs ~1), which a denormal does not move (same bits at both
 * scales in that run). */
static inline unsigned dpbf16_mode(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | _MM_DENORMALS_ZERO_ON | _MM_FLUSH_ZERO_ON);
    return csr;
}
#endif

#ifdef UCM_HAS_DPBF16
/* A bf16 item of paged_attention_dpbf16.h's bodies on the one it was made for: AMX prompt rows, decodes sharing a
 * prefix, or rows in lanes. run_item runs it in dpbf16_mode. */
static inline void dpbf16_item(const Problem *p, const Item *it) {
#ifdef UCM_HAS_AMX_ATTN
    if (it->amx_end > 0) {
        (p->head_dim == 64 ? amx_d64 : amx_any)(p, it->seq, it->kv_head, it->row0, it->amx_end);
        return;
    }
#endif
    if (it->group_len > 0) (p->head_dim == 64 ? dpbf16_shared_d64 : dpbf16_shared_any)(p, it);
    else (p->head_dim == 64 ? dpbf16_d64 : dpbf16_any)(p, it->seq, it->kv_head, it->row0);
}
#endif

/* One item on the body it was made for: kv_head >= 0 marks a lanes item (lane_rows). */
static inline void run_item(const Problem *p, const Item *it, ItemFn fn, int32_t dtype) {
#ifdef UCM_HAS_DPBF16
    if (it->amx_end > 0 || it->group_len > 0 || (it->kv_head >= 0 && dtype == UCM_DTYPE_BF16)) {
        const unsigned csr = dpbf16_mode();
        dpbf16_item(p, it);
        _mm_setcsr(csr);
        return;
    }
#endif
    if (it->kv_head < 0) {
        fn(p, it);
        return;
    }
#ifdef UCM_HAS_LANES
    (p->head_dim == 64 ? lanes_f32_d64 : lanes_f32_any)(p, it->seq, it->kv_head, it->row0);
#endif
    (void)dtype;
}

/* Checks every sequence before any work so a bad batch fails whole, with the first bad sequence in *err_seq;
 * counts the work items and the skipped whole prompts. */
static int validate(const Problem *p, int32_t dtype, int32_t num_seqs, int32_t num_tokens, int32_t max_blocks_per_seq,
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
        items += items_of(p, b, dtype);
    }
    *err_seq = -1;
    *num_items = items;
    *num_skipped = skips;
    return UCM_OK;
}

#ifdef UCM_HAS_AMX_ATTN
/* p->amx_vt for the sequences with AMX items, every chunk of every kv head built once, in parallel: one block
 * (*block, to free; NULL when no sequence has AMX items) and the per-sequence pointers into it (*ptrs, to free). */
static int build_amx_vt(Problem *p, int32_t dtype, int32_t num_seqs, int32_t num_threads, uint32_t ***ptrs,
                        uint32_t **block) {
    int64_t dwords = 0, tasks = 0;
    *ptrs = NULL;
    *block = NULL;
    for (int32_t b = 0; b < num_seqs; b++)
        if (!skipped(p, b) && amx_items(p, b, dtype) > 0) {
            dwords += p->num_kv_heads * amx_vt_head_dwords(p, b);
            tasks += (int64_t)p->num_kv_heads * ((p->seq_lens[b] + DKC - 1) / DKC);
        }
    if (tasks == 0) return UCM_OK;
    int32_t(*task)[3] = malloc((size_t)tasks * sizeof *task);
    *ptrs = calloc((size_t)num_seqs, sizeof **ptrs);
    *block = aligned_alloc(64, ((size_t)dwords * 4 + 63) / 64 * 64);
    if (!task || !*ptrs || !*block) {
        free(task), free(*ptrs), free(*block);
        *ptrs = NULL, *block = NULL;
        return UCM_ERR_NO_MEMORY;
    }
    int64_t k = 0, at = 0;
    for (int32_t b = 0; b < num_seqs; b++) {
        if (skipped(p, b) || amx_items(p, b, dtype) == 0) continue;
        (*ptrs)[b] = *block + at;
        at += p->num_kv_heads * amx_vt_head_dwords(p, b);
        for (int32_t h = 0; h < p->num_kv_heads; h++)
            for (int32_t c = 0; c < (p->seq_lens[b] + DKC - 1) / DKC; c++) task[k][0] = b, task[k][1] = h, task[k++][2] = c;
    }
    p->amx_vt = (const uint32_t *const *)*ptrs;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int32_t b = task[t][0], h = task[t][1], c = task[t][2];
        amx_build_vt(p, b, h, c, amx_vt_chunk(p, b, h, c));
    }
    free(task);
    return UCM_OK;
}
#endif

#include "paged_attention_shared.h"

/* Varlen causal paged attention (see the file comment). dtype: 0 fp32, 1 bf16. num_threads > 1 splits the
 * work items over OpenMP threads when the build has OpenMP (it shares the process's libgomp with torch).
 * With skip_whole_prompts, sequences whose queries are their whole context are left out (their output rows
 * untouched) and counted in *num_skipped. prompt_queries (NULL: none): per sequence, how many of its first queries
 * are prompt tokens, which take the AMX body where there is one (a bf16 row must meet the same body in every
 * step: the caller passes them every time or never). Returns UCM_OK or an UCM_ERR_* code with the sequence in *err_seq. */
int ucm_paged_attention(const void *q, int64_t q_stride_tok, int64_t q_stride_head, const void *k_cache,
                        const void *v_cache, void *out, const int32_t *query_start_loc, const int32_t *seq_lens,
                        const int32_t *block_tables, int64_t block_table_stride, int32_t max_blocks_per_seq,
                        int64_t num_blocks, int32_t num_seqs, int32_t num_tokens, int32_t num_q_heads,
                        int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int32_t dtype, float scale,
                        int32_t skip_whole_prompts, const int32_t *prompt_queries, int32_t num_threads,
                        int32_t *err_seq, int32_t *num_skipped) {
    *err_seq = -1;
    *num_skipped = 0;
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || head_dim <= 0 || head_dim > MAX_D ||
        block_size <= 0 || (dtype != UCM_DTYPE_F32 && dtype != UCM_DTYPE_BF16))
        return UCM_ERR_BAD_SHAPE;
    /* A lone decode (one sequence: a single user's stream) is one item of every kv head, on one thread while the
     * others wait; cut by kv heads, each thread takes a share (the VDPBF16PS cols items and the per-ISA ones). Each
     * head's rows are computed as in the whole item: the same bits. */
    const int32_t head_parts =
        num_seqs != 1 || num_threads < 2 ? 1 : num_threads < num_kv_heads ? num_threads : num_kv_heads;
    Problem p = {q, q_stride_tok, q_stride_head, k_cache, v_cache, out, query_start_loc, seq_lens,
                 block_tables, block_table_stride, num_q_heads, num_kv_heads, head_dim, block_size,
                 scale * LOG2E, skip_whole_prompts, prompt_queries, NULL, NULL, head_parts, 0};
#ifdef UCM_HAS_DPBF16
    p.cols_fma = dtype == UCM_DTYPE_BF16 && cols_products() == COLS_FMA;
#endif
#ifdef UCM_HAS_AMX_ATTN
    p.amx_rows = amx_rows_take(dtype, head_dim, num_q_heads, num_kv_heads);
#endif
    int64_t num_items = 0;
    int rc = validate(&p, dtype, num_seqs, num_tokens, max_blocks_per_seq, num_blocks, err_seq, &num_items, num_skipped);
    if (rc != UCM_OK) return rc;
#ifdef UCM_HAS_AMX_ATTN
    uint32_t **vt_ptrs, *vt_block;
    rc = build_amx_vt(&p, dtype, num_seqs, num_threads, &vt_ptrs, &vt_block);
    if (rc != UCM_OK) return rc;
#endif
    const ItemFn fn = pick_item_fn(head_dim, dtype);
#define RUN(it) run_item(&p, (it), fn, dtype)
    /* An items array where threads share them or where decodes may share a prefix (their group items after
     * everyone else's: taken first, they are the largest); else one item at a time. */
    Item *items = NULL;
    uint8_t *grouped = NULL;
    int32_t *members = NULL;
#ifdef UCM_HAS_DPBF16
    const int may_group = dtype == UCM_DTYPE_BF16 && num_seqs > 1 && !p.amx_rows; /* groups are cols items */
#else
    const int may_group = 0;
#endif
    if ((num_threads > 1 && num_items > 1) || may_group) {
        items = malloc((size_t)(num_items + num_seqs) * sizeof *items); /* + at most one group a sequence */
        grouped = calloc((size_t)num_seqs, 1);
        if (items == NULL || grouped == NULL) free(items), free(grouped), items = NULL, grouped = NULL;
    }
    if (items) {
        int64_t groups = 0;
#ifdef UCM_HAS_DPBF16
        if (may_group) {
            int64_t other = num_items; /* a candidate has one item */
            for (int32_t b = 0; b < num_seqs; b++) other -= shared_candidate(&p, b, dtype);
            groups = plan_shared(&p, dtype, num_seqs, other, num_threads, &members, grouped, items + num_items);
        }
        p.group_seqs = members;
#endif
        int64_t count = 0;
        for (int32_t b = 0; b < num_seqs; b++) {
            if (skipped(&p, b) || grouped[b]) continue;
            for (int32_t i = 0; i < items_of(&p, b, dtype); i++) items[count++] = item_at(&p, b, i, dtype);
        }
        memmove(items + count, items + num_items, (size_t)groups * sizeof *items);
        count += groups;
        /* The last items of a sequence's kv head see the most keys: taken first, no thread is left with one of
         * them while the other idles. */
        if (num_threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
            for (int64_t i = count - 1; i >= 0; i--) RUN(&items[i]);
        } else { /* no parallel region at all: an if(0) one still builds a team */
            for (int64_t i = count - 1; i >= 0; i--) RUN(&items[i]);
        }
    } else {
        for (int32_t b = 0; b < num_seqs; b++) {
            if (skipped(&p, b)) continue;
            for (int32_t i = 0; i < items_of(&p, b, dtype); i++) {
                const Item it = item_at(&p, b, i, dtype);
                RUN(&it);
            }
        }
    }
    free(items), free(grouped), free(members);
#undef RUN
#ifdef UCM_HAS_AMX_ATTN
    free(vt_ptrs), free(vt_block);
#endif
    return UCM_OK;
}

/* The shared-prefix decode groups plan_shared makes of a decode batch (bf16, one query a sequence, threads as
 * the call would have them): group_of[seq] = the group's index, -1 for a sequence on its own. Returns how many
 * groups; -1 where this build has no such groups (no AVX-512 BF16). For tests and diagnostics. */
int32_t ucm_shared_prefix_groups(const int32_t *seq_lens, const int32_t *block_tables, int64_t block_table_stride,
                                 int32_t num_seqs, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                                 int32_t block_size, int32_t num_threads, int32_t *group_of) {
#ifdef UCM_HAS_DPBF16
    const Problem p = {.seq_lens = seq_lens, .block_tables = block_tables, .block_table_stride = block_table_stride,
                       .num_q_heads = num_q_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
                       .block_size = block_size, .head_parts = 1};
    for (int32_t b = 0; b < num_seqs; b++) group_of[b] = -1;
#ifdef UCM_HAS_AMX_ATTN
    if (amx_rows_take(UCM_DTYPE_BF16, head_dim, num_q_heads, num_kv_heads)) return 0; /* no cols items: no groups */
#endif
    uint8_t *grouped = calloc((size_t)num_seqs + 1, 1);
    Item *groups = malloc(((size_t)num_seqs + 1) * sizeof *groups);
    int32_t *members = NULL;
    int64_t n = 0;
    if (grouped && groups) n = plan_shared(&p, UCM_DTYPE_BF16, num_seqs, 0, num_threads, &members, grouped, groups);
    for (int64_t g = 0; g < n; g++)
        for (int32_t m = 0; m < groups[g].group_len; m++) group_of[members[groups[g].group_at + m]] = (int32_t)g;
    free(grouped), free(groups), free(members);
    return (int32_t)n;
#else
    (void)seq_lens, (void)block_tables, (void)block_table_stride, (void)num_seqs, (void)num_q_heads;
    (void)num_kv_heads, (void)head_dim, (void)block_size, (void)num_threads;
    for (int32_t b = 0; b < num_seqs; b++) group_of[b] = -1;
    return -1;
#endif
}

/* Reshape-and-cache: key/value token t (num_kv_heads * head_dim contiguous elements, token_stride apart) goes
 * to cache slot slot_mapping[t] (block * block_size + offset); slot -1 skips. Checks every slot first and
 * returns the first bad token + 1 (0: all written). A prompt's rows are copied by num_threads OpenMP threads. */
int64_t ucm_write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                     void *v_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_slots,
                     int64_t row_bytes, int32_t num_threads) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return t + 1;
    /* A prompt's rows land in blocks nobody has touched for a while: the copy waits on memory, not the core. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && num_tokens >= 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy((char *)k_cache + slot * row_bytes, (const char *)key + t * key_stride, (size_t)row_bytes);
        memcpy((char *)v_cache + slot * row_bytes, (const char *)value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
