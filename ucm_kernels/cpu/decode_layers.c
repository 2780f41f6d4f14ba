/* A decode step's decoder layers in one call: the kernels engine/models/native_decode.py would call from Python,
 * called here in the same order with the same arguments, so every row gets the same bits.
 *
 * Why: a decode step of 8 rows on SmolLM2 makes ~330 kernel calls (11 a layer), most of them microseconds long;
 * from Python each cost a few microseconds of interpreter and ctypes on the calling thread while the other OpenMP
 * threads spun waiting for the next parallel region (perf on the 2-core Xeon with AMX: the second thread idle ~40%
 * of a decode step). Only steps whose every matmul is one of our own kernels come here (`DecodeLinear`'s formats,
 * a bias only after a bf16 kernel); a step with a oneDNN matmul or another bias stays in Python.
 *
 * Each kernel is the library's own entry point (their translation units share no other symbols); each still opens
 * its own parallel region, as it does when Python calls it. */

#include <stddef.h>
#include <stdint.h>

#include "bf16.h"
#include "entry_points.h"

/* Which kernel a matmul takes (ucm_kernels/cpu/decode_layers.py: LinearFormat). */
enum {
    DL_Q4_BF16 = 0,
    DL_F32_PANELS = 1,
    DL_Q4_F32 = 2,
    DL_Q8_F32 = 3,
    DL_AMX_BF16 = 4,
    DL_AMX_BF16_PAIRS = 5,
    DL_BF16_F32 = 6,
    DL_BF16_BF16 = 7
};

/* Where a step stopped (ucm_kernels/cpu/decode_layers.py: Failure). */
enum { DL_OK = 0, DL_LINEAR = 1, DL_WRITE_KV = 2, DL_ATTENTION = 3 };

/* One matmul y [T, n] = x [T, k] @ W^T (+ bias), W packed as `format` says: q its 4/8-bit bytes, fp32 panels or
 * AMX tiles (amx_gemm.c; PAIRS: a gate_up weight with its gate and up panels paired, SiLU-and-mul in the epilogue)
 * or bf16 panels of an fp32 model, scales the Q4_1 d|m or the Q8_0 d (NULL for fp32 and bf16 panels and AMX tiles); bias [n] bf16 or NULL,
 * after AMX_BF16, Q4_BF16 or BF16_BF16 only (Qwen2's qkv): added as the Python path adds it after the kernel,
 * y = bf16(y + bias) per element. */
typedef struct {
    const void *q;
    const float *scales;
    const uint16_t *bias;
    int64_t n, k, format;
} DecodeLinear;

typedef struct {
    const void *input_norm, *post_attn_norm; /* the norms' weights, the step's dtype */
    DecodeLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    double input_eps, post_attn_eps, scale; /* passed on as float, as ctypes would pass them */
} DecodeLayer;

/* The step: its shapes, its activations (allocated once, reused by every layer) and its attention metadata. */
typedef struct {
    int64_t tokens, hidden, inter, num_heads, num_kv_heads, head_dim, dtype; /* dtype: UCM_DTYPE_* */
    void *residual; /* [T, hidden]: the embeddings on entry, the residual stream after */
    void *x, *qkv, *att, *o_out, *gate_up, *act, *down_out, *out;
    const void *cos, *sin; /* [T, head_dim] */
    const void *final_norm;
    double final_eps;
    const int64_t *slots;
    const int32_t *seq_lens, *block_tables;
    int64_t num_slots, block_table_stride, max_blocks, num_blocks, block_size, threads;
    void *pad; /* the AMX kernel's scratch: 32 rows of the widest k per thread */
} DecodeStepArgs;

typedef struct {
    int64_t op, layer, status; /* DL_*, the layer, the kernel's own non-zero return */
    int32_t detail, pad;       /* the attention's sequence, or which matmul of the layer (0-3: qkv, o, gate_up, down) */
} DecodeFailure;

/* y[r] = bf16(y[r] + bias) for rows r < rows of n: torch's bf16 add (in fp32, rounded to nearest even). A decode
 * step's few rows: one thread. */
static void add_bias_bf16(uint16_t *y, const uint16_t *bias, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) y[r * n + c] = f32_to_bf16(bf16_to_f32(y[r * n + c]) + bf16_to_f32(bias[c]));
}

/* Every format but AMX_BF16_PAIRS, which only a gate_up weight has and gate_up_act runs. */
static int64_t linear(const DecodeLinear *w, const void *x, int64_t rows, void *y, int32_t threads, void *pad) {
    int64_t rc;
    switch (w->format) {
    case DL_AMX_BF16:
        rc = ucm_amx_gemm(x, rows, w->k, w->k, w->q, w->n, y, w->n, pad, threads, EPI_PLAIN);
        break;
    case DL_Q4_BF16:
        rc = ucm_q4_bf16(x, rows, w->k, w->q, w->scales, w->n, y, threads);
        break;
    case DL_BF16_BF16:
        rc = ucm_bf16_dp(x, rows, w->k, w->q, w->n, y, threads);
        break;
    case DL_F32_PANELS:
        ucm_skinny_gemm(x, rows, w->k, w->q, w->n, NULL, y, threads);
        return 0;
    case DL_Q4_F32:
        return ucm_skinny_gemm_q4(x, rows, w->k, w->q, w->scales, w->n, NULL, y, threads);
    case DL_Q8_F32:
        return ucm_skinny_gemm_q8(x, rows, w->k, w->q, w->scales, w->n, NULL, y, threads);
    case DL_BF16_F32:
        return ucm_skinny_gemm_bf16(x, rows, w->k, w->q, w->n, NULL, y, threads);
    default:
        return -100;
    }
    if (rc == 0 && w->bias != NULL) add_bias_bf16(y, w->bias, rows, w->n); /* the bf16 formats only (Python checks) */
    return rc;
}

