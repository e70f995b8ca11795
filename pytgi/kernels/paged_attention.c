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
 * Work is split over (request, kv head) pairs with OpenMP; each pair computes scores for its
 * group of query heads in one pass over the keys, a softmax, then one pass over the values, all
 * in float32. Built and loaded by pytgi/kernels/__init__.py. */
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

/* Keys and values are visited block by block (no division per position); each key or value row
 * is widened to float32 once and used by every query head that reads it. A task is one request
 * and `ng` of its key/value heads: all of them when there are enough requests to keep the threads
 * busy (each cache row is then read whole and in order), else one. */
#define DEFINE_DECODE(NAME, T, ROW, STORE)                                                           \
    int NAME(const T *q, const T *k_cache, const T *v_cache, T *out, const int64_t *rows,            \
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
            free(buf);                                                                               \
        }                                                                                            \
        return failed;                                                                               \
    }

DEFINE_DECODE(pytgi_decode_attention_f32, float, row_f32, store_f32)
DEFINE_DECODE(pytgi_decode_attention_bf16, uint16_t, row_bf16, store_bf16)
