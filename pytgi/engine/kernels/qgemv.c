/* Low-bit weight × int8 activation matmul for decode steps of a few tokens (AVX-512 VNNI, or AVX2).
 *
 * A decode step reads every weight once for a handful of activation rows, so it is bound by
 * memory: the weights are stored in 4 or 8 bits with a scale and an offset per group of 32 inputs
 * (GGUF's Q4_1 / Q8_0 grids), and each activation row is quantized to int8 per group of 32 (as
 * llama.cpp does), so the inner loop is `vpdpbusd`: 64 unsigned weight bytes times 4 signed
 * activation bytes, summed into 16 int32 lanes, one lane per output row.
 *
 *   y[t, n] = Σ_g  d[n,g]·sx[t,g]·Σ_k qw[n,k]·qx[t,k]  +  m[n,g]·sx[t,g]·Σ_k qx[t,k]
 *
 * with w[n,k] = d[n,g]·qw[n,k] + m[n,g]  (qw unsigned: 0..15, or 0..255 for 8 bits)
 * and  x[t,k] = sx[t,g]·qx[t,k]          (qx in -127..127).
 *
 * Packed layout (built by pytgi/engine/models/quant.py): for each tile of 16 output rows, for each group
 * of 32 inputs, one block of
 *   8 vectors of 64 bytes, vector j holding byte 4r+b = qw[row r, k = 4j + b]; with 4 bits,
 *     vector j (j < 4) is stored as the low nibbles and vector j+4 as the high nibbles of one
 *     64-byte vector (256 bytes), with 8 bits they are stored as they are (512 bytes);
 *   16 fp16 d, then 16 fp16 m (64 bytes).
 * Blocks are contiguous in (tile, group) order, so a tile is one sequential read.
 *
 * `bits` names the format: 4 or 8 as above, or 16 (QFMT_I8_16): 8-bit weights whose scale and offset
 * change every 16 inputs (the sub-blocks of GGUF's Q6_K and Q2_K), stored as the 8-bit block
 * followed by 16 fp16 d and 16 m for inputs 0..15 of the group, then 16 d and 16 m for 16..31
 * (128 bytes); the sums of the two halves are scaled apart, and x's offset sums are kept per half.
 * Or 5 (MXFP4, gpt-oss's experts): stored as 4 bits, but each nibble is an e2m1 code, not a level;
 * a table (one byte shuffle) turns the code into its level on a uniform grid of 25, 12 + 2·value
 * (0..24), so that d = the block's power of two / 2 and m = -12·d hold it exactly and the sums are
 * the 4-bit format's. d being a power of two and m following from it, the block ends in 16 bytes,
 * not 64: each row's E (MXFP4's own e8m0 byte, d = 2^(E - 128); 0: a block of zeros), 272 bytes,
 * 4.25 bits a weight as in the file. (The packer takes d from fp16, so E is 0 or 104..143: d and m
 * are exact in fp16 too, as the AMX path's spread blocks hold them.)
 * Or 6 (GGUF's Q6_K and Q3_K: symmetric levels 0..63 with a scale per 16 inputs, m = -32·d): the
 * levels' low 4 bits as the 4-bit format stores them (256 bytes), their high 2 bits in two more
 * vectors (vector j's bits at bit 2·(j % 4) of vector 4 + j / 4's byte; 128 bytes), then 16 fp16 d for
 * inputs 0..15 and 16 for 16..31 (64 bytes): 448 bytes, 7 bits a weight where 8-bit levels take 10.
 * Or 7 ("five": GGUF's Q5_0, symmetric levels 0..31 with one scale per 32, m = -16·d): the levels'
 * low 4 bits as the 4-bit format stores them (256 bytes), their high bits in one more vector (vector
 * j's at bit j of its bytes, so that a shift and an and put it at bit 4; 64 bytes), then 16 fp16 d
 * (32 bytes): 352 bytes, 5.5 bits a weight as in the file, where format 6 takes 7.
 *
 * With AVX2 only, the same layout is multiplied with AVX2's byte multiply-adds (below); with
 * neither, `pytgi_qgemv_supported()` returns 0 and callers use PyTorch's kernels.
 * Built and loaded by pytgi/engine/kernels/__init__.py. */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "lowbit.h"
#include "pytgi_kernels.h"

/* MXFP4: e2m1 code (sign, then magnitude 0 0.5 1 1.5 2 3 4 6) → level 12 + 2·value */
#define FP4_LEVELS 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#include <immintrin.h>

int pytgi_qgemv_supported(void) { return 1; }

/* Bits 6: weight vector j's high 2 bits (at bit 2·(j % 4) of h's bytes) as bits 4 and 5 */
static inline __m512i high2(__m512i h, int j) {
    const int k = j % 4;
    const __m512i at = k == 0 ? _mm512_slli_epi16(h, 4) : k == 1 ? _mm512_slli_epi16(h, 2) : k == 2 ? h : _mm512_srli_epi16(h, 2);
    return _mm512_and_si512(at, _mm512_set1_epi8(0x30));
}

/* Bits 7: weight vector j's high bit (bit j of h's bytes) as bit 4 */
static inline __m512i high1(__m512i h, int j) {
    const __m512i at = j < 4 ? _mm512_slli_epi16(h, 4 - j) : j == 4 ? h : _mm512_srli_epi16(h, j - 4);
    return _mm512_and_si512(at, _mm512_set1_epi8(0x10));
}

/* MXFP4's 16 exponent bytes (one a row; 0: a zero block) → the rows' steps 2^(E - 128) */
static inline __m512 fp4_steps(const uint8_t *e) {
    const __m512i E = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)e));
    const __m512i pow2 = _mm512_slli_epi32(_mm512_sub_epi32(E, _mm512_set1_epi32(1)), 23);
    return _mm512_maskz_mov_ps(_mm512_test_epi32_mask(E, E), _mm512_castsi512_ps(pow2));
}

/* One activation row (bf16) → int8 per group of 32, its scale, scale·Σq per group and scale·Σq
 * over the group's first 16 (for the formats with scales per 16). Group g's bytes go to q + qs·g,
 * its floats to index ss·g (qs 32, ss 1: row-major; see pytgi_qgemv_bf16 for the other). */
