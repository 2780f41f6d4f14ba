/* The library's exported entry points that other translation units of it call (decode_layers.c), declared once:
 * every source that defines one includes this, so a definition that drifts from its declaration does not compile.
 * Their comments where they are defined say what they take. Also the dtype codes the kernels share with Python
 * (ucm_kernels/cpu/paged_attention.py: DTYPE_CODES). */
#ifndef UCM_ENTRY_POINTS_H
#define UCM_ENTRY_POINTS_H

#include <stdint.h>

#define UCM_DTYPE_F32 0
#define UCM_DTYPE_BF16 1

int ucm_paged_attention(const void *q, int64_t q_stride_tok, int64_t q_stride_head, const void *k_cache,
                        const void *v_cache, void *out, const int32_t *query_start_loc, const int32_t *seq_lens,
                        const int32_t *block_tables, int64_t block_table_stride, int32_t max_blocks_per_seq,
                        int64_t num_blocks, int32_t num_seqs, int32_t num_tokens, int32_t num_q_heads,
                        int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int32_t dtype, float scale,
                        int32_t skip_whole_prompts, const int32_t *prompt_queries, int32_t num_threads,
                        int32_t *err_seq, int32_t *num_skipped);
int64_t ucm_write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                     void *v_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_slots,
                     int64_t row_bytes, int32_t num_threads);
void ucm_rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t hidden,
                  int64_t out_stride, float eps, int32_t num_threads);
void ucm_fused_add_rms_norm(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                            int64_t rows, int64_t hidden, int64_t out_stride, float eps, int32_t num_threads);
void ucm_silu_and_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int32_t num_threads);
void ucm_rotary_embedding(uint16_t *qk, int64_t token_stride, int64_t rows, int32_t heads, int32_t head_dim,
                          const uint16_t *cos, const uint16_t *sin, int32_t num_threads);
void ucm_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t hidden,
                      int64_t out_stride, float eps, int32_t num_threads);
void ucm_fused_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                                int64_t hidden, int64_t out_stride, float eps, int32_t num_threads);
void ucm_silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int32_t num_threads);
void ucm_rotary_embedding_f32(float *qk, int64_t token_stride, int64_t rows, int32_t heads, int32_t head_dim,
                              const float *cos, const float *sin, int32_t num_threads);
void ucm_skinny_gemm(const float *x, int64_t m, int64_t k, const float *wp, int64_t n, const float *bias, float *y,
                     int32_t num_threads);
int32_t ucm_skinny_gemm_q4(const float *x, int64_t m, int64_t k, const uint8_t *qp, const float *dm, int64_t n,
                           const float *bias, float *y, int32_t num_threads);
int32_t ucm_pack_panels_bf16(const float *w, uint16_t *bp, int64_t n, int64_t k);
int32_t ucm_skinny_gemm_bf16(const float *x, int64_t m, int64_t k, const uint16_t *bp, int64_t n, const float *bias,
                             float *y, int32_t num_threads);
int32_t ucm_skinny_gemm_q8(const float *x, int64_t m, int64_t k, const int8_t *qp, const float *d, int64_t n,
                           const float *bias, float *y, int32_t num_threads);

/* What ucm_amx_gemm does with a block's 32 outputs (two 16-output panels; amx_gemm.py: Epilogue). PAIRS and SILU
 * take a gate_up weight packed with its gate and up panels alternating (amx_gemm.py, pack(paired=True)): panel 2j
 * holds gate outputs 16j .. 16j + 15, panel 2j + 1 the same up outputs, so a block holds both halves of 16 SwiGLU
 * outputs. */
enum {
    EPI_PLAIN = 0, /* y [m][n] */
    EPI_PAIRS = 1, /* y [m][n] as [gate | up]: the unpaired weight's y */
    EPI_SILU = 2,  /* y [m][n / 2] = silu(gate) * up, each of gate and up rounded to bf16 first: what
                      elementwise.c's silu_and_mul gives on the PAIRS y, without writing and reading it */
};

int32_t ucm_amx_gemm(const uint16_t *x, int64_t m, int64_t k, int64_t lda, const uint16_t *wp, int64_t n, uint16_t *y,
                     int64_t ldy, uint16_t *pad, int32_t num_threads, int32_t epilogue);
int64_t ucm_amx_layout_chunk(int64_t k);
int32_t ucm_q4_bf16(const uint16_t *x, int64_t m, int64_t k, const uint8_t *qp, const float *dm, int64_t n,
                    uint16_t *y, int32_t num_threads);
int32_t ucm_bf16_dp(const uint16_t *x, int64_t m, int64_t k, const uint32_t *wp, int64_t n, uint16_t *y,
                    int32_t num_threads);

#endif /* UCM_ENTRY_POINTS_H */
