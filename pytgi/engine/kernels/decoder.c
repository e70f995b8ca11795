/* All decoder layers of a Llama-family model in one call, for CPU steps of few tokens in bf16.
 *
 * A decode step of one token runs ~10 kernels per layer; called one by one from Python, each pays
 * for a ctypes call, tensor allocations and module calls, which add up to a sizeable part of a
 * small step (docs/history/2026-11-30-default-model.md has the figures). This loop calls the very same kernels
 * (paged_attention.c, fused.c, qgemv.c) with the same arguments, so its output equals the Python
 * path's bit for bit. pytgi/engine/models/decoder_loop.py uses it when every linear has a packed low-bit
 * weight, attention is all paged, and the model is unsharded and bias-free.
 *
 * layers: per layer LAYER_FIELDS int64 values (see below); the residual stream `x` [T, hidden] is
 * updated in place and `h` receives the final RMSNorm of it. Returns nonzero on out of memory.
 *
 * LoRA adapters (pytgi/engine/models/lora.py): with `row_slots` (each row's adapter slot, -1: none) not NULL,
 * `lora` holds per layer LORA_FIELDS addresses, for each of the four linears lora.c's table (A's and
 * Bt's addresses, the ranks and the column spans, by slot; 0: no adapter targets it), and each linear's product gets
 * lora.c's rows added before what follows it, as the Python path adds them. */
#include <stdint.h>
#include <stdlib.h>

#include "pytgi_kernels.h"

enum {
    IN_NORM,   /* bf16 [hidden] */
    POST_NORM, /* bf16 [hidden] */
    NEXT_NORM, /* the next layer's input norm, or the final norm for the last layer */
    QKV_W,     /* packed (qgemv.c layout) [(H + 2 KVH) D, hidden] */
    QKV_BITS,
    O_W, /* [hidden, H D] */
    O_BITS,
    GU_W, /* [2 I, hidden] */
    GU_BITS,
    DOWN_W, /* [hidden, I] */
    DOWN_BITS,
    K_CACHE, /* bf16 [slots, KVH, D] */
    V_CACHE,
    LAYER_FIELDS
};

enum { LORA_A, LORA_BT, LORA_RANKS, LORA_COLS, LORA_TABLE }; /* per linear: qkv, o, gate_up, down */
#define LORA_FIELDS (4 * LORA_TABLE)

/* out += the rows' LoRA products for linear `which` of a layer (a no-op without adapters) */
static int lora(const int64_t *L, int which, const int64_t *row_slots, uint16_t *out, const uint16_t *in, int64_t T,
                int64_t K, int64_t N) {
    if (row_slots == NULL || L == NULL || L[which * LORA_TABLE + LORA_RANKS] == 0) return 0;
    const int64_t *t = L + which * LORA_TABLE;
    return pytgi_lora_add_bf16(out, in, T, K, N, row_slots, (const int64_t *)t[LORA_A], (const int64_t *)t[LORA_BT],
                               (const int64_t *)t[LORA_RANKS], (const int64_t *)t[LORA_COLS]);
}

/* the same choice as QuantizedWeight.matmul: qgemv up to vnni_max_m rows, AMX tiles above */
static int matmul(const uint16_t *x, int64_t w, int64_t bits, uint16_t *out, int64_t M, int64_t N, int64_t K,
                  int64_t vnni_max_m) {
    if (M > vnni_max_m) return pytgi_qgemm_amx_bf16(x, (const uint8_t *)w, out, M, N, K, bits);
    return pytgi_qgemv_bf16(x, (const uint8_t *)w, out, M, N, K, bits);
}

