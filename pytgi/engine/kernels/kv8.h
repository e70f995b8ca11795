/* The int8 KV cache's rows (--kv-cache-dtype int8): a head's D values as int8, then their bf16 scale
 * (2 bytes): value = q · scale, the scale the row's largest |value| / 127 rounded up to bf16 (so no
 * value is clipped). A row is written once, whole, by its token: its bits depend on nothing else. */
#ifndef PYTGI_KV8_H
#define PYTGI_KV8_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define KV8_ROW(D) ((D) + 2) /* bytes of one head's row */

static inline float kv8_scale(const uint8_t *row, int64_t D) {
    uint16_t s;
    memcpy(&s, row + D, 2);
    return bf16_load(s);
}

static inline void kv8_store(const float *x, int64_t D, uint8_t *row) {
    float amax = 0.0f;
    for (int64_t i = 0; i < D; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float s = amax / 127.0f;
    uint32_t u;
    memcpy(&u, &s, 4);
    if (u & 0xFFFFu) u = (u | 0xFFFFu) + 1u; /* up to the next bf16 (s >= 0) */
    const uint16_t sb = (uint16_t)(u >> 16);
    const float scale = bf16_load(sb), inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t i = 0; i < D; i++) {
        float v = rintf(x[i] * inv);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        row[i] = (uint8_t)(int8_t)v;
    }
    memcpy(row + D, &sb, 2);
}
#endif
