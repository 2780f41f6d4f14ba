/* The rate at which this CPU runs its widest multiply-accumulate right now, on operands that never leave the
 * registers (or the tiles): what no matmul can beat at this moment, whatever its blocking.
 *
 * A benchmark's figures on a shared host move with the host: on the 2-core Xeon with AMX (a VM) a loop of TDPBF16PS
 * ran at ~4.5 TFLOP/s for a while and at ~1.9 for the next seconds to minutes (2 threads, on values), and the
 * engine's matmuls halved with it (a layer of Llama-1B's: 1.66 -> 0.78 TFLOP/s, oneDNN's one 2048 x 2048 -> 8192
 * likewise). Probed beside a benchmark's runs, it says which phase each ran in (ucm_kernels/cpu/peak_probe.py).
 *
 * The operands are values a matmul meets, not zeros: on that Xeon a TDPBF16PS loop on zero tiles ran 1.09 TFLOP/s
 * against 0.91 on values of magnitude [1, 2) and either sign (one thread, a slow phase; 2.56 against 2.22 in a fast
 * one), and tiles of 1.0 ran as slowly as those: the unit does less on zeros, which no weight is. */

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
#include <string.h>
#include <time.h>

/* The instruction a probe loops (ucm_kernels/cpu/peak_probe.py: Kind). */
enum { PEAK_AMX_BF16 = 0, PEAK_AVX512_BF16 = 1, PEAK_AVX512_FP32 = 2, PEAK_AVX2_FP32 = 3, PEAK_NEON_FP32 = 4 };

static volatile float peak_sink; /* the accumulators' sum goes here, so no loop is dead code */

/* A fixed sequence of operands: bf16 of magnitude [1, 2), either sign (fp32: the same with low mantissa bits). */
static inline uint32_t next_random(uint32_t *state) {
    *state = *state * 1664525u + 1013904223u;
    return *state;
}

static inline uint16_t operand_bf16(uint32_t *state) {
    const uint32_t r = next_random(state);
    return (uint16_t)(0x3f80u | ((r >> 9) & 0x7fu) | ((r >> 5) & 0x8000u));
}

static inline float operand_f32(uint32_t *state) {
    const uint32_t bits = (uint32_t)operand_bf16(state) << 16 | (next_random(state) >> 16);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* n operands into `bf16` (or `f32`, where not NULL). */
static inline void fill_operands(uint16_t *bf16, float *f32, int n) {
    uint32_t state = 12345u;
    for (int i = 0; i < n; i++) {
        if (bf16) bf16[i] = operand_bf16(&state);
        if (f32) f32[i] = operand_f32(&state);
    }
}

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
        uint16_t operands[2 * 16 * 32] __attribute__((aligned(64))); /* A's tile, then B's */
        fill_operands(operands, NULL, 2 * 16 * 32);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        _tile_loadd(6, operands, 64);
        _tile_loadd(7, operands + 16 * 32, 64);
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
        uint16_t operands[64];
        fill_operands(operands, NULL, 64);
        const __m512bh a = (__m512bh)_mm512_loadu_si512(operands), b = (__m512bh)_mm512_loadu_si512(operands + 32);
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
        float operands[32];
        fill_operands(NULL, operands, 32);
        const __m512 a = _mm512_loadu_ps(operands), b = _mm512_loadu_ps(operands + 16);
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
        float operands[16];
        fill_operands(NULL, operands, 16);
        const __m256 a = _mm256_loadu_ps(operands), b = _mm256_loadu_ps(operands + 8);
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
        float operands[8];
        fill_operands(NULL, operands, 8);
        const float32x4_t a = vld1q_f32(operands), b = vld1q_f32(operands + 4);
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

/* The last loop's accumulator sum: not zero where its operands were not (a check that the loop multiplied values). */
double ucm_peak_last_sum(void) { return (double)peak_sink; }

/* The sum of buf[0 .. n - 1], each thread its share of the buffer as `streams` sequential streams read side by side
 * (ucm_kernels/cpu/peak_probe.py: read_sum), or -1 for arguments out of range. A core reads memory faster with more
 * streams in flight: a 2 GB buffer read by two threads as 1, 2, 4 or 8 streams each gave 27-28, 30, 31-32 and 32 GB/s
 * on the 2-core Xeon with AMX, where torch's sum read 24-28: a read bandwidth measured as one stream a thread is below
 * what the engine's decode matmuls reach (amx_gemm.c's block_16x64 reads four). Generic vectors of 16 floats, so that
 * every ISA the compiler targets gets its widest loads; the sum makes every load count. */
typedef float read_vec __attribute__((vector_size(64)));
#define READ_MAX_STREAMS 16

double ucm_read_sum(const float *buf, int64_t n, int32_t streams, int32_t num_threads) {
    if (buf == NULL || n < 0 || streams < 1 || streams > READ_MAX_STREAMS || num_threads < 1) return -1.0;
    double total = 0.0;
#pragma omp parallel for schedule(static, 1) num_threads(num_threads) reduction(+ : total)
    for (int64_t t = 0; t < num_threads; t++) { /* one share a thread */
        const int64_t lo = n * t / num_threads, hi = n * (t + 1) / num_threads;
        const int64_t len = (hi - lo) / (32 * streams) * 32; /* each stream's floats, whole steps of 2 vectors */
        read_vec acc[READ_MAX_STREAMS] = {0};
        for (int64_t i = 0; i < len; i += 32)
            for (int32_t s = 0; s < streams; s++) {
                read_vec a, b;
                memcpy(&a, buf + lo + s * len + i, sizeof a);
                memcpy(&b, buf + lo + s * len + i + 16, sizeof b);
                acc[s] += a + b;
            }
        double part = 0.0;
        for (int32_t s = 0; s < streams; s++)
            for (int j = 0; j < 16; j++) part += acc[s][j];
        for (int64_t i = lo + streams * len; i < hi; i++) part += buf[i]; /* the share's tail */
        total += part;
    }
    return total;
}
