/* The rate at which this CPU runs its widest multiply-accumulate right now, on operands that never leave the
 * registers (or the tiles): what no matmul can beat at this moment, whatever its blocking.
 *
 * A benchmark's figures on a shared host move with the host: on the 2-core Xeon with AMX (a VM) a loop of TDPBF16PS
 * ran at ~5.5 TFLOP/s for a while and at ~2.1 for the next seconds to minutes, and the engine's matmuls halved with
 * it (a layer of Llama-1B's: 1.66 -> 0.78 TFLOP/s, oneDNN's one 2048 x 2048 -> 8192 likewise). Probed beside a
 * benchmark's runs, it says which phase each ran in (ucm_kernels/cpu/peak_probe.py). */

#define _GNU_SOURCE
#include <stdint.h>

#include "amx_tiles.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include <time.h>

/* The instruction a probe loops (ucm_kernels/cpu/peak_probe.py: Kind). */
enum { PEAK_AMX_BF16 = 0, PEAK_AVX512_BF16 = 1, PEAK_AVX512_FP32 = 2, PEAK_AVX2_FP32 = 3, PEAK_NEON_FP32 = 4 };

static volatile float peak_sink; /* the accumulators' sum goes here, so no loop is dead code */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* FLOPs one thread does in `rounds` rounds of `kind`, or -1 where this build or CPU has no such instruction. Each
 * round issues 6 (tiles) or 12 (vectors) independent multiply-accumulates: more than the unit's latency covers. */
static double one_thread(int32_t kind, int64_t rounds) {
    switch (kind) {
#ifdef UCM_HAS_AMX
    case PEAK_AMX_BF16: {
        if (!amx_permitted()) return -1.0;
        amx_load_config();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t i = 0; i < rounds; i++) { /* six sums, each on A (tile 6) . B (tile 7) */
            _tile_dpbf16ps(0, 6, 7);
            _tile_dpbf16ps(1, 6, 7);
            _tile_dpbf16ps(2, 6, 7);
            _tile_dpbf16ps(3, 6, 7);
            _tile_dpbf16ps(4, 6, 7);
            _tile_dpbf16ps(5, 6, 7);
        }
        float out[16 * 16] __attribute__((aligned(64)));
        _tile_stored(0, out, 64);
        _tile_release();
        peak_sink = out[0];
        return 6.0 * 16 * 16 * 32 * 2 * (double)rounds; /* C 16 x 16 += A 16 x 32 . B 32 x 16 */
    }
#endif
#ifdef __AVX512BF16__
    case PEAK_AVX512_BF16: {
        __m512 acc[12];
        for (int j = 0; j < 12; j++) acc[j] = _mm512_setzero_ps();
        const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0); /* 1.0, 0.0 */
        for (int64_t i = 0; i < rounds; i++)
            for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
        __m512 s = acc[0];
        for (int j = 1; j < 12; j++) s = _mm512_add_ps(s, acc[j]);
        peak_sink = _mm512_reduce_add_ps(s);
        return 12.0 * 32 * 2 * (double)rounds; /* 16 lanes x 2 products */
    }
#endif
#ifdef __AVX512F__
    case PEAK_AVX512_FP32: {
        __m512 acc[12];
        for (int j = 0; j < 12; j++) acc[j] = _mm512_setzero_ps();
        const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0.0f);
        for (int64_t i = 0; i < rounds; i++)
            for (int j = 0; j < 12; j++) acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
        __m512 s = acc[0];
        for (int j = 1; j < 12; j++) s = _mm512_add_ps(s, acc[j]);
        peak_sink = _mm512_reduce_add_ps(s);
        return 12.0 * 16 * 2 * (double)rounds;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    case PEAK_AVX2_FP32: {
        __m256 acc[12];
        for (int j = 0; j < 12; j++) acc[j] = _mm256_setzero_ps();
        const __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(0.0f);
        for (int64_t i = 0; i < rounds; i++)
            for (int j = 0; j < 12; j++) acc[j] = _mm256_fmadd_ps(a, b, acc[j]);
        __m256 s = acc[0];
        for (int j = 1; j < 12; j++) s = _mm256_add_ps(s, acc[j]);
        float out[8];
        _mm256_storeu_ps(out, s);
        peak_sink = out[0];
        return 12.0 * 8 * 2 * (double)rounds;
    }
#endif
#if defined(__ARM_NEON)
    case PEAK_NEON_FP32: {
        float32x4_t acc[12];
        for (int j = 0; j < 12; j++) acc[j] = vdupq_n_f32(0.0f);
        const float32x4_t a = vdupq_n_f32(1.0f), b = vdupq_n_f32(0.0f);
        for (int64_t i = 0; i < rounds; i++)
            for (int j = 0; j < 12; j++) acc[j] = vfmaq_f32(acc[j], a, b);
        float32x4_t s = acc[0];
        for (int j = 1; j < 12; j++) s = vaddq_f32(s, acc[j]);
        peak_sink = vgetq_lane_f32(s, 0);
        return 12.0 * 4 * 2 * (double)rounds;
    }
#endif
    default:
        (void)rounds;
        return -1.0;
    }
}

/* GFLOP/s of `kind` on `num_threads` threads together, each `rounds` rounds; -1 where this build or CPU has no such
 * instruction (or the OS denies AMX). */
double ucm_peak_gflops(int32_t kind, int64_t rounds, int32_t num_threads) {
    if (rounds < 1 || num_threads < 1) return -1.0;
    double flops = 0.0;
    int missing = 0;
    const double t0 = now_s();
#pragma omp parallel num_threads(num_threads) reduction(+ : flops, missing)
    {
        const double f = one_thread(kind, rounds);
        if (f < 0) missing = 1;
        else flops = f;
    }
    const double seconds = now_s() - t0;
    return missing || seconds <= 0 ? -1.0 : flops / seconds / 1e9;
}
