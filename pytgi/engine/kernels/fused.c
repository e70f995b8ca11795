/* Fused element-wise steps of a decoder layer for CPU, float32 and bf16 (stored as uint16).
 *
 * In eager PyTorch each of these is 4–9 small ops; for a decode step of a few tokens their
 * dispatch costs more than their arithmetic. Math is done in float32; bf16 results are rounded
 * to nearest even where PyTorch would round an intermediate, so the bf16 path stays close to the
 * unfused one. Built and loaded by pytgi/engine/kernels/__init__.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp16.h"
#include "kv8.h"
#include "pytgi_kernels.h"

/* residual[t] += x[t]; out[t] = w * rms_norm(residual[t]).  x may be NULL (no add). */
void pytgi_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t T, int64_t D,
                            float eps) {
    _Pragma("omp parallel for if (T >= 8)")
    for (int64_t t = 0; t < T; t++) {
        float *r = residual + t * D, ss = 0.0f;
        if (x != NULL)
            for (int64_t i = 0; i < D; i++) r[i] += x[t * D + i];
        for (int64_t i = 0; i < D; i++) ss += r[i] * r[i];
        const float rstd = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) out[t * D + i] = w[i] * (r[i] * rstd);
    }
}

void pytgi_add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *w, uint16_t *out, int64_t T,
                             int64_t D, float eps) {
    _Pragma("omp parallel for if (T >= 8)")
    for (int64_t t = 0; t < T; t++) {
        uint16_t *r = residual + t * D;
        float ss = 0.0f;
        if (x != NULL)
            for (int64_t i = 0; i < D; i++) r[i] = bf16_round(bf16_load(r[i]) + bf16_load(x[t * D + i]));
        for (int64_t i = 0; i < D; i++) ss += bf16_load(r[i]) * bf16_load(r[i]);
        const float rstd = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++)
            out[t * D + i] = bf16_round(bf16_load(w[i]) * bf16_rt(bf16_load(r[i]) * rstd));
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]. e^-x is taken at 80 at most: -ffast-math assumes
 * no infinities, and its vector expf gave NaN for gates below -88 (silu is -0 there in float32 anyway,
 * to within 1e-33). */
static inline float silu(float x) { return x / (1.0f + expf(x > -80.0f ? -x : 80.0f)); }

void pytgi_silu_mul_f32(const float *gu, float *out, int64_t T, int64_t I) {
    _Pragma("omp parallel for if (T >= 8)")
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i++) out[t * I + i] = silu(g[i]) * u[i];
    }
}

void pytgi_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t T, int64_t I) {
    _Pragma("omp parallel for if (T >= 8)")
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gu + t * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i++) {
            const float x = bf16_load(g[i]);
            out[t * I + i] = bf16_round(bf16_rt(silu(x)) * bf16_load(u[i]));
        }
    }
}

/* Rotary embedding (rotate-half, sign folded into `sin`) on the q and k parts of each row of the
 * fused qkv output, then: q → q_out [T, H, D]; k, v → their cache slots [slot, KVH, D], or with
 * kv8 the int8 cache's rows of the values as the model's dtype holds them (kv8.h).
 * cos/sin: [T, D] for each token's position. */
