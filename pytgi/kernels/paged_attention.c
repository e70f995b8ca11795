/* Paged decode attention for CPU: one query token per request, keys and values read in place
 * from the block-paged cache (no gather into a padded copy).
 *
 * Layouts (row-major, element type T = float or bf16 stored as uint16):
 *   q, out        [T_flat, H, D]        the step's flat query tokens; row rows[b] is request b's
 *   k_cache, v    [num_slots, KVH, D]   slot = block_tables[b][pos / block_size] * block_size + pos % block_size
 *   block_tables  [B, max_blocks] int64
 *   ctx_lens      [B] int64             keys 0 .. ctx_lens[b]-1 are attended (the new token included)
 * Query head h uses key/value head h / (H / KVH) (grouped-query attention).
 *
 * Two implementations, all math in float32: with AVX-512 (and D a multiple of 16) a split-K
 * kernel with an online softmax (see decode512); otherwise a portable one that splits work over
 * (request, kv head) pairs, each computing scores for its group of query heads in one pass over
 * the keys, a softmax, then one pass over the values. Built and loaded by
 * pytgi/kernels/__init__.py. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline void row_f32(const float *restrict src, float *restrict dst, int64_t n) {
    memcpy(dst, src, sizeof(float) * (size_t)n);
}
static inline void row_bf16(const uint16_t *restrict src, float *restrict dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_load(src[i]);
}
static inline void store_f32(float *restrict dst, const float *restrict src, int64_t n) {
    memcpy(dst, src, sizeof(float) * (size_t)n);
}
static inline void store_bf16(uint16_t *restrict dst, const float *restrict src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_round(src[i]);
}
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
static inline void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* Softmax weights of far-off keys are tiny, and multiplying by a denormal float costs a microcode
 * assist of ~100 cycles: in a shared library -ffast-math does not set flush-to-zero, so each task
 * sets it (and restores the caller's mode) itself. */
#if defined(__SSE__)
#include <xmmintrin.h>
static inline unsigned int flush_denormals(void) {
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ | DAZ */
    return csr;
}
static inline void restore_csr(unsigned int csr) { _mm_setcsr(csr); }
#else
static inline unsigned int flush_denormals(void) { return 0; }
static inline void restore_csr(unsigned int csr) { (void)csr; }
#endif

/* Keys and values are visited block by block (no division per position); each key or value row
 * is widened to float32 once and used by every query head that reads it. A task is one request
 * and `ng` of its key/value heads: all of them when there are enough requests to keep the threads
 * busy (each cache row is then read whole and in order), else one. */
