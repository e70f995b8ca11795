/* The encoders' kernels (BERT's family), on the calling thread: the pooling engine calls them from its
 * worker threads, one per core, each computing its own prompts (no OpenMP here).
 *
 * Attention: one prompt's bidirectional attention: every query row sees every
 * key of its prompt. Read in place from the fused QKV projection's output, written in place into the
 * attention's output (no permuted copies):
 *
 *   qkv  [L, 3, H, D]   token i's query, key and value of head h at i·3HD + h·D, + HD, + 2HD
 *   out  [L, H, D]
 *
 * A row's result depends only on its prompt (its query, the prompt's keys and values), so per-prompt
 * calls keep batch invariance. Sums in float32.
 *
 * AVX-512 (D a multiple of 16): keys in the lanes, 16 keys' scores per vector, a tile of ROWS query
 * rows sharing every key and value load. float32 with FMAs; bf16 (AVX-512 BF16) with vdpbf16ps over
 * pairs of the head's dimensions for q·k and over pairs of keys for P·V, P rounded to bf16 (as the
 * paged kernel does). Elsewhere nothing: pytgi_encoder_attention_supported() says 0 and the encoder
 * takes PyTorch's SDPA (a portable loop here measured 4-6x slower than it).
 *
 * The layer's element-wise steps in bf16, each one pass over its rows, in float32 and rounded once (where
 * PyTorch rounds after each step): the up projection's bias and GELU (erf), and the bias, residual and
 * LayerNorm after the attention's output projection and after the down projection. Every row alone:
 * batch invariant. Built and loaded by pytgi/engine/kernels/__init__.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp16.h"
#include "pytgi_kernels.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#define CSR_SAVE() const unsigned int csr_ = _mm_getcsr(); _mm_setcsr(csr_ | 0x8040) /* FTZ | DAZ */
#define CSR_RESTORE() _mm_setcsr(csr_)
#else
#define CSR_SAVE() (void)0
#define CSR_RESTORE() (void)0
#endif

#define ROWS 8 /* query rows per tile */

#if defined(__AVX512F__)
#include <immintrin.h>

/* Each row's scores s[r][0 .. Lp) (keys from L on: -inf) → e^(s - max) in place; returns 1/sum per row. */
static inline void softmax_rows(float *s, int64_t Lp, int64_t L, int nr, float *inv) {
    for (int r = 0; r < nr; r++) {
        float *row = s + r * Lp;
        for (int64_t j = L; j < Lp; j++) row[j] = -INFINITY;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < Lp; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + j));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < Lp; j += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), m));
            _mm512_storeu_ps(row + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
}

