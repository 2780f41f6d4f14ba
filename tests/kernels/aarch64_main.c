/* The executable the aarch64 emulator test runs (tests/kernels/test_kernels_aarch64_build.py): musl starts it, the
 * emulator stops it at main and then calls the kernels' entry points itself. This table keeps them from the
 * linker's garbage collection. */
#include <stdint.h>

#include "entry_points.h"

const char *ucm_vector_path(void);
int32_t ucm_lanes_rows(void);

void *volatile ucm_entry_points[] = {(void *)ucm_paged_attention, (void *)ucm_vector_path, (void *)ucm_lanes_rows};

int main(void) { return ucm_entry_points[0] == 0; }