#define DEFINE_ROPE(NAME, T_, LOAD, STORE, RT)                                                       \
    void NAME(const T_ *qkv, const float *cos, const float *sin, const int64_t *slots, T_ *q_out,    \
              void *k_cache, void *v_cache, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t kv8) { \
        const int64_t half = D / 2, width = (H + 2 * KVH) * D;                                       \
        _Pragma("omp parallel for if (T >= 8)")                                                      \
        for (int64_t t = 0; t < T; t++) {                                                            \
            const T_ *row = qkv + t * width;                                                         \
            const float *c = cos + t * D, *s = sin + t * D;                                          \
            T_ kbuf[KV8_MAXD];                                                                       \
            for (int64_t h = 0; h < H + KVH; h++) {                                                  \
                const T_ *x = row + h * D;                                                           \
                T_ *dst = h < H ? q_out + (t * H + h) * D                                            \
                          : kv8 ? kbuf : (T_ *)k_cache + (slots[t] * KVH + h - H) * D;               \
                for (int64_t i = 0; i < D; i++) {                                                    \
                    const float sw = LOAD(x[i < half ? i + half : i - half]);                        \
                    dst[i] = STORE(RT(LOAD(x[i]) * RT(c[i])) + RT(sw * RT(s[i])));                   \
                }                                                                                    \
                if (kv8 && h >= H)                                                                   \
                    kv8_put_##T_(kbuf, D, (uint8_t *)k_cache + (slots[t] * KVH + h - H) * KV8_ROW(D)); \
            }                                                                                        \
            if (kv8)                                                                                 \
                for (int64_t h = 0; h < KVH; h++)                                                    \
                    kv8_put_##T_(row + (H + KVH + h) * D, D, (uint8_t *)v_cache + (slots[t] * KVH + h) * KV8_ROW(D)); \
            else                                                                                     \
                memcpy((T_ *)v_cache + slots[t] * KVH * D, row + (H + KVH) * D, sizeof(T_) * (size_t)(KVH * D)); \
        }                                                                                            \
    }

/* a row of D values of the model's dtype into the int8 cache's row (kv8.h) */
#define KV8_MAXD 512
static inline void kv8_put_float(const float *x, int64_t D, uint8_t *dst) { kv8_store(x, D, dst); }
static inline void kv8_put_uint16_t(const uint16_t *x, int64_t D, uint8_t *dst) {
    float f[KV8_MAXD];
    for (int64_t i = 0; i < D; i++) f[i] = bf16_load(x[i]);
    kv8_store(f, D, dst);
}

/* k, v [T, KVH, D] (the model's dtype) → the int8 cache's rows at their slots (kv8.h) */
#define DEFINE_WRITE_KV8(NAME, T_)                                                                   \
    void NAME(const T_ *k, const T_ *v, const int64_t *slots, void *k_cache, void *v_cache, int64_t T, \
              int64_t KVH, int64_t D) {                                                              \
        _Pragma("omp parallel for if (T >= 8)")                                                      \
        for (int64_t t = 0; t < T; t++)                                                              \
            for (int64_t h = 0; h < KVH; h++) {                                                      \
                const int64_t at = (slots[t] * KVH + h) * KV8_ROW(D);                                \
                kv8_put_##T_(k + (t * KVH + h) * D, D, (uint8_t *)k_cache + at);                     \
                kv8_put_##T_(v + (t * KVH + h) * D, D, (uint8_t *)v_cache + at);                     \
            }                                                                                        \
    }
DEFINE_WRITE_KV8(pytgi_write_kv8_f32, float)
DEFINE_WRITE_KV8(pytgi_write_kv8_bf16, uint16_t)

static inline float f32_load(float x) { return x; }
static inline float f32_id(float x) { return x; }
DEFINE_ROPE(pytgi_rope_write_kv_f32, float, f32_load, f32_id, f32_id)
DEFINE_ROPE(pytgi_rope_write_kv_bf16, uint16_t, bf16_load, bf16_round, bf16_rt)

/* Gemma's layers. Its RMSNorm scales by float32 `1 + w` (wa, wb here) and rounds once, at the
 * end; a layer norms both sides of attention and of the MLP ("sandwich" norms):
 *   residual[t] += rms_norm(x[t])·wa;  out[t] = rms_norm(residual[t])·wb
 * x NULL: no first norm or add (the layer's input norm); out NULL: no second norm. */
