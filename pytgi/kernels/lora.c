/* lora.c: LoRA's low-rank products, row by row (punica's SGMV, on the CPU).
 *
 * Row t of a step whose adapter slot s = slots[t] is >= 0 gets
 *     y[t, :] += (x[t, :] · A_sᵀ) · Bt_s
 * with A_s [R_s, K] and Bt_s [R_s, N] float32 (the scaling folded into Bt_s) at the addresses
 * a_ptrs[s] and bt_ptrs[s], R_s = ranks[s] (0: the adapter does not target this layer).
 * Each row is computed on its own by the same code in the same order, whatever the other rows of
 * the step and their adapters: the result is batch invariant. */
#include <stdlib.h>

#include "bf16.h"
#include "pytgi_kernels.h"

/* d[0:N] = (x · Aᵀ) · Bt for one row, in float32; xa: R floats of scratch */
static void lora_row(const float *x, const float *A, const float *Bt, int64_t R, int64_t K, int64_t N,
                     float *xa, float *d) {
    for (int64_t r = 0; r < R; r++) {
        const float *a = A + r * K;
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc += x[k] * a[k];
        xa[r] = acc;
    }
    for (int64_t n = 0; n < N; n++) d[n] = 0.0f;
    for (int64_t r = 0; r < R; r++) {
        const float *b = Bt + r * N;
        const float v = xa[r];
        for (int64_t n = 0; n < N; n++) d[n] += v * b[n];
    }
}

#define LORA_ADD(SUFFIX, T_ACT, LOAD, STORE)                                                           \
    int pytgi_lora_add_##SUFFIX(T_ACT *y, const T_ACT *x, int64_t T, int64_t K, int64_t N,            \
                                const int64_t *slots, const int64_t *a_ptrs, const int64_t *bt_ptrs,  \
                                const int64_t *ranks) {                                               \
        int failed = 0;                                                                               \
        int64_t max_r = 0;                                                                            \
        for (int64_t t = 0; t < T; t++)                                                               \
            if (slots[t] >= 0 && ranks[slots[t]] > max_r) max_r = ranks[slots[t]];                    \
        _Pragma("omp parallel if (T >= 4)") {                                                         \
            float *buf = malloc(sizeof(float) * (size_t)(K + N + max_r));                             \
            if (buf == NULL) {                                                                        \
                _Pragma("omp atomic write") failed = 1;                                               \
            }                                                                                         \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < T; t++) {                     \
                const int64_t s = slots[t];                                                           \
                if (buf == NULL || s < 0 || ranks[s] <= 0) continue;                                  \
                float *xf = buf, *d = buf + K, *xa = buf + K + N;                                     \
                const int64_t R = ranks[s];                                                           \
                for (int64_t k = 0; k < K; k++) xf[k] = LOAD(x[t * K + k]);                           \
                lora_row(xf, (const float *)(intptr_t)a_ptrs[s], (const float *)(intptr_t)bt_ptrs[s], \
                         R, K, N, xa, d);                                                             \
                T_ACT *yt = y + t * N;                                                                \
                for (int64_t n = 0; n < N; n++) yt[n] = STORE(LOAD(yt[n]) + d[n]);                    \
            }                                                                                         \
            free(buf);                                                                                \
        }                                                                                             \
        return failed;                                                                                \
    }

#define F32_LOAD(v) (v)
#define F32_STORE(v) (v)
LORA_ADD(f32, float, F32_LOAD, F32_STORE)
LORA_ADD(bf16, uint16_t, bf16_load, bf16_round)
