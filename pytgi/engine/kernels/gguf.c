/* GGUF's quantized blocks → levels and per-group grids (pytgi/engine/loading/gguf.py's `Grid`), at load
 * time: the same values as the PyTorch decoders there (their reference), in one pass over the blocks.
 *
 * For every block: q[v] (uint8 level of value v), and per group of 32 (16 for Q2_K, Q3_K, Q6_K) values
 * d (the step) and, for the types with an offset, m: value = d·q + m. The symmetric types (Q4_0, Q5_0,
 * Q8_0, Q3_K, Q6_K) have m = -zero·d and leave m alone. Types are ggml's numbers. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pytgi_kernels.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };

/* MXFP4 (e2m1 codes, a shared power of two per 32): code → level 12 + 2·value on a grid of step
 * d = 2^(e - 128) and offset -12·d (symmetric, zero 12) */
static const uint8_t FP4_LEVEL[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

static float e8m0_half(uint8_t e) { return ldexpf(1.0f, (int)e - 128); }

/* IEEE half → float, exact (subnormals, infinities and NaN included), whatever the CPU. */
static float half(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man)
        bits = sign;
    else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 1024)) man <<= 1, exp--;
        bits = sign | (exp << 23) | ((man & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K and Q5_K's 6-bit scale and min of sub-block j from their 12 bytes. */
static void k_scale(const uint8_t *s, int j, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63), *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 2) & 48));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 2) & 48));
    }
}

static int type_size(int64_t type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case MXFP4: return 17;
    default: return 0;
    }
}

/* Block b of `type` → its values' levels q[0 .. QK), groups' d and m. */
static void decode(int64_t type, const uint8_t *b, uint8_t *q, float *d, float *m) {
    switch (type) {
    case Q4_0:
    case Q4_1: {
        const uint8_t *qs = b + (type == Q4_0 ? 2 : 4);
        for (int i = 0; i < 16; i++) q[i] = qs[i] & 15, q[i + 16] = qs[i] >> 4;
        d[0] = half(b);
        if (type == Q4_1) m[0] = half(b + 2);
        break;
    }
    case Q5_0:
    case Q5_1: {
        const uint8_t *qh = b + (type == Q5_0 ? 2 : 4), *qs = qh + 4;
        for (int i = 0; i < 16; i++) q[i] = qs[i] & 15, q[i + 16] = qs[i] >> 4;
        for (int v = 0; v < 32; v++) q[v] |= ((qh[v / 8] >> (v % 8)) & 1) << 4;
        d[0] = half(b);
        if (type == Q5_1) m[0] = half(b + 2);
        break;
    }
    case Q8_0:
        for (int v = 0; v < 32; v++) q[v] = b[2 + v] ^ 128;
        d[0] = half(b);
        break;
    case MXFP4: /* the exponent, then values j and j + 16 in byte j's low and high nibbles */
        for (int i = 0; i < 16; i++) q[i] = FP4_LEVEL[b[1 + i] & 15], q[i + 16] = FP4_LEVEL[b[1 + i] >> 4];
        d[0] = e8m0_half(b[0]);
        break;
    case Q4_K:
    case Q5_K: {
        float dd = half(b), dmin = half(b + 2), sc, mn;
        const uint8_t *qh = b + 16, *qs = b + (type == Q4_K ? 16 : 48);
        for (int j = 0; j < 8; j++) {
            k_scale(b + 4, j, &sc, &mn);
            d[j] = dd * sc, m[j] = -dmin * mn;
            const uint8_t *c = qs + 32 * (j / 2);
            for (int l = 0; l < 32; l++) {
                q[32 * j + l] = j % 2 ? c[l] >> 4 : c[l] & 15;
                if (type == Q5_K) q[32 * j + l] |= ((qh[l] >> j) & 1) << 4;
            }
        }
        break;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        for (int v = 0; v < 256; v++) {
            int c = v / 128, w = v % 128, i = w / 32, l = w % 32;
            uint8_t low = w < 64 ? ql[64 * c + w] & 15 : ql[64 * c + w - 64] >> 4;
            q[v] = low | (((qh[32 * c + l] >> (2 * i)) & 3) << 4);
        }
        float dd = half(b + 208);
        for (int j = 0; j < 16; j++) d[j] = dd * (float)(int8_t)b[192 + j];
        break;
    }
    case Q3_K: {
        const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
        for (int v = 0; v < 256; v++) {
            int c = v / 128, i = (v % 128) / 32, l = v % 32;
            q[v] = ((qs[32 * c + l] >> (2 * i)) & 3) | (((hm[l] >> (v / 32)) & 1) << 2);
        }
        float dd = half(b + 108);
        for (int j = 0; j < 16; j++) {
            int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4, hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
            d[j] = dd * (float)((lo | (hi << 4)) - 32);
        }
        break;
    }
    case Q2_K: {
        const uint8_t *s = b, *qs = b + 16;
        for (int v = 0; v < 256; v++) {
            int c = v / 128, i = (v % 128) / 32, l = v % 32;
            q[v] = (qs[32 * c + l] >> (2 * i)) & 3;
        }
        float dd = half(b + 80), dmin = half(b + 82);
        for (int j = 0; j < 16; j++) d[j] = dd * (float)(s[j] & 15), m[j] = -dmin * (float)(s[j] >> 4);
        break;
    }
    }
}

int pytgi_gguf_decode(int64_t type, const uint8_t *blocks, int64_t nb, uint8_t *q, float *d, float *m) {
    int size = type_size(type);
    if (!size) return 2;
    int64_t qk = size < 84 ? 32 : 256, groups = type == Q4_K || type == Q5_K ? 8 : qk == 32 ? 1 : 16;
    int offset = type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K || type == Q2_K;
    if (offset && !m) return 1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nb; i++)
        decode(type, blocks + i * size, q + i * qk, d + i * groups, offset ? m + i * groups : 0);
    return 0;
}

/* A Hugging Face MXFP4 checkpoint's blocks (gpt-oss's `*_blocks`: 16 bytes per 32 values, value 2j in
 * byte j's low nibble and 2j + 1 in its high one) and their exponents (`*_scales`, one byte a block) →
 * levels and steps as the GGUF type's above. */
void pytgi_mxfp4_decode(const uint8_t *blocks, const uint8_t *scales, int64_t nb, uint8_t *q, float *d) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = blocks + 16 * i;
        uint8_t *o = q + 32 * i;
        for (int j = 0; j < 16; j++) o[2 * j] = FP4_LEVEL[b[j] & 15], o[2 * j + 1] = FP4_LEVEL[b[j] >> 4];
        d[i] = e8m0_half(scales[i]);
    }
}