/* float32: kt [Lp/16][D][16] (keys in the lanes) */
static int attention_f32(const float *qkv, float *out, int64_t L, int64_t H, int64_t D, float scale) {
    const int64_t Lp = (L + 15) / 16 * 16, stride = 3 * H * D;
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(Lp * D + ROWS * Lp));
    if (kt == NULL) return 1;
    float *s = kt + Lp * D;
    CSR_SAVE();
    for (int64_t h = 0; h < H; h++) {
        for (int64_t j = 0; j < Lp; j++)
            for (int64_t d = 0; d < D; d++)
                kt[(j / 16 * D + d) * 16 + j % 16] = j < L ? qkv[j * stride + H * D + h * D + d] : 0.0f;
        for (int64_t r0 = 0; r0 < L; r0 += ROWS) {
            const int nr = L - r0 < ROWS ? (int)(L - r0) : ROWS;
            const float *q[ROWS]; /* rows past the prompt's end repeat its last row: computed, not kept */
            for (int r = 0; r < ROWS; r++) q[r] = qkv + (r < nr ? r0 + r : L - 1) * stride + h * D;
            for (int64_t b = 0; b < Lp / 16; b++) {
                __m512 acc[ROWS];
                for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d++) {
                    const __m512 kv = _mm512_load_ps(kt + (b * D + d) * 16);
                    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d]), kv, acc[r]);
                }
                for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(s + r * Lp + b * 16, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
            }
            float inv[ROWS];
            softmax_rows(s, Lp, L, ROWS, inv);
            const float *v = qkv + 2 * H * D + h * D;
            for (int64_t c = 0; c < D; c += 16) {
                __m512 acc[ROWS];
                for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
                for (int64_t j = 0; j < L; j++) {
                    const __m512 vv = _mm512_loadu_ps(v + j * stride + c);
                    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(s[r * Lp + j]), vv, acc[r]);
                }
                for (int r = 0; r < nr; r++)
                    _mm512_storeu_ps(out + (r0 + r) * H * D + h * D + c, _mm512_mul_ps(acc[r], _mm512_set1_ps(inv[r])));
            }
        }
    }
    CSR_RESTORE();
    free(kt);
    return 0;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16: kt [Lp/16][D/2][16] dwords (keys in the lanes, a pair of the head's dimensions per dword),
 * vp [Lp/2][D] dwords (a pair of keys' values per dword), p [ROWS][Lp/2] dwords (a row's pair of
 * weights, rounded to bf16). */
static inline uint32_t pair(uint16_t lo, uint16_t hi) { return (uint32_t)lo | (uint32_t)hi << 16; }

static int attention_bf16(const uint16_t *qkv, uint16_t *out, int64_t L, int64_t H, int64_t D, float scale) {
    const int64_t Lp = (L + 15) / 16 * 16, stride = 3 * H * D;
    uint32_t *kt = aligned_alloc(64, sizeof(uint32_t) * (size_t)(Lp * D + ROWS * Lp / 2) + sizeof(float) * (size_t)(ROWS * Lp));
    if (kt == NULL) return 1;
    uint32_t *vp = kt + Lp * D / 2, *p = vp + Lp * D / 2;
    float *s = (float *)(p + ROWS * Lp / 2);
    CSR_SAVE();
    for (int64_t h = 0; h < H; h++) {
        const uint16_t *k = qkv + H * D + h * D, *v = qkv + 2 * H * D + h * D;
        for (int64_t j = 0; j < Lp; j++)
            for (int64_t d = 0; d < D; d += 2)
                kt[(j / 16 * D / 2 + d / 2) * 16 + j % 16] = j < L ? pair(k[j * stride + d], k[j * stride + d + 1]) : 0;
        for (int64_t j = 0; j < Lp; j += 2)
            for (int64_t d = 0; d < D; d++)
                vp[j / 2 * D + d] = pair(j < L ? v[j * stride + d] : 0, j + 1 < L ? v[(j + 1) * stride + d] : 0);
        for (int64_t r0 = 0; r0 < L; r0 += ROWS) {
            const int nr = L - r0 < ROWS ? (int)(L - r0) : ROWS;
            const uint16_t *q[ROWS]; /* rows past the prompt's end repeat its last row: computed, not kept */
            for (int r = 0; r < ROWS; r++) q[r] = qkv + (r < nr ? r0 + r : L - 1) * stride + h * D;
            for (int64_t b = 0; b < Lp / 16; b++) {
                __m512 acc[ROWS];
                for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 2) {
                    const __m512bh kv = (__m512bh)_mm512_load_si512(kt + (b * D / 2 + d / 2) * 16);
                    for (int r = 0; r < ROWS; r++) {
                        int32_t qd;
                        memcpy(&qd, q[r] + d, 4);
                        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(qd), kv);
                    }
                }
                for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(s + r * Lp + b * 16, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
            }
            float inv[ROWS];
            softmax_rows(s, Lp, L, ROWS, inv);
            for (int r = 0; r < ROWS; r++)
                for (int64_t j = 0; j < Lp; j += 16)
                    _mm256_storeu_si256((void *)(p + r * Lp / 2 + j / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + r * Lp + j)));
            for (int64_t c = 0; c < D; c += 16) {
                __m512 acc[ROWS];
                for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
                for (int64_t m = 0; m < Lp / 2; m++) {
                    const __m512bh vv = (__m512bh)_mm512_loadu_si512(vp + m * D + c);
                    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)p[r * Lp / 2 + m]), vv);
                }
                for (int r = 0; r < nr; r++)
                    _mm256_storeu_si256((void *)(out + (r0 + r) * H * D + h * D + c),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r], _mm512_set1_ps(inv[r]))));
            }
        }
    }
    CSR_RESTORE();
    free(kt);
    return 0;
}
#endif

/* 1 where this build has the fast path for the dtype (bf16 nonzero: bf16, else float32) and head size. */
int pytgi_encoder_attention_supported(int64_t bf16, int64_t D) {
    (void)bf16;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (bf16) return D % 16 == 0;
#endif
#if defined(__AVX512F__)
    if (!bf16) return D % 16 == 0;
#endif
    return (void)D, 0;
}

int pytgi_encoder_attention_f32(const float *qkv, float *out, int64_t L, int64_t H, int64_t D, float scale) {
#if defined(__AVX512F__)
    if (D % 16 == 0) return attention_f32(qkv, out, L, H, D, scale);
#endif
    return (void)qkv, (void)out, (void)L, (void)H, (void)D, (void)scale, 2;
}

