/* Every function the pytgi kernel library exports: each .c file includes this header (so the
 * compiler checks its definitions against it), and pytgi/engine/kernels/__init__.py reads the ctypes
 * signatures from it. Keep one declaration per function, on lines of its own, with parameter
 * types among: pointers, int64_t, float (and int or void results).
 *
 * bf16 values are stored as uint16_t. Row-major layouts:
 *   activations  [T, features]; q, out of attention [T, H, D]
 *   k_cache, v_cache [num_slots, KVH, D], slot = block_tables[b][pos / block_size] * block_size + pos % block_size;
 *   kv8 nonzero: uint8 [num_slots, KVH, D + 2], each row D int8 values and their bf16 scale (kv8.h)
 * Functions returning int return nonzero on failure (out of memory; 2: kernel not built here). */
#ifndef PYTGI_KERNELS_H
#define PYTGI_KERNELS_H
#include <stdint.h>

/* fused.c: element-wise steps of a decoder layer. x may be NULL (no residual add). */
void pytgi_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t T, int64_t D, float eps);
void pytgi_add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *w, uint16_t *out, int64_t T, int64_t D, float eps);
void pytgi_silu_mul_f32(const float *gu, float *out, int64_t T, int64_t I);
void pytgi_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t T, int64_t I);
void pytgi_rope_write_kv_f32(const float *qkv, const float *cos, const float *sin, const int64_t *slots, float *q, void *k_cache, void *v_cache, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t kv8);
void pytgi_norm_add_norm_f32(const float *x, float *residual, const float *wa, const float *wb, float *out, int64_t T, int64_t D, float eps);
void pytgi_norm_add_norm_bf16(const uint16_t *x, uint16_t *residual, const float *wa, const float *wb, uint16_t *out, int64_t T, int64_t D, float eps);
void pytgi_qk_norm_f32(float *qkv, const float *qw, const float *kw, int64_t T, int64_t H, int64_t KVH, int64_t D, float eps, int64_t round_first);
void pytgi_qk_norm_bf16(uint16_t *qkv, const float *qw, const float *kw, int64_t T, int64_t H, int64_t KVH, int64_t D, float eps, int64_t round_first);
void pytgi_gelu_tanh_mul_f32(const float *gu, float *out, int64_t T, int64_t I);
void pytgi_gelu_tanh_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t T, int64_t I);
void pytgi_rope_write_kv_bf16(const uint16_t *qkv, const float *cos, const float *sin, const int64_t *slots, uint16_t *q, void *k_cache, void *v_cache, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t kv8);
/* the int8 KV cache (kv8.h): k, v [T, KVH, D] in the model's dtype → their slots' rows */
void pytgi_write_kv8_f32(const float *k, const float *v, const int64_t *slots, void *k_cache, void *v_cache, int64_t T, int64_t KVH, int64_t D);
void pytgi_write_kv8_bf16(const uint16_t *k, const uint16_t *v, const int64_t *slots, void *k_cache, void *v_cache, int64_t T, int64_t KVH, int64_t D);
void pytgi_logit_stats_f32(const float *x, int64_t B, int64_t V, int64_t *argmax, float *lse, int64_t *bad);

/* paged_attention.c: attention over the paged cache, read in place. Decodes: one query token per
 * request, at flat row rows[b]. Prefill chunks (and decodes): q_lens[b] tokens from row q_starts[b].
 * sinks: NULL, or a float32 logit per query head in each row's softmax that attends to nothing (gpt-oss).
 * first: NULL, or per request the first key its queries see (a decode's sliding window). */
