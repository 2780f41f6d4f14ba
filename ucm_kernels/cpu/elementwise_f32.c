/* The Llama block's elementwise ops, fused, in fp32: RMSNorm (with the residual add folded in), SiLU-and-mul
 * and RoPE (elementwise.c has the bf16 ones). fp32 is the serving dtype on CPUs without native bf16, and
 * torch spends a pass over memory per op there: at 2048 tokens SiLU-and-mul alone took 7-19 ms a layer on a
 * 2-core AVX2 EPYC, more than the layer's attention.
 *
 * Same math as the torch expressions, not always the same bits: the residual add, RoPE's products and sums and
 * RMSNorm's scaling are the same IEEE operations in the same order (compiled with -std=c11, so gcc does not
 * contract a*b+c into an FMA, and the intrinsics below spell mul and add apart where torch rounds twice), so
 * they are bit-identical. RMSNorm's sum of squares runs in another order than aten's cascade and exp in SiLU is
 * a ~1 ulp polynomial like torch's Sleef one: those differ from torch by a few fp32 ulps
 * (tests/kernels/test_kernels_elementwise_f32.py bounds them).
 *
 * Vectorised for AVX2 + FMA (8 lanes, which AVX-512 CPUs run too); elsewhere the scalar loops, which the
 * compiler vectorises for the target it was given (-march=native: NEON on aarch64).
 */

#include <math.h>
#include <stdint.h>

#include "entry_points.h"
#include "row_loop.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define F32_AVX2 1
#endif

#define F32_INLINE static inline __attribute__((always_inline))

/* ---------------------------------------------------------------- RMSNorm */

static float sum_squares_f32(const float *x, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef F32_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
        a2 = _mm256_fmadd_ps(v2, v2, a2);
        a3 = _mm256_fmadd_ps(v3, v3, a3);
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v, v, a0);
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    for (int l = 0; l < 8; l++) total += lanes[l];
#endif
    for (; i < n; i++) total += x[i] * x[i];
    return total;
}

/* out = w * (x * rsqrt(mean(x^2) + eps)): HF's LlamaRMSNorm in fp32 (its casts are no-ops there). */
static void rms_norm_row_f32(const float *x, const float *w, float *out, int64_t n, float eps) {
    /* torch.rsqrt on fp32 is 1 / sqrt (two IEEE roundings), not a correctly rounded rsqrt */
    const float r = 1.0f / sqrtf(sum_squares_f32(x, n) / (float)n + eps);
    int64_t i = 0;
#ifdef F32_AVX2
    const __m256 vr = _mm256_set1_ps(r);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), vr)));
#endif
    for (; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* residual += x, in place. */
static void add_row_f32(const float *x, float *residual, int64_t n) {
    int64_t i = 0;
#ifdef F32_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(residual + i, _mm256_add_ps(_mm256_loadu_ps(residual + i), _mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) residual[i] += x[i];
}

/* ---------------------------------------------------------------- SiLU */

#ifdef F32_AVX2
/* exp on 8 lanes, as elementwise.c's exp16: n = round(x / ln2), r = x - n ln2 (ln2 split in two so r is
 * exact), Cephes' degree-7 polynomial for e^r, times 2^n built in two halves (each a normal float for every
 * n in [-150, 128], so n = 128 gives e^89 finite and n = -150 underflows gradually). About 1 ulp. */
F32_INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-104.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(89.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i lo = _mm256_srai_epi32(ni, 1), hi = _mm256_sub_epi32(ni, lo);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s_lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(lo, bias), 23));
    const __m256 s_hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(hi, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s_lo), s_hi);
}
#endif

