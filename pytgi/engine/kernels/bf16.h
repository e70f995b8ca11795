/* bfloat16 stored as uint16: widen to float32, and round float32 to nearest even. */
#ifndef PYTGI_BF16_H
#define PYTGI_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float bf16_rt(float x) { return bf16_load(bf16_round(x)); } /* round trip */

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 bf16 values widened to float32 */
static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}
#endif

#endif