static void quantize_row(const uint16_t *x, int64_t K, int8_t *q, int64_t qs, float *sx, float *sxs, float *sxh,
                         int64_t ss) {
    for (int64_t g = 0; g < K / 32; g++) {
        __m512 a = bf16x16_load(x + 32 * g), b = bf16x16_load(x + 32 * g + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));  /* round to nearest even */
        __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        _mm_storeu_si128((void *)(q + qs * g), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((void *)(q + qs * g + 16), _mm512_cvtsepi32_epi8(qb));
        sx[ss * g] = d;
        sxh[ss * g] = d * (float)_mm512_reduce_add_epi32(qa);
        sxs[ss * g] = sxh[ss * g] + d * (float)_mm512_reduce_add_epi32(qb);
    }
}

#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead of the block being read */
#endif

/* Add one row's group to its float32 accumulator (16 outputs): s0 and s1 are the int32 sums over the
 * group's inputs 0..15 and 16..31 (with scales per 16 inputs, bits 16, they are scaled apart; else
 * added first), xs the row's scale, xsum its scale·Σq and lo the first half's. The VNNI and the AMX
 * paths both fold with this, in the same order, so a row's output is the same bits whichever made
 * its sums: batch invariance rests on it. */
static inline __attribute__((always_inline)) __m512 fold_group(__m512 acc, __m512i s0, __m512i s1, int bits, __m512 d,
                                                                __m512 m, __m512 d1, __m512 m1, float xs, float xsum,
                                                                float lo) {
    const __m512 x = _mm512_set1_ps(xs);
    if (HALVES(bits)) {
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d, x), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, x), acc);
        acc = _mm512_fmadd_ps(m, _mm512_set1_ps(lo), acc);
        return _mm512_fmadd_ps(m1, _mm512_set1_ps(xsum - lo), acc);
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(d, x), acc);
    return _mm512_fmadd_ps(m, _mm512_set1_ps(xsum), acc);
}


/* MR rows of the output for one tile of 16 columns. MR and bits are literals at each call, so the
 * row loops unroll and the accumulators stay in registers. The activations are group-major (see
 * pytgi_qgemv_bf16): the MR rows' bytes of group g are 32·MR contiguous bytes at xq, and their
 * scales MR contiguous floats at sx (and sxs, sxh); the next group's are 32·M bytes and M floats on. */
static inline __attribute__((always_inline)) void tile(const uint8_t *blk, int bits, int64_t G, const int8_t *xq,
                                                        const float *sx, const float *sxs, const float *sxh,
                                                        int64_t M, int MR, __m512 *acc) {
    const __m512i nib = _mm512_set1_epi8(0x0F), fp4 = _mm512_broadcast_i32x4(_mm_setr_epi8(FP4_LEVELS));
    const int64_t wbytes = WEIGHT_BYTES(bits), bbytes = wbytes + TAIL_BYTES(bits);
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++, blk += bbytes) {
        for (int64_t i = 0; i < bbytes; i += 64) _mm_prefetch((const char *)blk + PREFETCH + i, _MM_HINT_T0);
        __m512i w[8];
        if (NIBBLES(bits) || bits == 6 || bits == 7) {
            for (int v = 0; v < 4; v++) {
                __m512i p = _mm512_loadu_si512((const void *)(blk + 64 * v));
                w[v] = _mm512_and_si512(p, nib);
                w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), nib);
                if (bits == 5) w[v] = _mm512_shuffle_epi8(fp4, w[v]), w[v + 4] = _mm512_shuffle_epi8(fp4, w[v + 4]);
            }
            if (bits == 6) {
                const __m512i h0 = _mm512_loadu_si512((const void *)(blk + 256)), h1 = _mm512_loadu_si512((const void *)(blk + 320));
                for (int j = 0; j < 4; j++)
                    w[j] = _mm512_or_si512(w[j], high2(h0, j)), w[j + 4] = _mm512_or_si512(w[j + 4], high2(h1, j));
            }
            if (bits == 7) {
                const __m512i h = _mm512_loadu_si512((const void *)(blk + 256));
                for (int j = 0; j < 4; j++)
                    w[j] = _mm512_or_si512(w[j], high1(h, j)), w[j + 4] = _mm512_or_si512(w[j + 4], high1(h, j + 4));
            }
        } else {
            for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(blk + 64 * j));
        }
        const __m512 d = bits == 5 ? fp4_steps(blk + wbytes) : _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes)));
        const __m512 m = bits == 5 ? _mm512_mul_ps(d, _mm512_set1_ps(-12.0f))
                         : bits == 6 ? _mm512_mul_ps(d, _mm512_set1_ps(-32.0f))
                         : bits == 7 ? _mm512_mul_ps(d, _mm512_set1_ps(-16.0f))
                                     : _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes + 32)));
        __m512 d1 = d, m1 = m; /* inputs 16..31's own scales (bits 16, 6), loaded once for the rows */
        if (bits == 16) {
            d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes + 64)));
            m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes + 96)));
        } else if (bits == 6) {
            d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes + 32)));
            m1 = _mm512_mul_ps(d1, _mm512_set1_ps(-32.0f));
        }
        for (int r = 0; r < MR; r++) {
            const int32_t *xr = (const int32_t *)(xq + 32 * r);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  /* inputs 0..15, 16..31 */
            for (int j = 0; j < 4; j++) {
                s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(xr[j]));
                s1 = _mm512_dpbusd_epi32(s1, w[j + 4], _mm512_set1_epi32(xr[j + 4]));
            }
            acc[r] = fold_group(acc[r], s0, s1, bits, d, m, d1, m1, sx[r], sxs[r], sxh[r]);
        }
        xq += 32 * M, sx += M, sxs += M, sxh += M;
    }
}

#define ROWS(MR, BITS)                                                                                \
    do {                                                                                              \
        __m512 acc[MR];                                                                               \
        tile(blk, BITS, G, xq + 32 * t, sx + t, sxs + t, sxh + t, M, MR, acc);                        \
        for (int r = 0; r < MR; r++)                                                                  \
            _mm256_storeu_si256((void *)(out + (t + r) * N + 16 * n16), (__m256i)_mm512_cvtneps_pbh(acc[r])); \
        t += MR;                                                                                      \
    } while (0)

