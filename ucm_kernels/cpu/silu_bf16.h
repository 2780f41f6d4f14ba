/* SiLU-and-mul on 16 bf16 lanes, as torch's bf16 F.silu(gate) * up: elementwise.c's silu_and_mul and the AMX
 * GEMM's gate/up epilogue (amx_gemm.c) share it, so a row gets the same bits from either.
 */
#ifndef UCM_SILU_BF16_H
#define UCM_SILU_BF16_H

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define UCM_HAS_SILU16 1

/* exp on 16 lanes: n = round(x / ln2), r = x - n ln2 (ln2 split in two so r is exact), Cephes' degree-7
 * polynomial for e^r, then scalef by 2^n (which handles n = 128 and the overflow to inf). About 1 ulp. */
BF16_INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* below: 0 (the caller only adds it to 1) */
    x = _mm512_min_ps(x, _mm512_set1_ps(89.0f));   /* above: inf, through scalef */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* bf16(silu(g)) in fp32: g is a bf16 value widened to fp32; silu(g) = g / (1 + exp(-g)). */
BF16_INLINE __m512 silu16(__m512 g) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return f32x16_round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

/* bf16(silu(g)) * u in fp32 (the caller rounds it to bf16 on store): g, u are bf16 values widened to fp32. */
BF16_INLINE __m512 silu_mul16(__m512 g, __m512 u) { return _mm512_mul_ps(silu16(g), u); }
#endif

#endif /* UCM_SILU_BF16_H */