int pytgi_decode_attention_f32(const float *q, const void *k_cache, const void *v_cache, float *out, const int64_t *rows, const int64_t *block_tables, const int64_t *ctx_lens, int64_t B, int64_t max_blocks, int64_t block_size, int64_t H, int64_t KVH, int64_t D, float scale, int64_t kv8, const float *sinks, const int64_t *first);
int pytgi_decode_attention_bf16(const uint16_t *q, const void *k_cache, const void *v_cache, uint16_t *out, const int64_t *rows, const int64_t *block_tables, const int64_t *ctx_lens, int64_t B, int64_t max_blocks, int64_t block_size, int64_t H, int64_t KVH, int64_t D, float scale, int64_t kv8, const float *sinks, const int64_t *first);
int pytgi_paged_prefill_f32(const float *q, const void *k_cache, const void *v_cache, float *out, const int64_t *q_starts, const int64_t *q_lens, const int64_t *block_tables, const int64_t *ctx_lens, const int64_t *tiles, int64_t B, int64_t max_blocks, int64_t block_size, int64_t H, int64_t KVH, int64_t D, float scale, int64_t kv8, const float *sinks, const int64_t *first);
int pytgi_paged_prefill_bf16(const uint16_t *q, const void *k_cache, const void *v_cache, uint16_t *out, const int64_t *q_starts, const int64_t *q_lens, const int64_t *block_tables, const int64_t *ctx_lens, const int64_t *tiles, int64_t B, int64_t max_blocks, int64_t block_size, int64_t H, int64_t KVH, int64_t D, float scale, int64_t kv8, const float *sinks, const int64_t *first);

/* qgemv.c: bf16 activations [M, K] times a packed low-bit weight [N, K] (VNNI; AMX tiles). */
int pytgi_qgemv_supported(void);
int pytgi_qgemv_bf16(const uint16_t *x, const uint8_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K, int64_t bits);
int pytgi_qgemm_amx_supported(void);
int pytgi_qgemm_amx_bf16(const uint16_t *x, const uint8_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K, int64_t bits);

/* moe.c: a mixture-of-experts layer's routed experts for a step (packed weights at the int64 addresses
 * gate_up[e], down[e]): routed by the bf16 router [E, H] (moe), or by the step's (token, expert) pairs
 * sorted by expert, expert e's from starts[e] (moe_experts; act: 0 SiLU·up, 1 GELU(tanh)·up, 2 relu(up)² of ungated experts). */
int pytgi_moe_bf16(const uint16_t *x, uint16_t *out, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k, int64_t norm_topk, const uint16_t *router, const int64_t *gate_up, const int64_t *down, const int64_t *bits_gu, const int64_t *bits_down, int64_t amx_above);
int pytgi_moe_oai_bf16(const uint16_t *x, uint16_t *out, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k, const uint16_t *router, const uint16_t *router_bias, const int64_t *gate_up, const int64_t *down, const int64_t *bits_gu, const int64_t *bits_down, int64_t amx_above, const uint16_t *gate_up_bias, const uint16_t *down_bias, float alpha, float limit);
int pytgi_moe_experts_bf16(const uint16_t *x, uint16_t *out, int64_t T, int64_t H, int64_t I, int64_t E, const int64_t *starts, const int64_t *tok, const float *wt, const int64_t *gate_up, const int64_t *down, const int64_t *bits_gu, const int64_t *bits_down, int64_t amx_above, int64_t act);

/* pack.c: levels u [N, K], fp16 bits of d and m per group → qgemv.c's packed layout (at load time). */
void pytgi_pack_lowbit(const uint8_t *u, const uint16_t *d16, const uint16_t *m16, uint8_t *out, int64_t N, int64_t K, int64_t bits);

/* gguf.c: n_blocks GGUF blocks of ggml type `type` → levels q, steps d and offsets m per group (m: NULL
 * for the symmetric types); returns 2 for a type it does not decode. */
int pytgi_gguf_decode(int64_t type, const uint8_t *blocks, int64_t n_blocks, uint8_t *q, float *d, float *m);
void pytgi_mxfp4_decode(const uint8_t *blocks, const uint8_t *scales, int64_t n_blocks, uint8_t *q, float *d);

/* bf16gemm.c: bf16 activations [M, K] times a packed bf16 weight [N, K] (AVX-512 BF16, or AVX2). */
int pytgi_bf16gemm_supported(void);
int pytgi_bf16gemm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K);
int pytgi_bf16gemm_batched_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t G, int64_t M,
                                int64_t N, int64_t K, int64_t xg, int64_t xm, int64_t og, int64_t om);