/* Output tiles n16 of all M rows, up to 8 rows a pass: a pass's cost is mostly loading and spreading
 * the weights (a 5-row step in passes of 4 and 1 cost twice a 4-row one), and 8 accumulators still
 * fit the registers. */
#define TILE_ROWS(BITS)                                                                               \
    static void tile_rows_##BITS(const uint8_t *blk, int64_t G, const int8_t *xq, const float *sx,       \
                                 const float *sxs, const float *sxh, int64_t M, uint16_t *out, int64_t N, \
                                 int64_t n16) {                                                       \
        int64_t t = 0;                                                                                \
        while (M - t >= 8) ROWS(8, BITS);                                                             \
        switch (M - t) {                                                                              \
        case 7: ROWS(7, BITS); break;                                                                 \
        case 6: ROWS(6, BITS); break;                                                                 \
        case 5: ROWS(5, BITS); break;                                                                 \
        case 4: ROWS(4, BITS); break;                                                                 \
        case 3: ROWS(3, BITS); break;                                                                 \
        case 2: ROWS(2, BITS); break;                                                                 \
        case 1: ROWS(1, BITS); break;                                                                 \
        default: break;                                                                               \
        }                                                                                             \
    }
TILE_ROWS(4)
TILE_ROWS(5)
TILE_ROWS(6)
TILE_ROWS(7)
TILE_ROWS(8)
TILE_ROWS(16)

static void tile_rows(const uint8_t *blk, int64_t bits, int64_t G, const int8_t *xq, const float *sx,
                      const float *sxs, const float *sxh, int64_t M, uint16_t *out, int64_t N, int64_t n16) {
    if (bits == 4) tile_rows_4(blk, G, xq, sx, sxs, sxh, M, out, N, n16);
    else if (bits == 5) tile_rows_5(blk, G, xq, sx, sxs, sxh, M, out, N, n16);
    else if (bits == 6) tile_rows_6(blk, G, xq, sx, sxs, sxh, M, out, N, n16);
    else if (bits == 7) tile_rows_7(blk, G, xq, sx, sxs, sxh, M, out, N, n16);
    else if (bits == 8) tile_rows_8(blk, G, xq, sx, sxs, sxh, M, out, N, n16);
    else tile_rows_16(blk, G, xq, sx, sxs, sxh, M, out, N, n16);
}
#define QGEMV_BUILT 1


#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
/* Steps of more tokens (prefill chunks, decode batches): the same sums with AMX tiles. The
 * activations are quantized per row exactly as above, and each (tile, group) block of the packed
 * weights is already an AMX B tile (8 rows of 16 outputs × 4 inputs) for TDPBSUD (signed
 * activation bytes × unsigned weight bytes, int32 sums): with 4 bits its nibbles are spread to
 * bytes first. The tile's int32 group sums are the integers `tile` above computes, and they are
 * scaled into float32 with the same operations in the same order, so a row's output is bit for
 * bit the VNNI kernel's whatever the number of rows: a request's numerics do not depend on the
 * step it shares (batch invariance). With scales per 16 inputs (bits 16) each half is its own
 * TDPBSUD over 16 inputs. */
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"

#define QGEMM_AMX_BUILT 1
int pytgi_qgemm_amx_supported(void) {
    static int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

/* tiles: 0, 1, 6, 7: C (16 rows × 16 int32); 2: A, 16 activation rows × 32 bytes; 3: B, 8 rows × 64
 * bytes; 4: A over 16 inputs; 5: B over 16 inputs (4 rows) */
static amx_config qgemm_config(int R) { /* R: activation rows per tile (16, or all of a smaller step's) */
    amx_config cfg = {0};
    cfg.palette_id = 1;
    const int rows[8] = {R, R, R, 8, R, 4, R, R}, colsb[8] = {64, 64, 32, 64, 16, 64, 64, 64};
    for (int t = 0; t < 8; t++) cfg.rows[t] = (uint8_t)rows[t], cfg.colsb[t] = (uint16_t)colsb[t];
    return cfg;
}

/* Group g's int32 sums for 16 activation rows into C (and C + 256: inputs 16..31, bits 16), with
 * C tiles 0 and 1 (`odd` 0) or 6 and 7 (`odd` 1), so that a group's sums are made while the one
 * before is scaled. B: room for a 4-bit block spread to bytes. */
#define AMX_SUMS(CA, CB)                                                                              \
    do {                                                                                              \
        _tile_zero(CA);                                                                               \
        if (bits == 16) {                                                                             \
            _tile_zero(CB);                                                                           \
            _tile_loadd(4, xq + 32 * g, K);                                                           \
            _tile_loadd(5, b, 64);                                                                    \
            _tile_dpbsud(CA, 4, 5);                                                                   \
            _tile_loadd(4, xq + 32 * g + 16, K);                                                      \
            _tile_loadd(5, b + 256, 64);                                                              \
            _tile_dpbsud(CB, 4, 5);                                                                   \
            _tile_stored(CB, C + 256, 64);                                                            \
        } else {                                                                                      \
            _tile_loadd(2, xq + 32 * g, K);                                                           \
            _tile_loadd(3, b, 64);                                                                    \
            _tile_dpbsud(CA, 2, 3);                                                                   \
        }                                                                                             \
        _tile_stored(CA, C, 64);                                                                      \
    } while (0)

static inline __attribute__((always_inline)) void amx_sums(const uint8_t *blk, int bits, int64_t g, const int8_t *xq,
                                                            int64_t K, int odd, uint8_t *B, int32_t *C) {
    const uint8_t *b = blk;
    if (bits == 4) {
        const __m512i nib = _mm512_set1_epi8(0x0F);
        for (int v = 0; v < 4; v++) {
            const __m512i p = _mm512_loadu_si512((const void *)(blk + 64 * v));
            _mm512_store_si512((void *)(B + 64 * v), _mm512_and_si512(p, nib));
            _mm512_store_si512((void *)(B + 64 * (v + 4)), _mm512_and_si512(_mm512_srli_epi16(p, 4), nib));
        }
        b = B;
    }
    if (odd) AMX_SUMS(6, 7);
    else AMX_SUMS(0, 1);
}

/* Output rows m0 .. m0+15 (of xq, zero-padded to whole tiles) for one tile of 16 columns; acc as
 * in `tile`, one register per row. */
static inline __attribute__((always_inline)) void amx_rows(const uint8_t *blk, int bits, int64_t G,
                                                            const int8_t *xq, const float *sx, const float *sxs,
                                                            const float *sxh, int64_t K, int R, __m512 *acc) {
    const int64_t wbytes = bits == 4 ? 256 : 512, bbytes = wbytes + (bits == 16 ? 128 : 64);
    uint8_t B[2][512] __attribute__((aligned(64)));
    int32_t C[2][2 * 16 * 16] __attribute__((aligned(64)));
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    amx_sums(blk, bits, 0, xq, K, 0, B[0], C[0]);
    for (int64_t g = 0; g < G; g++, blk += bbytes) {
        if (g + 1 < G) amx_sums(blk + bbytes, bits, g + 1, xq, K, (int)((g + 1) & 1), B[(g + 1) & 1], C[(g + 1) & 1]);
        const int32_t *c = C[g & 1];
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes + 32)));
        __m512 d1 = d, m1 = m;
        if (bits == 16) {
            d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes + 64)));
            m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes + 96)));
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) { /* fold_group, as `tile` calls it */
            const __m512i s0 = _mm512_load_si512((const void *)(c + 16 * r));  /* the whole group's sum, or its first half */
            const __m512i s1 = bits == 16 ? _mm512_load_si512((const void *)(c + 256 + 16 * r)) : _mm512_setzero_si512();
            acc[r] = fold_group(acc[r], s0, s1, bits, d, m, d1, m1, sx[r * G + g], sxs[r * G + g], sxh[r * G + g]);
        }
    }
}

