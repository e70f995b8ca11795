/* The gated delta rule's decode step for CPU (Qwen3-Next's and Qwen3.5's linear-attention layers,
 * pytgi/engine/models/linear_attention.py): one token of each of B requests, each request's recurrent
 * state read and written in place in the layer's state pool, so the step makes two passes over each
 * state and no copies. For request b and value head h, S = pool[slots[b], h] (K × V, float32):
 *
 *     S ← e^g S;  u = β (v − Sᵀk);  S ← S + k uᵀ;  o = Sᵀq
 *
 * computed as m = Sᵀk (the old state), u = β (v − e^g m), then S_kv = e^g S_kv + k_k u_v row by row,
 * with o accumulated from the new rows. q and k come L2-normalized (q scaled), one per value head.
 * Each (b, h) is independent of the others: a request's numbers do not depend on its batch. */
#include <math.h>
#include <stdint.h>

#include "pytgi_kernels.h"

void pytgi_gdn_decode_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                          float *pool, const int64_t *slots, float *out, int64_t B, int64_t H, int64_t K,
                          int64_t V) {
    _Pragma("omp parallel for schedule(static) if (B * H >= 4)")
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        float *S = pool + (slots[b] * H + h) * K * V;
        const float *qb = q + bh * K, *kb = k + bh * K, *vb = v + bh * V;
        float *o = out + bh * V;
        const float decay = expf(g[bh]), bt = beta[bh];
        float u[V];
        for (int64_t j = 0; j < V; j++) u[j] = 0.0f;
        for (int64_t i = 0; i < K; i++) {
            const float ki = kb[i];
            const float *row = S + i * V;
            for (int64_t j = 0; j < V; j++) u[j] += ki * row[j];
        }
        for (int64_t j = 0; j < V; j++) {
            u[j] = bt * (vb[j] - decay * u[j]);
            o[j] = 0.0f;
        }
        for (int64_t i = 0; i < K; i++) {
            const float ki = kb[i], qi = qb[i];
            float *row = S + i * V;
            for (int64_t j = 0; j < V; j++) {
                const float s = decay * row[j] + ki * u[j];
                row[j] = s;
                o[j] += qi * s;
            }
        }
    }
}