#define DEFINE_DECODE(NAME, T, ROW, STORE)                                                           \
    static int NAME(const T *q, const T *k_cache, const T *v_cache, T *out, const int64_t *rows,            \
             const int64_t *block_tables, const int64_t *ctx_lens, int64_t B, int64_t max_blocks,    \
             int64_t block_size, int64_t H, int64_t KVH, int64_t D, float scale) {                  \
        const int64_t G = H / KVH;                                                                   \
        const int64_t ng = B >= 2 * omp_get_max_threads() ? KVH : 1, per_b = KVH / ng;               \
        int failed = 0;                                                                              \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                             \
        for (int64_t task = 0; task < B * per_b; task++) {                                           \
            const int64_t b = task / per_b, g0 = (task % per_b) * ng, L = ctx_lens[b];               \
            const int64_t nh = ng * G, *table = block_tables + b * max_blocks;                       \
            float *buf = malloc(sizeof(float) * (size_t)(nh * D * 2 + ng * D + nh * L));             \
            if (buf == NULL) {                                                                       \
                failed = 1;                                                                          \
                continue;                                                                            \
            }                                                                                        \
            float *qf = buf, *acc = buf + nh * D, *row = acc + nh * D, *s = row + ng * D;            \
            const unsigned int csr = flush_denormals();                                              \
            ROW(q + (rows[b] * H + g0 * G) * D, qf, nh * D);                                         \
            for (int64_t i = 0; i < nh * D; i++) {                                                   \
                qf[i] *= scale;                                                                      \
                acc[i] = 0.0f;                                                                       \
            }                                                                                        \
            for (int64_t j0 = 0; j0 < L; j0 += block_size) {                                         \
                const int64_t n = L - j0 < block_size ? L - j0 : block_size;                         \
                const T *k = k_cache + (table[j0 / block_size] * block_size * KVH + g0) * D;         \
                for (int64_t j = 0; j < n; j++) {                                                    \
                    ROW(k + j * KVH * D, row, ng * D);                                               \
                    for (int64_t h = 0; h < nh; h++)                                                 \
                        s[h * L + j0 + j] = dot(qf + h * D, row + (h / G) * D, D);                   \
                }                                                                                    \
            }                                                                                        \
            for (int64_t h = 0; h < nh; h++) {                                                       \
                float *sh = s + h * L, m = -INFINITY, sum = 0.0f;                                    \
                for (int64_t j = 0; j < L; j++) m = sh[j] > m ? sh[j] : m;                           \
                for (int64_t j = 0; j < L; j++) {                                                    \
                    sh[j] = expf(sh[j] - m);                                                         \
                    sum += sh[j];                                                                    \
                }                                                                                    \
                const float inv = 1.0f / sum;                                                        \
                for (int64_t j = 0; j < L; j++) sh[j] *= inv;                                        \
            }                                                                                        \
            for (int64_t j0 = 0; j0 < L; j0 += block_size) {                                         \
                const int64_t n = L - j0 < block_size ? L - j0 : block_size;                         \
                const T *v = v_cache + (table[j0 / block_size] * block_size * KVH + g0) * D;         \
                for (int64_t j = 0; j < n; j++) {                                                    \
                    ROW(v + j * KVH * D, row, ng * D);                                               \
                    for (int64_t h = 0; h < nh; h++)                                                 \
                        axpy(acc + h * D, s[h * L + j0 + j], row + (h / G) * D, D);                  \
                }                                                                                    \
            }                                                                                        \
            STORE(out + (rows[b] * H + g0 * G) * D, acc, nh * D);                                    \
            restore_csr(csr);                                                                        \
            free(buf);                                                                               \
        }                                                                                            \
        return failed;                                                                               \
    }

DEFINE_DECODE(decode_generic_f32, float, row_f32, store_f32)
DEFINE_DECODE(decode_generic_bf16, uint16_t, row_bf16, store_bf16)

#if defined(__AVX512F__)
#include <immintrin.h>

/* The AVX-512 kernel: split-K ("flash decoding"). Each (request, kv head) pair's keys are cut
 * into chunks of CHUNK; a task is one chunk, run with an online softmax (no score buffer), and
 * a second pass combines a pair's chunks. The chunking depends only on the request's own length,
 * so a request's result does not depend on what else is in the batch, and one long request keeps
 * every thread busy. Needs D % 16 == 0, D <= MAXD and at most MAXG query heads per kv head;
 * D = 64 and 128 get code compiled for their size. */
#define CHUNK 128
#define MAXD 256
#define MAXG 16