/* x: bf16 [M, K]; w: packed as for pytgi_qgemv_bf16; out: bf16 [M, N], each row equal to
 * pytgi_qgemv_bf16's. Call only when pytgi_qgemm_amx_supported() said yes. Returns nonzero on out
 * of memory. */
int pytgi_qgemm_amx_bf16(const uint16_t *x, const uint8_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K,
                         int64_t bits) {
    /* a step of fewer than 16 rows configures tiles of that many rows: the tiles' products, stores
     * and folds cost what its rows need, not a whole tile's */
    const int R = M < 16 ? (int)M : 16;
    const int64_t G = K / 32, tile_bytes = G * block_bytes(bits), Mp = (M + R - 1) / R * R;
    int8_t *xq = aligned_alloc(64, (size_t)(Mp * K)); /* zero-padded to whole 16-row tiles */
    float *sx = malloc(sizeof(float) * (size_t)(3 * Mp * G));
    if (xq == NULL || sx == NULL) {
        free(xq);
        free(sx);
        return 1;
    }
    float *sxs = sx + Mp * G, *sxh = sxs + Mp * G;
    memset(xq + M * K, 0, (size_t)((Mp - M) * K));
    for (int64_t i = M * G; i < Mp * G; i++) sx[i] = sxs[i] = sxh[i] = 0.0f;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t t = 0; t < M; t++)
        quantize_row(x + t * K, K, xq + t * K, 32, sx + t * G, sxs + t * G, sxh + t * G, 1);
    const amx_config cfg = qgemm_config(R);
    _Pragma("omp parallel")
    {
        amx_config saved;
        _tile_storeconfig(&saved);
        _tile_loadconfig(&cfg);
        /* 4-bit blocks are spread to bytes once per column tile (as 8-bit blocks: the same sums and
         * scales) when several row tiles read them; MXFP4 codes become their levels there, and 6-bit
         * blocks become int8x16's (bits 16) with m = -32·d written out, 5.5-bit ones (bits 7) 8-bit
         * blocks with m = -16·d */
        const int64_t spread = bits == 6 ? 16 : 8; /* the format the spread blocks take */
        uint8_t *wide = NIBBLES(bits) || bits == 6 || bits == 7 ? aligned_alloc(64, (size_t)(G * block_bytes(spread))) : NULL;
        _Pragma("omp for schedule(static)")
        for (int64_t n16 = 0; n16 < N / 16; n16++) {
            const uint8_t *blk = w + n16 * tile_bytes;
            int64_t kind = bits;
            if (wide != NULL) {
                const __m512i nib = _mm512_set1_epi8(0x0F), fp4 = _mm512_broadcast_i32x4(_mm_setr_epi8(FP4_LEVELS));
                for (int64_t g = 0; g < G; g++) {
                    const uint8_t *src = blk + g * block_bytes(bits);
                    uint8_t *dst = wide + g * block_bytes(spread);
                    for (int v = 0; v < 4; v++) {
                        const __m512i p = _mm512_loadu_si512((const void *)(src + 64 * v));
                        __m512i lo = _mm512_and_si512(p, nib), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), nib);
                        if (bits == 5) lo = _mm512_shuffle_epi8(fp4, lo), hi = _mm512_shuffle_epi8(fp4, hi);
                        if (bits == 6) {
                            lo = _mm512_or_si512(lo, high2(_mm512_loadu_si512((const void *)(src + 256)), v));
                            hi = _mm512_or_si512(hi, high2(_mm512_loadu_si512((const void *)(src + 320)), v));
                        }
                        if (bits == 7) {
                            const __m512i h = _mm512_loadu_si512((const void *)(src + 256));
                            lo = _mm512_or_si512(lo, high1(h, v)), hi = _mm512_or_si512(hi, high1(h, v + 4));
                        }
                        _mm512_store_si512((void *)(dst + 64 * v), lo);
                        _mm512_store_si512((void *)(dst + 64 * (v + 4)), hi);
                    }
                    if (bits == 6) { /* per half: d, then m = -32·d (exact in fp16 for d below 2^11) */
                        for (int h = 0; h < 2; h++) {
                            const __m256i d = _mm256_loadu_si256((const void *)(src + 384 + 32 * h));
                            const __m512 m = _mm512_mul_ps(_mm512_cvtph_ps(d), _mm512_set1_ps(-32.0f));
                            _mm256_store_si256((void *)(dst + 512 + 64 * h), d);
                            _mm256_store_si256((void *)(dst + 544 + 64 * h), _mm512_cvtps_ph(m, _MM_FROUND_TO_NEAREST_INT));
                        }
                    } else if (bits == 7) { /* d, then m = -16·d (exact in fp16 for d below 2^12) */
                        const __m256i d = _mm256_loadu_si256((const void *)(src + 320));
                        const __m512 m = _mm512_mul_ps(_mm512_cvtph_ps(d), _mm512_set1_ps(-16.0f));
                        _mm256_store_si256((void *)(dst + 512), d);
                        _mm256_store_si256((void *)(dst + 544), _mm512_cvtps_ph(m, _MM_FROUND_TO_NEAREST_INT));
                    } else if (bits == 5) { /* fp16 d and m from the exponents (exact: see the layout) */
                        const __m512 d = fp4_steps(src + 256);
                        _mm256_store_si256((void *)(dst + 512), _mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT));
                        _mm256_store_si256((void *)(dst + 544), _mm512_cvtps_ph(_mm512_mul_ps(d, _mm512_set1_ps(-12.0f)),
                                                                                _MM_FROUND_TO_NEAREST_INT));
                    } else
                        _mm512_store_si512((void *)(dst + 512), _mm512_loadu_si512((const void *)(src + 256)));
                }
                blk = wide, kind = spread;
            }
            for (int64_t m0 = 0; m0 < Mp; m0 += R) {
                __m512 acc[16];
                const int64_t rows = M - m0 < 16 ? M - m0 : 16;
                const int8_t *xm = xq + m0 * K;
                const float *s0 = sx + m0 * G, *s1 = sxs + m0 * G, *s2 = sxh + m0 * G;
                if (kind == 4) amx_rows(blk, 4, G, xm, s0, s1, s2, K, R, acc); /* the width a literal in each copy */
                else if (kind == 8) amx_rows(blk, 8, G, xm, s0, s1, s2, K, R, acc);
                else amx_rows(blk, 16, G, xm, s0, s1, s2, K, R, acc);
                for (int64_t r = 0; r < rows; r++)
                    _mm256_storeu_si256((void *)(out + (m0 + r) * N + 16 * n16), (__m256i)_mm512_cvtneps_pbh(acc[r]));
            }
        }
        free(wide);
        amx_return(&saved);
    }
    free(xq);
    free(sx);
    return 0;
}
#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 (x86-64-v3: most laptops, desktops and cloud CPUs without AVX-512): the same packed layout
 * and the same sums, with `vpmaddubsw` (unsigned weight byte × signed activation byte, pairs
 * summed to int16) and `vpmaddwd` by ones (int16 pairs to int32) in place of `vpdpbusd`. A
 * 64-byte vector of the layout is two 32-byte halves: rows 0-7, then rows 8-15.
 * 4-bit weights: each int16 pair sum is at most 2·15·127, so the 8 vectors of a group add up in
 * int16 (≤ 30480) before one widening; MXFP4's levels (≤ 24, bits 5) and Q5_0's (≤ 31, bits 7) are
 * widened every two vectors, Q6_K's (≤ 63, bits 6) every vector. 8-bit weights (unsigned 1..255) would saturate the int16
 * pairs, so they are made signed (q − 128, offset m + 128·d) and multiplied as |x| × sign(x)·q,
 * as llama.cpp does, or with several rows as |q| × sign(q)·x, |q| shared by the rows (≤ 2·127·127
 * a pair either way), widened every vector. */
