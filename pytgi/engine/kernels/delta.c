/* Gated DeltaNet's decodes for CPU (Qwen3-Next's and Qwen3.5's linear-attention layers,
 * pytgi/engine/models/linear_attention.py): everything a layer does to one token of each of B requests
 * between its input projections and its output projection, each request's states read and written in
 * place in the layer's pools, so the step makes two passes over each state and no copies. For request b
 * and value head h, S = pool[slots[b], h] (K × V, float32):
 *
 *     S ← e^g S;  u = β (v − Sᵀk);  S ← S + k uᵀ;  o = Sᵀq
 *
 * computed as m = Sᵀk (the old state), u = β (v − e^g m), then S_kv = e^g S_kv + k_k u_v row by row,
 * with o accumulated from the new rows. Each (b, h) is independent of the others: a request's numbers
 * do not depend on its batch. One call instead of a dozen PyTorch operations a layer: at one stream
 * those cost more than the rule itself. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#include "pytgi_kernels.h"

/* sigmoid and SiLU with e^-x bounded: under -ffast-math the division by 1 + inf (x below about -88)
 * gives NaN, not 0; above -80 the bits are the plain formula's */
static inline float dn_sigmoid(float x) { return 1.0f / (1.0f + expf(x > -80.0f ? -x : 80.0f)); }
static inline float dn_silu(float x) { return x / (1.0f + expf(x > -80.0f ? -x : 80.0f)); }

/* A whole gated DeltaNet layer's decodes after its projections, in one call: for each decoding request
 * (its flat row rows[b], its state slot slots[b]; fresh[b]: its states start from zero here)
 *
 *   1. the causal convolution over its last conv_kernel inputs of each channel (the pool's
 *      conv_kernel − 1 and this row's), SiLU, rounded to the model's dtype; the inputs shift by one;
 *   2. per value head h (reading key head kh: h % nk tiled, h / (nv / nk) grouped): q and k
 *      L2-normalized (q scaled by dk^-½), β = sigmoid(b) (in the model's dtype), the log decay
 *      g = −e^A_log · softplus(a + dt_bias), and the rule's step on the float32 state in place;
 *   3. the gated RMSNorm of the head's output: (w · norm(o)) · SiLU(z), with the roundings to the
 *      model's dtype that the PyTorch path (linear_attention.GatedRMSNorm) makes, into out's row.
 *
 * Phase 1 runs over (request, channel block), then phase 2 over (request, value head): a key head's
 * channels feed several value heads, so the convolution's state moves before any head reads it. */
