/* AMX tiles as both AMX kernels (qgemv.c, paged_attention.c) use them: every tile 16 rows × 64
 * bytes, borrowed for the length of one parallel region. */
#ifndef PYTGI_AMX_H
#define PYTGI_AMX_H
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config;

/* Configure tiles 0 .. n-1 and return the thread's previous configuration: oneDNN (PyTorch's bf16
 * matmuls) may keep one on this thread and not load it again. */
static inline amx_config amx_borrow(int n) {
    amx_config saved, cfg = {0};
    _tile_storeconfig(&saved);
    cfg.palette_id = 1;
    for (int t = 0; t < n; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    return saved;
}

static inline void amx_return(const amx_config *saved) {
    if (saved->palette_id != 0) _tile_loadconfig(saved);
    else _tile_release();
}
#endif
#endif
