/* The Llama block's elementwise ops, fused, in bf16: RMSNorm (with the residual add folded in), SiLU-and-mul
 * and RoPE. Built into the same library as paged_attention.c (ucm_kernels/cpu/native.py).
 *
 * Each op reproduces the torch expression it replaces bit for bit: torch computes a bf16 elementwise op in
 * fp32 and rounds to bf16 (nearest even) after EVERY op, so these round at the same places (`round_bf16`),
 * not once at the end. Where torch reduces (the mean of x^2 in RMSNorm) the sum follows aten's cascade order
 * (`sum_squares`), so the norms match too, not just to an ulp. The one fp32 function that is not an IEEE
 * primitive, exp in SiLU, is accurate enough that silu(x) rounded to bf16 equals torch's for every bf16 x
 * (tests/kernels/test_kernels_elementwise.py checks all 65536).
 *
 * Compiled with -std=c11, so gcc does not contract a*b+c into an FMA (that would skip a rounding torch does).
 *
 * bf16 tensors are passed as uint16_t; all are contiguous except RoPE's q|k rows, which are views into the
 * fused qkv output (a token stride, heads contiguous inside a row).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "entry_points.h"
#include "row_loop.h"
#include "silu_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define EW_AVX512 1
#endif

/* aten's vectorized inner sum: 16-lane vectors (AVX-512 build of torch), 4 of them interleaved (its ILP
 * factor), cascaded in 4 levels. */
#define SUM_LANES 16
#define SUM_ILP 4
#define SUM_LEVELS 4

#define EW_INLINE static inline __attribute__((always_inline))

/* ---------------------------------------------------------------- bf16 rounding (conversions: bf16.h) */

/* The fp32 value torch carries into the next op after storing a bf16 intermediate. */
EW_INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* ---------------------------------------------------------------- bf16 <-> fp32, 16 lanes (bf16.h) */

#ifdef EW_AVX512
EW_INLINE __m512 load16(const uint16_t *p) { return bf16x16_to_f32(p); }

EW_INLINE void store16(uint16_t *p, __m512 f) { f32x16_store_bf16(p, f); }

EW_INLINE __m512 round16(__m512 f) { return f32x16_round_bf16(f); }
#endif

/* ---------------------------------------------------------------- RMSNorm */

static int64_t ceil_log2(int64_t x) { /* c10's CeilLog2, including its 1 for x <= 2 */
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) bits++;
    return bits;
}

/* aten's multi_row_sum + row_sum over `size` "elements" of `width` lanes each, element e being the squares of
 * x[e * width .. e * width + width): elements 4i..4i+3 form row i, rows accumulate into level 0, which spills
 * into the higher levels every 2^level_power rows. Lane results land in out[0..width). */
EW_INLINE void cascade_squares(const uint16_t *x, int64_t size, int width, float *out) {
    float acc[SUM_LEVELS][SUM_ILP][SUM_LANES];
    memset(acc, 0, sizeof acc);
    const int64_t size_ilp = size / SUM_ILP;
    const int64_t lc = ceil_log2(size_ilp) / SUM_LEVELS;
    const int64_t level_power = lc > 4 ? lc : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    int64_t i = 0;
    while (i + level_step <= size_ilp) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < SUM_ILP; k++)
                for (int l = 0; l < width; l++) {
                    const float v = bf16_to_f32(x[(i * SUM_ILP + k) * width + l]);
                    acc[0][k][l] += v * v;
                }
        for (int lev = 1; lev < SUM_LEVELS; lev++) {
            for (int k = 0; k < SUM_ILP; k++)
                for (int l = 0; l < width; l++) {
                    acc[lev][k][l] += acc[lev - 1][k][l];
                    acc[lev - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (lev * level_power))) != 0) break;
        }
    }
    for (; i < size_ilp; i++)
        for (int k = 0; k < SUM_ILP; k++)
            for (int l = 0; l < width; l++) {
                const float v = bf16_to_f32(x[(i * SUM_ILP + k) * width + l]);
                acc[0][k][l] += v * v;
            }
    for (int lev = 1; lev < SUM_LEVELS; lev++)
        for (int k = 0; k < SUM_ILP; k++)
            for (int l = 0; l < width; l++) acc[0][k][l] += acc[lev][k][l];
    for (int64_t e = size_ilp * SUM_ILP; e < size; e++) /* row_sum's leftover elements */
        for (int l = 0; l < width; l++) {
            const float v = bf16_to_f32(x[e * width + l]);
            acc[0][0][l] += v * v;
        }
    for (int k = 1; k < SUM_ILP; k++)
        for (int l = 0; l < width; l++) acc[0][0][l] += acc[0][k][l];
    memcpy(out, acc[0][0], (size_t)width * sizeof *out);
}

