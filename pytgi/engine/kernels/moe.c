/* All the routed experts of a mixture-of-experts layer for one step, in one call (bf16, experts packed
 * for qgemv.c). In PyTorch a decode step was ~15 small operations per expert (gather, two matmul calls,
 * SiLU, weighting, the sum): 8 experts in each of 48 layers made the Python around the matmuls a tenth of
 * a token's time. The matmuls are qgemv.c's (AMX tiles above `amx_above` rows, where built), so each
 * expert's rows are what the step-by-step PyTorch path computed.
 *
 * The step's P (token, expert) pairs come sorted by expert: pair p is token tok[p] with router weight
 * wt[p]; expert e owns pairs starts[e] .. starts[e + 1]. Its gate|up and down weights are packed at the
 * addresses gate_up[e], down[e] in formats bits_gu[e], bits_down[e]. Each token's output is the sum of
 * its pairs' weighted outputs in float32, in the order of the pairs (by expert): the same for a token
 * whatever else the step holds.
 *
 * gpt-oss's experts (`pytgi_moe_oai_bf16`) add a bias to the router's logits, to each expert's gate|up
 * and to its down output (given on one tensor-parallel rank only: the partial outputs are summed), and
 * take a clamped SwiGLU: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = min(gate, limit). Its
 * router softmaxes the chosen logits: the renormalised softmax over the chosen experts.
 *
 * `pytgi_moe_experts_bf16` (routed by the caller) takes the experts' activation by its code `act`: SiLU·up
 * (0), Gemma 4's GELU(tanh)·up (1), or Nemotron-H's relu(up)² (2), whose experts have no gate: their
 * first weight is the I up rows alone, not gate|up's 2I. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "pytgi_kernels.h"

/* The router: per token, softmax over the E experts' logits (bf16, as a bf16 linear rounds them), its
 * k largest (the lower index first among equals), renormalised to sum 1 when norm_topk; then the
 * (token, expert) pairs sorted by expert, stably (token order within an expert): starts [E + 1], tok and
 * wt [T k]. */
static int route(const uint16_t *x, const uint16_t *router, const uint16_t *bias, int64_t T, int64_t H, int64_t E,
                 int64_t k, int64_t norm_topk, int64_t *starts, int64_t *tok, float *wt) {
    float *p = malloc(sizeof(float) * (size_t)(T * E));
    int64_t *pick = malloc(sizeof(int64_t) * (size_t)(T * k));
    float *pw = malloc(sizeof(float) * (size_t)(T * k));
    if (p == NULL || pick == NULL || pw == NULL) {
        free(p), free(pick), free(pw);
        return 1;
    }
#pragma omp parallel for schedule(static) if (T >= 8)
    for (int64_t t = 0; t < T; t++) {
        float *pt = p + t * E, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            float acc = 0.0f;
            for (int64_t h = 0; h < H; h++) acc += bf16_load(x[t * H + h]) * bf16_load(router[e * H + h]);
            pt[e] = bf16_rt(bias != NULL ? acc + bf16_load(bias[e]) : acc);
        }
        float top = pt[0];
        for (int64_t e = 1; e < E; e++) top = pt[e] > top ? pt[e] : top;
        for (int64_t e = 0; e < E; e++) sum += (pt[e] = expf(pt[e] - top));
        for (int64_t e = 0; e < E; e++) pt[e] /= sum;
        float chosen = 0.0f;
        for (int64_t j = 0; j < k; j++) { /* k passes: k is small (8 of 128) */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= pick[t * k + i] == e;
                if (!taken && (best < 0 || pt[e] > pt[best])) best = e;
            }
            pick[t * k + j] = best, pw[t * k + j] = pt[best], chosen += pt[best];
        }
        if (norm_topk)
            for (int64_t j = 0; j < k; j++) pw[t * k + j] /= chosen;
    }
    for (int64_t e = 0; e <= E; e++) starts[e] = 0;
    for (int64_t i = 0; i < T * k; i++) starts[pick[i] + 1]++;
    for (int64_t e = 0; e < E; e++) starts[e + 1] += starts[e];
    int64_t *at = malloc(sizeof(int64_t) * (size_t)E);
    if (at == NULL) {
        free(p), free(pick), free(pw);
        return 1;
    }
    for (int64_t e = 0; e < E; e++) at[e] = starts[e];
    for (int64_t i = 0; i < T * k; i++) { /* flat order (token, choice): stable within an expert */
        const int64_t q = at[pick[i]]++;
        tok[q] = i / k, wt[q] = pw[i];
    }
    free(at), free(p), free(pick), free(pw);
    return 0;
}

