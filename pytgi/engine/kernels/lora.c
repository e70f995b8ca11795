/* lora.c: LoRA's low-rank products, row by row (punica's SGMV, on the CPU).
 *
 * Row t of a step whose adapter slot s = slots[t] is >= 0 gets
 *     y[t, :] += (x[t, :] · A_sᵀ) · B_sᵀ
 * A_s [R_s, K] is at a_ptrs[s]; R_s = ranks[s] (0: the adapter does not target this layer). B_sᵀ is
 * stored by rank row, each row only over the output columns it reaches: row r covers columns
 * [cols[2r], cols[2r] + cols[2r + 1]) (cols at col_ptrs[s]; a fused layer's part reaches only its
 * own columns), its values one after the other at bt_ptrs[s]. The scaling is folded into B.
 * Weights are in the activations' type (float32, or bf16 stored as uint16); sums are float32.
 *
 * Batch invariance: every element is computed by the same two out-of-line functions (`noipa`, so
 * that no call site gets other code), in the same order, whatever the other rows of the step: xa[r]
 * is one dot product over k, and d[n] adds xa[r]·B[r, n] over r in order. Only who computes what
 * differs: the rows are split over the threads (from four rows on; fewer run on the caller's thread:
 * a thread team costs more than a decode row's products, which are memory-bound). */
#include <stdlib.h>

#include "bf16.h"
#include "pytgi_kernels.h"

#define NOIPA __attribute__((noipa))
#define COLS_CHUNK 256

#define F32_LOAD(v) (v)
#define F32_STORE(v) (v)

#define LORA_KERNEL(SUFFIX, T_ACT, LOAD, STORE)                                                        \
    NOIPA static float dot_##SUFFIX(const float *x, const T_ACT *a, int64_t K) {                      \
        float acc = 0.0f;                                                                             \
        for (int64_t k = 0; k < K; k++) acc += x[k] * LOAD(a[k]);                                     \
        return acc;                                                                                   \
    }                                                                                                 \
    NOIPA static void axpy_##SUFFIX(float *d, float v, const T_ACT *b, int64_t n) {                    \
        for (int64_t i = 0; i < n; i++) d[i] += v * LOAD(b[i]);                                       \
    }                                                                                                 \
                                                                                                      \
    /* d[lo:hi] (d's index 0 is column lo) of the row whose rank projections are xa */               \
    static void columns_##SUFFIX(float *d, int64_t lo, int64_t hi, const float *xa, int64_t R,          \
                                 const T_ACT *Bt, const int64_t *cols) {                              \
        for (int64_t n = 0; n < hi - lo; n++) d[n] = 0.0f;                                            \
        const T_ACT *b = Bt;                                                                          \
        for (int64_t r = 0; r < R; r++) {                                                             \
            const int64_t c0 = cols[2 * r], len = cols[2 * r + 1];                                    \
            const int64_t from = c0 > lo ? c0 : lo, to = c0 + len < hi ? c0 + len : hi;               \
            if (from < to) axpy_##SUFFIX(d + (from - lo), xa[r], b + (from - c0), to - from);         \
            b += len;                                                                                 \
        }                                                                                             \
    }                                                                                                 \
                                                                                                      \
    int pytgi_lora_add_##SUFFIX(T_ACT *y, const T_ACT *x, int64_t T, int64_t K, int64_t N,            \
                                const int64_t *slots, const int64_t *a_ptrs, const int64_t *bt_ptrs,  \
                                const int64_t *ranks, const int64_t *col_ptrs) {                      \
        int64_t max_r = 0, rows = 0;                                                                  \
        for (int64_t t = 0; t < T; t++) {                                                             \
            const int64_t s = slots[t];                                                               \
            if (s >= 0 && ranks[s] > 0) {                                                             \
                rows++;                                                                               \
                if (ranks[s] > max_r) max_r = ranks[s];                                               \
            }                                                                                         \
        }                                                                                             \
        if (rows == 0) return 0;                                                                      \
        int failed = 0;                                                                               \
        _Pragma("omp parallel if (rows >= 4)") { /* a row per thread at a time */                    \
            float *buf = malloc(sizeof(float) * (size_t)(K + max_r + COLS_CHUNK));                    \
            if (buf == NULL) {                                                                        \
                _Pragma("omp atomic write") failed = 1;                                               \
            }                                                                                         \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < T; t++) {                     \
                const int64_t s = slots[t];                                                           \
                if (buf == NULL || s < 0 || ranks[s] <= 0) continue;                                  \
                const int64_t R = ranks[s];                                                           \
                const T_ACT *A = (const T_ACT *)(intptr_t)a_ptrs[s], *Bt = (const T_ACT *)(intptr_t)bt_ptrs[s]; \
                const int64_t *cols = (const int64_t *)(intptr_t)col_ptrs[s];                         \
                float *xf = buf, *xa = buf + K, *d = buf + K + max_r;                                 \
                for (int64_t k = 0; k < K; k++) xf[k] = LOAD(x[t * K + k]);                           \
                for (int64_t r = 0; r < R; r++) xa[r] = dot_##SUFFIX(xf, A + r * K, K);              \
                T_ACT *yt = y + t * N;                                                                \
                for (int64_t lo = 0; lo < N; lo += COLS_CHUNK) {                                      \
                    const int64_t hi = lo + COLS_CHUNK < N ? lo + COLS_CHUNK : N;                     \
                    columns_##SUFFIX(d, lo, hi, xa, R, Bt, cols);                                     \
                    for (int64_t n = lo; n < hi; n++) yt[n] = STORE(LOAD(yt[n]) + d[n - lo]);         \
                }                                                                                     \
            }                                                                                         \
            free(buf);                                                                                \
        }                                                                                             \
        return failed;                                                                                \
    }

LORA_KERNEL(f32, float, F32_LOAD, F32_STORE)
LORA_KERNEL(bf16, uint16_t, bf16_load, bf16_round)