/* out = silu(gate) * up with silu(g) = g / (1 + exp(-g)), as torch's fp32 F.silu. */
static void silu_and_mul_row_f32(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
#ifdef F32_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* ---------------------------------------------------------------- RoPE */

/* One head, rotate-half layout, in place: x = x * cos + rot(x) * sin with rot(x) = [x2 | x1] and the sign
 * folded into sin ([-sin | sin]), as engine/models/rope.py builds it: two products and a sum, each rounded. */
static void rope_head_f32(float *x, const float *cos, const float *sin, int32_t d) {
    const int32_t half = d / 2;
    int32_t i = 0;
#ifdef F32_AVX2
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        const __m256 a1 = _mm256_mul_ps(x1, _mm256_loadu_ps(cos + i));
        const __m256 b1 = _mm256_mul_ps(x2, _mm256_loadu_ps(sin + i));
        const __m256 a2 = _mm256_mul_ps(x2, _mm256_loadu_ps(cos + half + i));
        const __m256 b2 = _mm256_mul_ps(x1, _mm256_loadu_ps(sin + half + i));
        _mm256_storeu_ps(x + i, _mm256_add_ps(a1, b1));
        _mm256_storeu_ps(x + half + i, _mm256_add_ps(a2, b2));
    }
#endif
    for (; i < half; i++) {
        const float x1 = x[i], x2 = x[half + i];
        x[i] = x1 * cos[i] + x2 * sin[i];
        x[half + i] = x2 * cos[half + i] + x1 * sin[half + i];
    }
}

/* ---------------------------------------------------------------- entry points */

typedef struct {
    const float *x, *weight;
    float *residual, *out;
    int64_t width, stride;
    int32_t heads, head_dim;
    float eps;
    const float *cos, *sin;
} RowsF32;

static void norm_one(const void *args, int64_t r) {
    const RowsF32 *a = args;
    rms_norm_row_f32(a->x + r * a->width, a->weight, a->out + r * a->stride, a->width, a->eps);
}

static void add_norm_one(const void *args, int64_t r) {
    const RowsF32 *a = args;
    float *res = a->residual + r * a->width;
    add_row_f32(a->x + r * a->width, res, a->width);
    rms_norm_row_f32(res, a->weight, a->out + r * a->stride, a->width, a->eps);
}

static void silu_one(const void *args, int64_t r) {
    const RowsF32 *a = args;
    const float *row = a->x + r * 2 * a->width;
    silu_and_mul_row_f32(row, row + a->width, a->out + r * a->width, a->width);
}

static void rope_one(const void *args, int64_t r) {
    const RowsF32 *a = args;
    float *tok = a->out + r * a->stride;
    const int64_t d = a->head_dim;
    for (int32_t h = 0; h < a->heads; h++) rope_head_f32(tok + h * d, a->cos + r * d, a->sin + r * d, a->head_dim);
}

/* The fp32 twins of elementwise.c's entry points: same arguments, float data, strides in elements. */
void ucm_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t hidden,
                      int64_t out_stride, float eps, int32_t num_threads) {
    const RowsF32 a = {.x = x, .weight = weight, .out = out, .width = hidden, .stride = out_stride, .eps = eps};
    for_rows(norm_one, &a, rows, num_threads, rows * hidden);
}

void ucm_fused_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                                int64_t hidden, int64_t out_stride, float eps, int32_t num_threads) {
    const RowsF32 a = {.x = x, .weight = weight, .residual = residual, .out = out, .width = hidden,
                       .stride = out_stride, .eps = eps};
    for_rows(add_norm_one, &a, rows, num_threads, rows * hidden);
}

void ucm_silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int32_t num_threads) {
    const RowsF32 a = {.x = gate_up, .out = out, .width = inter};
    for_rows(silu_one, &a, rows, num_threads, rows * inter);
}

void ucm_rotary_embedding_f32(float *qk, int64_t token_stride, int64_t rows, int32_t heads, int32_t head_dim,
                              const float *cos, const float *sin, int32_t num_threads) {
    const RowsF32 a = {.out = qk, .stride = token_stride, .heads = heads, .head_dim = head_dim, .cos = cos, .sin = sin};
    for_rows(rope_one, &a, rows, num_threads, rows * heads * head_dim);
}