#include <immintrin.h>

int pytgi_qgemv_supported(void) { return 1; }

static inline __m256 bf16x8_load(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* As the AVX-512 version: one bf16 row → int8 per group of 32, its scale, scale·Σq and the first
 * 16's scale·Σq, group g at q + qs·g and index ss·g. */
static void quantize_row(const uint16_t *x, int64_t K, int8_t *q, int64_t qs, float *sx, float *sxs, float *sxh,
                         int64_t ss) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < K / 32; g++) {
        __m256 a[4];
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            a[i] = bf16x8_load(x + 32 * g + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, a[i]));
        }
        const float amax = hmax8(mx), d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i qi[4];
        for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], _mm256_set1_ps(inv)));
        /* packs work per 128-bit lane: dwords come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] | q0[4:8] ... */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((void *)(q + qs * g), p);
        sx[ss * g] = d;
        sxh[ss * g] = d * (float)hsum8i(_mm256_add_epi32(qi[0], qi[1]));
        sxs[ss * g] = sxh[ss * g] + d * (float)hsum8i(_mm256_add_epi32(qi[2], qi[3]));
    }
}

#ifndef PREFETCH
#define PREFETCH 1024
#endif

/* acc += s·d·sx + m'·xsum for one half of a group, where m' is the offset of the weights as
 * multiplied (8-bit weights are made signed: + 128·d). */
static inline __attribute__((always_inline)) __m256 fold(__m256 acc, __m256i s, const uint8_t *dp, int bits,
                                                          float sx, float xsum) {
    __m256 d, m;
    if (bits == 5) { /* 8 rows' MXFP4 exponents (0: a zero block): d = 2^(E - 128), m = -12·d */
        const __m256i E = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)dp));
        const __m256i pow2 = _mm256_slli_epi32(_mm256_sub_epi32(E, _mm256_set1_epi32(1)), 23);
        d = _mm256_and_ps(_mm256_castsi256_ps(pow2), _mm256_castsi256_ps(_mm256_cmpgt_epi32(E, _mm256_setzero_si256())));
        m = _mm256_mul_ps(d, _mm256_set1_ps(-12.0f));
    } else if (bits == 6 || bits == 7) { /* 8 rows' d (m = -32·d, or -16·d) */
        d = _mm256_cvtph_ps(_mm_loadu_si128((const void *)dp));
        m = _mm256_mul_ps(d, _mm256_set1_ps(bits == 6 ? -32.0f : -16.0f));
    } else {
        d = _mm256_cvtph_ps(_mm_loadu_si128((const void *)dp));
        m = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(dp + 32)));
    }
    if (bits == 8 || bits == 16) m = _mm256_fmadd_ps(_mm256_set1_ps(128.0f), d, m); /* the sign trick's */
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(sx)), acc);
    return _mm256_fmadd_ps(m, _mm256_set1_ps(xsum), acc);
}