/* decoder.c: all decoder layers in one call (bf16, packed weights, paged attention): Llama's, Gemma 3's. */
int pytgi_gemma_layers_bf16(const int64_t *layers, int64_t n_layers, uint16_t *x, int64_t T, int64_t hidden, int64_t I, int64_t H, int64_t KVH, int64_t D, float eps, float scale, const float *cos, const float *sin, const float *cos_local, const float *sin_local, const int64_t *slots, const int64_t *q_starts, const int64_t *q_lens, const int64_t *block_tables, const int64_t *ctx_lens, const int64_t *tiles, int64_t B, int64_t max_blocks, int64_t block_size, int64_t all_decodes, int64_t vnni_max_m, int64_t kv8, const int64_t *first);
int pytgi_decoder_layers_bf16(const int64_t *layers, int64_t n_layers, uint16_t *x, uint16_t *h, int64_t T, int64_t hidden, int64_t I, int64_t H, int64_t KVH, int64_t D, float eps, float scale, const float *cos, const float *sin, const int64_t *slots, const int64_t *q_starts, const int64_t *q_lens, const int64_t *block_tables, const int64_t *ctx_lens, const int64_t *tiles, int64_t B, int64_t max_blocks, int64_t block_size, int64_t all_decodes, int64_t vnni_max_m, const int64_t *lora_layers, const int64_t *row_slots, int64_t kv8);

/* lora.c: LoRA's low-rank products per row: y[t] += (x[t] · A_sᵀ) · B_sᵀ for the row's adapter slot s
 * (slots[t] < 0: none); A_s [R_s, K] at a_ptrs[s], R_s = ranks[s]; B_sᵀ's rows at bt_ptrs[s], each over
 * the columns its (start, length) pair at col_ptrs[s] gives; weights in the activations' type. */
int pytgi_lora_add_f32(float *y, const float *x, int64_t T, int64_t K, int64_t N, const int64_t *slots, const int64_t *a_ptrs, const int64_t *bt_ptrs, const int64_t *ranks, const int64_t *col_ptrs);
int pytgi_lora_add_bf16(uint16_t *y, const uint16_t *x, int64_t T, int64_t K, int64_t N, const int64_t *slots, const int64_t *a_ptrs, const int64_t *bt_ptrs, const int64_t *ranks, const int64_t *col_ptrs);

/* delta.c: a gated DeltaNet layer's decodes from its projections' rows (qkv [T, C], z [T, nv·dv], b and a [T, nv]):
 * convolution, the rule's step and the gated norm, into out's rows; states in place in the pools */
int pytgi_gdn_decode_layer_f32(const float *qkv, const float *z, const float *bq, const float *aq, const int64_t *rows, const int64_t *slots, const int64_t *fresh, float *conv_pool, const float *conv_w, const float *A_log, const float *dt_bias, const float *norm_w, float *rec_pool, float *out, int64_t B, int64_t C, int64_t Kc, int64_t nk, int64_t nv, int64_t dk, int64_t dv, int64_t tiled, float eps);
/* one prompt chunk through the rule: q, k [L, H, K], v [L, H, V], g, beta [L, H] float32, state [H, K, V] in
 * place, out [L, H, V], in chunks of C tokens */
int pytgi_gdn_prefill_f32(const float *q, const float *k, const float *v, const float *g, const float *beta, float *state, float *out, int64_t L, int64_t H, int64_t K, int64_t V, int64_t C);
/* one request's prompt chunk through a whole gated DeltaNet layer after its projections: qkv [n, C], z, b, a
 * its rows, its state slot (fresh: from zero); the gated norm's output into out [n, nv·dv] */
int pytgi_gdn_prefill_layer_f32(const float *qkv, const float *z, const float *bq, const float *aq, int64_t n, int64_t slot, int64_t fresh, float *conv_pool, const float *conv_w, const float *A_log, const float *dt_bias, const float *norm_w, float *rec_pool, float *out, int64_t C, int64_t Kc, int64_t nk, int64_t nv, int64_t dk, int64_t dv, int64_t tiled, float eps, int64_t chunk);
int pytgi_gdn_prefill_layer_bf16(const uint16_t *qkv, const uint16_t *z, const uint16_t *bq, const uint16_t *aq, int64_t n, int64_t slot, int64_t fresh, uint16_t *conv_pool, const float *conv_w, const float *A_log, const float *dt_bias, const float *norm_w, float *rec_pool, uint16_t *out, int64_t C, int64_t Kc, int64_t nk, int64_t nv, int64_t dk, int64_t dv, int64_t tiled, float eps, int64_t chunk);
int pytgi_gdn_decode_layer_bf16(const uint16_t *qkv, const uint16_t *z, const uint16_t *bq, const uint16_t *aq, const int64_t *rows, const int64_t *slots, const int64_t *fresh, uint16_t *conv_pool, const float *conv_w, const float *A_log, const float *dt_bias, const float *norm_w, float *rec_pool, uint16_t *out, int64_t B, int64_t C, int64_t Kc, int64_t nk, int64_t nv, int64_t dk, int64_t dv, int64_t tiled, float eps);

