/* The row loop shared by the elementwise kernels (elementwise.c in bf16, elementwise_f32.c in fp32): rows split
 * statically over OpenMP threads when a call is big enough to pay for waking them. */
#ifndef UCM_ROW_LOOP_H
#define UCM_ROW_LOOP_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* Below this many elements a call stays on the calling thread: waking the OpenMP pool costs a few us, about
 * what a 32-token decode step's norm or SiLU takes on one core. */
#define EW_PARALLEL_MIN_ELEMS 65536

/* One row of an op; `args` is the op's own argument struct. */
typedef void (*RowFn)(const void *args, int64_t r);

/* With one thread no parallel region is entered at all (an if(0) region still builds a team). */
static void for_rows(RowFn fn, const void *args, int64_t rows, int32_t num_threads, int64_t elems) {
#ifdef _OPENMP
    if (num_threads > 1 && rows > 1 && elems >= EW_PARALLEL_MIN_ELEMS) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t r = 0; r < rows; r++) fn(args, r);
        return;
    }
#endif
    (void)num_threads;
    (void)elems;
    for (int64_t r = 0; r < rows; r++) fn(args, r);
}

#endif /* UCM_ROW_LOOP_H */