/* Bits 6: weight vector j's high 2 bits (at bit 2·(j % 4) of h's bytes) as bits 4 and 5 */
static inline __m256i high2(__m256i h, int j) {
    const int k = j % 4;
    const __m256i at = k == 0 ? _mm256_slli_epi16(h, 4) : k == 1 ? _mm256_slli_epi16(h, 2) : k == 2 ? h : _mm256_srli_epi16(h, 2);
    return _mm256_and_si256(at, _mm256_set1_epi8(0x30));
}

/* Bits 7: weight vector j's high bit (bit j of h's bytes) as bit 4 */
static inline __m256i high1(__m256i h, int j) {
    const __m256i at = j < 4 ? _mm256_slli_epi16(h, 4 - j) : j == 4 ? h : _mm256_srli_epi16(h, j - 4);
    return _mm256_and_si256(at, _mm256_set1_epi8(0x10));
}

/* MR rows of the output for one tile of 16 columns (activations group-major, as the AVX-512 tile
 * reads them); acc[2r + h] holds row r's half h.
 * Each weight vector is used for all MR rows as it is loaded (AVX2's 16 registers hold no whole
 * block), so the sums stay in registers. With scales per 16 inputs (bits 16) the sums are folded
 * in after vector 3 and again after vector 7. */
static inline __attribute__((always_inline)) void tile(const uint8_t *blk, int bits, int64_t G, const int8_t *xq,
                                                        const float *sx, const float *sxs, const float *sxh,
                                                        int64_t M, int MR, __m256 *acc) {
    const __m256i nib = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const __m256i fp4 = _mm256_broadcastsi128_si256(_mm_setr_epi8(FP4_LEVELS));
    const int64_t wbytes = WEIGHT_BYTES(bits), bbytes = wbytes + TAIL_BYTES(bits);
    for (int r = 0; r < 2 * MR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++, blk += bbytes) {
        for (int64_t i = 0; i < bbytes; i += 64) _mm_prefetch((const char *)blk + PREFETCH + i, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i s[4];
            for (int r = 0; r < MR; r++) s[r] = _mm256_setzero_si256();
            if (bits == 4) {
                for (int v = 0; v < 4; v++) {  /* low nibbles: inputs 4v..4v+3, high: 4v+16.. */
                    const __m256i p = _mm256_loadu_si256((const void *)(blk + 64 * v + 32 * h));
                    const __m256i lo = _mm256_and_si256(p, nib), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), nib);
                    for (int r = 0; r < MR; r++) {
                        const int32_t *xr = (const int32_t *)(xq + 32 * r);
                        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xr[v])));
                        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xr[v + 4])));
                    }
                }
                for (int r = 0; r < MR; r++) s[r] = _mm256_madd_epi16(s[r], ones);
            } else if (bits == 6) { /* inputs 0..15 (low nibbles) and 16..31 apart: each half its own d */
                __m256i s1[4];
                const __m256i h0 = _mm256_loadu_si256((const void *)(blk + 256 + 32 * h));
                const __m256i h1 = _mm256_loadu_si256((const void *)(blk + 320 + 32 * h));
                for (int r = 0; r < MR; r++) s1[r] = _mm256_setzero_si256();
                for (int v = 0; v < 4; v++) {
                    const __m256i p = _mm256_loadu_si256((const void *)(blk + 64 * v + 32 * h));
                    const __m256i lo = _mm256_or_si256(_mm256_and_si256(p, nib), high2(h0, v));
                    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), nib), high2(h1, v));
                    for (int r = 0; r < MR; r++) {
                        const int32_t *xr = (const int32_t *)(xq + 32 * r);
                        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xr[v])), ones));
                        s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(xr[v + 4])), ones));
                    }
                }
                for (int r = 0; r < MR; r++) {
                    acc[2 * r + h] = fold(acc[2 * r + h], s[r], blk + 384 + 16 * h, bits, sx[r], sxh[r]);
                    acc[2 * r + h] = fold(acc[2 * r + h], s1[r], blk + 416 + 16 * h, bits, sx[r], sxs[r] - sxh[r]);
                }
                continue;
            } else if (bits == 7) { /* levels to 31: each pair of vectors' int16 sums widened */
                const __m256i hb = _mm256_loadu_si256((const void *)(blk + 256 + 32 * h));
                for (int v = 0; v < 4; v++) {
                    const __m256i p = _mm256_loadu_si256((const void *)(blk + 64 * v + 32 * h));
                    const __m256i lo = _mm256_or_si256(_mm256_and_si256(p, nib), high1(hb, v));
                    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), nib), high1(hb, v + 4));
                    for (int r = 0; r < MR; r++) {
                        const int32_t *xr = (const int32_t *)(xq + 32 * r);
                        const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xr[v])),
                                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xr[v + 4])));
                        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(t, ones));
                    }
                }
            } else if (bits == 5) {
                for (int v = 0; v < 4; v++) {
                    const __m256i p = _mm256_loadu_si256((const void *)(blk + 64 * v + 32 * h));
                    const __m256i lo = _mm256_shuffle_epi8(fp4, _mm256_and_si256(p, nib));
                    const __m256i hi = _mm256_shuffle_epi8(fp4, _mm256_and_si256(_mm256_srli_epi16(p, 4), nib));
                    for (int r = 0; r < MR; r++) {
                        const int32_t *xr = (const int32_t *)(xq + 32 * r);
                        const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xr[v])),
                                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xr[v + 4])));
                        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(t, ones));
                    }
                }
            } else {
                for (int j = 0; j < 8; j++) {  /* |q| shared by the rows, each row's x takes q's sign */
                    const __m256i wj = _mm256_xor_si256(_mm256_loadu_si256((const void *)(blk + 64 * j + 32 * h)), flip);
                    const __m256i wa = _mm256_sign_epi8(wj, wj);
                    for (int r = 0; r < MR; r++) {
                        const __m256i xb = _mm256_set1_epi32(((const int32_t *)(xq + 32 * r))[j]);
                        const __m256i p = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xb, wj));
                        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, ones));
                    }
                    if (bits == 16 && j == 3) {  /* inputs 0..15 have their own scales */
                        for (int r = 0; r < MR; r++) {
                            acc[2 * r + h] = fold(acc[2 * r + h], s[r], blk + wbytes + 16 * h, bits, sx[r], sxh[r]);
                            s[r] = _mm256_setzero_si256();
                        }
                    }
                }
            }
            const uint8_t *dp = blk + wbytes + (bits == 16 ? 64 : 0) + (bits == 5 ? 8 : 16) * h;
            for (int r = 0; r < MR; r++)
                acc[2 * r + h] = fold(acc[2 * r + h], s[r], dp, bits, sx[r], bits == 16 ? sxs[r] - sxh[r] : sxs[r]);
        }
        xq += 32 * M, sx += M, sxs += M, sxh += M;
    }
}

