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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline void store_f32(float *p, int64_t i, float x) { p[i] = x; }
static inline float load_bf16(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline void store_bf16(uint16_t *p, int64_t i, float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    p[i] = (uint16_t)(u >> 16);
}

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                          \
    int NAME(const T *q, const T *k_cache, const T *v_cache, T *out, const int64_t *rows,            \
             const int64_t *block_tables, const int64_t *ctx_lens, int64_t B, int64_t max_blocks,    \
             int64_t block_size, int64_t H, int64_t KVH, int64_t D, float scale) {                  \
        const int64_t G = H / KVH;                                                                   \
        int failed = 0;                                                                              \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                             \
        for (int64_t task = 0; task < B * KVH; task++) {                                             \
            const int64_t b = task / KVH, g = task % KVH, L = ctx_lens[b];                           \
            const int64_t *table = block_tables + b * max_blocks;                                    \
            float *buf = malloc(sizeof(float) * (size_t)(G * D * 2 + G * L));                        \
            if (buf == NULL) {                                                                       \
                failed = 1;                                                                          \
                continue;                                                                            \
            }                                                                                        \
            float *qf = buf, *acc = buf + G * D, *s = buf + 2 * G * D;                               \
            for (int64_t i = 0; i < G * D; i++) {                                                    \
                qf[i] = LOAD(q, (rows[b] * H + g * G) * D + i) * scale;                              \
                acc[i] = 0.0f;                                                                       \
            }                                                                                        \
            for (int64_t j = 0; j < L; j++) {                                                        \
                const int64_t slot = table[j / block_size] * block_size + j % block_size;            \
                const T *k = k_cache + (slot * KVH + g) * D;                                         \
                for (int64_t i = 0; i < G; i++) {                                                    \
                    float dot = 0.0f;                                                                \
                    for (int64_t d = 0; d < D; d++) dot += qf[i * D + d] * LOAD(k, d);               \
                    s[i * L + j] = dot;                                                              \
                }                                                                                    \
            }                                                                                        \
            for (int64_t i = 0; i < G; i++) {                                                        \
                float *si = s + i * L, m = -INFINITY, sum = 0.0f;                                    \
                for (int64_t j = 0; j < L; j++) m = si[j] > m ? si[j] : m;                           \
                for (int64_t j = 0; j < L; j++) {                                                    \
                    si[j] = expf(si[j] - m);                                                         \
                    sum += si[j];                                                                    \
                }                                                                                    \
                for (int64_t j = 0; j < L; j++) si[j] /= sum;                                        \
            }                                                                                        \
            for (int64_t j = 0; j < L; j++) {                                                        \
                const int64_t slot = table[j / block_size] * block_size + j % block_size;            \
                const T *v = v_cache + (slot * KVH + g) * D;                                         \
                for (int64_t i = 0; i < G; i++) {                                                    \
                    const float p = s[i * L + j];                                                    \
                    for (int64_t d = 0; d < D; d++) acc[i * D + d] += p * LOAD(v, d);                \
                }                                                                                    \
            }                                                                                        \
            for (int64_t i = 0; i < G * D; i++) STORE(out, (rows[b] * H + g * G) * D + i, acc[i]);   \
            free(buf);                                                                               \
        }                                                                                            \
        return failed;                                                                               \
    }

DEFINE_DECODE(pytgi_decode_attention_f32, float, load_f32, store_f32)
DEFINE_DECODE(pytgi_decode_attention_bf16, uint16_t, load_bf16, store_bf16)