enum { ACT_SILU = 0, ACT_GELU = 1, ACT_RELU2 = 2 }; /* `act`: the experts' activation */

/* up rows (bf16) → relu(up)², rounded to bf16 once, as PyTorch's relu then square round it */
static void relu2(const uint16_t *up, uint16_t *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float u = bf16_load(up[i]);
        h[i] = u > 0.0f ? bf16_round(u * u) : 0;
    }
}

/* gpt-oss's additions to the experts (NULL: plain SwiGLU experts without biases). */
typedef struct {
    const uint16_t *gate_up_bias; /* [E, 2I] */
    const uint16_t *down_bias;    /* [E, H], or NULL (a rank but the first) */
    float alpha, limit;
} oai_experts;

/* gate|up rows (bf16 [n, 2I]) plus expert bias b [2I] → the clamped SwiGLU h [n, I], each operation
 * rounded to bf16 as the PyTorch path's are. */
static void oai_act(const uint16_t *gu, const uint16_t *b, uint16_t *h, int64_t n, int64_t I, float alpha,
                    float limit) {
    _Pragma("omp parallel for if (n >= 8)")
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < I; i++) {
            float g = bf16_rt(bf16_load(gu[t * 2 * I + i]) + bf16_load(b[i]));
            float u = bf16_rt(bf16_load(gu[t * 2 * I + I + i]) + bf16_load(b[I + i]));
            g = g < limit ? g : limit;
            u = u < -limit ? -limit : u > limit ? limit : u;
            /* the exponent kept finite (-ffast-math assumes no infinities): sigmoid(-80) is 0 in bf16 */
            const float z = bf16_rt(g * alpha);
            const float glu = bf16_rt(g * bf16_rt(1.0f / (1.0f + expf(z > -80.0f ? -z : 80.0f))));
            h[t * I + i] = bf16_round(bf16_rt(u + 1.0f) * glu);
        }
}

static int experts(const uint16_t *x, uint16_t *out, int64_t T, int64_t H, int64_t I, int64_t E,
                   const int64_t *starts, const int64_t *tok, const float *wt, const int64_t *gate_up,
                   const int64_t *down, const int64_t *bits_gu, const int64_t *bits_down, int64_t amx_above,
                   const oai_experts *oai, int act) {
    const int64_t P = starts[E], I1 = act == ACT_RELU2 ? I : 2 * I; /* the first weight's rows */
    uint16_t *xs = malloc(sizeof(uint16_t) * (size_t)(P * (2 * H + 3 * I)));
    float *acc = calloc((size_t)(T * H), sizeof(float));
    int64_t *expert = malloc(sizeof(int64_t) * (size_t)(P > 0 ? P : 1));
    if (xs == NULL || acc == NULL || expert == NULL) {
        free(xs), free(acc), free(expert);
        return 1;
    }
    uint16_t *ys = xs + P * H, *gu = ys + P * H, *h = gu + 2 * P * I;
    for (int64_t p = 0; p < P; p++)
        for (int64_t i = 0; i < H; i++) xs[p * H + i] = x[tok[p] * H + i];
    int failed = 0;
    for (int64_t e = 0; e < E && !failed; e++) {
        const int64_t a = starts[e], n = starts[e + 1] - a;
        for (int64_t p = a; p < a + n; p++) expert[p] = e;
        if (n == 0) continue;
        const int amx = n > amx_above;
        const uint8_t *wgu = (const uint8_t *)(intptr_t)gate_up[e], *wd = (const uint8_t *)(intptr_t)down[e];
        failed |= amx ? pytgi_qgemm_amx_bf16(xs + a * H, wgu, gu + a * I1, n, I1, H, bits_gu[e])
                      : pytgi_qgemv_bf16(xs + a * H, wgu, gu + a * I1, n, I1, H, bits_gu[e]);
        if (oai != NULL)
            oai_act(gu + 2 * a * I, oai->gate_up_bias + e * 2 * I, h + a * I, n, I, oai->alpha, oai->limit);
        else if (act == ACT_GELU)
            pytgi_gelu_tanh_mul_bf16(gu + 2 * a * I, h + a * I, n, I);
        else if (act == ACT_RELU2)
            relu2(gu + a * I, h + a * I, n * I);
        else
            pytgi_silu_mul_bf16(gu + 2 * a * I, h + a * I, n, I);
        failed |= amx ? pytgi_qgemm_amx_bf16(h + a * I, wd, ys + a * H, n, H, I, bits_down[e])
                      : pytgi_qgemv_bf16(h + a * I, wd, ys + a * H, n, H, I, bits_down[e]);
    }
    if (!failed) {
        const uint16_t *db = oai != NULL ? oai->down_bias : NULL;
        for (int64_t p = 0; p < P; p++) {
            float *o = acc + tok[p] * H;
            const uint16_t *y = ys + p * H;
            const float w = wt[p];
            if (db != NULL)
                for (int64_t i = 0; i < H; i++) o[i] += w * bf16_rt(bf16_load(y[i]) + bf16_load(db[expert[p] * H + i]));
            else
                for (int64_t i = 0; i < H; i++) o[i] += w * bf16_load(y[i]);
        }
        for (int64_t i = 0; i < T * H; i++) out[i] = bf16_round(acc[i]);
    }
    free(xs), free(acc), free(expert);
    return failed;
}