/* One activation row (decode steps of one token: most of them), written out so that every value
 * stays in a register: per group, each half's 8 weight vectors meet the row's 8 broadcast dwords. */
static inline __attribute__((always_inline)) void tile1(const uint8_t *blk, int bits, int64_t G, const int8_t *xq,
                                                         const float *sx, const float *sxs, const float *sxh,
                                                         int64_t M, __m256 *acc) {
    const __m256i nib = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const __m256i fp4 = _mm256_broadcastsi128_si256(_mm_setr_epi8(FP4_LEVELS));
    const int64_t wbytes = WEIGHT_BYTES(bits), bbytes = wbytes + TAIL_BYTES(bits);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++, blk += bbytes) {
        for (int64_t i = 0; i < bbytes; i += 64) _mm_prefetch((const char *)blk + PREFETCH + i, _MM_HINT_T0);
        const int32_t *xr = (const int32_t *)(xq + 32 * M * g);
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        if (bits == 4) {
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                const __m256i xl = _mm256_set1_epi32(xr[v]), xh = _mm256_set1_epi32(xr[v + 4]);
                const __m256i p0 = _mm256_loadu_si256((const void *)(blk + 64 * v));
                const __m256i p1 = _mm256_loadu_si256((const void *)(blk + 64 * v + 32));
                s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(p0, nib), xl));
                s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p0, 4), nib), xh));
                s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(p1, nib), xl));
                s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p1, 4), nib), xh));
            }
            s0 = _mm256_madd_epi16(s0, ones);
            s1 = _mm256_madd_epi16(s1, ones);
        } else if (bits == 6) { /* as `tile`: each half of the inputs its own sums and d */
            const __m256i h00 = _mm256_loadu_si256((const void *)(blk + 256)), h01 = _mm256_loadu_si256((const void *)(blk + 288));
            const __m256i h10 = _mm256_loadu_si256((const void *)(blk + 320)), h11 = _mm256_loadu_si256((const void *)(blk + 352));
            __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                const __m256i xl = _mm256_set1_epi32(xr[v]), xh = _mm256_set1_epi32(xr[v + 4]);
                const __m256i p0 = _mm256_loadu_si256((const void *)(blk + 64 * v));
                const __m256i p1 = _mm256_loadu_si256((const void *)(blk + 64 * v + 32));
                const __m256i l0 = _mm256_or_si256(_mm256_and_si256(p0, nib), high2(h00, v));
                const __m256i u0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p0, 4), nib), high2(h10, v));
                const __m256i l1 = _mm256_or_si256(_mm256_and_si256(p1, nib), high2(h01, v));
                const __m256i u1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p1, 4), nib), high2(h11, v));
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(l0, xl), ones));
                t0 = _mm256_add_epi32(t0, _mm256_madd_epi16(_mm256_maddubs_epi16(u0, xh), ones));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(l1, xl), ones));
                t1 = _mm256_add_epi32(t1, _mm256_madd_epi16(_mm256_maddubs_epi16(u1, xh), ones));
            }
            const float lo = sxh[M * g], rest = sxs[M * g] - sxh[M * g];
            a0 = fold(fold(a0, s0, blk + 384, bits, sx[M * g], lo), t0, blk + 416, bits, sx[M * g], rest);
            a1 = fold(fold(a1, s1, blk + 400, bits, sx[M * g], lo), t1, blk + 432, bits, sx[M * g], rest);
            continue;
        } else if (bits == 7) { /* as bits 5, each level's high bit or-ed in */
            const __m256i hb0 = _mm256_loadu_si256((const void *)(blk + 256)), hb1 = _mm256_loadu_si256((const void *)(blk + 288));
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                const __m256i xl = _mm256_set1_epi32(xr[v]), xh = _mm256_set1_epi32(xr[v + 4]);
                const __m256i p0 = _mm256_loadu_si256((const void *)(blk + 64 * v));
                const __m256i p1 = _mm256_loadu_si256((const void *)(blk + 64 * v + 32));
                const __m256i l0 = _mm256_or_si256(_mm256_and_si256(p0, nib), high1(hb0, v));
                const __m256i u0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p0, 4), nib), high1(hb0, v + 4));
                const __m256i l1 = _mm256_or_si256(_mm256_and_si256(p1, nib), high1(hb1, v));
                const __m256i u1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p1, 4), nib), high1(hb1, v + 4));
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l0, xl), _mm256_maddubs_epi16(u0, xh)), ones));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l1, xl), _mm256_maddubs_epi16(u1, xh)), ones));
            }
        } else if (bits == 5) {
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                const __m256i xl = _mm256_set1_epi32(xr[v]), xh = _mm256_set1_epi32(xr[v + 4]);
                const __m256i p0 = _mm256_loadu_si256((const void *)(blk + 64 * v));
                const __m256i p1 = _mm256_loadu_si256((const void *)(blk + 64 * v + 32));
                const __m256i l0 = _mm256_shuffle_epi8(fp4, _mm256_and_si256(p0, nib));
                const __m256i h0 = _mm256_shuffle_epi8(fp4, _mm256_and_si256(_mm256_srli_epi16(p0, 4), nib));
                const __m256i l1 = _mm256_shuffle_epi8(fp4, _mm256_and_si256(p1, nib));
                const __m256i h1 = _mm256_shuffle_epi8(fp4, _mm256_and_si256(_mm256_srli_epi16(p1, 4), nib));
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l0, xl), _mm256_maddubs_epi16(h0, xh)), ones));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l1, xl), _mm256_maddubs_epi16(h1, xh)), ones));
            }
        } else {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256i xb = _mm256_set1_epi32(xr[j]), xa = _mm256_sign_epi8(xb, xb);
                const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const void *)(blk + 64 * j)), flip);
                const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const void *)(blk + 64 * j + 32)), flip);
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w0, xb)), ones));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w1, xb)), ones));
                if (bits == 16 && j == 3) {  /* inputs 0..15 have their own scales */
                    a0 = fold(a0, s0, blk + wbytes, bits, sx[M * g], sxh[M * g]);
                    a1 = fold(a1, s1, blk + wbytes + 16, bits, sx[M * g], sxh[M * g]);
                    s0 = s1 = _mm256_setzero_si256();
                }
            }
        }
        const uint8_t *dp = blk + wbytes + (bits == 16 ? 64 : 0);
        const float xsum = bits == 16 ? sxs[M * g] - sxh[M * g] : sxs[M * g];
        a0 = fold(a0, s0, dp, bits, sx[M * g], xsum);
        a1 = fold(a1, s1, dp + (bits == 5 ? 8 : 16), bits, sx[M * g], xsum);
    }
    acc[0] = a0;
    acc[1] = a1;
}

