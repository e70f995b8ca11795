/* Kimi Delta Attention's rule for CPU (Kimi Linear's linear-attention layers, pytgi/engine/models/kda.py):
 * after the causal convolution (`pytgi_causal_conv_*`, mamba1.c) and the projections, everything up to
 * the output projection, for a whole step (its decodes and prompt chunks: request r owns the flat rows
 * [starts[r], starts[r + 1]), its state at slots[r], from zero where fresh[r]). Per request, head h and
 * token, on the float32 state S [K, V] (V = K) in place in the pool:
 *
 *     g = A_h · softplus(f + dt_bias) (A = −e^A_log, per key channel);  β = sigmoid(b)
 *     S ← diag(e^g) S;  u = β (v − Sᵀk);  S ← S + k uᵀ;  o = Sᵀq
 *
 * with q and k L2-normalized (q scaled by K^-½), computed as m = Σ_k (e^g_k k_k) S_k (the old state),
 * u = β (v − m), then each row S_k ← e^g_k S_k + k_k u with o accumulated from the new rows: two passes
 * over the state a token. Then o, rounded to the model's dtype, RMS-normed (times the norm's weight)
 * and gated by sigmoid(gate), rounded once into out: the PyTorch path's roundings.
 *
 * The prompt's tokens run the recurrence one by one (not kda.py's chunked form): a token's arithmetic
 * is then the same whatever its chunk, so a prompt leaves the same state to the bit however it is cut,
 * and the head's state (64 KiB at K = 128) stays in the core's cache over the tokens. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#include "pytgi_kernels.h"

static inline float kda_f32(float x) { return x; }

static inline float kda_sigmoid(float x) { return 1.0f / (1.0f + expf(x > -80.0f ? -x : 80.0f)); }

/* mixed [T, 3 H K] (q | k | v after the convolution, the model's dtype), f [T, H K] (f_b's output),
 * b [T, H], gate [T, H K] (g_b's output), all the model's dtype; A [H], dt_bias [H K], norm_w [K] in
 * float32; rec_pool [S, H, K, K]; out [T, H K]. */
#define DEFINE_KDA_RULE(NAME, T_, LOAD, STORE, RT)                                                           \
    void NAME(const T_ *mixed, const T_ *f, const T_ *b, const T_ *gate, const int64_t *starts,              \
              const int64_t *slots, const int64_t *fresh, float *rec_pool, const float *A,                  \
              const float *dt_bias, const float *norm_w, T_ *out, int64_t R, int64_t H, int64_t K, float eps) { \
        const int64_t HK = H * K;                                                                           \
        const float qscale = 1.0f / sqrtf((float)K);                                                        \
        _Pragma("omp parallel for schedule(dynamic, 1)") for (int64_t rh = 0; rh < R * H; rh++) {          \
            const int64_t r = rh / H, h = rh % H;                                                           \
            float *S = rec_pool + (slots[r] * H + h) * K * K;                                               \
            if (fresh[r])                                                                                   \
                for (int64_t i = 0; i < K * K; i++) S[i] = 0.0f;                                            \
            float q[K], k[K], ke[K], decay[K], u[K], o[K];                                                  \
            for (int64_t t = starts[r]; t < starts[r + 1]; t++) {                                           \
                const T_ *qm = mixed + t * 3 * HK + h * K, *km = qm + HK, *vm = km + HK;                   \
                float sq = 0.0f, sk = 0.0f;                                                                 \
                for (int64_t i = 0; i < K; i++) {                                                           \
                    q[i] = LOAD(qm[i]);                                                                     \
                    k[i] = LOAD(km[i]);                                                                     \
                    sq += q[i] * q[i];                                                                      \
                    sk += k[i] * k[i];                                                                      \
                }                                                                                           \
                const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);                   \
                const T_ *fr = f + t * HK + h * K;                                                          \
                for (int64_t i = 0; i < K; i++) {                                                           \
                    q[i] = q[i] * rq * qscale;                                                              \
                    k[i] = k[i] * rk;                                                                       \
                    const float a = LOAD(fr[i]) + dt_bias[h * K + i];                                       \
                    decay[i] = expf(A[h] * (a > 20.0f ? a : log1pf(expf(a))));                              \
                    ke[i] = k[i] * decay[i];                                                                \
                }                                                                                           \
                const float beta = RT(kda_sigmoid(LOAD(b[t * H + h])));                                     \
                for (int64_t j = 0; j < K; j++) u[j] = 0.0f;                                                \
                for (int64_t i = 0; i < K; i++) {                                                           \
                    const float *row = S + i * K;                                                           \
                    for (int64_t j = 0; j < K; j++) u[j] += ke[i] * row[j];                                 \
                }                                                                                           \
                for (int64_t j = 0; j < K; j++) {                                                           \
                    u[j] = beta * (LOAD(vm[j]) - u[j]);                                                     \
                    o[j] = 0.0f;                                                                            \
                }                                                                                           \
                for (int64_t i = 0; i < K; i++) {                                                           \
                    float *row = S + i * K;                                                                 \
                    for (int64_t j = 0; j < K; j++) {                                                       \
                        const float s = decay[i] * row[j] + k[i] * u[j];                                    \
                        row[j] = s;                                                                         \
                        o[j] += q[i] * s;                                                                   \
                    }                                                                                       \
                }                                                                                           \
                float ss = 0.0f;                                                                            \
                for (int64_t j = 0; j < K; j++) {                                                           \
                    o[j] = RT(o[j]);                                                                        \
                    ss += o[j] * o[j];                                                                      \
                }                                                                                           \
                const float rn = 1.0f / sqrtf(ss / (float)K + eps);                                         \
                const T_ *gr = gate + t * HK + h * K;                                                       \
                T_ *dst = out + t * HK + h * K;                                                             \
                for (int64_t j = 0; j < K; j++)                                                             \
                    dst[j] = STORE(o[j] * rn * norm_w[j] * kda_sigmoid(LOAD(gr[j])));                       \
            }                                                                                               \
        }                                                                                                   \
    }

DEFINE_KDA_RULE(pytgi_kda_rule_f32, float, kda_f32, kda_f32, kda_f32)
DEFINE_KDA_RULE(pytgi_kda_rule_bf16, uint16_t, bf16_load, bf16_round, bf16_rt)
