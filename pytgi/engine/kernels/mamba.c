/* Mamba-2's selective state-space layer for CPU (Nemotron-H, Granite-4.0-H and Bamba's recurrent layers,
 * pytgi/engine/models/mamba2.py): everything a layer does between its input projection and its output
 * projection, each request's states read and written in place in the layer's pools. The projection's
 * row is z | x B C | dt (inner, conv_dim = inner + 2 G N, H values); per head h (group g = h / (H / G)),
 * with dt = softplus(dt_raw + dt_bias) clamped to [dt_lo, dt_hi] and A = −e^A_log,
 *
 *     S ← e^(dt A) S + dt x Bᵀ;   y = S C + D x
 *
 * on the float32 state S [P, N], then y · SiLU(z) RMS-normed over each group's features, times the
 * norm's weight, rounded once to the model's dtype: the roundings of the PyTorch path, which keeps
 * everything after the projection in float32. One call for all decodes of a step, one per prompt chunk,
 * instead of some twenty PyTorch operations a layer: at one stream those cost more than the step. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#include "pytgi_kernels.h"

static inline float m2_f32(float x) { return x; }

static inline float m2_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static inline float m2_silu(float x) { return x / (1.0f + expf(x > -80.0f ? -x : 80.0f)); }

/* One head's state through one token: S [P, N] in place, x [P], B and C [N]; y [P] gets S C + D x. */
static inline void m2_step(float *S, const float *x, const float *Bv, const float *Cv, float dt, float dA,
                           float D, float *y, int64_t P, int64_t N) {
    for (int64_t p = 0; p < P; p++) {
        float *row = S + p * N;
        const float xd = x[p] * dt;
        float acc = 0.0f;
        for (int64_t n = 0; n < N; n++) {
            const float s = dA * row[n] + xd * Bv[n];
            row[n] = s;
            acc += s * Cv[n];
        }
        y[p] = acc + D * x[p];
    }
}

/* The gated grouped RMSNorm of one token: y [G · gs] (float32), z [G · gs] (model dtype) → dst. */
#define M2_NORM(T_, LOAD, STORE, y, zr, dst, g, gs, norm_w, eps)                                             \
    do {                                                                                                    \
        const float *yg = (y) + (g) * (gs);                                                                 \
        const T_ *zg = (zr) + (g) * (gs);                                                                   \
        float ss = 0.0f;                                                                                    \
        for (int64_t i = 0; i < (gs); i++) {                                                                \
            const float v = yg[i] * m2_silu(LOAD(zg[i]));                                                   \
            ss += v * v;                                                                                    \
        }                                                                                                   \
        const float r = 1.0f / sqrtf(ss / (float)(gs) + (eps));                                             \
        const float *wg = (norm_w) + (g) * (gs);                                                            \
        T_ *dg = (dst) + (g) * (gs);                                                                        \
        for (int64_t i = 0; i < (gs); i++) dg[i] = STORE(wg[i] * (yg[i] * m2_silu(LOAD(zg[i])) * r));       \
    } while (0)

/* A whole Mamba-2 layer's decodes after its input projection, in one call: for each decoding request
 * (its flat row rows[b] of proj [T, inner + conv_dim + H], its state slot slots[b]; fresh[b]: its states
 * start from zero here)
 *
 *   1. the causal convolution over its last Kc inputs of each channel (the pool's Kc − 1 and this row's),
 *      plus the bias (conv_b, may be NULL), SiLU, in float32; the pool's inputs shift by one;
 *   2. per head, dt, the state's step in place in ssm_pool [S, H, P, N] and D's skip;
 *   3. per group, the gated RMSNorm into out's row [T, inner] (the model's dtype).
 *
 * Phase 1 runs over (request, channel block), phase 2 over (request, head), phase 3 over (request,
 * group): a group's B and C feed several heads, so the convolution finishes before any head reads it.
 * Returns 1 out of memory. */