static int moe(const uint16_t *x, uint16_t *out, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k,
               int64_t norm_topk, const uint16_t *router, const uint16_t *router_bias, const int64_t *gate_up,
               const int64_t *down, const int64_t *bits_gu, const int64_t *bits_down, int64_t amx_above,
               const oai_experts *oai) {
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(E + 1 + T * k));
    float *wt = malloc(sizeof(float) * (size_t)(T * k));
    int failed = starts == NULL || wt == NULL;
    if (!failed) failed = route(x, router, router_bias, T, H, E, k, norm_topk, starts, starts + E + 1, wt);
    if (!failed)
        failed = experts(x, out, T, H, I, E, starts, starts + E + 1, wt, gate_up, down, bits_gu, bits_down,
                         amx_above, oai, ACT_SILU);
    free(starts);
    free(wt);
    return failed;
}

int pytgi_moe_bf16(const uint16_t *x, uint16_t *out, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k,
                   int64_t norm_topk, const uint16_t *router, const int64_t *gate_up, const int64_t *down,
                   const int64_t *bits_gu, const int64_t *bits_down, int64_t amx_above) {
    return moe(x, out, T, H, I, E, k, norm_topk, router, NULL, gate_up, down, bits_gu, bits_down, amx_above, NULL);
}

int pytgi_moe_oai_bf16(const uint16_t *x, uint16_t *out, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k,
                       const uint16_t *router, const uint16_t *router_bias, const int64_t *gate_up,
                       const int64_t *down, const int64_t *bits_gu, const int64_t *bits_down, int64_t amx_above,
                       const uint16_t *gate_up_bias, const uint16_t *down_bias, float alpha, float limit) {
    const oai_experts oai = {gate_up_bias, down_bias, alpha, limit};
    return moe(x, out, T, H, I, E, k, 1, router, router_bias, gate_up, down, bits_gu, bits_down, amx_above, &oai);
}

int pytgi_moe_experts_bf16(const uint16_t *x, uint16_t *out, int64_t T, int64_t H, int64_t I, int64_t E,
                           const int64_t *starts, const int64_t *tok, const float *wt, const int64_t *gate_up,
                           const int64_t *down, const int64_t *bits_gu, const int64_t *bits_down,
                           int64_t amx_above, int64_t act) {
    if (act < ACT_SILU || act > ACT_RELU2) return 1;
    return experts(x, out, T, H, I, E, starts, tok, wt, gate_up, down, bits_gu, bits_down, amx_above, NULL,
                   (int)act);
}