/* 16 float32 (two halves) → 16 bf16, rounded to nearest even. */
static inline void store_bf16x16(uint16_t *out, __m256 lo, __m256 hi) {
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    __m256i a = _mm256_castps_si256(lo), b = _mm256_castps_si256(hi);
    a = _mm256_srli_epi32(_mm256_add_epi32(a, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(a, 16), one))), 16);
    b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
    _mm256_storeu_si256((void *)out, _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
}

#define ROWS_BITS(MR, BITS)                                                             \
    do {                                                                                \
        __m256 acc[2 * MR];                                                             \
        tile(blk, BITS, G, xq + 32 * t, sx + t, sxs + t, sxh + t, M, MR, acc);                       \
        for (int r = 0; r < MR; r++) store_bf16x16(out + (t + r) * N + 16 * n16, acc[2 * r], acc[2 * r + 1]); \
        t += MR;                                                                        \
    } while (0)

#define ROW1_BITS(BITS)                                                                 \
    do {                                                                                \
        __m256 acc[2];                                                                  \
        tile1(blk, BITS, G, xq + 32 * t, sx + t, sxs + t, sxh + t, M, acc);                          \
        store_bf16x16(out + t * N + 16 * n16, acc[0], acc[1]);                          \
        t += 1;                                                                         \
    } while (0)

static void tile_rows(const uint8_t *blk, int64_t bits, int64_t G, const int8_t *xq, const float *sx,
                      const float *sxs, const float *sxh, int64_t M, uint16_t *out, int64_t N, int64_t n16) {
    int64_t t = 0;
    if (bits == 4) {  /* the bit width a literal in each copy */
        while (M - t >= 4) ROWS_BITS(4, 4);
        while (M - t >= 1) ROW1_BITS(4);
    } else if (bits == 5) {
        while (M - t >= 4) ROWS_BITS(4, 5);
        while (M - t >= 1) ROW1_BITS(5);
    } else if (bits == 6) {
        while (M - t >= 4) ROWS_BITS(4, 6);
        while (M - t >= 1) ROW1_BITS(6);
    } else if (bits == 7) {
        while (M - t >= 4) ROWS_BITS(4, 7);
        while (M - t >= 1) ROW1_BITS(7);
    } else if (bits == 8) {
        while (M - t >= 4) ROWS_BITS(4, 8);
        while (M - t >= 1) ROW1_BITS(8);
    } else {
        while (M - t >= 4) ROWS_BITS(4, 16);
        while (M - t >= 1) ROW1_BITS(16);
    }
}
#define QGEMV_BUILT 1


#else
int pytgi_qgemv_supported(void) { return 0; }
int pytgi_qgemv_bf16(const uint16_t *x, const uint8_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K,
                     int64_t bits) {
    (void)x, (void)w, (void)out, (void)M, (void)N, (void)K, (void)bits;
    abort(); /* never called: pytgi_qgemv_supported() said no */
}
#endif

#if !QGEMM_AMX_BUILT
int pytgi_qgemm_amx_supported(void) { return 0; }
int pytgi_qgemm_amx_bf16(const uint16_t *x, const uint8_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K,
                         int64_t bits) {
    (void)x, (void)w, (void)out, (void)M, (void)N, (void)K, (void)bits;
    abort(); /* never called: pytgi_qgemm_amx_supported() said no */
}
#endif

#if QGEMV_BUILT
/* x: bf16 [M, K]; w: packed as above for N rows (N % 16 == 0, K % 32 == 0); out: bf16 [M, N].
 * The activations are quantized group-major: group g of row t at xq + 32 (g M + t) and its scalars
 * at index g M + t, so that a pass over some rows reads each group's bytes and scales in one place.
 * Returns nonzero on out of memory. */
int pytgi_qgemv_bf16(const uint16_t *x, const uint8_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K,
                     int64_t bits) {
    const int64_t G = K / 32, tile_bytes = G * block_bytes(bits);
    int8_t *xq = malloc((size_t)(M * K));
    float *sx = malloc(sizeof(float) * (size_t)(3 * M * G));
    if (xq == NULL || sx == NULL) {
        free(xq);
        free(sx);
        return 1;
    }
    float *sxs = sx + M * G, *sxh = sxs + M * G;
    _Pragma("omp parallel for schedule(static) if (M >= 8)")
    for (int64_t t = 0; t < M; t++) quantize_row(x + t * K, K, xq + 32 * t, 32 * M, sx + t, sxs + t, sxh + t, M);
    _Pragma("omp parallel for schedule(static)")
    for (int64_t n16 = 0; n16 < N / 16; n16++)
        tile_rows(w + n16 * tile_bytes, bits, G, xq, sx, sxs, sxh, M, out, N, n16);
    free(xq);
    free(sx);
    return 0;
}
#endif