/* mamba.c: a Mamba-2 layer's decodes from its input projection's rows (proj [T, inner + conv_dim + H]: z, x B C,
 * dt): convolution (+ bias, may be NULL), dt, the SSM step per head, D's skip and the gated grouped RMSNorm, into
 * out's rows [T, inner]; A = -exp(A_log); states in place in the pools (conv [S, conv_dim, Kc - 1], ssm [S, H, P, N]) */
int pytgi_mamba2_decode_layer_f32(const float *proj, const int64_t *rows, const int64_t *slots, const int64_t *fresh, float *conv_pool, const float *conv_w, const float *conv_b, const float *dt_bias, const float *A, const float *D, const float *norm_w, float *ssm_pool, float *out, int64_t B, int64_t H, int64_t P, int64_t G, int64_t N, int64_t Kc, float dt_lo, float dt_hi, float eps);
int pytgi_mamba2_decode_layer_bf16(const uint16_t *proj, const int64_t *rows, const int64_t *slots, const int64_t *fresh, uint16_t *conv_pool, const float *conv_w, const float *conv_b, const float *dt_bias, const float *A, const float *D, const float *norm_w, float *ssm_pool, uint16_t *out, int64_t B, int64_t H, int64_t P, int64_t G, int64_t N, int64_t Kc, float dt_lo, float dt_hi, float eps);
/* one request's prompt chunk through a Mamba-2 layer: proj [n, inner + conv_dim + H] its rows, its state slot
 * (fresh: from zero); the gated norm's output into out [n, inner] */
int pytgi_mamba2_prefill_layer_f32(const float *proj, int64_t n, int64_t slot, int64_t fresh, float *conv_pool, const float *conv_w, const float *conv_b, const float *dt_bias, const float *A, const float *D, const float *norm_w, float *ssm_pool, float *out, int64_t H, int64_t P, int64_t G, int64_t N, int64_t Kc, float dt_lo, float dt_hi, float eps);
int pytgi_mamba2_prefill_layer_bf16(const uint16_t *proj, int64_t n, int64_t slot, int64_t fresh, uint16_t *conv_pool, const float *conv_w, const float *conv_b, const float *dt_bias, const float *A, const float *D, const float *norm_w, float *ssm_pool, uint16_t *out, int64_t H, int64_t P, int64_t G, int64_t N, int64_t Kc, float dt_lo, float dt_hi, float eps);

/* mamba1.c: a Mamba-1 layer's step (its decodes and prompt chunks: request r owns rows [starts[r], starts[r + 1]),
 * its states at slots[r], from zero where fresh[r]). causal_conv (Mamba-1's and KDA's): the convolution of x (columns [0, D) of xz
 * [T, W]) with the pool [S, D, Kc - 1], SiLU, into mixed [T, D]; returns 1 out of memory. scan: the selective
 * scan (dt = softplus(dt_raw), bc [T, 2N] float32 B | C, A = -exp(A_log) [D, N]) with the pool [S, D, N] in place,
 * D's skip and SiLU(z) (columns [D, 2D) of xz), into out [T, D] */
