/* Mamba-1's selective state-space layer for CPU (Mamba, FalconMamba and Jamba's recurrent layers,
 * pytgi/engine/models/mamba1.py), in two calls a step around the projections that sit between them
 * (x_proj, the norms, dt_proj: PyTorch's): the causal convolution over x with its state, then the
 * selective scan with D's skip and the gate. Each call takes the whole step, its decodes and prompt
 * chunks alike: request r owns the flat rows [starts[r], starts[r + 1]), its states at slot slots[r],
 * and fresh[r] says they start from zero here.
 *
 * A token's arithmetic does not depend on where its chunk starts or on what else is in the step: the
 * convolution reads the same window in the same order whether its inputs come from the pool or from the
 * chunk, and the scan carries each channel's state through the tokens one by one, so a prompt gives
 * the same states to the bit however it is cut into chunks (decodes included). Mamba-1's decay differs
 * by channel and state, so the scan has no matmul form worth taking (mamba1.py); its channels are
 * independent, so a work item is 16 channels of one request through all its tokens, the state
 * [16 channels, N] held in registers, the 16 channels in the vector lanes. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "exp16.h"

#include "pytgi_kernels.h"

#define M1_LANES 16 /* channels a work item carries (one AVX-512 vector of float32) */

static inline float m1_f32(float x) { return x; }

/* PyTorch's softplus (threshold 20) and SiLU */
static inline float m1_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static inline float m1_silu(float x) { return x / (1.0f + expf(x > -80.0f ? -x : 80.0f)); }

/* One token through 16 channels' states S [N][16] (in place): S ← e^(dt a) ⊙ S + dx B; y += S C, the
 * states in the order k = 0 … N − 1 in every lane. AVX-512: Cephes' e^x inline (exp16.h; dt a ≤ 0 as
 * dt > 0 and A < 0), else the compiler's vector expf (libmvec). */
static inline void m1_states(float (*S)[M1_LANES], const float (*a)[M1_LANES], const float *dt, const float *dx,
                             const float *Bt, const float *Ct, float *y, int64_t N) {
#if defined(__AVX512F__)
    const __m512 dtv = _mm512_loadu_ps(dt), dxv = _mm512_loadu_ps(dx);
    __m512 yv = _mm512_loadu_ps(y);
    for (int64_t k = 0; k < N; k++) {
        const __m512 e = exp16(_mm512_mul_ps(dtv, _mm512_loadu_ps(a[k])));
        const __m512 s = _mm512_fmadd_ps(e, _mm512_loadu_ps(S[k]), _mm512_mul_ps(dxv, _mm512_set1_ps(Bt[k])));
        _mm512_storeu_ps(S[k], s);
        yv = _mm512_fmadd_ps(s, _mm512_set1_ps(Ct[k]), yv);
    }
    _mm512_storeu_ps(y, yv);
#else
    for (int64_t k = 0; k < N; k++)
        for (int64_t c = 0; c < M1_LANES; c++) {
            S[k][c] = expf(dt[c] * a[k][c]) * S[k][c] + dx[c] * Bt[k];
            y[c] += S[k][c] * Ct[k];
        }
#endif
}

/* The causal depthwise convolution of x (columns [0, D) of xz [T, W], the model's dtype) with its
 * state: per request and channel c, token t's output is SiLU(conv_b[c] + Σ_j conv_w[c, j] · in[t + j −
 * (Kc − 1)]) in float32, rounded into mixed [T, D]; `in` is the pool's Kc − 1 inputs (zero where fresh)
 * then the request's rows. The pool [S, D, Kc − 1] keeps the last Kc − 1 inputs. */
#define DEFINE_CAUSAL_CONV(NAME, T_, LOAD, STORE)                                                            \
    int NAME(const T_ *xz, const int64_t *starts, const int64_t *slots, const int64_t *fresh, T_ *conv_pool,  \
             const float *conv_w, const float *conv_b, T_ *mixed, int64_t R, int64_t D, int64_t W,           \
             int64_t Kc) {                                                                                  \
        const int64_t KS = Kc - 1, nblk = (D + M1_LANES - 1) / M1_LANES;                                    \
        int64_t longest = 0;                                                                                \
        for (int64_t r = 0; r < R; r++)                                                                     \
            if (starts[r + 1] - starts[r] > longest) longest = starts[r + 1] - starts[r];                   \
        int failed = 0;                                                                                     \
        _Pragma("omp parallel") {                                                                           \
            /* a channel block's inputs, token-major: the pool's then the request's */                     \
            float *in = malloc(sizeof(float) * (size_t)((KS + longest) * M1_LANES));                       \
            if (!in) {                                                                                      \
                _Pragma("omp atomic write") failed = 1;                                                     \
            }                                                                                               \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t it = 0; it < R * nblk; it++) {            \
                if (!in) continue;                                                                          \
                const int64_t r = it / nblk, d0 = (it % nblk) * M1_LANES;                                   \
                const int64_t cb = D - d0 < M1_LANES ? D - d0 : M1_LANES, s0 = starts[r];                   \
                const int64_t n = starts[r + 1] - s0;                                                       \
                T_ *st = conv_pool + (slots[r] * D + d0) * KS;                                              \
                for (int64_t j = 0; j < KS; j++)                                                            \
                    for (int64_t c = 0; c < M1_LANES; c++)                                                  \
                        in[j * M1_LANES + c] = c < cb && !fresh[r] ? LOAD(st[c * KS + j]) : 0.0f;          \
                for (int64_t t = 0; t < n; t++)                                                             \
                    for (int64_t c = 0; c < M1_LANES; c++)                                                  \
                        in[(KS + t) * M1_LANES + c] = c < cb ? LOAD(xz[(s0 + t) * W + d0 + c]) : 0.0f;     \
                float w[Kc][M1_LANES], b[M1_LANES];                                                         \
                for (int64_t c = 0; c < M1_LANES; c++) {                                                    \
                    b[c] = c < cb && conv_b ? conv_b[d0 + c] : 0.0f;                                        \
                    for (int64_t j = 0; j < Kc; j++) w[j][c] = c < cb ? conv_w[(d0 + c) * Kc + j] : 0.0f;   \
                }                                                                                           \
                for (int64_t t = 0; t < n; t++) {                                                           \
                    float acc[M1_LANES];                                                                    \
                    for (int64_t c = 0; c < M1_LANES; c++) acc[c] = b[c];                                   \
                    for (int64_t j = 0; j < Kc; j++)                                                        \
                        for (int64_t c = 0; c < M1_LANES; c++) acc[c] += in[(t + j) * M1_LANES + c] * w[j][c]; \
                    T_ *dst = mixed + (s0 + t) * D + d0;                                                    \
                    for (int64_t c = 0; c < cb; c++) dst[c] = STORE(m1_silu(acc[c]));                       \
                }                                                                                           \
                for (int64_t j = 0; j < KS; j++) /* exact: each value came from the model's dtype */        \
                    for (int64_t c = 0; c < cb; c++) st[c * KS + j] = STORE(in[(n + j) * M1_LANES + c]);    \
            }                                                                                               \
            free(in);                                                                                       \
        }                                                                                                   \
        return failed;                                                                                      \
    }