int pytgi_encoder_attention_bf16(const uint16_t *qkv, uint16_t *out, int64_t L, int64_t H, int64_t D, float scale) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (D % 16 == 0) return attention_bf16(qkv, out, L, H, D, scale);
#endif
    return (void)qkv, (void)out, (void)L, (void)H, (void)D, (void)scale, 2;
}

/* -- bias + GELU, bias + residual + LayerNorm (bf16) ------------------------------------------------------- */
#if defined(__AVX512F__)
static inline void store16_bf16(uint16_t *p, __m512 x) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((void *)p, (__m256i)_mm512_cvtneps_pbh(x));
#else /* round to nearest even, as bf16_round */
    __m512i u = _mm512_castps_si512(x);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    _mm256_storeu_si256((void *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#endif
}

/* erf GELU, x/2 · (1 + erf(x/√2)), erf by Abramowitz and Stegun 7.1.26 (|error| < 1.5e-7) */
static inline __m512 gelu16(__m512 x) {
    const __m512 z = _mm512_abs_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f)));
    const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(z, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.0f)));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    p = _mm512_mul_ps(p, t);
    const __m512 e = _mm512_fnmadd_ps(p, exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), z)), _mm512_set1_ps(1.0f));
    /* erf(x/√2) with x's sign: 1 + erf for x >= 0, 1 - erf below */
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 one_plus = _mm512_mask_sub_ps(_mm512_add_ps(_mm512_set1_ps(1.0f), e), neg, _mm512_set1_ps(1.0f), e);
    return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), one_plus);
}
#endif

void pytgi_bias_gelu_bf16(uint16_t *x, const uint16_t *bias, int64_t T, int64_t N) {
    for (int64_t t = 0; t < T; t++) {
        uint16_t *row = x + t * N;
        int64_t n = 0;
#if defined(__AVX512F__)
        for (; n + 16 <= N; n += 16) store16_bf16(row + n, gelu16(_mm512_add_ps(bf16x16_load(row + n), bf16x16_load(bias + n))));
#endif
        for (; n < N; n++) {
            const float v = bf16_load(row[n]) + bf16_load(bias[n]);
            row[n] = bf16_round(0.5f * v * (1.0f + erff(v * 0.70710678118654752f)));
        }
    }
}

int pytgi_bias_residual_norm_bf16(const uint16_t *x, const uint16_t *bias, const uint16_t *residual, const uint16_t *w, const uint16_t *b,
                                  uint16_t *out, int64_t T, int64_t N, float eps) {
    float *h = malloc(sizeof(float) * (size_t)N);
    if (h == NULL) return 1;
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * N, *rr = residual + t * N;
        uint16_t *o = out + t * N;
        float sum = 0.0f, sq = 0.0f;
        int64_t n = 0;
#if defined(__AVX512F__)
        __m512 vs = _mm512_setzero_ps();
        for (; n + 16 <= N; n += 16) {
            const __m512 v = _mm512_add_ps(_mm512_add_ps(bf16x16_load(xr + n), bf16x16_load(bias + n)), bf16x16_load(rr + n));
            _mm512_storeu_ps(h + n, v);
            vs = _mm512_add_ps(vs, v);
        }
        sum = _mm512_reduce_add_ps(vs);
#endif
        for (; n < N; n++) sum += (h[n] = bf16_load(xr[n]) + bf16_load(bias[n]) + bf16_load(rr[n]));
        const float mean = sum / (float)N;
        n = 0;
#if defined(__AVX512F__)
        __m512 vq = _mm512_setzero_ps();
        for (; n + 16 <= N; n += 16) {
            const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(h + n), _mm512_set1_ps(mean));
            vq = _mm512_fmadd_ps(d, d, vq);
        }
        sq = _mm512_reduce_add_ps(vq);
#endif
        for (; n < N; n++) sq += (h[n] - mean) * (h[n] - mean);
        const float inv = 1.0f / sqrtf(sq / (float)N + eps);
        n = 0;
#if defined(__AVX512F__)
        for (; n + 16 <= N; n += 16) {
            const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(h + n), _mm512_set1_ps(mean)), _mm512_set1_ps(inv));
            store16_bf16(o + n, _mm512_fmadd_ps(d, bf16x16_load(w + n), bf16x16_load(b + n)));
        }
#endif
        for (; n < N; n++) o[n] = bf16_round((h[n] - mean) * inv * bf16_load(w[n]) + bf16_load(b[n]));
    }
    free(h);
    return 0;
}