#define DEFINE_NORM_ADD_NORM(NAME, T_, LOAD, STORE)                                                  \
    void NAME(const T_ *x, T_ *residual, const float *wa, const float *wb, T_ *out, int64_t T, int64_t D, \
              float eps) {                                                                           \
        _Pragma("omp parallel for if (T >= 8)")                                                      \
        for (int64_t t = 0; t < T; t++) {                                                            \
            T_ *r = residual + t * D;                                                                \
            if (x != NULL) {                                                                         \
                const T_ *xt = x + t * D;                                                            \
                float ss = 0.0f;                                                                     \
                for (int64_t i = 0; i < D; i++) ss += LOAD(xt[i]) * LOAD(xt[i]);                     \
                const float rstd = 1.0f / sqrtf(ss / (float)D + eps);                                \
                for (int64_t i = 0; i < D; i++) r[i] = STORE(LOAD(r[i]) + LOAD(STORE(LOAD(xt[i]) * rstd * wa[i]))); \
            }                                                                                        \
            if (out != NULL) {                                                                       \
                float ss = 0.0f;                                                                     \
                for (int64_t i = 0; i < D; i++) ss += LOAD(r[i]) * LOAD(r[i]);                       \
                const float rstd = 1.0f / sqrtf(ss / (float)D + eps);                                \
                for (int64_t i = 0; i < D; i++) out[t * D + i] = STORE(LOAD(r[i]) * rstd * wb[i]);   \
            }                                                                                        \
        }                                                                                            \
    }

/* Gemma's per-head query and key norms, in place on the q and k parts of each fused qkv row. */
#define DEFINE_QK_NORM(NAME, T_, LOAD, STORE, RT)                                                    \
    void NAME(T_ *qkv, const float *qw, const float *kw, int64_t T, int64_t H, int64_t KVH, int64_t D, float eps, \
              int64_t round_first) {                                                                 \
        _Pragma("omp parallel for if (T >= 8)")                                                      \
        for (int64_t t = 0; t < T; t++) {                                                            \
            for (int64_t h = 0; h < H + KVH; h++) {                                                  \
                T_ *v = qkv + t * (H + 2 * KVH) * D + h * D;                                         \
                const float *w = h < H ? qw : kw;                                                    \
                float ss = 0.0f;                                                                     \
                for (int64_t i = 0; i < D; i++) ss += LOAD(v[i]) * LOAD(v[i]);                       \
                const float rstd = 1.0f / sqrtf(ss / (float)D + eps);                                \
                if (round_first) /* Qwen3: the normed value in the model's dtype, times the weight */ \
                    for (int64_t i = 0; i < D; i++) v[i] = STORE(RT(LOAD(v[i]) * rstd) * w[i]);      \
                else /* Gemma: times 1 + w in float32, rounded once */                              \
                    for (int64_t i = 0; i < D; i++) v[i] = STORE(LOAD(v[i]) * rstd * w[i]);          \
            }                                                                                        \
        }                                                                                            \
    }

/* out[t, i] = gelu_tanh(gate_up[t, i]) * gate_up[t, I + i] (the gelu rounded, as PyTorch's is) */
#define DEFINE_GELU_MUL(NAME, T_, LOAD, STORE, RT)                                                   \
    void NAME(const T_ *gu, T_ *out, int64_t T, int64_t I) {                                         \
        _Pragma("omp parallel for if (T >= 8)")                                                      \
        for (int64_t t = 0; t < T; t++) {                                                            \
            const T_ *g = gu + t * 2 * I, *u = g + I;                                                \
            for (int64_t i = 0; i < I; i++) {                                                        \
                const float x = LOAD(g[i]);                                                          \
                const float y = 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x))); \
                out[t * I + i] = STORE(RT(y) * LOAD(u[i]));                                          \
            }                                                                                        \
        }                                                                                            \
    }

DEFINE_NORM_ADD_NORM(pytgi_norm_add_norm_f32, float, f32_load, f32_id)
DEFINE_NORM_ADD_NORM(pytgi_norm_add_norm_bf16, uint16_t, bf16_load, bf16_round)
DEFINE_QK_NORM(pytgi_qk_norm_f32, float, f32_load, f32_id, f32_id)
DEFINE_QK_NORM(pytgi_qk_norm_bf16, uint16_t, bf16_load, bf16_round, bf16_rt)
DEFINE_GELU_MUL(pytgi_gelu_tanh_mul_f32, float, f32_load, f32_id, f32_id)
DEFINE_GELU_MUL(pytgi_gelu_tanh_mul_bf16, uint16_t, bf16_load, bf16_round, bf16_rt)

