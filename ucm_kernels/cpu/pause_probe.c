/* How long one spin-wait round of libgomp takes on this CPU: an idle OpenMP thread spins GOMP_SPINCOUNT of them
 * before it sleeps, and node/openmp_env.py sets that count from this figure. The instruction is libgomp's own
 * cpu_relax (`pause` on x86, whose latency differs several-fold between CPUs). Built without OpenMP: it runs before
 * torch loads libgomp, which reads GOMP_SPINCOUNT once, at load. */
#include <stdint.h>
#include <time.h>

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("rep; nop" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* Nanoseconds per round, the least of `tries` timings of `rounds` rounds (the least is the one nothing preempted). */
double ucm_pause_ns(int64_t rounds, int32_t tries) {
    double best = -1.0;
    for (int32_t t = 0; t < tries; t++) {
        const double start = now_ns();
        for (int64_t i = 0; i < rounds; i++) relax();
        const double ns = (now_ns() - start) / (double)rounds;
        if (best < 0.0 || ns < best) best = ns;
    }
    return best;
}