#define DEFINE_MAMBA2_DECODE(NAME, T_, LOAD, STORE)                                                          \
    int NAME(const T_ *proj, const int64_t *rows, const int64_t *slots, const int64_t *fresh, T_ *conv_pool,  \
             const float *conv_w, const float *conv_b, const float *dt_bias, const float *A, const float *D,  \
             const float *norm_w, float *ssm_pool, T_ *out, int64_t B, int64_t H, int64_t P, int64_t G,      \
             int64_t N, int64_t Kc, float dt_lo, float dt_hi, float eps) {                                   \
        const int64_t inner = H * P, C = inner + 2 * G * N, W = inner + C + H, KS = Kc - 1;                \
        const int64_t rep = H / G, gs = inner / G, CB = 256, nblk = (C + CB - 1) / CB;                     \
        float *mixed = malloc(sizeof(float) * (size_t)(B * (C + inner)));                                  \
        if (!mixed) return 1;                                                                               \
        float *ys = mixed + B * C;                                                                          \
        _Pragma("omp parallel") {                                                                           \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < B * nblk; t++) {                   \
                const int64_t b = t / nblk, c0 = (t % nblk) * CB, c1 = c0 + CB < C ? c0 + CB : C;          \
                T_ *st = conv_pool + slots[b] * C * KS;                                                     \
                const T_ *x = proj + rows[b] * W + inner;                                                   \
                for (int64_t c = c0; c < c1; c++) {                                                         \
                    T_ *s = st + c * KS;                                                                    \
                    const float *w = conv_w + c * Kc;                                                       \
                    float y = (conv_b ? conv_b[c] : 0.0f) + LOAD(x[c]) * w[KS];                             \
                    if (!fresh[b])                                                                          \
                        for (int64_t j = 0; j < KS; j++) y += LOAD(s[j]) * w[j];                            \
                    for (int64_t j = 0; j + 1 < KS; j++) s[j] = fresh[b] ? (T_)0 : s[j + 1];                \
                    if (KS > 0) s[KS - 1] = x[c];                                                           \
                    mixed[b * C + c] = m2_silu(y);                                                          \
                }                                                                                           \
            }                                                                                               \
            _Pragma("omp for schedule(static)") for (int64_t bh = 0; bh < B * H; bh++) {                   \
                const int64_t b = bh / H, h = bh % H, g = h / rep;                                          \
                const float *m = mixed + b * C;                                                             \
                float dt = m2_softplus(LOAD(proj[rows[b] * W + inner + C + h]) + dt_bias[h]);              \
                dt = dt < dt_lo ? dt_lo : dt > dt_hi ? dt_hi : dt;                                          \
                float *S = ssm_pool + (slots[b] * H + h) * P * N;                                           \
                if (fresh[b])                                                                               \
                    for (int64_t i = 0; i < P * N; i++) S[i] = 0.0f;                                        \
                m2_step(S, m + h * P, m + inner + g * N, m + inner + G * N + g * N, dt, expf(dt * A[h]),    \
                        D[h], ys + b * inner + h * P, P, N);                                                \
            }                                                                                               \
            _Pragma("omp for schedule(static)") for (int64_t bg = 0; bg < B * G; bg++) {                   \
                const int64_t b = bg / G, g = bg % G;                                                       \
                M2_NORM(T_, LOAD, STORE, ys + b * inner, proj + rows[b] * W, out + rows[b] * inner, g, gs,  \
                        norm_w, eps);                                                                       \
            }                                                                                               \
        }                                                                                                   \
        free(mixed);                                                                                        \
        return 0;                                                                                           \
    }

DEFINE_MAMBA2_DECODE(pytgi_mamba2_decode_layer_f32, float, m2_f32, m2_f32)
DEFINE_MAMBA2_DECODE(pytgi_mamba2_decode_layer_bf16, uint16_t, bf16_load, bf16_round)

/* One request's prompt chunk through a Mamba-2 layer after its input projection, in one call: its rows
 * proj [n, inner + conv_dim + H] (model dtype), its state slot and `fresh` (its states start from zero
 * here); the pools and weights as the decodes' kernel's. The convolution over the pool's last inputs
 * and the chunk's (the pool keeps the chunk's last Kc − 1), then each head's tokens through the
 * recurrence one after another, then the gated norm per token and group into out [n, inner].
 *
 * The scan is the recurrence itself, not mamba2.py's chunked (matmul) form: the head's state, P · N
 * floats (32 KiB at Nemotron-H's 64 × 128), stays in the core's cache over the tokens, each token's step
 * is 2 P N multiply-adds the compiler vectorizes over N, and the whole scan is a few percent of the
 * layer's projections; the chunked form's gain is in matmul units this code does not use. Returns 1
 * out of memory. */
