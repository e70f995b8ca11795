/* Multi-head latent attention's decodes in one call (pytgi/engine/models/mla.py): everything between
 * the projections q_b / kv_a and o_proj, with the same roundings as the layer's PyTorch ops, so that a
 * decode gives the same bits on either path (and a decode's row, batch invariant there, stays so).
 *
 * A decode step's PyTorch ops here are some forty small ones a layer (norm, the rotary embedding of
 * q_pe and k_pe, cat, the cache write, the two per-head products, the attention call's checks): their
 * dispatch costs more than their arithmetic. The parts:
 *   - kv_a_layernorm of the latent c: RMSNorm's steps (float32 squares summed in a fixed order of this
 *     file's, `sum_squares`; mean, rsqrt; x · rstd rounded to bf16, times the weight,
 *     rounded) into the cache row at the token's slot;
 *   - the rotary embedding of k_pe (into the row) and of each head's q_pe (into the query row), each
 *     product and the sum rounded to bf16 as PyTorch's bf16 ops round them, the tables rounded to bf16;
 *     DeepSeek's paired features (x0, x1), ... first laid out as rotate-half's;
 *   - the query's latent part q_nope · W_UK, the attention over the cached rows and its latent part
 *     times W_UV: bf16gemm.c's batched matmul and paged_attention.c's decode entry, the calls the
 *     PyTorch path makes.
 * Both the scalar code here and the calls it makes have portable paths (bf16gemm.c: AVX2; attention:
 * its portable kernel); without bf16gemm.c's build (no AVX2) the layer never packs W_UK, W_UV and
 * never calls this. Built and loaded by pytgi/engine/kernels/__init__.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "pytgi_kernels.h"

/* PyTorch's float32 sum and the division, rsqrt and products after it: evaluated as written (no
 * reassociation, no fused multiply-adds), whatever the file's -ffast-math. */
#if defined(__clang__)
#define AS_WRITTEN __attribute__((noinline))
#define FP_STRICT _Pragma("clang fp reassociate(off) contract(off)")
#elif defined(__GNUC__)
#define AS_WRITTEN __attribute__((noinline, optimize("no-fast-math", "fp-contract=off")))
#define FP_STRICT
#else
#define AS_WRITTEN
#define FP_STRICT
#endif

#define PARTS 16 /* the sum's interleaved partial sums */

/* Σ x[i]² over n bf16 values in float32, in a fixed order whatever the build: PARTS interleaved partial
 * sums (lane-wise, so the compiler vectorizes them without reassociating), then the tail, then the parts
 * in order. Not PyTorch's order: the MLA layer takes this norm on every step where mla.c may run
 * (`MLAttention._norms_in_c`), so no row meets the other. */
AS_WRITTEN static float sum_squares(const uint16_t *x, int64_t n) {
    FP_STRICT
    float part[PARTS] = {0}, sum = 0.0f;
    int64_t i = 0;
    for (; i + PARTS <= n; i += PARTS)
        for (int l = 0; l < PARTS; l++) {
            const float f = bf16_load(x[i + l]), s = f * f;
            part[l] += s;
        }
    for (; i < n; i++) {
        const float f = bf16_load(x[i]), s = f * f;
        sum += s;
    }
    for (int l = 0; l < PARTS; l++) sum += part[l];
    return sum;
}

/* RMSNorm (pytgi/engine/models/layers.py) of n bf16 values: w · bf16(x · rsqrt(mean(x²) + eps)). */
AS_WRITTEN static void rms_norm(const uint16_t *x, const float *w, uint16_t *out, int64_t n, float eps) {
    FP_STRICT
    const float mean = sum_squares(x, n) / (float)n;
    const float rstd = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < n; i++) {
        const float y = bf16_load(x[i]) * rstd;
        out[i] = bf16_round(w[i] * bf16_rt(y));
    }
}

void pytgi_rms_norm_bf16(const uint16_t *x, const float *w, uint16_t *out, int64_t T, int64_t D, float eps) {
    for (int64_t t = 0; t < T; t++) rms_norm(x + t * D, w, out + t * D, D, eps);
}

/* The rotary embedding of d bf16 values (the sign of rotate-half folded into sin): y · cos + swap(y) · sin,
 * each product and the sum rounded to bf16; y = x, or x's pairs (x0, x1), ... laid out as (x0, x2, ...,
 * x1, x3, ...) with `interleave`. */
static void rotary(const uint16_t *x, const float *cos, const float *sin, uint16_t *out, int64_t d, int interleave) {
    const int64_t half = d / 2;
    float y[512];
    for (int64_t e = 0; e < d; e++)
        y[e] = bf16_load(interleave ? x[e < half ? 2 * e : 2 * (e - half) + 1] : x[e]);
    for (int64_t e = 0; e < d; e++) {
        const float sw = y[e < half ? e + half : e - half];
        const float a = bf16_rt(y[e] * bf16_rt(cos[e])), b = bf16_rt(sw * bf16_rt(sin[e]));
        out[e] = bf16_round(a + b);
    }
}

int pytgi_mla_decode_bf16(const uint16_t *q, const uint16_t *kv, const float *cos, const float *sin,
                          const int64_t *slots, const float *norm_w, uint16_t *k_cache, int64_t num_slots,
                          const uint16_t *w_uk, const uint16_t *w_uv, uint16_t *out, const int64_t *rows,
                          const int64_t *block_tables, const int64_t *ctx_lens, int64_t B, int64_t max_blocks,
                          int64_t block_size, int64_t H, int64_t nope, int64_t d, int64_t r, int64_t v,
                          int64_t interleave, float eps, float scale) {
    const int64_t T = B, qw = nope + d, row = r + d;
    if (d > 512) return 2;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 3;
    uint16_t *q_row = malloc(sizeof(uint16_t) * T * H * row), *att = malloc(sizeof(uint16_t) * T * H * row);
    int err = 1;
    if (q_row == NULL || att == NULL) goto done;
    _Pragma("omp parallel for if (T >= 8)")
    for (int64_t t = 0; t < T; t++) { /* the cache row [norm(c), rotary(k_pe)], the queries' rotary part */
        const uint16_t *c = kv + t * row;
        uint16_t *cached = k_cache + slots[t] * row;
        rms_norm(c, norm_w, cached, r, eps);
        rotary(c + r, cos + t * d, sin + t * d, cached + r, d, (int)interleave);
        for (int64_t h = 0; h < H; h++)
            rotary(q + (t * H + h) * qw + nope, cos + t * d, sin + t * d, q_row + (t * H + h) * row + r, d,
                   (int)interleave);
    }
    err = pytgi_bf16gemm_batched_bf16(q, w_uk, q_row, H, T, r, nope, qw, H * qw, row, H * row);
    if (!err)
        err = pytgi_decode_attention_bf16(q_row, k_cache, k_cache, att, rows, block_tables, ctx_lens, B, max_blocks,
                                          block_size, H, 1, row, scale, 0, NULL, NULL);
    if (!err) err = pytgi_bf16gemm_batched_bf16(att, w_uv, out, H, T, v, r, row, H * row, v, H * v);
done:
    free(q_row);
    free(att);
    return err;
}