/* this step's attention over the paged cache: the decode entry point when every query is one token */
static int attend(const uint16_t *q, const void *kc, const void *vc, uint16_t *out, const int64_t *q_starts,
                  const int64_t *q_lens, const int64_t *block_tables, const int64_t *ctx_lens, const int64_t *tiles,
                  int64_t B, int64_t max_blocks, int64_t block_size, int64_t H, int64_t KVH, int64_t D, float scale,
                  int64_t all_decodes, int64_t kv8, const int64_t *first) {
    if (all_decodes)
        return pytgi_decode_attention_bf16(q, kc, vc, out, q_starts, block_tables, ctx_lens, B, max_blocks, block_size,
                                           H, KVH, D, scale, kv8, NULL, first);
    return pytgi_paged_prefill_bf16(q, kc, vc, out, q_starts, q_lens, block_tables, ctx_lens, tiles, B, max_blocks,
                                    block_size, H, KVH, D, scale, kv8, NULL, first);
}

int pytgi_decoder_layers_bf16(const int64_t *layers, int64_t n_layers, uint16_t *x, uint16_t *h, int64_t T,
                              int64_t hidden, int64_t I, int64_t H, int64_t KVH, int64_t D, float eps, float scale,
                              const float *cos, const float *sin, const int64_t *slots, const int64_t *q_starts,
                              const int64_t *q_lens, const int64_t *block_tables, const int64_t *ctx_lens, const int64_t *tiles, int64_t B,
                              int64_t max_blocks, int64_t block_size, int64_t all_decodes, int64_t vnni_max_m,
                              const int64_t *lora_layers, const int64_t *row_slots, int64_t kv8) {
    const int64_t nqkv = (H + 2 * KVH) * D;
    uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)(T * (nqkv + 2 * H * D + 2 * hidden + 3 * I)));
    if (buf == NULL) return 1;
    uint16_t *qkv = buf, *q = qkv + T * nqkv, *attn = q + T * H * D, *o = attn + T * H * D, *down = o + T * hidden;
    uint16_t *gu = down + T * hidden, *act = gu + T * 2 * I;
    int failed = 0;
    pytgi_add_rms_norm_bf16(NULL, x, (const uint16_t *)layers[IN_NORM], h, T, hidden, eps);
    for (int64_t i = 0; i < n_layers && !failed; i++) {
        const int64_t *L = layers + i * LAYER_FIELDS;
        const int64_t *R = lora_layers == NULL ? NULL : lora_layers + i * LORA_FIELDS;
        void *kc = (void *)L[K_CACHE], *vc = (void *)L[V_CACHE];
        failed |= matmul(h, L[QKV_W], L[QKV_BITS], qkv, T, nqkv, hidden, vnni_max_m);
        failed |= lora(R, 0, row_slots, qkv, h, T, hidden, nqkv);
        pytgi_rope_write_kv_bf16(qkv, cos, sin, slots, q, kc, vc, T, H, KVH, D, kv8);
        failed |= attend(q, kc, vc, attn, q_starts, q_lens, block_tables, ctx_lens, tiles, B, max_blocks, block_size, H, KVH,
                         D, scale, all_decodes, kv8, NULL);
        failed |= matmul(attn, L[O_W], L[O_BITS], o, T, hidden, H * D, vnni_max_m);
        failed |= lora(R, 1, row_slots, o, attn, T, H * D, hidden);
        pytgi_add_rms_norm_bf16(o, x, (const uint16_t *)L[POST_NORM], h, T, hidden, eps);
        failed |= matmul(h, L[GU_W], L[GU_BITS], gu, T, 2 * I, hidden, vnni_max_m);
        failed |= lora(R, 2, row_slots, gu, h, T, hidden, 2 * I);
        pytgi_silu_mul_bf16(gu, act, T, I);
        failed |= matmul(act, L[DOWN_W], L[DOWN_BITS], down, T, hidden, I, vnni_max_m);
        failed |= lora(R, 3, row_slots, down, act, T, I, hidden);
        pytgi_add_rms_norm_bf16(down, x, (const uint16_t *)L[NEXT_NORM], h, T, hidden, eps);
    }
    free(buf);
    return failed;
}

/* Gemma 3's layers (pytgi/engine/models/gemma.py with the fused kernels), the same calls in the same
 * order: sandwich norms around each residual add, per-head q/k norms, each layer's own RoPE table
 * (sliding layers rotate with the local base), GELU-tanh·up. The residual stream `x` is updated in
 * place; the final norm stays with the caller. Norm weights are float32 (Gemma's 1 + w). `first`: NULL, or
 * per request the first key the sliding layers see (its window's; every query one token then). */