#define DEFINE_GDN_LAYER(NAME, T_, LOAD, STORE, RT)                                                          \
    int NAME(const T_ *qkv, const T_ *z, const T_ *bq, const T_ *aq, const int64_t *rows,                  \
             const int64_t *slots, const int64_t *fresh, T_ *conv_pool, const float *conv_w,              \
             const float *A_log, const float *dt_bias, const float *norm_w, float *rec_pool, T_ *out,      \
             int64_t B, int64_t C, int64_t Kc, int64_t nk, int64_t nv, int64_t dk, int64_t dv,              \
             int64_t tiled, float eps) {                                                                    \
        float *mixed = malloc(sizeof(float) * (size_t)(B * C));                                            \
        if (!mixed) return 1;                                                                               \
        const int64_t KS = Kc - 1, rep = nv / nk, CB = 256, nblk = (C + CB - 1) / CB;                      \
        const float qscale = 1.0f / sqrtf((float)dk);                                                      \
        _Pragma("omp parallel") {                                                                           \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < B * nblk; t++) {                   \
                const int64_t b = t / nblk, c0 = (t % nblk) * CB, c1 = c0 + CB < C ? c0 + CB : C;          \
                T_ *st = conv_pool + slots[b] * C * KS;                                                     \
                const T_ *x = qkv + rows[b] * C;                                                            \
                for (int64_t c = c0; c < c1; c++) {                                                         \
                    T_ *s = st + c * KS;                                                                    \
                    const float *w = conv_w + c * Kc;                                                       \
                    float y = LOAD(x[c]) * w[KS];                                                           \
                    if (!fresh[b])                                                                          \
                        for (int64_t j = 0; j < KS; j++) y += LOAD(s[j]) * w[j];                            \
                    for (int64_t j = 0; j + 1 < KS; j++) s[j] = fresh[b] ? (T_)0 : s[j + 1];                \
                    if (KS > 0) s[KS - 1] = x[c];                                                           \
                    mixed[b * C + c] = RT(dn_silu(y));                                                      \
                }                                                                                           \
            }                                                                                               \
            _Pragma("omp for schedule(static)") for (int64_t bh = 0; bh < B * nv; bh++) {                  \
                const int64_t b = bh / nv, h = bh % nv, kh = tiled ? h % nk : h / rep;                     \
                const float *qm = mixed + b * C + kh * dk, *km = mixed + b * C + (nk + kh) * dk;            \
                const float *vm = mixed + b * C + 2 * nk * dk + h * dv;                                     \
                float qn[dk], kn[dk], u[dv], o[dv];                                                         \
                float sq = 0.0f, sk = 0.0f;                                                                 \
                for (int64_t i = 0; i < dk; i++) {                                                          \
                    sq += qm[i] * qm[i];                                                                    \
                    sk += km[i] * km[i];                                                                    \
                }                                                                                           \
                const float rq = qscale / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);                 \
                for (int64_t i = 0; i < dk; i++) {                                                          \
                    qn[i] = qm[i] * rq;                                                                     \
                    kn[i] = km[i] * rk;                                                                     \
                }                                                                                           \
                const float av = LOAD(aq[rows[b] * nv + h]) + dt_bias[h];                                  \
                const float sp = av > 20.0f ? av : log1pf(expf(av));                                        \
                const float decay = expf(-expf(A_log[h]) * sp);                                             \
                const float bt = RT(dn_sigmoid(LOAD(bq[rows[b] * nv + h])));                                \
                float *S = rec_pool + (slots[b] * nv + h) * dk * dv;                                        \
                if (fresh[b])                                                                               \
                    for (int64_t i = 0; i < dk * dv; i++) S[i] = 0.0f;                                      \
                for (int64_t j = 0; j < dv; j++) u[j] = 0.0f;                                               \
                for (int64_t i = 0; i < dk; i++) {                                                          \
                    const float ki = kn[i];                                                                 \
                    const float *row = S + i * dv;                                                          \
                    for (int64_t j = 0; j < dv; j++) u[j] += ki * row[j];                                   \
                }                                                                                           \
                for (int64_t j = 0; j < dv; j++) {                                                          \
                    u[j] = bt * (vm[j] - decay * u[j]);                                                     \
                    o[j] = 0.0f;                                                                            \
                }                                                                                           \
                for (int64_t i = 0; i < dk; i++) {                                                          \
                    const float ki = kn[i], qi = qn[i];                                                     \
                    float *row = S + i * dv;                                                                \
                    for (int64_t j = 0; j < dv; j++) {                                                      \
                        const float s = decay * row[j] + ki * u[j];                                         \
                        row[j] = s;                                                                         \
                        o[j] += qi * s;                                                                     \
                    }                                                                                       \
                }                                                                                           \
                float ss = 0.0f;                                                                            \
                for (int64_t j = 0; j < dv; j++) {                                                          \
                    o[j] = RT(o[j]);                                                                        \
                    ss += o[j] * o[j];                                                                      \
                }                                                                                           \
                const float r = 1.0f / sqrtf(ss / (float)dv + eps);                                         \
                const T_ *zr = z + rows[b] * nv * dv + h * dv;                                              \
                T_ *dst = out + rows[b] * nv * dv + h * dv;                                                 \
                for (int64_t j = 0; j < dv; j++) {                                                          \
                    const float zj = LOAD(zr[j]);                                                           \
                    dst[j] = STORE(RT(norm_w[j] * RT(o[j] * r)) * dn_silu(zj));                             \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        free(mixed);                                                                                        \
        return 0;                                                                                           \
    }

static inline float f32_same(float x) { return x; }
DEFINE_GDN_LAYER(pytgi_gdn_decode_layer_f32, float, f32_same, f32_same, f32_same)
DEFINE_GDN_LAYER(pytgi_gdn_decode_layer_bf16, uint16_t, bf16_load, bf16_round, bf16_rt)

/* One head of one request's prompt chunk through the rule, in chunks of C tokens (the chunked form
 * linear_attention.chunked_rule computes with matmuls and a triangular solve): token t's q and k at
 * q + t·ldqk, k + t·ldqk (q scaled, both L2-normalized), v at v + t·ldv, g and β at g[t·ldgb],
 * beta[t·ldgb], all float32; the head's state S [K, V] in place; o at out + t·ldo. Within a chunk, with
 * G the log decay summed from the chunk's start,
 *
 *     (I + A) [u0 | w] = [β v | β e^G k],   A_ij = β_i e^(G_i − G_j) k_i·k_j  (j < i)
 *     u = u0 − w S;   o_i = e^G_i q_i S + Σ_(j ≤ i) e^(G_i − G_j) (q_i·k_j) u_j
 *     S ← e^G_last S + Σ_i e^(G_last − G_i) k_i u_iᵀ
 *
 * by forward substitution and row updates over S, each a loop over V the compiler vectorizes. `buf`
 * holds C (3K + 2V + 2C + 2) floats. */
static void rule_head(const float *q, const float *k, int64_t ldqk, const float *v, int64_t ldv, const float *g,
                      const float *beta, int64_t ldgb, float *S, float *out, int64_t ldo, int64_t L, int64_t K,
                      int64_t V, int64_t C, float *buf) {
    float *qc = buf, *kc = qc + C * K, *w = kc + C * K, *u = w + C * K, *oc = u + C * V;
    float *kk = oc + C * V, *qk = kk + C * C, *G = qk + C * C, *eG = G + C;
    for (int64_t c0 = 0; c0 < L; c0 += C) {
        const int64_t n = L - c0 < C ? L - c0 : C;
        float acc = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const int64_t t = c0 + i;
            acc += g[t * ldgb];
            G[i] = acc;
            eG[i] = expf(acc);
            for (int64_t d = 0; d < K; d++) {
                qc[i * K + d] = q[t * ldqk + d];
                kc[i * K + d] = k[t * ldqk + d];
            }
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j <= i; j++) {
                float sk = 0.0f, sq = 0.0f;
                for (int64_t d = 0; d < K; d++) {
                    sk += kc[i * K + d] * kc[j * K + d];
                    sq += qc[i * K + d] * kc[j * K + d];
                }
                const float e = expf(G[i] - G[j]);
                kk[i * C + j] = beta[(c0 + i) * ldgb] * e * sk;
                qk[i * C + j] = e * sq;
            }
        /* forward substitution: row i of [u0 | w] from the rows before it */
        for (int64_t i = 0; i < n; i++) {
            const int64_t t = c0 + i;
            const float b = beta[t * ldgb], be = b * eG[i];
            float *ui = u + i * V, *wi = w + i * K;
            for (int64_t d = 0; d < V; d++) ui[d] = b * v[t * ldv + d];
            for (int64_t d = 0; d < K; d++) wi[d] = be * kc[i * K + d];
            for (int64_t j = 0; j < i; j++) {
                const float a = kk[i * C + j];
                const float *uj = u + j * V, *wj = w + j * K;
                for (int64_t d = 0; d < V; d++) ui[d] -= a * uj[d];
                for (int64_t d = 0; d < K; d++) wi[d] -= a * wj[d];
            }
        }
        /* u −= w S and o = e^G q S, over S's rows */
        for (int64_t i = 0; i < n; i++) {
            float *ui = u + i * V, *oi = oc + i * V;
            const float *wi = w + i * K, *qi = qc + i * K;
            for (int64_t d = 0; d < V; d++) oi[d] = 0.0f;
            for (int64_t r = 0; r < K; r++) {
                const float *Sr = S + r * V;
                const float a = wi[r], b = qi[r] * eG[i];
                for (int64_t d = 0; d < V; d++) {
                    ui[d] -= a * Sr[d];
                    oi[d] += b * Sr[d];
                }
            }
        }
        /* o_i += Σ_(j ≤ i) qk_ij u_j, then out */
        for (int64_t i = 0; i < n; i++) {
            float *oi = oc + i * V;
            for (int64_t j = 0; j <= i; j++) {
                const float a = qk[i * C + j];
                const float *uj = u + j * V;
                for (int64_t d = 0; d < V; d++) oi[d] += a * uj[d];
            }
            float *dst = out + (c0 + i) * ldo;
            for (int64_t d = 0; d < V; d++) dst[d] = oi[d];
        }
        /* S ← e^G_last S + Σ_i e^(G_last − G_i) k_i u_iᵀ */
        const float last = G[n - 1], eL = eG[n - 1];
        for (int64_t i = 0; i < n; i++) G[i] = expf(last - G[i]);
        for (int64_t r = 0; r < K; r++) {
            float *Sr = S + r * V;
            for (int64_t d = 0; d < V; d++) Sr[d] *= eL;
            for (int64_t i = 0; i < n; i++) {
                const float a = G[i] * kc[i * K + r];
                const float *ui = u + i * V;
                for (int64_t d = 0; d < V; d++) Sr[d] += a * ui[d];
            }
        }
    }
}