DEFINE_CAUSAL_CONV(pytgi_causal_conv_f32, float, m1_f32, m1_f32)
DEFINE_CAUSAL_CONV(pytgi_causal_conv_bf16, uint16_t, bf16_load, bf16_round)

/* The selective scan after the projections: per request, channel d and token t (x = mixed[t, d],
 * dt = softplus(dt_raw[t, d]) in float32, B and C = bc[t] [2N], float32),
 *
 *     S_d ← e^(dt A_d) ⊙ S_d + (dt x) B;   y = S_d · C + Dskip_d x;   out[t, d] = y · SiLU(z[t, d])
 *
 * with z columns [D, 2D) of xz [T, W]; S: the float32 state at ssm_pool [S, D, N], in place; out [T, D]
 * in the model's dtype (rounded once, as the PyTorch path rounds it). */
#define DEFINE_MAMBA1_SCAN(NAME, T_, LOAD, STORE)                                                            \
    void NAME(const T_ *xz, const T_ *mixed, const T_ *dt_raw, const float *bc, const int64_t *starts,       \
              const int64_t *slots, const int64_t *fresh, float *ssm_pool, const float *A, const float *Dskip, \
              T_ *out, int64_t R, int64_t D, int64_t N, int64_t W) {                                         \
        const int64_t nblk = (D + M1_LANES - 1) / M1_LANES;                                                 \
        _Pragma("omp parallel for schedule(dynamic, 1)") for (int64_t it = 0; it < R * nblk; it++) {       \
            const int64_t r = it / nblk, d0 = (it % nblk) * M1_LANES;                                       \
            const int64_t cb = D - d0 < M1_LANES ? D - d0 : M1_LANES;                                       \
            float S[N][M1_LANES], a[N][M1_LANES], skip[M1_LANES];                                           \
            float *pool = ssm_pool + (slots[r] * D + d0) * N;                                               \
            for (int64_t c = 0; c < M1_LANES; c++) {                                                        \
                skip[c] = c < cb ? Dskip[d0 + c] : 0.0f;                                                    \
                for (int64_t k = 0; k < N; k++) {                                                           \
                    a[k][c] = c < cb ? A[(d0 + c) * N + k] : 0.0f;                                          \
                    S[k][c] = c < cb && !fresh[r] ? pool[c * N + k] : 0.0f;                                 \
                }                                                                                           \
            }                                                                                               \
            for (int64_t t = starts[r]; t < starts[r + 1]; t++) {                                           \
                const float *Bt = bc + t * 2 * N, *Ct = Bt + N;                                             \
                float x[M1_LANES], dt[M1_LANES], dx[M1_LANES], y[M1_LANES];                                 \
                for (int64_t c = 0; c < M1_LANES; c++) {                                                    \
                    x[c] = c < cb ? LOAD(mixed[t * D + d0 + c]) : 0.0f;                                     \
                    dt[c] = m1_softplus(c < cb ? LOAD(dt_raw[t * D + d0 + c]) : 0.0f);                      \
                    dx[c] = dt[c] * x[c];                                                                   \
                    y[c] = 0.0f;                                                                            \
                }                                                                                           \
                m1_states(S, a, dt, dx, Bt, Ct, y, N);                                                      \
                for (int64_t c = 0; c < cb; c++) {                                                          \
                    const float z = LOAD(xz[t * W + D + d0 + c]);                                           \
                    out[t * D + d0 + c] = STORE((y[c] + skip[c] * x[c]) * m1_silu(z));                      \
                }                                                                                           \
            }                                                                                               \
            for (int64_t c = 0; c < cb; c++)                                                                \
                for (int64_t k = 0; k < N; k++) pool[c * N + k] = S[k][c];                                  \
        }                                                                                                   \
    }

DEFINE_MAMBA1_SCAN(pytgi_mamba1_scan_f32, float, m1_f32, m1_f32)
DEFINE_MAMBA1_SCAN(pytgi_mamba1_scan_bf16, uint16_t, bf16_load, bf16_round)