/* sum(x^2) of one row in fp32, in the order of torch's `x.float().pow(2).mean(-1)` (aten cascade_sum): rows of
 * at least 16 take its vectorized inner sum (lanes summed last, after the scalar tail), shorter rows its
 * scalar one. */
static float sum_squares(const uint16_t *x, int64_t n) {
    float lanes[SUM_LANES];
    if (n < SUM_LANES) {
        cascade_squares(x, n, 1, lanes);
        return lanes[0];
    }
    const int64_t nvec = n / SUM_LANES;
    cascade_squares(x, nvec, SUM_LANES, lanes);
    float total = 0.0f;
    for (int64_t i = nvec * SUM_LANES; i < n; i++) {
        const float v = bf16_to_f32(x[i]);
        total += v * v;
    }
    for (int l = 0; l < SUM_LANES; l++) total += lanes[l];
    return total;
}

/* out = w * bf16(x * rsqrt(mean(x^2) + eps)): HF's LlamaRMSNorm in bf16, both roundings included. */
static void rms_norm_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t n, float eps) {
    /* torch.rsqrt on fp32 is 1 / sqrt (two IEEE roundings), not a correctly rounded rsqrt */
    const float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    int64_t i = 0;
#ifdef EW_AVX512
    const __m512 vr = _mm512_set1_ps(r);
    for (; i + 16 <= n; i += 16) {
        const __m512 h = round16(_mm512_mul_ps(load16(x + i), vr));
        store16(out + i, _mm512_mul_ps(load16(w + i), h));
    }
#endif
    for (; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * r));
}

/* residual = bf16(residual + x), in place. */
static void add_row(const uint16_t *x, uint16_t *residual, int64_t n) {
    int64_t i = 0;
#ifdef EW_AVX512
    for (; i + 16 <= n; i += 16) store16(residual + i, _mm512_add_ps(load16(residual + i), load16(x + i)));
#endif
    for (; i < n; i++) residual[i] = f32_to_bf16(bf16_to_f32(residual[i]) + bf16_to_f32(x[i]));
}

/* ---------------------------------------------------------------- SiLU */

/* out = bf16(bf16(silu(gate)) * up) with silu(g) = g / (1 + exp(-g)) in fp32, as torch's bf16 F.silu. */
static void silu_and_mul_row(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    int64_t i = 0;
#ifdef EW_AVX512
    for (; i + 16 <= n; i += 16) store16(out + i, silu_mul16(load16(gate + i), load16(up + i)));
#endif
    for (; i < n; i++) {
        const float g = bf16_to_f32(gate[i]);
        out[i] = f32_to_bf16(round_bf16(g / (1.0f + expf(-g))) * bf16_to_f32(up[i]));
    }
}

/* ---------------------------------------------------------------- RoPE */

/* One head, rotate-half layout, in place: x = bf16(bf16(x * cos) + bf16(rot(x) * sin)) with rot(x) =
 * [x2 | x1] and the sign already folded into sin ([-sin | sin]), as engine/models/rope.py builds it. */
