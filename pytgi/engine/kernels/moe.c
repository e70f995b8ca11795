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
 * whatever else the step holds. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "pytgi_kernels.h"

/* The router: per token, softmax over the E experts' logits (bf16, as a bf16 linear rounds them), its
 * k largest (the lower index first among equals), renormalised to sum 1 when norm_topk; then the
 * (token, expert) pairs sorted by expert, stably (token order within an expert): starts [E + 1], tok and
 * wt [T k]. */
static int route(const uint16_t *x, const uint16_t *router, int64_t T, int64_t H, int64_t E, int64_t k,
                 int64_t norm_topk, int64_t *starts, int64_t *tok, float *wt) {
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
            pt[e] = bf16_rt(acc);
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

int pytgi_moe_bf16(const uint16_t *x, uint16_t *out, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k,
                   int64_t norm_topk, const uint16_t *router, const int64_t *gate_up, const int64_t *down,
                   const int64_t *bits_gu, const int64_t *bits_down, int64_t amx_above) {
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(E + 1 + T * k));
    float *wt = malloc(sizeof(float) * (size_t)(T * k));
    int failed = starts == NULL || wt == NULL;
    if (!failed) failed = route(x, router, T, H, E, k, norm_topk, starts, starts + E + 1, wt);
    if (!failed)
        failed = pytgi_moe_experts_bf16(x, out, T, H, I, E, starts, starts + E + 1, wt, gate_up, down, bits_gu,
                                        bits_down, amx_above);
    free(starts);
    free(wt);
    return failed;
}

int pytgi_moe_experts_bf16(const uint16_t *x, uint16_t *out, int64_t T, int64_t H, int64_t I, int64_t E,
                           const int64_t *starts, const int64_t *tok, const float *wt, const int64_t *gate_up,
                           const int64_t *down, const int64_t *bits_gu, const int64_t *bits_down,
                           int64_t amx_above) {
    const int64_t P = starts[E];
    uint16_t *xs = malloc(sizeof(uint16_t) * (size_t)(P * (2 * H + 3 * I)));
    float *acc = calloc((size_t)(T * H), sizeof(float));
    if (xs == NULL || acc == NULL) {
        free(xs);
        free(acc);
        return 1;
    }
    uint16_t *ys = xs + P * H, *gu = ys + P * H, *h = gu + 2 * P * I;
    for (int64_t p = 0; p < P; p++)
        for (int64_t i = 0; i < H; i++) xs[p * H + i] = x[tok[p] * H + i];
    int failed = 0;
    for (int64_t e = 0; e < E && !failed; e++) {
        const int64_t a = starts[e], n = starts[e + 1] - a;
        if (n == 0) continue;
        const int amx = n > amx_above;
        const uint8_t *wgu = (const uint8_t *)(intptr_t)gate_up[e], *wd = (const uint8_t *)(intptr_t)down[e];
        failed |= amx ? pytgi_qgemm_amx_bf16(xs + a * H, wgu, gu + 2 * a * I, n, 2 * I, H, bits_gu[e])
                      : pytgi_qgemv_bf16(xs + a * H, wgu, gu + 2 * a * I, n, 2 * I, H, bits_gu[e]);
        pytgi_silu_mul_bf16(gu + 2 * a * I, h + a * I, n, I);
        failed |= amx ? pytgi_qgemm_amx_bf16(h + a * I, wd, ys + a * H, n, H, I, bits_down[e])
                      : pytgi_qgemv_bf16(h + a * I, wd, ys + a * H, n, H, I, bits_down[e]);
    }
    if (!failed) {
        for (int64_t p = 0; p < P; p++) {
            float *o = acc + tok[p] * H;
            const uint16_t *y = ys + p * H;
            const float w = wt[p];
            for (int64_t i = 0; i < H; i++) o[i] += w * bf16_load(y[i]);
        }
        for (int64_t i = 0; i < T * H; i++) out[i] = bf16_round(acc[i]);
    }
    free(xs);
    free(acc);
    return failed;
}