/* The sampler's per-row reductions over a [B, V] float32 logits matrix: argmax[b] (the first index
 * of the row's largest value), and, when lse is not NULL, lse[b] = log Σ exp(x[b, v]). Each row is
 * cut into fixed pieces of LOGIT_PIECE values, reduced on their own (in any thread) and combined in
 * order, so a row's results are the same bits whatever the number of rows or threads (batch
 * invariance, docs/batch-invariance.md). bad[b] is set when the row holds a NaN or an infinity
 * (checked on the bits, which -ffast-math cannot assume away): the caller then uses PyTorch. */
#define LOGIT_PIECE 4096

/* Σ exp(r[i] - m) for r[i] <= m, in a fixed order. */
#if defined(__AVX512F__)
static float sum_exp(const float *r, int64_t n, float m) {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, r + i), mv))));
    }
    return _mm512_reduce_add_ps(acc);
}

/* The piece's largest value, its first index, and the largest |bits| (NaN/infinity check). */
static int64_t piece_max(const float *r, int64_t n, float *max, uint32_t *worst) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    __m512i wv = _mm512_setzero_si512();
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512i v = _mm512_maskz_loadu_epi32(k, r + i);
        wv = _mm512_max_epu32(wv, _mm512_and_si512(v, abs));
        mv = _mm512_mask_max_ps(mv, k, mv, _mm512_castsi512_ps(v));
    }
    const float m = _mm512_reduce_max_ps(mv);
    *max = m, *worst = (uint32_t)_mm512_reduce_max_epu32(wv);
    const __m512 target = _mm512_set1_ps(m);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(k, _mm512_maskz_loadu_ps(k, r + i), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0;
}
#else
static float sum_exp(const float *r, int64_t n, float m) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += expf(r[i] - m);
    return s;
}

static int64_t piece_max(const float *r, int64_t n, float *max, uint32_t *worst) {
    const uint32_t *u = (const uint32_t *)r;
    uint32_t w = 0;
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t a = u[i] & 0x7FFFFFFFu;
        w = a > w ? a : w;
        if (r[i] > r[at]) at = i;
    }
    *max = r[at], *worst = w;
    return at;
}
#endif
void pytgi_logit_stats_f32(const float *x, int64_t B, int64_t V, int64_t *argmax, float *lse, int64_t *bad) {
    const int64_t P = (V + LOGIT_PIECE - 1) / LOGIT_PIECE;
    float *pmax = malloc(sizeof(float) * (size_t)(2 * B * P + 1));
    int64_t *parg = malloc(sizeof(int64_t) * (size_t)(2 * B * P + 1));
    if (pmax == NULL || parg == NULL) { /* rare: one piece at a time, same order */
        free(pmax), free(parg);
        for (int64_t b = 0; b < B; b++) bad[b] = 1;
        return;
    }
    float *psum = pmax + B * P;
    int64_t *pbad = parg + B * P;
    _Pragma("omp parallel for schedule(static) if (B * V >= 32768)")
    for (int64_t task = 0; task < B * P; task++) {
        const int64_t b = task / P, v0 = task % P * LOGIT_PIECE, n = V - v0 < LOGIT_PIECE ? V - v0 : LOGIT_PIECE;
        const float *r = x + b * V + v0;
        uint32_t worst;
        float m;
        const int64_t at = piece_max(r, n, &m, &worst);
        float s = 0.0f;
        if (lse != NULL) s = sum_exp(r, n, m);
        pmax[task] = m, psum[task] = s, parg[task] = v0 + at, pbad[task] = worst >= 0x7F800000u;
    }
    for (int64_t b = 0; b < B; b++) {
        const float *mb = pmax + b * P, *sb = psum + b * P;
        float m = mb[0];
        int64_t at = parg[b * P], isbad = 0;
        for (int64_t p = 0; p < P; p++) {
            isbad |= pbad[b * P + p];
            if (mb[p] > m) m = mb[p], at = parg[b * P + p];
        }
        argmax[b] = at, bad[b] = isbad;
        if (lse != NULL) {
            float s = 0.0f;
            for (int64_t p = 0; p < P; p++) s += sb[p] * expf(mb[p] - m);
            lse[b] = m + logf(s);
        }
    }
    free(pmax);
    free(parg);
}
