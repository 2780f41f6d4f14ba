/* bf16 <-> fp32 conversions shared by the CPU kernels (paged_attention.c, elementwise.c).
 *
 * bf16 tensors are passed as uint16_t: the high half of an fp32. Rounding is to nearest even with a NaN kept a
 * NaN, exactly as c10::BFloat16 rounds, so the kernels reproduce torch's bf16 results bit for bit. (Native
 * VCVTNEPS2BF16 flushes denormals: only results defined by it may use it, as the AMX kernels' P and GEMM
 * outputs are.)
 * Every helper is static inline: each translation unit gets its own copy and the library exports none of them.
 */
#ifndef UCM_BF16_H
#define UCM_BF16_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BF16_INLINE static inline __attribute__((always_inline))

BF16_INLINE float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

BF16_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* keep NaN a NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                             /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__)
/* 16 bf16 values widened to fp32. */
BF16_INLINE __m512 bf16x16_to_f32(const uint16_t *src) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* f32_to_bf16 on 16 lanes; the bf16 bits sit in the low half of each 32-bit lane. */
BF16_INLINE __m512i bf16x16_bits(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}

/* f32_to_bf16 on 16 lanes, packed into 16 words. With AVX-512 BF16, VCVTNEPS2BF16 rounds exactly so (nearest
 * even, a NaN quieted by its 0x40 bit) except that it flushes a denormal input to a signed zero: a vector holding
 * one (fpclass 0x20, rare: |f| < 2^-126) takes the integer rounding instead. */
BF16_INLINE __m256i bf16x16_pack(__m512 f) {
#if defined(__AVX512BF16__)
    if (__builtin_expect(_mm512_fpclass_ps_mask(f, 0x20) == 0, 1)) return (__m256i)_mm512_cvtneps_pbh(f);
#endif
    return _mm512_cvtepi32_epi16(bf16x16_bits(f));
}

/* f32_to_bf16 on 16 lanes, stored. */
BF16_INLINE void f32x16_store_bf16(uint16_t *dst, __m512 f) { _mm256_storeu_si256((__m256i *)dst, bf16x16_pack(f)); }

/* f: the fp32 value of f32_to_bf16(f), on 16 lanes (a bf16 rounding kept in fp32). */
BF16_INLINE __m512 f32x16_round_bf16(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_pack(f)), 16));
}
#endif

#endif /* UCM_BF16_H */
