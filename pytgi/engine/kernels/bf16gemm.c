/* bf16 weight × bf16 activation matmul for Hugging Face bf16 models on CPU: exact to the
 * checkpoint's weights, at memory speed for decode steps, and batch invariant.
 *
 * PyTorch's bf16 linear (oneDNN) is slow for a few rows (a decode step) and picks its kernel by the
 * step's shape, so a row's result changes with the step's size. Here every output element is one
 * float32 sum over the input pairs p = 0 .. K/2-1 in that order, x[2p]·w[2p] and x[2p+1]·w[2p+1]
 * added per pair (`vdpbf16ps`'s operation: odd product first, then even, each sum rounded, denormals
 * flushed), whatever the number of rows M: the same bits for a row alone or in a batch.
 *
 * Packed layout (pytgi/engine/models/quant.py, pack_bf16): per tile of 16 output rows, K/2 vectors of 64
 * bytes, vector p holding w[row r, 2p] and w[row r, 2p+1] as dword r: `vdpbf16ps`'s operand. A
 * tile is one sequential read of 32·K bytes.
 *
 * AVX-512 BF16: `vdpbf16ps` on 16 rows at once. AVX2: each dword widened to two float32 lanes
 * (shifts) and the same two products added in the same order with FMAs under flush-to-zero, so the
 * AVX2 path gives the AVX-512 path's bits. Neither: pytgi_bf16gemm_supported() is 0 and the model
 * keeps PyTorch's linear. Built and loaded by pytgi/engine/kernels/__init__.py. */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "pytgi_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16GEMM_BUILT 1
#define TB 4 /* tiles (of 16 output rows) per pass: independent sums per activation row */
#define RB 4 /* activation rows per pass: TB·RB accumulators, in 16 of the 32 registers */

int pytgi_bf16gemm_supported(void) { return 1; }

/* Rows t0 .. t0+nr-1 (nr <= RB) of x against tiles n0 .. n0+nt-1 (nt <= TB) of w. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, const uint16_t *w, uint16_t *out,
                                                        int64_t K, int64_t xs, int64_t os, int64_t t0, int nr, int64_t n0, int nt) {
    __m512 acc[RB][TB];
    for (int r = 0; r < RB; r++)
        for (int j = 0; j < TB; j++) acc[r][j] = _mm512_setzero_ps();
    const uint16_t *wt = w + n0 * 16 * K;
    for (int64_t p = 0; p < K / 2; p++) {
        __m512bh wv[TB];
        for (int j = 0; j < nt; j++) wv[j] = (__m512bh)_mm512_loadu_si512(wt + (j * K / 2 + p) * 32);
        for (int r = 0; r < nr; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + (t0 + r) * xs + 2 * p));
            for (int j = 0; j < nt; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < nt; j++)
            _mm256_storeu_si256((void *)(out + (t0 + r) * os + (n0 + j) * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BF16GEMM_BUILT 1
#define TB 2 /* a tile is two vectors here: TB·RB·2 accumulators in 8 of the 16 registers */
#define RB 2

int pytgi_bf16gemm_supported(void) { return 1; }

/* Round float32 to bf16 (nearest even), 8 lanes → 8 uint16 (as vcvtneps2bf16; no NaN here). */
static inline __m128i round8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                                                        _mm256_set1_epi32(1))));
    u = _mm256_srli_epi32(u, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

static inline __attribute__((always_inline)) void block(const uint16_t *x, const uint16_t *w, uint16_t *out,
                                                        int64_t K, int64_t xs, int64_t os, int64_t t0, int nr, int64_t n0, int nt) {
    __m256 acc[RB][TB][2]; /* rows 0-7 and 8-15 of a tile */
    for (int r = 0; r < RB; r++)
        for (int j = 0; j < TB; j++) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
    const uint16_t *wt = w + n0 * 16 * K;
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t p = 0; p < K / 2; p++) {
        __m256 xe[RB], xo[RB];
        for (int r = 0; r < nr; r++) {
            const uint32_t pair = *(const uint32_t *)(x + (t0 + r) * xs + 2 * p);
            xe[r] = _mm256_castsi256_ps(_mm256_set1_epi32((int32_t)(pair << 16)));
            xo[r] = _mm256_castsi256_ps(_mm256_set1_epi32((int32_t)(pair & 0xFFFF0000u)));
        }
        for (int j = 0; j < nt; j++)
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const void *)(wt + (j * K / 2 + p) * 32 + h * 16));
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
                for (int r = 0; r < nr; r++) /* odd first, then even: vdpbf16ps's order */
                    acc[r][j][h] = _mm256_fmadd_ps(we, xe[r], _mm256_fmadd_ps(wo, xo[r], acc[r][j][h]));
            }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < nt; j++)
            for (int h = 0; h < 2; h++)
                _mm_storeu_si128((void *)(out + (t0 + r) * os + (n0 + j) * 16 + h * 8), round8(acc[r][j][h]));
}
#endif