static size_t rule_floats(int64_t K, int64_t V, int64_t C) { return (size_t)(C * (3 * K + 2 * V + 2 * C + 2)); }

/* One request's prompt chunk through the rule: q, k [L, H, K] (q scaled, both L2-normalized), v [L, H, V],
 * g and beta [L, H], all float32; state [H, K, V] in place; out [L, H, V]. One head a thread. Returns 1
 * out of memory. */
int pytgi_gdn_prefill_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                          float *state, float *out, int64_t L, int64_t H, int64_t K, int64_t V, int64_t C) {
    int failed = 0;
    _Pragma("omp parallel") {
        float *buf = malloc(sizeof(float) * rule_floats(K, V, C));
        if (!buf) {
            _Pragma("omp atomic write") failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t h = 0; h < H; h++) {
            if (buf)
                rule_head(q + h * K, k + h * K, H * K, v + h * V, H * V, g + h, beta + h, H, state + h * K * V,
                          out + h * V, H * V, L, K, V, C, buf);
        }
        free(buf);
    }
    return failed;
}

/* A whole gated DeltaNet layer's prompt chunk of one request after its projections, in one call: qkv
 * [n, C], z [n, nv·dv], b and a [n, nv] in the model's dtype (the request's rows), its state slot and
 * `fresh` (its states start from zero here). As the decodes' kernel: the causal convolution over the
 * pool's last inputs and the chunk's (SiLU, rounded to the model's dtype; the pool keeps the last
 * kernel − 1 inputs), q and k L2-normalized per key head in place (q scaled), β and the log decay per
 * token and value head, the chunked rule per value head (reading its key head's columns: no copies
 * per value head), then the gated RMSNorm into out [n, nv·dv]. Returns 1 out of memory. */