int pytgi_causal_conv_f32(const float *xz, const int64_t *starts, const int64_t *slots, const int64_t *fresh, float *conv_pool, const float *conv_w, const float *conv_b, float *mixed, int64_t R, int64_t D, int64_t W, int64_t Kc);
int pytgi_causal_conv_bf16(const uint16_t *xz, const int64_t *starts, const int64_t *slots, const int64_t *fresh, uint16_t *conv_pool, const float *conv_w, const float *conv_b, uint16_t *mixed, int64_t R, int64_t D, int64_t W, int64_t Kc);
void pytgi_mamba1_scan_f32(const float *xz, const float *mixed, const float *dt_raw, const float *bc, const int64_t *starts, const int64_t *slots, const int64_t *fresh, float *ssm_pool, const float *A, const float *Dskip, float *out, int64_t R, int64_t D, int64_t N, int64_t W);
void pytgi_mamba1_scan_bf16(const uint16_t *xz, const uint16_t *mixed, const uint16_t *dt_raw, const float *bc, const int64_t *starts, const int64_t *slots, const int64_t *fresh, float *ssm_pool, const float *A, const float *Dskip, uint16_t *out, int64_t R, int64_t D, int64_t N, int64_t W);

/* kda.c: Kimi Delta Attention's rule over a step (rows, slots and fresh as mamba1.c's), after the convolution:
 * mixed [T, 3 H K] (q | k | v), f [T, H K] (before dt_bias and the softplus), b [T, H] (before the sigmoid),
 * gate [T, H K] (before the sigmoid); the state pool [S, H, K, K] in place; the normed, gated output into out */
void pytgi_kda_rule_f32(const float *mixed, const float *f, const float *b, const float *gate, const int64_t *starts, const int64_t *slots, const int64_t *fresh, float *rec_pool, const float *A, const float *dt_bias, const float *norm_w, float *out, int64_t R, int64_t H, int64_t K, float eps);
void pytgi_kda_rule_bf16(const uint16_t *mixed, const uint16_t *f, const uint16_t *b, const uint16_t *gate, const int64_t *starts, const int64_t *slots, const int64_t *fresh, float *rec_pool, const float *A, const float *dt_bias, const float *norm_w, uint16_t *out, int64_t R, int64_t H, int64_t K, float eps);

/* encoder.c: one prompt's bidirectional attention (the encoders), on the calling thread:
 * qkv [L, 3, H, D] (the fused projection's output) → out [L, H, D]. Built for AVX-512 (bf16: AVX-512 BF16)
 * and D a multiple of 16 (supported(): 1), else returns 2. */
int pytgi_encoder_attention_supported(int64_t bf16, int64_t D);
int pytgi_encoder_attention_f32(const float *qkv, float *out, int64_t L, int64_t H, int64_t D, float scale);
int pytgi_encoder_attention_bf16(const uint16_t *qkv, uint16_t *out, int64_t L, int64_t H, int64_t D, float scale);
/* x [T, N] = GELU(x + bias) in place (erf GELU); out [T, N] = LayerNorm(x + bias + residual) · w + b. */
void pytgi_bias_gelu_bf16(uint16_t *x, const uint16_t *bias, int64_t T, int64_t N);
int pytgi_bias_residual_norm_bf16(const uint16_t *x, const uint16_t *bias, const uint16_t *residual, const uint16_t *w, const uint16_t *b, uint16_t *out, int64_t T, int64_t N, float eps);

/* mla.c: multi-head latent attention's decodes (T = B, one token each, flat rows rows[b]) from the projections'
 * rows (q [T, H, nope + d], kv [T, r + d]) to o_proj's input out [T, H, v]: kv_a's norm and the rotary
 * embedding into the cache row at slots[t] (bf16 [num_slots, 1, r + d]; 3: a slot outside it), the absorbed
 * products by W_UK, W_UV (bf16gemm.c's packing) and the paged attention; the norm and rotary as PyTorch rounds
 * them. rms_norm: that norm alone. */
int pytgi_mla_decode_bf16(const uint16_t *q, const uint16_t *kv, const float *cos, const float *sin, const int64_t *slots, const float *norm_w, uint16_t *k_cache, int64_t num_slots, const uint16_t *w_uk, const uint16_t *w_uv, uint16_t *out, const int64_t *rows, const int64_t *block_tables, const int64_t *ctx_lens, int64_t B, int64_t max_blocks, int64_t block_size, int64_t H, int64_t nope, int64_t d, int64_t r, int64_t v, int64_t interleave, float eps, float scale);
void pytgi_rms_norm_bf16(const uint16_t *x, const float *w, uint16_t *out, int64_t T, int64_t D, float eps);

#endif