#if BF16GEMM_BUILT
/* x: bf16 [M, K]; w: packed as above for N rows (N % 16 == 0, K % 2 == 0); out: bf16 [M, N].
 * Threads split the tiles; each walks its tiles TB at a time, all rows RB at a time (the tiles' weights
 * stay in cache across row blocks). */
int pytgi_bf16gemm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K) {
    const int64_t tiles = N / 16, passes = (tiles + TB - 1) / TB;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t i = 0; i < passes; i++) {
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* FTZ | DAZ: vdpbf16ps's denormal rule, on both paths */
        const int64_t n0 = i * TB;
        const int nt = tiles - n0 < TB ? (int)(tiles - n0) : TB;
        for (int64_t t0 = 0; t0 < M; t0 += RB) {
            const int nr = M - t0 < RB ? (int)(M - t0) : RB;
            if (nt == TB && nr == RB) block(x, w, out, K, K, N, t0, RB, n0, TB); /* the common case, unrolled */
            else block(x, w, out, K, K, N, t0, nr, n0, nt);
        }
        _mm_setcsr(csr);
    }
    return 0;
}

/* G independent matmuls in one call (multi-head latent attention's per-head projections): for each g,
 * out_g [M, N] = x_g [M, K] · w_g [N, K]ᵀ, w_g packed as above at w + g·N·K; x_g's row m at
 * x + g·xg + m·xm and out_g's at out + g·og + m·om (strides in elements, even: a view of [T, H, D]
 * rows). Each output element is the sum pytgi_bf16gemm_bf16 makes, whatever M and G. */
int pytgi_bf16gemm_batched_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t G, int64_t M,
                                int64_t N, int64_t K, int64_t xg, int64_t xm, int64_t og, int64_t om) {
    const int64_t tiles = N / 16, passes = (tiles + TB - 1) / TB;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t i = 0; i < G * passes; i++) {
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
        const int64_t g = i / passes, n0 = i % passes * TB;
        const int nt = tiles - n0 < TB ? (int)(tiles - n0) : TB;
        const uint16_t *xg0 = x + g * xg, *wg = w + g * N * K;
        uint16_t *og0 = out + g * og;
        for (int64_t t0 = 0; t0 < M; t0 += RB) {
            const int nr = M - t0 < RB ? (int)(M - t0) : RB;
            if (nt == TB && nr == RB) block(xg0, wg, og0, K, xm, om, t0, RB, n0, TB);
            else block(xg0, wg, og0, K, xm, om, t0, nr, n0, nt);
        }
        _mm_setcsr(csr);
    }
    return 0;
}
#else
int pytgi_bf16gemm_supported(void) { return 0; }
int pytgi_bf16gemm_batched_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t G, int64_t M,
                                int64_t N, int64_t K, int64_t xg, int64_t xm, int64_t og, int64_t om) {
    (void)x, (void)w, (void)out, (void)G, (void)M, (void)N, (void)K, (void)xg, (void)xm, (void)og, (void)om;
    return 2;
}
int pytgi_bf16gemm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K) {
    (void)x, (void)w, (void)out, (void)M, (void)N, (void)K;
    return 2;
}
#endif
