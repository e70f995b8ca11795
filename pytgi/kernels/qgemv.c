/* Low-bit weight × int8 activation matmul for decode steps of a few tokens (AVX-512 VNNI).
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
 * Packed layout (built by pytgi/models/quant.py): for each tile of 16 output rows, for each group
 * of 32 inputs, one block of
 *   8 vectors of 64 bytes, vector j holding byte 4r+b = qw[row r, k = 4j + b]; with 4 bits,
 *     vector j (j < 4) is stored as the low nibbles and vector j+4 as the high nibbles of one
 *     64-byte vector (256 bytes), with 8 bits they are stored as they are (512 bytes);
 *   16 fp16 d, then 16 fp16 m (64 bytes).
 * Blocks are contiguous in (tile, group) order, so a tile is one sequential read.
 *
 * Without AVX-512 VNNI `pytgi_qgemv_supported()` returns 0 and callers use PyTorch's kernels.
 * Built and loaded by pytgi/kernels/__init__.py. */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#include <immintrin.h>

int pytgi_qgemv_supported(void) { return 1; }

/* One activation row (bf16) → int8 per group of 32, its scale and scale·Σq per group. */
static void quantize_row(const uint16_t *x, int64_t K, int8_t *q, float *sx, float *sxs) {
    for (int64_t g = 0; g < K / 32; g++) {
        __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(x + 32 * g))), 16));
        __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(x + 32 * g + 16))), 16));
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));  /* round to nearest even */
        __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        _mm_storeu_si128((void *)(q + 32 * g), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((void *)(q + 32 * g + 16), _mm512_cvtsepi32_epi8(qb));
        sx[g] = d;
        sxs[g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead of the block being read */
#endif

/* Rows t0 .. t0+MR-1 of the output for one tile of 16 columns. MR is a literal at each call, so
 * the row loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const uint8_t *blk, int bits, int64_t G, const int8_t *xq,
                                                        const float *sx, const float *sxs, int64_t K, int MR,
                                                        __m512 *acc) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const int64_t wbytes = bits == 4 ? 256 : 512;
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++, blk += wbytes + 64) {
        for (int64_t i = 0; i < wbytes + 64; i += 64) _mm_prefetch((const char *)blk + PREFETCH + i, _MM_HINT_T0);
        __m512i w[8];
        if (bits == 4) {
            for (int v = 0; v < 4; v++) {
                __m512i p = _mm512_loadu_si512((const void *)(blk + 64 * v));
                w[v] = _mm512_and_si512(p, nib);
                w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), nib);
            }
        } else {
            for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(blk + 64 * j));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(blk + wbytes + 32)));
        for (int r = 0; r < MR; r++) {
            const int32_t *xr = (const int32_t *)(xq + r * K + 32 * g);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(xr[j]));
                s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(xr[j + 1]));
            }
            const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(sx[r * G + g])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sxs[r * G + g]), acc[r]);
        }
    }
}

#define ROWS(MR)                                                                                      \
    do {                                                                                              \
        __m512 acc[MR];                                                                               \
        tile(blk, (int)bits, G, xq + t * K, sx + t * G, sxs + t * G, K, MR, acc);                     \
        for (int r = 0; r < MR; r++)                                                                  \
            _mm256_storeu_si256((void *)(out + (t + r) * N + 16 * n16), (__m256i)_mm512_cvtneps_pbh(acc[r])); \
        t += MR;                                                                                      \
    } while (0)

/* x: bf16 [M, K]; w: packed as above for N rows (N % 16 == 0, K % 32 == 0); out: bf16 [M, N]. */
void pytgi_qgemv_bf16(const uint16_t *x, const uint8_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K,
                      int64_t bits) {
    const int64_t G = K / 32, tile_bytes = G * ((bits == 4 ? 256 : 512) + 64);
    int8_t *xq = malloc((size_t)(M * K));
    float *sx = malloc(sizeof(float) * (size_t)(2 * M * G)), *sxs = sx + M * G;
    for (int64_t t = 0; t < M; t++) quantize_row(x + t * K, K, xq + t * K, sx + t * G, sxs + t * G);
    _Pragma("omp parallel for schedule(static)")
    for (int64_t n16 = 0; n16 < N / 16; n16++) {
        const uint8_t *blk = w + n16 * tile_bytes;
        int64_t t = 0;
        while (M - t >= 4) ROWS(4);
        if (M - t == 3) ROWS(3);
        else if (M - t == 2) ROWS(2);
        else if (M - t == 1) ROWS(1);
    }
    free(xq);
    free(sx);
}

#else
int pytgi_qgemv_supported(void) { return 0; }
void pytgi_qgemv_bf16(const uint16_t *x, const uint8_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K,
                      int64_t bits) {
    (void)x, (void)w, (void)out, (void)M, (void)N, (void)K, (void)bits;
    abort(); /* never called: pytgi_qgemv_supported() said no */
}
#endif