#define DEFINE_GDN_PREFILL_LAYER(NAME, T_, LOAD, STORE, RT)                                                  \
    int NAME(const T_ *qkv, const T_ *z, const T_ *bq, const T_ *aq, int64_t n, int64_t slot, int64_t fresh,  \
             T_ *conv_pool, const float *conv_w, const float *A_log, const float *dt_bias, const float *norm_w, \
             float *rec_pool, T_ *out, int64_t C, int64_t Kc, int64_t nk, int64_t nv, int64_t dk, int64_t dv,  \
             int64_t tiled, float eps, int64_t chunk) {                                                     \
        const int64_t KS = Kc - 1, rep = nv / nk;                                                           \
        float *mixed = malloc(sizeof(float) * (size_t)(n * C + 2 * n * nv + n * nv * dv));                 \
        if (!mixed) return 1;                                                                               \
        float *gs = mixed + n * C, *bs = gs + n * nv, *o = bs + n * nv;                                     \
        T_ *st = conv_pool + slot * C * KS;                                                                 \
        const float qscale = 1.0f / sqrtf((float)dk);                                                      \
        int failed = 0;                                                                                     \
        _Pragma("omp parallel") {                                                                           \
            /* channel blocks of 64, the tokens in order: each token's inputs are read along a row */    \
            _Pragma("omp for schedule(static)") for (int64_t c0 = 0; c0 < C; c0 += 64) {                   \
                const int64_t c1 = c0 + 64 < C ? c0 + 64 : C;                                               \
                for (int64_t t = 0; t < n; t++) {                                                           \
                    float *mt = mixed + t * C;                                                              \
                    for (int64_t c = c0; c < c1; c++) mt[c] = 0.0f;                                         \
                    for (int64_t j = 0; j < Kc; j++) {                                                      \
                        const int64_t at = t + j - KS; /* < 0: the pool's inputs */                         \
                        if (at >= 0) {                                                                      \
                            const T_ *x = qkv + at * C;                                                     \
                            for (int64_t c = c0; c < c1; c++) mt[c] += LOAD(x[c]) * conv_w[c * Kc + j];     \
                        } else if (!fresh) {                                                                \
                            for (int64_t c = c0; c < c1; c++)                                               \
                                mt[c] += LOAD(st[c * KS + KS + at]) * conv_w[c * Kc + j];                   \
                        }                                                                                   \
                    }                                                                                       \
                    for (int64_t c = c0; c < c1; c++) mt[c] = RT(dn_silu(mt[c]));                           \
                }                                                                                           \
                for (int64_t c = c0; c < c1; c++) {                                                         \
                    T_ *s = st + c * KS;                                                                    \
                    T_ keep[KS > 0 ? KS : 1];                                                               \
                    for (int64_t j = 0; j < KS; j++) {                                                      \
                        const int64_t at = n - KS + j;                                                      \
                        keep[j] = at >= 0 ? qkv[at * C + c] : fresh ? (T_)0 : s[KS + at];                  \
                    }                                                                                       \
                    for (int64_t j = 0; j < KS; j++) s[j] = keep[j];                                        \
                }                                                                                           \
            }                                                                                               \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++) {                          \
                for (int64_t h = 0; h < nk; h++)                                                            \
                    for (int64_t part = 0; part < 2; part++) {                                              \
                        float *x = mixed + t * C + (part * nk + h) * dk, ss = 0.0f;                         \
                        for (int64_t d = 0; d < dk; d++) ss += x[d] * x[d];                                 \
                        const float r = (part ? 1.0f : qscale) / sqrtf(ss + 1e-6f);                         \
                        for (int64_t d = 0; d < dk; d++) x[d] *= r;                                         \
                    }                                                                                       \
                for (int64_t h = 0; h < nv; h++) {                                                          \
                    const float av = LOAD(aq[t * nv + h]) + dt_bias[h];                                     \
                    const float sp = av > 20.0f ? av : log1pf(expf(av));                                    \
                    gs[t * nv + h] = -expf(A_log[h]) * sp;                                                  \
                    bs[t * nv + h] = RT(dn_sigmoid(LOAD(bq[t * nv + h])));                                  \
                }                                                                                           \
            }                                                                                               \
            float *buf = malloc(sizeof(float) * rule_floats(dk, dv, chunk));                                \
            if (!buf) {                                                                                     \
                _Pragma("omp atomic write") failed = 1;                                                     \
            }                                                                                               \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t h = 0; h < nv; h++) {                     \
                if (!buf) continue;                                                                         \
                const int64_t kh = tiled ? h % nk : h / rep;                                                \
                float *S = rec_pool + (slot * nv + h) * dk * dv;                                            \
                if (fresh)                                                                                  \
                    for (int64_t i = 0; i < dk * dv; i++) S[i] = 0.0f;                                      \
                rule_head(mixed + kh * dk, mixed + (nk + kh) * dk, C, mixed + 2 * nk * dk + h * dv, C, gs + h,  \
                          bs + h, nv, S, o + h * dv, nv * dv, n, dk, dv, chunk, buf);                       \
            }                                                                                               \
            free(buf);                                                                                      \
            _Pragma("omp for schedule(static)") for (int64_t th = 0; th < n * nv; th++) {                  \
                const float *oi = o + th * dv;                                                              \
                float ss = 0.0f;                                                                            \
                for (int64_t j = 0; j < dv; j++) {                                                          \
                    const float x = RT(oi[j]);                                                              \
                    ss += x * x;                                                                            \
                }                                                                                           \
                const float r = 1.0f / sqrtf(ss / (float)dv + eps);                                         \
                const T_ *zr = z + th * dv;                                                                 \
                T_ *dst = out + th * dv;                                                                    \
                for (int64_t j = 0; j < dv; j++) {                                                          \
                    const float zj = LOAD(zr[j]);                                                           \
                    dst[j] = STORE(RT(norm_w[j] * RT(RT(oi[j]) * r)) * dn_silu(zj));                        \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        free(mixed);                                                                                        \
        return failed;                                                                                      \
    }

DEFINE_GDN_PREFILL_LAYER(pytgi_gdn_prefill_layer_f32, float, f32_same, f32_same, f32_same)
DEFINE_GDN_PREFILL_LAYER(pytgi_gdn_prefill_layer_bf16, uint16_t, bf16_load, bf16_round, bf16_rt)