static inline __m512 ld16(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps(p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
}
static inline void st16(void *p, __m512 x, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps(p, x);
        return;
    }
    __m512i u = _mm512_castps_si512(x); /* round to nearest even, as bf16_round */
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    _mm256_storeu_si256(p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

/* e^x for x <= 0 (Cephes' polynomial, ~1 ulp); below -87 it gives 0. */
static inline __m512 exp16(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(~tiny, p, n);
}

/* r[j] = Σ v[j] (the 16 horizontal sums at once, ~3 shuffles or adds per sum instead of ~8). */
static inline __m512 reduce16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) { /* per 128-bit lane: that lane's sums of v[4k .. 4k+3] */
        const __m512d c = _mm512_castps_pd(t[2 * k]), d = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

/* Keys j_begin .. j_end-1 of one (request, kv head) pair for its G query heads `q` (G*D
 * contiguous elements): acc[G*D] = Σ_j e^(s_j - m) v_j, m[G] the max score, l[G] = Σ_j e^(s_j - m).
 * Inlined with literal `bf16` and `D`, the row loops unroll into registers. */
static inline __attribute__((always_inline)) void chunk(int bf16, int64_t D, const char *q, const char *kc,
                                                         const char *vc, const int64_t *table, int64_t bs,
                                                         int64_t KVH, int64_t kvh, int64_t j_begin, int64_t j_end,
                                                         int64_t G, float scale, float *acc, float *m, float *l) {
    const int64_t es = bf16 ? 2 : 4, DV = D / 16, row = KVH * D * es;
    float qf[MAXG * MAXD], sc[MAXG * 16], vf[16 * MAXD];
    __m512 dots[MAXG * 16];
    for (int64_t h = 0; h < G; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        for (int64_t i = 0; i < DV; i++) {
            _mm512_storeu_ps(qf + h * D + 16 * i, _mm512_mul_ps(ld16(q + (h * D + 16 * i) * es, bf16), _mm512_set1_ps(scale)));
            _mm512_storeu_ps(acc + h * D + 16 * i, _mm512_setzero_ps());
        }
    }
    for (int64_t j0 = j_begin; j0 < j_end; j0 += 16) {
        const int64_t n = j_end - j0 < 16 ? j_end - j0 : 16;
        if (n < 16)
            for (int64_t h = 0; h < G; h++)
                for (int64_t j = n; j < 16; j++) dots[h * 16 + j] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const int64_t pos = j0 + j, off = (table[pos / bs] * bs + pos % bs) * row + kvh * D * es;
            __m512 k[MAXD / 16];
            for (int64_t i = 0; i < DV; i++) {
                k[i] = ld16(kc + off + 16 * i * es, bf16);
                _mm512_storeu_ps(vf + j * D + 16 * i, ld16(vc + off + 16 * i * es, bf16));
            }
            for (int64_t h = 0; h < G; h++) {
                __m512 d = _mm512_mul_ps(k[0], _mm512_loadu_ps(qf + h * D));
                for (int64_t i = 1; i < DV; i++) d = _mm512_fmadd_ps(k[i], _mm512_loadu_ps(qf + h * D + 16 * i), d);
                dots[h * 16 + j] = d;
            }
        }
        for (int64_t h = 0; h < G; h++) _mm512_storeu_ps(sc + h * 16, reduce16(dots + h * 16));
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        for (int64_t h = 0; h < G; h++) {
            const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, sc + h * 16);
            const float mx = _mm512_reduce_max_ps(s), m_new = mx > m[h] ? mx : m[h];
            const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
            const float alpha = m_new > m[h] ? (m[h] == -INFINITY ? 0.0f : expf(m[h] - m_new)) : 1.0f;
            m[h] = m_new;
            l[h] = l[h] * alpha + _mm512_reduce_add_ps(p);
            _mm512_storeu_ps(sc + h * 16, p);
            __m512 a[MAXD / 16];
            for (int64_t i = 0; i < DV; i++) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + 16 * i), _mm512_set1_ps(alpha));
            for (int64_t j = 0; j < n; j++) {
                const __m512 pj = _mm512_set1_ps(sc[h * 16 + j]);
                for (int64_t i = 0; i < DV; i++) a[i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vf + j * D + 16 * i), a[i]);
            }
            for (int64_t i = 0; i < DV; i++) _mm512_storeu_ps(acc + h * D + 16 * i, a[i]);
        }
    }
}