enum {
    G_IN_NORM,   /* float32 [hidden] */
    G_POST_ATTN, /* float32 [hidden] */
    G_PRE_FF,    /* float32 [hidden] */
    G_POST_FF,   /* float32 [hidden] */
    G_Q_NORM,    /* float32 [D] */
    G_K_NORM,    /* float32 [D] */
    G_QKV_W,
    G_QKV_BITS,
    G_O_W,
    G_O_BITS,
    G_GU_W,
    G_GU_BITS,
    G_DOWN_W,
    G_DOWN_BITS,
    G_K_CACHE,
    G_V_CACHE,
    G_LOCAL, /* 1: the sliding layers' RoPE table */
    G_FIELDS
};

int pytgi_gemma_layers_bf16(const int64_t *layers, int64_t n_layers, uint16_t *x, int64_t T, int64_t hidden,
                            int64_t I, int64_t H, int64_t KVH, int64_t D, float eps, float scale, const float *cos,
                            const float *sin, const float *cos_local, const float *sin_local, const int64_t *slots,
                            const int64_t *q_starts, const int64_t *q_lens, const int64_t *block_tables,
                            const int64_t *ctx_lens, const int64_t *tiles, int64_t B, int64_t max_blocks, int64_t block_size,
                            int64_t all_decodes, int64_t vnni_max_m, int64_t kv8, const int64_t *first) {
    const int64_t nqkv = (H + 2 * KVH) * D;
    uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)(T * (nqkv + 2 * H * D + 3 * hidden + 3 * I)));
    if (buf == NULL) return 1;
    uint16_t *qkv = buf, *q = qkv + T * nqkv, *attn = q + T * H * D, *o = attn + T * H * D, *down = o + T * hidden;
    uint16_t *h = down + T * hidden, *gu = h + T * hidden, *act = gu + T * 2 * I;
    int failed = 0;
    for (int64_t i = 0; i < n_layers && !failed; i++) {
        const int64_t *L = layers + i * G_FIELDS;
        void *kc = (void *)L[G_K_CACHE], *vc = (void *)L[G_V_CACHE];
        pytgi_norm_add_norm_bf16(NULL, x, NULL, (const float *)L[G_IN_NORM], h, T, hidden, eps);
        failed |= matmul(h, L[G_QKV_W], L[G_QKV_BITS], qkv, T, nqkv, hidden, vnni_max_m);
        if (L[G_Q_NORM]) pytgi_qk_norm_bf16(qkv, (const float *)L[G_Q_NORM], (const float *)L[G_K_NORM], T, H, KVH, D, eps, 0);
        pytgi_rope_write_kv_bf16(qkv, L[G_LOCAL] ? cos_local : cos, L[G_LOCAL] ? sin_local : sin, slots, q, kc, vc, T,
                                 H, KVH, D, kv8);
        failed |= attend(q, kc, vc, attn, q_starts, q_lens, block_tables, ctx_lens, tiles, B, max_blocks, block_size, H, KVH,
                         D, scale, all_decodes, kv8, L[G_LOCAL] ? first : NULL);
        failed |= matmul(attn, L[G_O_W], L[G_O_BITS], o, T, hidden, H * D, vnni_max_m);
        pytgi_norm_add_norm_bf16(o, x, (const float *)L[G_POST_ATTN], (const float *)L[G_PRE_FF], h, T, hidden, eps);
        failed |= matmul(h, L[G_GU_W], L[G_GU_BITS], gu, T, 2 * I, hidden, vnni_max_m);
        pytgi_gelu_tanh_mul_bf16(gu, act, T, I);
        failed |= matmul(act, L[G_DOWN_W], L[G_DOWN_BITS], down, T, hidden, I, vnni_max_m);
        pytgi_norm_add_norm_bf16(down, x, (const float *)L[G_POST_FF], NULL, NULL, T, hidden, eps);
    }
    free(buf);
    return failed;
}
