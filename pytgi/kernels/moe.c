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
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "pytgi_kernels.h"

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