static int decode512(int bf16, const char *q, const char *k_cache, const char *v_cache, char *out, const int64_t *rows,
                     const int64_t *block_tables, const int64_t *ctx_lens, int64_t B, int64_t max_blocks,
                     int64_t bs, int64_t H, int64_t KVH, int64_t D, float scale) {
    const int64_t G = H / KVH, part = G * D + 2 * G, es = bf16 ? 2 : 4;
    int64_t S = 1;
    for (int64_t b = 0; b < B; b++) S = (ctx_lens[b] + CHUNK - 1) / CHUNK > S ? (ctx_lens[b] + CHUNK - 1) / CHUNK : S;
    float *parts = malloc(sizeof(float) * (size_t)(B * KVH * S * part));
    if (parts == NULL) return 1;
    _Pragma("omp parallel")
    {
        const unsigned int csr = flush_denormals();
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t task = 0; task < B * KVH * S; task++) {
            const int64_t b = task / (KVH * S), kvh = task / S % KVH, c = task % S;
            const int64_t j_end = ctx_lens[b] < (c + 1) * CHUNK ? ctx_lens[b] : (c + 1) * CHUNK;
            if (c * CHUNK >= j_end) continue;
            const char *qp = q + (rows[b] * H + kvh * G) * D * es;
            const int64_t *table = block_tables + b * max_blocks;
            float *acc = parts + task * part, *m = acc + G * D, *l = m + G;
#define CHUNK_ARGS qp, k_cache, v_cache, table, bs, KVH, kvh, c * CHUNK, j_end, G, scale, acc, m, l
            if (D == 64 && bf16) chunk(1, 64, CHUNK_ARGS);
            else if (D == 64) chunk(0, 64, CHUNK_ARGS);
            else if (D == 128 && bf16) chunk(1, 128, CHUNK_ARGS);
            else if (D == 128) chunk(0, 128, CHUNK_ARGS);
            else chunk(bf16, D, CHUNK_ARGS);
#undef CHUNK_ARGS
        }
        _Pragma("omp for schedule(static)")
        for (int64_t pair = 0; pair < B * KVH; pair++) {
            const int64_t b = pair / KVH, kvh = pair % KVH, nc = (ctx_lens[b] + CHUNK - 1) / CHUNK;
            const float *first = parts + pair * S * part;
            for (int64_t h = 0; h < G; h++) {
                float M = -INFINITY, sum = 0.0f;
                for (int64_t c = 0; c < nc; c++) M = first[c * part + G * D + h] > M ? first[c * part + G * D + h] : M;
                for (int64_t i = 0; i < D / 16; i++) {
                    __m512 o = _mm512_setzero_ps();
                    for (int64_t c = 0; c < nc; c++) {
                        const float *pc = first + c * part, e = expf(pc[G * D + h] - M);
                        if (i == 0) sum += e * pc[G * D + G + h];
                        o = _mm512_fmadd_ps(_mm512_set1_ps(e), _mm512_loadu_ps(pc + h * D + 16 * i), o);
                    }
                    st16(out + ((rows[b] * H + kvh * G + h) * D + 16 * i) * es, _mm512_mul_ps(o, _mm512_set1_ps(1.0f / sum)), bf16);
                }
            }
        }
        restore_csr(csr);
    }
    free(parts);
    return 0;
}

#define FAST_OK (D % 16 == 0 && D <= MAXD && H / KVH <= MAXG)
#else
#define FAST_OK 0
#define decode512(...) 0
#endif

int pytgi_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                               const int64_t *rows, const int64_t *block_tables, const int64_t *ctx_lens, int64_t B,
                               int64_t max_blocks, int64_t block_size, int64_t H, int64_t KVH, int64_t D, float scale) {
    if (FAST_OK)
        return decode512(0, (const char *)q, (const char *)k_cache, (const char *)v_cache, (char *)out, rows,
                         block_tables, ctx_lens, B, max_blocks, block_size, H, KVH, D, scale);
    return decode_generic_f32(q, k_cache, v_cache, out, rows, block_tables, ctx_lens, B, max_blocks, block_size, H,
                              KVH, D, scale);
}

int pytgi_decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out,
                                const int64_t *rows, const int64_t *block_tables, const int64_t *ctx_lens, int64_t B,
                                int64_t max_blocks, int64_t block_size, int64_t H, int64_t KVH, int64_t D, float scale) {
    if (FAST_OK)
        return decode512(1, (const char *)q, (const char *)k_cache, (const char *)v_cache, (char *)out, rows,
                         block_tables, ctx_lens, B, max_blocks, block_size, H, KVH, D, scale);
    return decode_generic_bf16(q, k_cache, v_cache, out, rows, block_tables, ctx_lens, B, max_blocks, block_size, H,
                               KVH, D, scale);
}
