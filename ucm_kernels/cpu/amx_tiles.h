/* What the AMX kernels share (amx_gemm.c, paged_attention_amx.h): whether this build has AMX, the OS permission
 * Linux asks for before a process may use the tiles, and the one tile configuration both use.
 *
 * Every helper is static inline: each translation unit gets its own copy (and asks the OS once itself).
 */
#ifndef UCM_AMX_TILES_H
#define UCM_AMX_TILES_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define UCM_HAS_AMX 1

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux gives a process AMX state only when asked (once; oneDNN may have asked already). */
static inline int amx_permitted(void) {
    static int state = 0; /* 0 unknown, 1 yes, -1 no */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Palette 1, all eight tiles 16 rows x 64 bytes (16 fp32 or 32 bf16 a row), on the calling thread. */
static inline void amx_load_config(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif

#endif /* UCM_AMX_TILES_H */