static void rope_head(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int32_t d) {
    const int32_t half = d / 2;
    int32_t i = 0;
#ifdef EW_AVX512
    for (; i + 16 <= half; i += 16) {
        const __m512 x1 = load16(x + i), x2 = load16(x + half + i);
        const __m512 a1 = round16(_mm512_mul_ps(x1, load16(cos + i)));
        const __m512 b1 = round16(_mm512_mul_ps(x2, load16(sin + i)));
        const __m512 a2 = round16(_mm512_mul_ps(x2, load16(cos + half + i)));
        const __m512 b2 = round16(_mm512_mul_ps(x1, load16(sin + half + i)));
        store16(x + i, _mm512_add_ps(a1, b1));
        store16(x + half + i, _mm512_add_ps(a2, b2));
    }
#endif
    for (; i < half; i++) {
        const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[half + i]);
        const float a1 = round_bf16(x1 * bf16_to_f32(cos[i])), b1 = round_bf16(x2 * bf16_to_f32(sin[i]));
        const float a2 = round_bf16(x2 * bf16_to_f32(cos[half + i])), b2 = round_bf16(x1 * bf16_to_f32(sin[half + i]));
        x[i] = f32_to_bf16(a1 + b1);
        x[half + i] = f32_to_bf16(a2 + b2);
    }
}

/* ---------------------------------------------------------------- entry points */

typedef struct {
    const uint16_t *x, *weight;
    uint16_t *residual, *out;
    int64_t width, stride;
    int32_t heads, head_dim;
    float eps;
    const uint16_t *cos, *sin;
} Rows;

static void norm_one(const void *args, int64_t r) {
    const Rows *a = args;
    rms_norm_row(a->x + r * a->width, a->weight, a->out + r * a->stride, a->width, a->eps);
}

static void add_norm_one(const void *args, int64_t r) {
    const Rows *a = args;
    uint16_t *res = a->residual + r * a->width;
    add_row(a->x + r * a->width, res, a->width);
    rms_norm_row(res, a->weight, a->out + r * a->stride, a->width, a->eps);
}

static void silu_one(const void *args, int64_t r) {
    const Rows *a = args;
    const uint16_t *row = a->x + r * 2 * a->width;
    silu_and_mul_row(row, row + a->width, a->out + r * a->width, a->width);
}

static void rope_one(const void *args, int64_t r) {
    const Rows *a = args;
    uint16_t *tok = a->out + r * a->stride;
    const int64_t d = a->head_dim;
    for (int32_t h = 0; h < a->heads; h++) rope_head(tok + h * d, a->cos + r * d, a->sin + r * d, a->head_dim);
}

/* out[r] = rms_norm(x[r]) * weight for rows r < rows, each `hidden` wide; out's rows `out_stride` apart (padded
 * where they would be a multiple of 4 KB apart: ucm_kernels/cpu/amx_gemm.py's padded_rows). */
void ucm_rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t hidden,
                  int64_t out_stride, float eps, int32_t num_threads) {
    const Rows a = {.x = x, .weight = weight, .out = out, .width = hidden, .stride = out_stride, .eps = eps};
    for_rows(norm_one, &a, rows, num_threads, rows * hidden);
}

/* vLLM's fused_add_rms_norm: residual[r] = bf16(residual[r] + x[r]) in place, out[r] = rms_norm(residual[r]) (out's
 * rows `out_stride` apart). */
void ucm_fused_add_rms_norm(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                            int64_t rows, int64_t hidden, int64_t out_stride, float eps, int32_t num_threads) {
    const Rows a = {.x = x, .weight = weight, .residual = residual, .out = out, .width = hidden, .stride = out_stride,
                    .eps = eps};
    for_rows(add_norm_one, &a, rows, num_threads, rows * hidden);
}

/* gate_up [rows, 2 * inter] (gate | up) -> out [rows, inter]. */
void ucm_silu_and_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int32_t num_threads) {
    const Rows a = {.x = gate_up, .out = out, .width = inter};
    for_rows(silu_one, &a, rows, num_threads, rows * inter);
}

/* RoPE in place on qk [rows, heads, head_dim] (token r at qk + r * token_stride, heads head_dim apart) with
 * cos, sin [rows, head_dim] contiguous. */
void ucm_rotary_embedding(uint16_t *qk, int64_t token_stride, int64_t rows, int32_t heads, int32_t head_dim,
                          const uint16_t *cos, const uint16_t *sin, int32_t num_threads) {
    const Rows a = {.out = qk, .stride = token_stride, .heads = heads, .head_dim = head_dim, .cos = cos, .sin = sin};
    for_rows(rope_one, &a, rows, num_threads, rows * heads * head_dim);
}
