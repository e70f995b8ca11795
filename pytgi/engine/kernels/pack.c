/* Packing a low-bit weight into the layout qgemv.c reads (described there), at load time.
 *
 * The same bytes as pytgi/engine/models/quant.py's `pack_vnni` (its reference, in PyTorch operations), in one
 * pass over the output: a GGUF model's every linear goes through here while it loads, and PyTorch's
 * permute-and-copy of the levels was most of an 8B model's load time. */
#include <stdint.h>
#include <string.h>

#include "lowbit.h"
#include "pytgi_kernels.h"

/* MXFP4's level (12 + 2·value, 0..24) → its e2m1 code, which qgemv.c's format 5 stores (levels off
 * that grid, which no MXFP4 block holds, are taken as the nearest one below) */
static const uint8_t FP4_CODE[25] = {15, 15, 15, 15, 14, 14, 13, 13, 12, 11, 10, 9, 0,
                                     1,  2,  3,  4,  4,  5,  5,  6,  6,  6,  6,  7};

/* An fp16 power of two (MXFP4's step) → MXFP4's e8m0 byte E, the step being 2^(E - 128); 0 for zero
 * (a mantissa, which no MXFP4 step has, is dropped) */
static uint8_t fp4_exponent(uint16_t h) {
    const int e = (h >> 10) & 31, mant = h & 1023;
    if (e == 0) return mant == 0 ? 0 : (uint8_t)(104 + 31 - __builtin_clz((unsigned)mant)); /* 2^(j - 24) */
    return (uint8_t)(e - 15 + 128);
}

/* u: levels [N, K] (< 16 for bits 4, < 25 for bits 5: MXFP4's, < 64 for bits 6, < 32 for bits 7); d16,
 * m16: fp16 bits [N, K/32] (bits 4, 5, 7, 8; bits 5 reads d alone, m being -12·d, and bits 7 too, m
 * being -16·d) or [N, K/16] (bits 16, and 6, which reads d alone: m = -32·d); out: N/16 tiles × K/32 groups of qgemv.c's blocks. N a multiple of 16, K
 * of 32. */
void pytgi_pack_lowbit(const uint8_t *u, const uint16_t *d16, const uint16_t *m16, uint8_t *out, int64_t N,
                       int64_t K, int64_t bits) {
    const int64_t G = K / 32, halves = HALVES(bits) ? 2 : 1, S = G * halves; /* scales per row */
    const int64_t wbytes = WEIGHT_BYTES(bits), block = block_bytes(bits);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N / 16; t++) {
        for (int64_t g = 0; g < G; g++) {
            uint8_t *o = out + (t * G + g) * block;
            /* 4 inputs to a 32-bit word: word j of row r goes to word 16j + r (with 4 bits, words j and
             * j + 4 share one, the second in the high nibbles: levels < 16 never carry into a neighbour) */
            uint32_t *o32 = (uint32_t *)o;
            if (bits == 6) memset(o + 256, 0, 128);
            if (bits == 7) memset(o + 256, 0, 64);
            for (int64_t r = 0; r < 16; r++) {
                uint32_t w[8];
                memcpy(w, u + (16 * t + r) * K + 32 * g, sizeof w);
                if (bits == 5) {
                    uint8_t *c = (uint8_t *)w;
                    for (int i = 0; i < 32; i++) c[i] = FP4_CODE[c[i] < 25 ? c[i] : 24];
                }
                if (bits == 6) /* low 4 bits as bits 4 stores them; vector j's high 2 at bit 2·(j % 4) of 4 + j / 4 */
                    for (int64_t j = 0; j < 8; j++) {
                        if (j < 4) o32[16 * j + r] = (w[j] & 0x0F0F0F0Fu) | ((w[j + 4] & 0x0F0F0F0Fu) << 4);
                        o32[64 + 16 * (j / 4) + r] |= ((w[j] >> 4) & 0x03030303u) << (2 * (j % 4));
                    }
                else if (bits == 7) /* low 4 bits as bits 4 stores them; vector j's high bit at bit j of 4 */
                    for (int64_t j = 0; j < 8; j++) {
                        if (j < 4) o32[16 * j + r] = (w[j] & 0x0F0F0F0Fu) | ((w[j + 4] & 0x0F0F0F0Fu) << 4);
                        o32[64 + r] |= ((w[j] >> 4) & 0x01010101u) << j;
                    }
                else if (NIBBLES(bits))
                    for (int64_t j = 0; j < 4; j++) o32[16 * j + r] = w[j] | (w[j + 4] << 4);
                else
                    for (int64_t j = 0; j < 8; j++) o32[16 * j + r] = w[j];
            }
            if (bits == 5) { /* each row's exponent */
                for (int64_t r = 0; r < 16; r++) o[wbytes + r] = fp4_exponent(d16[(16 * t + r) * S + g]);
                continue;
            }
            uint16_t *s = (uint16_t *)(o + wbytes); /* per half: 16 d, then 16 m (bits 6: 16 d; 7: 16 d a group) */
            if (bits == 7) {
                for (int64_t r = 0; r < 16; r++) s[r] = d16[(16 * t + r) * S + g];
                continue;
            }
            if (bits == 6) {
                for (int64_t h = 0; h < 2; h++)
                    for (int64_t r = 0; r < 16; r++) s[16 * h + r] = d16[(16 * t + r) * S + 2 * g + h];
                continue;
            }
            for (int64_t h = 0; h < halves; h++)
                for (int64_t r = 0; r < 16; r++) {
                    s[32 * h + r] = d16[(16 * t + r) * S + g * halves + h];
                    s[32 * h + 16 + r] = m16[(16 * t + r) * S + g * halves + h];
                }
        }
    }
}