#define DEFINE_MAMBA2_PREFILL(NAME, T_, LOAD, STORE)                                                         \
    int NAME(const T_ *proj, int64_t n, int64_t slot, int64_t fresh, T_ *conv_pool, const float *conv_w,      \
             const float *conv_b, const float *dt_bias, const float *A, const float *D, const float *norm_w,  \
             float *ssm_pool, T_ *out, int64_t H, int64_t P, int64_t G, int64_t N, int64_t Kc, float dt_lo,   \
             float dt_hi, float eps) {                                                                      \
        const int64_t inner = H * P, C = inner + 2 * G * N, W = inner + C + H, KS = Kc - 1;                \
        const int64_t rep = H / G, gs = inner / G;                                                          \
        float *mixed = malloc(sizeof(float) * (size_t)(n * (C + inner)));                                  \
        if (!mixed) return 1;                                                                               \
        float *ys = mixed + n * C;                                                                          \
        T_ *st = conv_pool + slot * C * KS;                                                                 \
        _Pragma("omp parallel") {                                                                           \
            /* channel blocks of 64, the tokens in order: each token's inputs are read along a row */    \
            _Pragma("omp for schedule(static)") for (int64_t c0 = 0; c0 < C; c0 += 64) {                   \
                const int64_t c1 = c0 + 64 < C ? c0 + 64 : C;                                               \
                for (int64_t t = 0; t < n; t++) {                                                           \
                    float *mt = mixed + t * C;                                                              \
                    for (int64_t c = c0; c < c1; c++) mt[c] = conv_b ? conv_b[c] : 0.0f;                    \
                    for (int64_t j = 0; j < Kc; j++) {                                                      \
                        const int64_t at = t + j - KS; /* < 0: the pool's inputs */                         \
                        if (at >= 0) {                                                                      \
                            const T_ *x = proj + at * W + inner;                                            \
                            for (int64_t c = c0; c < c1; c++) mt[c] += LOAD(x[c]) * conv_w[c * Kc + j];     \
                        } else if (!fresh) {                                                                \
                            for (int64_t c = c0; c < c1; c++)                                               \
                                mt[c] += LOAD(st[c * KS + KS + at]) * conv_w[c * Kc + j];                   \
                        }                                                                                   \
                    }                                                                                       \
                    for (int64_t c = c0; c < c1; c++) mt[c] = m2_silu(mt[c]);                               \
                }                                                                                           \
                for (int64_t c = c0; c < c1; c++) {                                                         \
                    T_ *s = st + c * KS;                                                                    \
                    T_ keep[KS > 0 ? KS : 1];                                                               \
                    for (int64_t j = 0; j < KS; j++) {                                                      \
                        const int64_t at = n - KS + j;                                                      \
                        keep[j] = at >= 0 ? proj[at * W + inner + c] : fresh ? (T_)0 : s[KS + at];         \
                    }                                                                                       \
                    for (int64_t j = 0; j < KS; j++) s[j] = keep[j];                                        \
                }                                                                                           \
            }                                                                                               \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t h = 0; h < H; h++) {                      \
                const int64_t g = h / rep;                                                                  \
                float *S = ssm_pool + (slot * H + h) * P * N;                                               \
                if (fresh)                                                                                  \
                    for (int64_t i = 0; i < P * N; i++) S[i] = 0.0f;                                        \
                for (int64_t t = 0; t < n; t++) {                                                           \
                    const float *m = mixed + t * C;                                                         \
                    float dt = m2_softplus(LOAD(proj[t * W + inner + C + h]) + dt_bias[h]);                \
                    dt = dt < dt_lo ? dt_lo : dt > dt_hi ? dt_hi : dt;                                      \
                    m2_step(S, m + h * P, m + inner + g * N, m + inner + G * N + g * N, dt, expf(dt * A[h]), \
                            D[h], ys + t * inner + h * P, P, N);                                            \
                }                                                                                           \
            }                                                                                               \
            _Pragma("omp for schedule(static)") for (int64_t tg = 0; tg < n * G; tg++) {                   \
                const int64_t t = tg / G, g = tg % G;                                                       \
                M2_NORM(T_, LOAD, STORE, ys + t * inner, proj + t * W, out + t * inner, g, gs, norm_w, eps); \
            }                                                                                               \
        }                                                                                                   \
        free(mixed);                                                                                        \
        return 0;                                                                                           \
    }

DEFINE_MAMBA2_PREFILL(pytgi_mamba2_prefill_layer_f32, float, m2_f32, m2_f32)
DEFINE_MAMBA2_PREFILL(pytgi_mamba2_prefill_layer_bf16, uint16_t, bf16_load, bf16_round)