/* The MLP's gate_up and SiLU-and-mul: s->act [T, inter]. A paired AMX weight takes the SiLU as its GEMM's epilogue
 * (EPI_SILU: the bits silu_and_mul gives on the PAIRS y), which spreads it over the GEMM's threads: a decode step's
 * few rows are under the elementwise kernels' parallel threshold, and Qwen2.5-0.5B's 8 rows of 4864 took ~50 us a
 * layer on one thread while the other waited. */
static int64_t gate_up_act(const DecodeStepArgs *s, const DecodeLinear *w, int32_t threads) {
    const int64_t t = s->tokens;
    if (w->format == DL_AMX_BF16_PAIRS)
        return ucm_amx_gemm(s->x, t, w->k, w->k, w->q, w->n, s->act, w->n / 2, s->pad, threads, EPI_SILU);
    const int64_t rc = linear(w, s->x, t, s->gate_up, threads, s->pad);
    if (rc) return rc;
    if (s->dtype == UCM_DTYPE_BF16) ucm_silu_and_mul(s->gate_up, s->act, t, s->inter, threads);
    else ucm_silu_and_mul_f32(s->gate_up, s->act, t, s->inter, threads);
    return 0;
}

static void add_norm(const DecodeStepArgs *s, const void *x, const void *weight, double eps, void *out) {
    const int32_t threads = (int32_t)s->threads;
    if (s->dtype == UCM_DTYPE_BF16)
        ucm_fused_add_rms_norm(x, s->residual, weight, out, s->tokens, s->hidden, s->hidden, (float)eps, threads);
    else
        ucm_fused_add_rms_norm_f32(x, s->residual, weight, out, s->tokens, s->hidden, s->hidden, (float)eps, threads);
}

static int32_t fail(DecodeFailure *f, int64_t op, int64_t layer, int64_t status, int32_t detail) {
    f->op = op, f->layer = layer, f->status = status, f->detail = detail;
    return (int32_t)op;
}

/* The layers of native_decode.NativeDecode.forward, then the final norm into s->out. 0 (DL_OK), or the DL_* op
 * that failed with *failure filled in (the step's outputs are then undefined, as a failed Python call's are). */
int32_t ucm_decode_layers(const DecodeStepArgs *s, const DecodeLayer *layers, int64_t num_layers,
                          DecodeFailure *failure) {
    const int64_t t = s->tokens, hq = s->num_heads, hkv = s->num_kv_heads, d = s->head_dim;
    const int64_t esize = s->dtype == UCM_DTYPE_BF16 ? 2 : 4, bf16 = s->dtype == UCM_DTYPE_BF16;
    const int64_t q_size = hq * d, kv_size = hkv * d, stride = q_size + 2 * kv_size;
    const int32_t threads = (int32_t)s->threads;
    char *const qkv = s->qkv, *const k = qkv + q_size * esize, *const v = k + kv_size * esize;
    fail(failure, DL_OK, -1, 0, -1);
    if (bf16)
        ucm_rms_norm(s->residual, layers[0].input_norm, s->x, t, s->hidden, s->hidden, (float)layers[0].input_eps,
                     threads);
    else
        ucm_rms_norm_f32(s->residual, layers[0].input_norm, s->x, t, s->hidden, s->hidden,
                         (float)layers[0].input_eps, threads);
    for (int64_t i = 0; i < num_layers; i++) {
        const DecodeLayer *l = &layers[i];
        int64_t rc;
        if (i) /* the previous MLP's output joins the residual here */
            add_norm(s, s->down_out, l->input_norm, l->input_eps, s->x);
        if ((rc = linear(&l->qkv, s->x, t, qkv, threads, s->pad))) return fail(failure, DL_LINEAR, i, rc, 0);
        if (bf16) /* q and k, in place */
            ucm_rotary_embedding((uint16_t *)qkv, stride, t, (int32_t)(hq + hkv), (int32_t)d, s->cos, s->sin, threads);
        else
            ucm_rotary_embedding_f32((float *)qkv, stride, t, (int32_t)(hq + hkv), (int32_t)d, s->cos, s->sin, threads);
        rc = ucm_write_kv(k, stride * esize, v, stride * esize, l->k_cache, l->v_cache, s->slots, t, s->num_slots,
                          kv_size * esize, threads);
        if (rc) return fail(failure, DL_WRITE_KV, i, rc, -1);
        int32_t err_seq = -1, skipped = 0;
        rc = ucm_paged_attention(qkv, stride, d, l->k_cache, l->v_cache, s->att, NULL, s->seq_lens, s->block_tables,
                                 s->block_table_stride, (int32_t)s->max_blocks, s->num_blocks, (int32_t)t, (int32_t)t,
                                 (int32_t)hq, (int32_t)hkv, (int32_t)d, (int32_t)s->block_size, (int32_t)s->dtype,
                                 (float)l->scale, 0, NULL, threads, &err_seq, &skipped);
        if (rc) return fail(failure, DL_ATTENTION, i, rc, err_seq);
        if ((rc = linear(&l->o, s->att, t, s->o_out, threads, s->pad))) return fail(failure, DL_LINEAR, i, rc, 1);
        add_norm(s, s->o_out, l->post_attn_norm, l->post_attn_eps, s->x);
        if ((rc = gate_up_act(s, &l->gate_up, threads))) return fail(failure, DL_LINEAR, i, rc, 2);
        if ((rc = linear(&l->down, s->act, t, s->down_out, threads, s->pad))) return fail(failure, DL_LINEAR, i, rc, 3);
    }
    add_norm(s, s->down_out, s->final_norm, s->final_eps, s->out);
    return DL_OK;
}
