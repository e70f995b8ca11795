/* Paged attention for CPU: the query tokens of decodes and of prefill chunks attend to their
 * request's context, keys and values read in place from the block-paged cache (no gather into a
 * padded copy).
 *
 * Layouts (row-major, element type T = float or bf16 stored as uint16):
 *   q, out        [T_flat, H, D]        the step's flat query tokens; request b's start at row q_starts[b]
 *   k_cache, v    [num_slots, KVH, D]   slot = block_tables[b][pos / block_size] * block_size + pos % block_size
 *                                       (kv8: uint8 rows of D int8 values and their bf16 scale, kv8.h)
 *   block_tables  [B, max_blocks] int64
 *   ctx_lens      [B] int64             keys 0 .. ctx_lens[b]-1 exist (this step's included); query
 *                                       token i of q_lens[b] sits at ctx_lens[b] - q_lens[b] + i (causal)
 *   first         [B] int64 or NULL     no query of request b sees a key before first[b] (NULL: 0): a
 *                                       decode's sliding window (at most ctx_lens[b] - q_lens[b])
 * Query head h uses key/value head h / (H / KVH) (grouped-query attention).
 *
 * Two implementations, sums in float32, both taking decodes and prefill chunks alike: with
 * AVX-512 (and D a multiple of 16) a split-K kernel with an online softmax (see attention512; for
 * bf16 with AVX-512 BF16, vdpbf16ps with keys in the lanes, see chunk_lanes, or AMX tiles; both
 * round P to bf16); otherwise a portable one (see
 * attention_portable: GCC vector extensions, AVX2 on x86-64-v3) that computes every query row with
 * the same three functions, so that it is batch invariant too. Built and
 * loaded by pytgi/engine/kernels/__init__.py. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp16.h"
#include "kv8.h"
#include "pytgi_kernels.h"

static inline void row_f32(const float *restrict src, float *restrict dst, int64_t n) {
    memcpy(dst, src, sizeof(float) * (size_t)n);
}
static inline void row_bf16(const uint16_t *restrict src, float *restrict dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_load(src[i]);
}
static inline void store_f32(float *restrict dst, const float *restrict src, int64_t n) {
    memcpy(dst, src, sizeof(float) * (size_t)n);
}
static inline void store_bf16(uint16_t *restrict dst, const float *restrict src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_round(src[i]);
}

/* Softmax weights of far-off keys are tiny, and multiplying by a denormal float costs a microcode
 * assist of ~100 cycles: in a shared library -ffast-math does not set flush-to-zero, so each task
 * sets it (and restores the caller's mode) itself. */
#if defined(__SSE__)
#include <xmmintrin.h>
static inline unsigned int flush_denormals(void) {
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ | DAZ */
    return csr;
}
static inline void restore_csr(unsigned int csr) { _mm_setcsr(csr); }
#else
static inline unsigned int flush_denormals(void) { return 0; }
static inline void restore_csr(unsigned int csr) { (void)csr; }
#endif

/* The portable kernel: decodes and prefill chunks alike where the AVX-512 kernel does not apply (no
 * AVX-512, or heads it does not take). GCC's vector extensions (8 float lanes: AVX2 on x86-64-v3)
 * instead of intrinsics.
 *
 * Batch invariance rests on one rule: every query row (one token, one query head) is computed by
 * the same three functions, never inlined or specialised, with the same arguments, whatever else
 * its task holds: qk_block (its scores for a block of 32 keys), softmax_row (over the row's own
 * keys) and pv_block (Σ p·v over the keys of a block that the row sees). A key's score depends only
 * on the row's query and that key; the softmax's sum runs over the row's own length. So a decode,
 * the same token's row in a verified draft and in a prompt's chunk give the same bits.
 *
 * A task is one request's tile of up to 16 query tokens and one kv head (or one query head, when
 * the tasks would not keep the threads busy): each block of keys, then of values, is widened to
 * float32 once and used by every row of the tile. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define KB 32   /* keys per block */
#define ROWS 16 /* query tokens per task */
#if defined(__clang__)
#define ROW_FN __attribute__((noinline))
#else
#define ROW_FN __attribute__((noipa)) /* one copy of the code, never specialised for a call site */
#endif

/* e^x lane by lane for x <= 0 (Cephes' expf polynomial, as exp16.h); below -87: 0. */
static inline v8f exp8(v8f x) {
    const v8f lowest = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    const v8i tiny = x < lowest;
    x = (v8f)(((v8i)x & ~tiny) | ((v8i)lowest & tiny));
    const v8i n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v8i); /* toward 0: nearest */
    const v8f nf = __builtin_convertvector(n, v8f);
    v8f r = x - nf * 0.693359375f;
    r = r + nf * 2.12194440e-4f;
    v8f p = r * 1.9875691500E-4f + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + (r + 1.0f);
    return (v8f)(((v8i)p + (n << 23)) & ~tiny);
}

/* r[i] = the sum of v[i]'s lanes, for 8 vectors at once (3 rounds of shuffles and adds). */
static inline v8f sum8x8(const v8f v[8]) {
    v8f t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* s[j] = q · key j for the block's KB keys (kf: KB rows of Dv vectors, zeros past D and past the
 * last key; q: Dv vectors, already scaled). */
static inline __attribute__((always_inline)) void qk_body(const v8f *restrict q, const v8f *restrict kf, int64_t Dv,
                                                          v8f *restrict s) {
    for (int64_t g = 0; g < KB / 8; g++, kf += 8 * Dv) {
        v8f acc[8] = {{0}};
        for (int64_t c = 0; c < Dv; c++)
            for (int i = 0; i < 8; i++) acc[i] += q[c] * kf[i * Dv + c];
        s[g] = sum8x8(acc);
    }
}
ROW_FN static void qk_block(const v8f *restrict q, const v8f *restrict kf, int64_t Dv, v8f *restrict s) {
    if (Dv == 8) qk_body(q, kf, 8, s); /* D = 64 and 128 unrolled: a model has one D, so every row */
    else if (Dv == 16) qk_body(q, kf, 16, s); /* of a run takes the same code all the same */
    else qk_body(q, kf, Dv, s);
}

/* The row's L scores → e^(s - max) (padded with zeros to whole vectors); returns 1 / Σ. `sink` (NULL:
 * none): one more logit in the softmax that attends to nothing (gpt-oss), in Σ and the max. */
ROW_FN static float softmax_row(float *restrict s, int64_t L, const float *sink) {
    float m = sink != NULL ? *sink : -INFINITY;
    for (int64_t j = 0; j < L; j++) m = s[j] > m ? s[j] : m;
    for (int64_t j = L; j < (L + 7) / 8 * 8; j++) s[j] = m - 100.0f; /* e^-100: 0 */
    v8f sum = {0};
    for (int64_t j = 0; j < L; j += 8) {
        v8f x;
        memcpy(&x, s + j, sizeof x);
        x = exp8(x - m);
        memcpy(s + j, &x, sizeof x);
        sum += x;
    }
    const float total = ((sum[0] + sum[4]) + (sum[2] + sum[6])) + ((sum[1] + sum[5]) + (sum[3] + sum[7]));
    return 1.0f / (sink != NULL ? total + expf(*sink - m) : total);
}

/* acc (Dv vectors) += Σ_{j < n} p[j] · value j (vf: KB rows of Dv vectors). */
static inline __attribute__((always_inline)) void pv_body(v8f *restrict acc, const float *restrict p,
                                                          const v8f *restrict vf, int64_t Dv, int64_t n) {
    v8f a[16];
    for (int64_t c = 0; c < Dv; c++) a[c] = acc[c];
    for (int64_t j = 0; j < n; j++, vf += Dv)
        for (int64_t c = 0; c < Dv; c++) a[c] += p[j] * vf[c];
    for (int64_t c = 0; c < Dv; c++) acc[c] = a[c];
}
ROW_FN static void pv_block(v8f *restrict acc, const float *restrict p, const v8f *restrict vf, int64_t Dv,
                            int64_t n) {
    if (Dv == 8) pv_body(acc, p, vf, 8, n);
    else if (Dv == 16) pv_body(acc, p, vf, 16, n);
    else
        for (int64_t j = 0; j < n; j++, vf += Dv)
            for (int64_t c = 0; c < Dv; c++) acc[c] += p[j] * vf[c];
}

/* Rows j0 .. j0+n-1 (n <= KB) of kv head kvh of `cache`, widened into out (KB rows of Dq floats,
 * zeros past D and past n). */
#define DEFINE_WIDEN(NAME, T, LOAD)                                                                    \
    static void NAME(const T *cache, const int64_t *table, int64_t bs, int64_t KVH, int64_t kvh,       \
                     int64_t D, int64_t j0, int64_t n, float *out, int64_t Dq) {                       \
        for (int64_t j = 0; j < n; j++) {                                                              \
            const int64_t pos = j0 + j;                                                                \
            const T *src = cache + ((table[pos / bs] * bs + pos % bs) * KVH + kvh) * D;                \
            for (int64_t d = 0; d < D; d++) out[j * Dq + d] = LOAD(src[d]);                            \
            for (int64_t d = D; d < Dq; d++) out[j * Dq + d] = 0.0f;                                   \
        }                                                                                              \
        memset(out + n * Dq, 0, sizeof(float) * (size_t)((KB - n) * Dq));                             \
    }
static inline float load_f32(float x) { return x; }
DEFINE_WIDEN(widen_f32, float, load_f32)
DEFINE_WIDEN(widen_bf16, uint16_t, bf16_load)

/* The same from the int8 cache (kv8.h): each row's values times its scale. */
static void widen_kv8(const uint8_t *cache, const int64_t *table, int64_t bs, int64_t KVH, int64_t kvh, int64_t D,
                      int64_t j0, int64_t n, float *out, int64_t Dq) {
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = j0 + j;
        const uint8_t *src = cache + ((table[pos / bs] * bs + pos % bs) * KVH + kvh) * KV8_ROW(D);
        const float s = kv8_scale(src, D);
        for (int64_t d = 0; d < D; d++) out[j * Dq + d] = (float)(int8_t)src[d] * s;
        for (int64_t d = D; d < Dq; d++) out[j * Dq + d] = 0.0f;
    }
    memset(out + n * Dq, 0, sizeof(float) * (size_t)((KB - n) * Dq));
}

/* Request b's query tokens t0 .. t1-1 (of Q, the last of its ctx cached positions), query heads
 * h0 .. h0+nh-1 (a kv head's group, or one of them). */
#define DEFINE_PORTABLE_TASK(NAME, T, ROW, STORE, WIDEN)                                               \
    static int NAME(const T *q, const void *k_cache, const void *v_cache, T *out, int64_t q0, int64_t Q, \
                    int64_t t0, int64_t t1, int64_t ctx, const int64_t *table, int64_t bs, int64_t H,  \
                    int64_t KVH, int64_t D, int64_t h0, int64_t nh, float scale, int kv8,              \
                    const float *sinks, int64_t f) {                                                   \
        /* keys f .. Lmax-1; row r's scores at s + r * stride, key j's at j - f */                  \
        const int64_t kvh = h0 / (H / KVH), Lmax = ctx - Q + t1, stride = (Lmax - f + KB - 1) / KB * KB; \
        const int64_t Dv = (D + 7) / 8, Dq = Dv * 8, R = (t1 - t0) * nh;                             \
        /* kv: a block of keys or values; per row r: its query, output sums and scores */           \
        float *kv = aligned_alloc(32, sizeof(float) * (size_t)(KB * Dq + R * (2 * Dq + stride + 8))); \
        if (kv == NULL) return 1;                                                                    \
        float *qf = kv + KB * Dq, *acc = qf + R * Dq, *s = acc + R * Dq, *inv = s + R * stride;      \
        memset(qf, 0, sizeof(float) * (size_t)(2 * R * Dq));                                         \
        for (int64_t r = 0; r < R; r++) {                                                            \
            ROW(q + ((q0 + t0 + r / nh) * H + h0 + r % nh) * D, qf + r * Dq, D);                     \
            for (int64_t d = 0; d < D; d++) qf[r * Dq + d] *= scale;                                 \
        }                                                                                            \
        for (int64_t j0 = f; j0 < Lmax; j0 += KB) {                                                  \
            if (kv8) widen_kv8(k_cache, table, bs, KVH, kvh, D, j0, Lmax - j0 < KB ? Lmax - j0 : KB, kv, Dq); \
            else WIDEN(k_cache, table, bs, KVH, kvh, D, j0, Lmax - j0 < KB ? Lmax - j0 : KB, kv, Dq); \
            for (int64_t r = 0; r < R; r++) /* row r sees keys f .. ctx - Q + t0 + r / nh */         \
                if (j0 < ctx - Q + t0 + r / nh + 1)                                                  \
                    qk_block((const v8f *)(qf + r * Dq), (const v8f *)kv, Dv, (v8f *)(s + r * stride + j0 - f)); \
        }                                                                                            \
        for (int64_t r = 0; r < R; r++)                                                              \
            inv[r] = softmax_row(s + r * stride, ctx - Q + t0 + r / nh + 1 - f, sinks ? sinks + h0 + r % nh : NULL); \
        for (int64_t j0 = f; j0 < Lmax; j0 += KB) {                                                  \
            if (kv8) widen_kv8(v_cache, table, bs, KVH, kvh, D, j0, Lmax - j0 < KB ? Lmax - j0 : KB, kv, Dq); \
            else WIDEN(v_cache, table, bs, KVH, kvh, D, j0, Lmax - j0 < KB ? Lmax - j0 : KB, kv, Dq); \
            for (int64_t r = 0; r < R; r++) {                                                        \
                const int64_t L = ctx - Q + t0 + r / nh + 1;                                         \
                if (j0 < L)                                                                          \
                    pv_block((v8f *)(acc + r * Dq), s + r * stride + j0 - f, (const v8f *)kv, Dv,    \
                             L - j0 < KB ? L - j0 : KB);                                             \
            }                                                                                        \
        }                                                                                            \
        for (int64_t r = 0; r < R; r++) {                                                            \
            for (int64_t d = 0; d < D; d++) acc[r * Dq + d] *= inv[r];                               \
            STORE(out + ((q0 + t0 + r / nh) * H + h0 + r % nh) * D, acc + r * Dq, D);                \
        }                                                                                            \
        free(kv);                                                                                    \
        return 0;                                                                                    \
    }
DEFINE_PORTABLE_TASK(portable_task_f32, float, row_f32, store_f32, widen_f32)
DEFINE_PORTABLE_TASK(portable_task_bf16, uint16_t, row_bf16, store_bf16, widen_bf16)

/* Requests b = 0 .. B-1, q_lens[b] query tokens each (NULL: one) at flat rows q_starts[b] .., the
 * last ones of their ctx_lens[b] cached positions. */
static int attention_portable(int bf16, const void *q, const void *k_cache, const void *v_cache, void *out,
                              const int64_t *q_starts, const int64_t *q_lens, const int64_t *block_tables,
                              const int64_t *ctx_lens, int64_t B, int64_t max_blocks, int64_t bs, int64_t H,
                              int64_t KVH, int64_t D, float scale, int kv8, const float *sinks,
                              const int64_t *kv_first) {
    const int64_t G = H / KVH;
    int64_t tiles = 0;
    for (int64_t b = 0; b < B; b++) tiles += ((q_lens ? q_lens[b] : 1) + ROWS - 1) / ROWS;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (first == NULL) return 1;
    for (int64_t b = 0, n = 0; b <= B; b++) {
        first[b] = n;
        if (b < B) n += ((q_lens ? q_lens[b] : 1) + ROWS - 1) / ROWS;
    }
    /* a task per (tile, kv head); where those would leave threads idle, per (tile, share of a kv
     * head's query heads), the largest share that keeps every thread busy (each task widens its kv
     * head's keys and values once: latent attention's 16-128 query heads share one) */
    int64_t nh = G;
    while (nh > 1 && tiles * KVH * (G / nh) < omp_get_max_threads())
        do nh--; while (G % nh);
    const int64_t per = H / nh;
    int failed = 0;
    _Pragma("omp parallel for schedule(dynamic, 1)")
    for (int64_t task = 0; task < tiles * per; task++) {
        const int64_t tile = task / per, h0 = task % per * nh;
        int64_t b = 0;
        while (first[b + 1] <= tile) b++;
        const int64_t Q = q_lens ? q_lens[b] : 1, t0 = (tile - first[b]) * ROWS, t1 = t0 + ROWS < Q ? t0 + ROWS : Q;
        const int64_t f = kv_first == NULL ? 0 : kv_first[b] < ctx_lens[b] - Q ? kv_first[b] : ctx_lens[b] - Q;
        const unsigned int csr = flush_denormals();
        const int err = bf16 ? portable_task_bf16(q, k_cache, v_cache, out, q_starts[b], Q, t0, t1, ctx_lens[b],
                                                  block_tables + b * max_blocks, bs, H, KVH, D, h0, nh, scale, kv8, sinks, f)
                             : portable_task_f32(q, k_cache, v_cache, out, q_starts[b], Q, t0, t1, ctx_lens[b],
                                                 block_tables + b * max_blocks, bs, H, KVH, D, h0, nh, scale, kv8, sinks, f);
        restore_csr(csr);
        if (err) {
            _Pragma("omp atomic write")
            failed = 1;
        }
    }
    free(first);
    return failed;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The AVX-512 kernel: split-K ("flash decoding"). Each (request, kv head) pair's keys are cut
 * into chunks of CHUNK; a task is one chunk, run with an online softmax (no score buffer), and
 * a second pass combines a pair's chunks. The chunking depends only on the request's own length,
 * so a request's result does not depend on what else is in the batch, and one long request keeps
 * every thread busy. Needs D % 16 == 0, D <= MAXD and at most MAXG query heads per kv head;
 * D = 64 and 128 get code compiled for their size. MAXD holds latent attention's rows (DeepSeek's
 * 512 + 64); the AMX tiles take rows up to AMX_MAXD. */
#define CHUNK 128
#define AMX_MIN_ROWS 1 /* query rows (tokens × heads per kv head) from which a chunk uses AMX */
#define MAXD 576
#define AMX_MAXD 256
#define MAXG 16

static inline __m512 ld16(const void *p, int bf16) { return bf16 ? bf16x16_load(p) : _mm512_loadu_ps(p); }
static inline void st16(void *p, __m512 x, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps(p, x);
        return;
    }
    __m512i u = _mm512_castps_si512(x); /* round to nearest even, as bf16_round */
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    _mm256_storeu_si256(p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

/* r[j] = Σ v[j] (the 16 horizontal sums at once, ~3 shuffles or adds per sum instead of ~8). */
static inline __m512 reduce16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) { /* per 128-bit lane: that lane's sums of v[4k .. 4k+3] */
        const __m512d c = _mm512_castps_pd(t[2 * k]), d = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

/* Keys j_begin .. j_end-1 of one (request, kv head) pair, for its Q query tokens × G query heads.
 * Query token t (0 <= t < Q) sits at position ctx - Q + t and sees keys 0 .. ctx - Q + t (causal).
 * `q` is the pair's first query head of token 0; tokens are `qstride` elements apart. Writes, per
 * (t, h): acc[(t*G + h)*D ..] = Σ_j e^(s_j - m) v_j, m[t*G + h] the max score, l[..] = Σ_j e^(s_j - m)
 * (m = -inf, l = 0 when the token sees no key here). Inlined with literal `bf16`, `D` and `kv8` (the
 * int8 cache's rows, widened times their scales), the row loops unroll into registers. */
static inline __attribute__((always_inline)) void chunk(int bf16, int64_t D, int kv8, const char *q, int64_t qstride,
                                                         int64_t Q, int64_t ctx, const char *kc, const char *vc,
                                                         const int64_t *table, int64_t bs, int64_t KVH, int64_t kvh,
                                                         int64_t j_begin, int64_t j_end, int64_t G, float scale,
                                                         float *acc, float *m, float *l) {
    const int64_t es = bf16 ? 2 : 4, DV = D / 16, rb = kv8 ? KV8_ROW(D) : D * es, row = KVH * rb;
    float kf[16 * MAXD], vf[16 * MAXD];
    for (int64_t r = 0; r < Q * G; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int64_t i = 0; i < DV; i++) _mm512_storeu_ps(acc + r * D + 16 * i, _mm512_setzero_ps());
    }
    for (int64_t j0 = j_begin; j0 < j_end; j0 += 16) {
        const int64_t n = j_end - j0 < 16 ? j_end - j0 : 16;
        for (int64_t j = 0; j < n; j++) { /* this block's keys and values, once for every query */
            const int64_t pos = j0 + j, off = (table[pos / bs] * bs + pos % bs) * row + kvh * rb;
            if (pos + 16 < j_end) { /* the next block's rows: the cache is read in scattered 128-byte pieces */
                const int64_t ahead = (table[(pos + 16) / bs] * bs + (pos + 16) % bs) * row + kvh * rb;
                for (int64_t b = 0; b < rb; b += 64) {
                    _mm_prefetch(kc + ahead + b, _MM_HINT_T0);
                    _mm_prefetch(vc + ahead + b, _MM_HINT_T0);
                }
            }
            if (kv8) {
                const __m512 ks = _mm512_set1_ps(kv8_scale((const uint8_t *)kc + off, D));
                const __m512 vs = _mm512_set1_ps(kv8_scale((const uint8_t *)vc + off, D));
                for (int64_t i = 0; i < DV; i++) {
                    const __m128i kb = _mm_loadu_si128((const __m128i *)(kc + off + 16 * i));
                    const __m128i vb = _mm_loadu_si128((const __m128i *)(vc + off + 16 * i));
                    _mm512_storeu_ps(kf + j * D + 16 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(kb)), ks));
                    _mm512_storeu_ps(vf + j * D + 16 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(vb)), vs));
                }
                continue;
            }
            for (int64_t i = 0; i < DV; i++) {
                _mm512_storeu_ps(kf + j * D + 16 * i, ld16(kc + off + 16 * i * es, bf16));
                _mm512_storeu_ps(vf + j * D + 16 * i, ld16(vc + off + 16 * i * es, bf16));
            }
        }
        /* the first token that sees key j0 */
        for (int64_t t = j0 - (ctx - Q) > 0 ? j0 - (ctx - Q) : 0; t < Q; t++) {
            const int64_t lim = ctx - Q + t + 1 - j0, nq = lim < n ? lim : n; /* keys this token sees */
            const __mmask16 valid = (__mmask16)((1u << nq) - 1u);
            for (int64_t h = 0; h < G; h++) {
                const int64_t r = t * G + h;
                __m512 qv[MAXD / 16], dots[16], a[MAXD / 16];
                for (int64_t i = 0; i < DV; i++)
                    qv[i] = _mm512_mul_ps(ld16(q + (t * qstride + h * D + 16 * i) * es, bf16), _mm512_set1_ps(scale));
                for (int64_t j = 0; j < 16; j++) {
                    dots[j] = _mm512_setzero_ps();
                    if (j < nq)
                        for (int64_t i = 0; i < DV; i++) dots[j] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kf + j * D + 16 * i), dots[j]);
                }
                const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, reduce16(dots));
                const float mx = _mm512_reduce_max_ps(s), m_new = mx > m[r] ? mx : m[r];
                const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
                const float alpha = m_new > m[r] ? (m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new)) : 1.0f;
                m[r] = m_new;
                l[r] = l[r] * alpha + _mm512_reduce_add_ps(p);
                float pj[16];
                _mm512_storeu_ps(pj, p);
                __m512 a2[MAXD / 16]; /* even and odd keys in two chains of adds: half the latency */
                for (int64_t i = 0; i < DV; i++) {
                    a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * i), _mm512_set1_ps(alpha));
                    a2[i] = _mm512_setzero_ps();
                }
                for (int64_t j = 0; j + 1 < nq; j += 2)
                    for (int64_t i = 0; i < DV; i++) {
                        a[i] = _mm512_fmadd_ps(_mm512_set1_ps(pj[j]), _mm512_loadu_ps(vf + j * D + 16 * i), a[i]);
                        a2[i] = _mm512_fmadd_ps(_mm512_set1_ps(pj[j + 1]), _mm512_loadu_ps(vf + (j + 1) * D + 16 * i), a2[i]);
                    }
                if (nq % 2)
                    for (int64_t i = 0; i < DV; i++)
                        a[i] = _mm512_fmadd_ps(_mm512_set1_ps(pj[nq - 1]), _mm512_loadu_ps(vf + (nq - 1) * D + 16 * i), a[i]);
                for (int64_t i = 0; i < DV; i++) _mm512_storeu_ps(acc + r * D + 16 * i, _mm512_add_ps(a[i], a2[i]));
            }
        }
    }
}

#if defined(__AVX512BF16__)
/* bf16 with D a multiple of 32 (the models' head sizes): scores and P·V with vdpbf16ps (bf16
 * products, float32 sums), keys in the vector lanes. Per block of LB keys the keys are transposed
 * once, so that lane j of kt[p] holds key j's dims 2p and 2p+1: a query row's scores are D/2
 * multiply-adds of its broadcast dim pairs, with no horizontal sums. The values are interleaved by
 * key pairs (lane d of vp[k] holds dim d of keys 2k and 2k+1), and P, rounded to bf16 as the AMX
 * kernel rounds it, multiplies them a pair at a time. The block's layout work is shared by all the
 * query rows that see it. Rows go two at a time for independent chains of multiply-adds, but each
 * row's operations and their order are its own, whatever row it is paired with and however many
 * tokens the step has (batch invariance). */
#define LB 64 /* keys per block: the softmax's reductions and rescaling are per row and block */

/* rows[i] (16 dwords each) → out row j holds dword j of every input row */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* now r[4a + b] holds, in each 128-bit lane L, dword b... of rows 4L'.. : finish across lanes */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

/* Elements at .. at+31 of an int8 cache row (kv8.h) as 32 bf16: each value times the row's scale,
 * rounded to bf16 (the bf16 the lanes multiply by). */
static inline __m512i kv8_bf16x32(const char *row, int64_t D, int64_t at) {
    const __m512 s = _mm512_set1_ps(kv8_scale((const uint8_t *)row, D));
    const __m256i b = _mm256_loadu_si256((const __m256i *)(row + at));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b))), s);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1))), s);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* Keys j0 .. j0+n-1 (n <= LB) of kv head kvh into kt [D/2][LB] and vp [LB/2][D] (dwords; zeros past
 * n), and the next block's cache rows prefetched. kv8: the cache's rows are int8 (kv8_bf16x32). */
static inline __attribute__((always_inline)) void lanes_block(int64_t D, int kv8, const char *kc, const char *vc,
                                                              const int64_t *table, int64_t bs, int64_t KVH,
                                                              int64_t kvh, int64_t j0, int64_t n, int64_t j_end,
                                                              uint32_t *kt, uint32_t *vp) {
    const __m512i zero = _mm512_setzero_si512();
    const int64_t rb = kv8 ? KV8_ROW(D) : D * 2, row = KVH * rb;
    int64_t off[LB];
    for (int64_t j = 0; j < LB; j++) off[j] = j < n ? (table[(j0 + j) / bs] * bs + (j0 + j) % bs) * row + kvh * rb : -1;
    for (int64_t pos = j0 + LB; pos < j0 + 2 * LB && pos < j_end; pos++) {
        const int64_t ahead = (table[pos / bs] * bs + pos % bs) * row + kvh * rb;
        for (int64_t b = 0; b < rb; b += 64) {
            _mm_prefetch(kc + ahead + b, _MM_HINT_T0);
            _mm_prefetch(vc + ahead + b, _MM_HINT_T0);
        }
    }
    for (int64_t h = 0; h < LB / 16; h++)
        for (int64_t c = 0; c < D / 32; c++) { /* dwords 16c .. 16c+15 of keys 16h .. 16h+15 */
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                const int64_t o = off[16 * h + j];
                r[j] = o < 0 ? zero : kv8 ? kv8_bf16x32(kc + o, D, 32 * c) : _mm512_loadu_si512(kc + o + 64 * c);
            }
            transpose16(r);
            for (int p = 0; p < 16; p++) _mm512_store_si512(kt + (16 * c + p) * LB + 16 * h, r[p]);
        }
    /* bf16 lane 2i of `lo` is element i of key a, 2i + 1 element i of key b; `hi` the same for i + 16 */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t k = 0; k < LB / 2; k++) {
        const int64_t a = off[2 * k], b = off[2 * k + 1];
        for (int64_t i = 0; i < D / 32; i++) {
            const __m512i va = a < 0 ? zero : kv8 ? kv8_bf16x32(vc + a, D, 32 * i) : _mm512_loadu_si512(vc + a + 64 * i);
            const __m512i vb = b < 0 ? zero : kv8 ? kv8_bf16x32(vc + b, D, 32 * i) : _mm512_loadu_si512(vc + b + 64 * i);
            _mm512_store_si512(vp + k * D + 32 * i, _mm512_permutex2var_epi16(va, lo, vb));
            _mm512_store_si512(vp + k * D + 32 * i + 16, _mm512_permutex2var_epi16(va, hi, vb));
        }
    }
}

/* MR (1 or 2) query rows against one block: row i's query qr[i] (D bf16) sees the block's first
 * nq[i] keys; its running max m[i], sum l[i] and output acc[i] (D floats) are updated. */
static inline __attribute__((always_inline)) void lanes_rows(int64_t D, int MR, const uint16_t *const *qr,
                                                             const int64_t *nq, const uint32_t *kt,
                                                             const uint32_t *vp, float scale, float *const *acc,
                                                             float *const *m, float *const *l) {
    __m512 sa[2][LB / 16], sb[2][LB / 16]; /* even and odd dim pairs: two chains per row and 16 keys */
    for (int r = 0; r < MR; r++)
        for (int h = 0; h < LB / 16; h++) sa[r][h] = sb[r][h] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p += 2)
        for (int r = 0; r < MR; r++) {
            const __m512bh q0 = (__m512bh)_mm512_set1_epi32(((const int32_t *)qr[r])[p]);
            const __m512bh q1 = (__m512bh)_mm512_set1_epi32(((const int32_t *)qr[r])[p + 1]);
            for (int h = 0; h < LB / 16; h++) {
                sa[r][h] = _mm512_dpbf16_ps(sa[r][h], q0, (__m512bh)_mm512_load_si512(kt + p * LB + 16 * h));
                sb[r][h] = _mm512_dpbf16_ps(sb[r][h], q1, (__m512bh)_mm512_load_si512(kt + (p + 1) * LB + 16 * h));
            }
        }
    uint32_t pw[2][LB / 2] __attribute__((aligned(64)));
    float alpha[2];
    int64_t np[2], most = 0;
    for (int r = 0; r < MR; r++) {
        const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
        __m512 sv[LB / 16], mxv = ninf;
        __mmask16 v[LB / 16];
        for (int h = 0; h < LB / 16; h++) { /* keys 16h .. 16h+15 */
            v[h] = nq[r] >= 16 * (h + 1) ? 0xFFFF : nq[r] > 16 * h ? (__mmask16)((1u << (nq[r] - 16 * h)) - 1u) : 0;
            sv[h] = _mm512_mask_mov_ps(ninf, v[h], _mm512_mul_ps(_mm512_add_ps(sa[r][h], sb[r][h]), sc));
            mxv = _mm512_max_ps(mxv, sv[h]);
        }
        const float mx = _mm512_reduce_max_ps(mxv), mo = *m[r], mn = mx > mo ? mx : mo;
        __m512 sum = _mm512_setzero_ps();
        for (int h = 0; h < LB / 16; h++) {
            sv[h] = _mm512_maskz_mov_ps(v[h], exp16(_mm512_sub_ps(sv[h], _mm512_set1_ps(mn))));
            sum = _mm512_add_ps(sum, sv[h]);
        }
        alpha[r] = mn > mo ? _mm512_cvtss_f32(exp16(_mm512_set1_ps(mo - mn))) : 1.0f; /* mo = -inf: 0 */
        *m[r] = mn;
        *l[r] = *l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
        for (int h = 0; h < LB / 16; h += 2) /* dword k: keys 2k, 2k+1 */
            _mm512_store_si512(pw[r] + 8 * h, (__m512i)_mm512_cvtne2ps_pbh(sv[h + 1], sv[h]));
        np[r] = (nq[r] + 1) / 2;
        most = np[r] > most ? np[r] : most;
    }
    __m512 o[2][MAXD / 16];
    for (int r = 0; r < MR; r++)
        for (int64_t i = 0; i < D / 16; i++) {
            o[r][i] = _mm512_loadu_ps(acc[r] + 16 * i);
            if (alpha[r] != 1.0f) o[r][i] = _mm512_mul_ps(o[r][i], _mm512_set1_ps(alpha[r]));
        }
    for (int64_t k = 0; k < most; k++)
        for (int r = 0; r < MR; r++) {
            if (k >= np[r]) continue; /* pairs past the row's keys: P is zero there */
            const __m512bh pk = (__m512bh)_mm512_set1_epi32((int32_t)pw[r][k]);
            for (int64_t i = 0; i < D / 16; i++)
                o[r][i] = _mm512_dpbf16_ps(o[r][i], pk, (__m512bh)_mm512_load_si512(vp + k * D + 16 * i));
        }
    for (int r = 0; r < MR; r++)
        for (int64_t i = 0; i < D / 16; i++) _mm512_storeu_ps(acc[r] + 16 * i, o[r][i]);
}

/* Rows r_begin .. r_end-1 (token × head) of a request's Q*G against one laid-out block of keys
 * j0 .. j0+n-1 (from the first row that sees key j0), two rows at a time (four measured no faster):
 * row r's query at q + ((r / G) * qstride + (r % G) * D) bf16, its acc, m and l at index r - base. */
static inline __attribute__((always_inline)) void lanes_block_rows(int64_t D, const char *q, int64_t qstride,
                                                                   int64_t Q, int64_t ctx, int64_t G, int64_t j0,
                                                                   int64_t n, int64_t r_begin, int64_t r_end,
                                                                   int64_t base, const uint32_t *kt,
                                                                   const uint32_t *vp, float scale, float *acc,
                                                                   float *m, float *l) {
    const int64_t first = (j0 - (ctx - Q) > 0 ? j0 - (ctx - Q) : 0) * G;
    for (int64_t r = first > r_begin ? first : r_begin; r < r_end; r += 2) {
        const int MR = r + 1 < r_end ? 2 : 1;
        const uint16_t *qr[2];
        int64_t nq[2];
        float *ar[2], *mr[2], *lr[2];
        for (int i = 0; i < MR; i++) {
            const int64_t t = (r + i) / G, h = (r + i) % G, lim = ctx - Q + t + 1 - j0;
            qr[i] = (const uint16_t *)(q + (t * qstride + h * D) * 2);
            nq[i] = lim < n ? lim : n;
            ar[i] = acc + (r + i - base) * D, mr[i] = m + r + i - base, lr[i] = l + r + i - base;
        }
        if (MR == 2) lanes_rows(D, 2, qr, nq, kt, vp, scale, ar, mr, lr);
        else lanes_rows(D, 1, qr, nq, kt, vp, scale, ar, mr, lr);
    }
}

/* `chunk` for bf16 and D % 32 == 0 (same arguments and results). */
static inline __attribute__((always_inline)) void chunk_lanes(int64_t D, int kv8, const char *q, int64_t qstride, int64_t Q,
                                                              int64_t ctx, const char *kc, const char *vc,
                                                              const int64_t *table, int64_t bs, int64_t KVH,
                                                              int64_t kvh, int64_t j_begin, int64_t j_end, int64_t G,
                                                              float scale, float *acc, float *m, float *l) {
    uint32_t kt[MAXD / 2 * LB] __attribute__((aligned(64))), vp[LB / 2 * MAXD] __attribute__((aligned(64)));
    for (int64_t r = 0; r < Q * G; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int64_t i = 0; i < D / 16; i++) _mm512_storeu_ps(acc + r * D + 16 * i, _mm512_setzero_ps());
    }
    for (int64_t j0 = j_begin; j0 < j_end; j0 += LB) {
        const int64_t n = j_end - j0 < LB ? j_end - j0 : LB;
        lanes_block(D, kv8, kc, vc, table, bs, KVH, kvh, j0, n, j_end, kt, vp);
        lanes_block_rows(D, q, qstride, Q, ctx, G, j0, n, 0, Q * G, 0, kt, vp, scale, acc, m, l);
    }
}
#define LANES_BUILT 1
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* The same chunk with AMX tiles, for bf16 prefill chunks (Q*G query rows, in tiles of 16):
 * S = Q·Kᵀ and O += P·V with TDPBF16PS (bf16 in, float32 sums), the online softmax in AVX-512
 * between them. Per block of 32 keys the keys are transposed once (16×16 dword transposes) and the
 * values interleaved by key pairs, for every row tile. P is rounded to bf16 for the P·V product. */
#define AMX_ATTN 1
#include "amx.h"

/* Keys and values j0 .. j0+n-1 (n <= 32) of one kv head, for the tiles: Kᵀ tiles [D/32][2 halves][16][32]
 * in kt and V tiles by key pairs [D/16][16][32] in vt (keys past n are zeros). */
static void amx_block_kv(int64_t D, const uint16_t *kc, const uint16_t *vc, const int64_t *table, int64_t bs,
                         int64_t row, int64_t kvh, int64_t j0, int64_t n, int64_t ctx, uint16_t *kt, uint16_t *vt) {
    const uint16_t *krow[32], *vrow[32];
    for (int64_t j = 0; j < 32; j++) {
        const int64_t pos = j0 + (j < n ? j : 0), off = (table[pos / bs] * bs + pos % bs) * row + kvh * D;
        krow[j] = kc + off, vrow[j] = vc + off;
        if (j0 + 32 + j < ctx) { /* the next block's rows: the cache is read in scattered pieces of D values */
            const int64_t ahead = (table[(j0 + 32 + j) / bs] * bs + (j0 + 32 + j) % bs) * row + kvh * D;
            for (int64_t b = 0; b < D; b += 32) {
                _mm_prefetch((const char *)(kc + ahead + b), _MM_HINT_T0);
                _mm_prefetch((const char *)(vc + ahead + b), _MM_HINT_T0);
            }
        }
    }
    for (int64_t dc = 0; dc < D / 32; dc++)
        for (int64_t h = 0; h < 2; h++) {
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++)
                r[i] = 16 * h + i < n ? _mm512_loadu_si512(krow[16 * h + i] + 32 * dc) : _mm512_setzero_si512();
            transpose16(r);
            for (int64_t i = 0; i < 16; i++) _mm512_store_si512(kt + ((dc * 2 + h) * 16 + i) * 32, r[i]);
        }
    for (int64_t dv = 0; dv < D / 16; dv++)
        for (int64_t p = 0; p < 16; p++) {
            const __m512i a = 2 * p < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(vrow[2 * p] + 16 * dv))) : _mm512_setzero_si512();
            const __m512i b = 2 * p + 1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(vrow[2 * p + 1] + 16 * dv))) : _mm512_setzero_si512();
            _mm512_store_si512(vt + (dv * 16 + p) * 32, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
}

/* One tile of query rows r0 .. r0+15 (of R = Q*G; qa: the tile's rows, D bf16 each, zero past R) against
 * keys j0 .. j0+n-1 (amx_block_kv's kt and vt), online softmax: acc (D floats per row), m and l
 * are the tile's rows' own. Row r is query token r / G at position ctx - Q + r / G (causal). */
static inline void amx_block_rows(int64_t D, const uint16_t *qa, int64_t r0, int64_t R, int64_t G, int64_t Q,
                                  int64_t ctx, int64_t j0, int64_t n, float scale, const uint16_t *kt,
                                  const uint16_t *vt, float *acc, float *m, float *l) {
    const int64_t last = (r0 + 15 < R - 1 ? r0 + 15 : R - 1) / G; /* the tile's last (latest) token */
    if (ctx - Q + last + 1 <= j0) return;                          /* sees none of these keys */
    float S[16 * 32] __attribute__((aligned(64))), Cv[16 * 16] __attribute__((aligned(64)));
    uint16_t P[16 * 32] __attribute__((aligned(64)));
    float alpha[16];
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t dc = 0; dc < D / 32; dc++) {
        _tile_loadd(2, qa + 32 * dc, D * 2);
        _tile_loadd(3, kt + (dc * 2) * 512, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, kt + (dc * 2 + 1) * 512, 64);
        _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, S, 128);
    _tile_stored(1, S + 16, 128);
    for (int64_t i = 0; i < 16; i++) {
        const int64_t r = r0 + i;
        const int64_t vis = r < R ? ctx - Q + r / G + 1 - j0 : 0; /* keys of this block the row sees */
        const int64_t nv = vis < n ? (vis > 0 ? vis : 0) : n;
        const __mmask16 k0 = (__mmask16)(nv >= 16 ? 0xFFFF : (1u << nv) - 1u);
        const __mmask16 k1 = (__mmask16)(nv >= 32 ? 0xFFFF : nv > 16 ? (1u << (nv - 16)) - 1u : 0);
        if (nv == 0) {
            alpha[i] = 1.0f;
            _mm512_store_si512(P + 32 * i, _mm512_setzero_si512());
            continue;
        }
        const __m512 s0 = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), k0, _mm512_load_ps(S + 32 * i), _mm512_set1_ps(scale));
        const __m512 s1 = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), k1, _mm512_load_ps(S + 32 * i + 16), _mm512_set1_ps(scale));
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)), m_new = mx > m[i] ? mx : m[i];
        const __m512 p0 = _mm512_maskz_mov_ps(k0, exp16(_mm512_sub_ps(s0, _mm512_set1_ps(m_new))));
        const __m512 p1 = _mm512_maskz_mov_ps(k1, exp16(_mm512_sub_ps(s1, _mm512_set1_ps(m_new))));
        alpha[i] = m_new > m[i] ? (m[i] == -INFINITY ? 0.0f : expf(m[i] - m_new)) : 1.0f;
        m[i] = m_new;
        l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        _mm512_store_si512(P + 32 * i, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    _tile_loadd(5, P, 64);
    for (int64_t dv = 0; dv < D / 16; dv++) {
        _tile_zero(4);
        _tile_loadd(6, vt + dv * 512, 64);
        _tile_dpbf16ps(4, 5, 6);
        _tile_stored(4, Cv, 64);
        for (int64_t i = 0; i < 16 && r0 + i < R; i++) {
            float *o = acc + i * D + 16 * dv;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), _mm512_set1_ps(alpha[i]), _mm512_load_ps(Cv + 16 * i)));
        }
    }
}

/* A pair's query rows (R = Q*G, zero-padded to whole tiles), gathered for the tiles: row r is query
 * token r / G's head r % G; q points at the pair's first head of token 0, tokens qstride apart. */
static uint16_t *amx_query_rows(int64_t D, const uint16_t *q, int64_t qstride, int64_t Q, int64_t G) {
    const int64_t R = Q * G, RT = (R + 15) / 16;
    uint16_t *qa = aligned_alloc(64, (size_t)(RT * 16 * D * 2));
    if (qa == NULL) return NULL;
    memset(qa, 0, (size_t)(RT * 16 * D * 2));
    for (int64_t r = 0; r < R; r++) memcpy(qa + r * D, q + (r / G) * qstride + (r % G) * D, (size_t)(D * 2));
    return qa;
}

/* Tiles with R query rows (S, q, P·V, P) and 16 (Kᵀ, V): a decode's few rows cost few rows. The
 * thread's current R is remembered, so tasks of the same size do not configure again. */
static _Thread_local int amx_rows_now = 0;
static inline void amx_rows_config(int R) {
    if (R == amx_rows_now) return;
    amx_config cfg = {0};
    cfg.palette_id = 1;
    for (int t = 0; t < 7; t++) cfg.rows[t] = (uint8_t)(t == 3 || t == 6 ? 16 : R), cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    amx_rows_now = R;
}

static int chunk_amx(int64_t D, const uint16_t *q, int64_t qstride, int64_t Q, int64_t ctx, const uint16_t *kc,
                      const uint16_t *vc, const int64_t *table, int64_t bs, int64_t KVH, int64_t kvh, int64_t j_begin,
                      int64_t j_end, int64_t G, float scale, float *acc, float *m, float *l) {
    const int64_t R = Q * G, RT = (R + 15) / 16;
    uint16_t kt[MAXD / 32 * 2 * 512] __attribute__((aligned(64))), vt[MAXD / 16 * 512] __attribute__((aligned(64)));
    uint16_t one[16 * MAXD] __attribute__((aligned(64))); /* a decode's rows: one tile, no allocation */
    uint16_t *qa = RT == 1 ? one : amx_query_rows(D, q, qstride, Q, G);
    if (qa == NULL) return 1;
    if (RT == 1) {
        memset(one, 0, sizeof(uint16_t) * (size_t)(16 * D));
        for (int64_t r = 0; r < R; r++) memcpy(one + r * D, q + (r / G) * qstride + (r % G) * D, (size_t)(D * 2));
    }
    amx_rows_config(RT == 1 ? (int)R : 16);
    for (int64_t r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(acc + r * D, 0, sizeof(float) * (size_t)D);
    }
    for (int64_t j0 = j_begin; j0 < j_end; j0 += 32) {
        const int64_t n = j_end - j0 < 32 ? j_end - j0 : 32;
        amx_block_kv(D, kc, vc, table, bs, KVH * D, kvh, j0, n, j_end, kt, vt);
        for (int64_t rt = 0; rt < RT; rt++)
            amx_block_rows(D, qa + rt * 16 * D, rt * 16, R, G, Q, ctx, j0, n, scale, kt, vt, acc + rt * 16 * D,
                           m + rt * 16, l + rt * 16);
    }
    if (qa != one) free(qa);
    return 0;
}
#else
#define AMX_ATTN 0
#endif

/* One query row's output from its chunks' partial results (the split-K kernel's second pass): chunk c's
 * acc (D floats), m and l at acc + c * cs, m[c * cs], l[c * cs].
 * out = Σ_c e^(m_c - M) acc_c / Σ_c e^(m_c - M) l_c. Both schedules below combine with this, so a
 * row's result is the same bits whichever computed it. */
static inline void combine_row(int64_t nc, const float *acc, const float *m, const float *l, int64_t cs, int64_t D,
                               char *dst, int bf16, const float *sink) {
    float M = sink != NULL ? *sink : -INFINITY, sum = 0.0f; /* a sink (NULL: none) joins the max and Σ */
    for (int64_t c = 0; c < nc; c++) M = m[c * cs] > M ? m[c * cs] : M;
    if (sink != NULL) sum = expf(*sink - M); /* the sink's term of Σ (it attends to nothing) */
    __m512 o[MAXD / 16];
    for (int64_t i = 0; i < D / 16; i++) o[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        if (m[c * cs] == -INFINITY) continue; /* this token sees no key in chunk c */
        const float e = expf(m[c * cs] - M);
        sum += e * l[c * cs];
        for (int64_t i = 0; i < D / 16; i++) o[i] = _mm512_fmadd_ps(_mm512_set1_ps(e), _mm512_loadu_ps(acc + c * cs + 16 * i), o[i]);
    }
    const int64_t es = bf16 ? 2 : 4;
    for (int64_t i = 0; i < D / 16; i++) st16(dst + 16 * i * es, _mm512_mul_ps(o[i], _mm512_set1_ps(1.0f / sum)), bf16);
}

#define BYROWS_MIN 64 /* query rows (tokens × heads per kv head) from which a tiled request goes by row tiles */
#if LANES_BUILT
/* Bytes of one block of LB keys laid out for lanes_rows: kt [D/2][LB], then vp [LB/2][D] (dwords). */
#define LANES_BLOCK_BYTES(D) ((D) / 2 * LB * 4 + LB / 2 * (D) * 4)

/* rows_task for the lanes kernel: kv head task / RT's query rows 16 * (task % RT) .. against every key,
 * chunk by chunk as the split-K tasks cut them, each chunk's partial results kept for the tile (in L2,
 * not a buffer of every row × chunk in memory) and combined at the end. The same blocks, the same
 * rows against them and the same combine as chunk_lanes and the split-K pass: the same bits. kv: the
 * request's keys and values laid out by lanes_block, per kv head and block of LB. */
static inline __attribute__((always_inline)) int lanes_rows_task(int64_t task, int64_t RT, int64_t D, const char *q,
                                                                 int64_t q0, int64_t Q, int64_t ctx, const uint8_t *kv,
                                                                 int64_t H, int64_t KVH, int64_t G, float scale,
                                                                 char *out, const float *sinks) {
    const int64_t kvh = task / RT, r0 = task % RT * 16, R = Q * G, r1 = r0 + 16 < R ? r0 + 16 : R;
    const int64_t nc = (ctx + CHUNK - 1) / CHUNK, cs = 16 * (D + 2), nblk = (ctx + LB - 1) / LB;
    const char *qp = q + (q0 * H + kvh * G) * D * 2; /* the kv head's first query row */
    float *part = malloc(sizeof(float) * (size_t)(nc * cs));
    if (part == NULL) return 1;
    for (int64_t c = 0; c < nc; c++) {
        float *acc = part + c * cs, *m = acc + 16 * D, *l = m + 16;
        for (int64_t i = 0; i < 16; i++) {
            m[i] = -INFINITY, l[i] = 0.0f;
            for (int64_t d = 0; d < D / 16; d++) _mm512_storeu_ps(acc + i * D + 16 * d, _mm512_setzero_ps());
        }
        const int64_t j_end = ctx < (c + 1) * CHUNK ? ctx : (c + 1) * CHUNK;
        for (int64_t j0 = c * CHUNK; j0 < j_end; j0 += LB) {
            const int64_t n = j_end - j0 < LB ? j_end - j0 : LB;
            const uint32_t *kt = (const uint32_t *)(kv + (kvh * nblk + j0 / LB) * LANES_BLOCK_BYTES(D));
            lanes_block_rows(D, qp, H * D, Q, ctx, G, j0, n, r0, r1, r0, kt, kt + D / 2 * LB, scale, acc, m, l);
        }
    }
    for (int64_t r = r0; r < r1; r++)
        combine_row(nc, part + (r - r0) * D, part + 16 * D + (r - r0), part + 16 * D + 16 + (r - r0), cs, D,
                    out + ((q0 + r / G) * H + kvh * G + r % G) * D * 2, 1, sinks ? sinks + kvh * G + r % G : NULL);
    free(part);
    return 0;
}
#endif
#if AMX_ATTN
/* Bytes of one block of 32 keys for the tiles: Kᵀ, then V by key pairs (amx_block_kv). */
#define KV_BLOCK_BYTES(D) ((D) / 32 * 2 * 1024 + (D) / 16 * 1024)

/* Task `task` of a request taken by row tiles (many query rows: a long prompt's chunk): kv head
 * task / RT's query rows 16 * (task % RT) .. against every key, chunk by chunk as the split-K tasks
 * cut them, with the chunks' partial results kept here (not in a buffer of every row × chunk, which
 * for a long prompt is tens of MB written and read again), then combined. kv: the request's keys
 * and values for the tiles, per kv head and block of 32 (amx_block_kv). */
static int rows_task(int64_t task, int64_t RT, int64_t D, const uint16_t *q, int64_t q0, int64_t Q, int64_t ctx,
                     const uint8_t *kv, int64_t H, int64_t KVH, int64_t G, float scale, uint16_t *out,
                     const float *sinks) {
    const int64_t kvh = task / RT, r0 = task % RT * 16, R = Q * G, nc = (ctx + CHUNK - 1) / CHUNK, cs = 16 * (D + 2);
    const int64_t nblk = (ctx + 31) / 32;
    float *part = malloc(sizeof(float) * (size_t)(nc * cs));
    uint16_t *qa = aligned_alloc(64, (size_t)(16 * D * 2));
    if (part == NULL || qa == NULL) {
        free(part);
        free(qa);
        return 1;
    }
    memset(qa, 0, (size_t)(16 * D * 2));
    amx_rows_config(16);
    for (int64_t i = 0; i < 16 && r0 + i < R; i++) {
        const int64_t r = r0 + i;
        memcpy(qa + i * D, q + ((q0 + r / G) * H + kvh * G + r % G) * D, (size_t)(D * 2));
    }
    for (int64_t c = 0; c < nc; c++) {
        float *acc = part + c * cs, *m = acc + 16 * D, *l = m + 16;
        for (int64_t i = 0; i < 16; i++) m[i] = -INFINITY, l[i] = 0.0f;
        memset(acc, 0, sizeof(float) * (size_t)(16 * D));
        const int64_t j_end = ctx < (c + 1) * CHUNK ? ctx : (c + 1) * CHUNK;
        for (int64_t j0 = c * CHUNK; j0 < j_end; j0 += 32) {
            const uint8_t *blk = kv + (kvh * nblk + j0 / 32) * KV_BLOCK_BYTES(D);
            amx_block_rows(D, qa, r0, R, G, Q, ctx, j0, j_end - j0 < 32 ? j_end - j0 : 32, scale,
                           (const uint16_t *)blk, (const uint16_t *)(blk + D / 32 * 2 * 1024), acc, m, l);
        }
    }
    for (int64_t i = 0; i < 16 && r0 + i < R; i++) {
        const int64_t r = r0 + i;
        combine_row(nc, part + i * D, part + 16 * D + i, part + 16 * D + 16 + i, cs, D,
                    (char *)(out + ((q0 + r / G) * H + kvh * G + r % G) * D), 1, sinks ? sinks + kvh * G + r % G : NULL);
    }
    free(part);
    free(qa);
    return 0;
}
#endif

/* Requests b = 0 .. B-1, each with q_lens[b] query tokens (flat rows q_starts[b] ..; q_lens NULL:
 * one each) at the end of its ctx_lens[b] cached tokens (its own keys already written); request b
 * uses AMX tiles where tiles[b] is nonzero (tiles NULL: none). The caller chooses for every row alike,
 * not by how many there are, so that a row's numerics do not depend on the step it is in. Two
 * schedules, the same arithmetic per row: split-K (a task per request, chunk of keys and kv head,
 * then a pass combining each row's chunks), and for a tiled request with many query rows a task per
 * kv head and tile of 16 rows over all its keys (rows_task). Returns nonzero on out of memory. */
#define QLEN(b) (q_lens != NULL ? q_lens[b] : 1)
static int attention512(int bf16, const char *q, const char *k_cache, const char *v_cache, char *out,
                        const int64_t *q_starts, const int64_t *q_lens, const int64_t *block_tables,
                        const int64_t *ctx_lens, const int64_t *tiles, int64_t B, int64_t max_blocks, int64_t bs,
                        int64_t H, int64_t KVH, int64_t D, float scale, int kv8, const float *sinks,
                        const int64_t *kv_first) {
    const int64_t G = H / KVH, es = bf16 ? 2 : 4;
    int use_amx = 0;
#if AMX_ATTN
    if (bf16 && !kv8 && D % 32 == 0 && D <= AMX_MAXD && tiles != NULL)
        for (int64_t b = 0; b < B; b++) use_amx |= tiles[b] != 0;
    use_amx = use_amx && pytgi_qgemm_amx_supported();
#endif
#if LANES_BUILT
    const int lanes = bf16 && D % 32 == 0; /* requests not on the tiles take chunk_lanes */
#else
    const int lanes = 0;
#endif
#define ROW_AMX(b) (use_amx && tiles[b])
/* a request's first key (a sliding window's: split-K's chunks start there) and its number of chunks */
#define FIRST(b) (kv_first == NULL ? 0 : kv_first[b] < ctx_lens[b] - QLEN(b) ? kv_first[b] : ctx_lens[b] - QLEN(b))
#define CHUNKS(b) ((ctx_lens[b] - FIRST(b) + CHUNK - 1) / CHUNK)
#define BYROWS(b) ((ROW_AMX(b) || lanes) && QLEN(b) * G >= BYROWS_MIN && ctx_lens[b] > CHUNK && FIRST(b) == 0)
    /* split-K task i: request task_b[i], chunk task_c[i], all kv heads (task index * KVH + kvh); partial
     * results at part_off[i] + kvh * (its size). Row-tile tasks: request rows_b[i], rows_first[i] its
     * first, with its keys and values for the tiles at kv[i]. */
    int64_t n_tasks = 0, floats = 0, n_rows = 0, row_tasks = 0;
    for (int64_t b = 0; b < B; b++) {
        if (BYROWS(b)) n_rows++, row_tasks += KVH * ((QLEN(b) * G + 15) / 16);
        else n_tasks += CHUNKS(b);
    }
    int64_t *meta = malloc(sizeof(int64_t) * (size_t)(3 * n_tasks + 2 * B + 2 * n_rows + 2));
    uint8_t **kv = calloc((size_t)(n_rows + 1), sizeof(uint8_t *));
    if (meta == NULL || kv == NULL) {
        free(meta);
        free(kv);
        return 1;
    }
    int64_t *task_b = meta, *task_c = meta + n_tasks, *part_off = meta + 2 * n_tasks, *first_task = meta + 3 * n_tasks;
    int64_t *rows_b = first_task + B + 1, *rows_first = rows_b + n_rows;
    for (int64_t b = 0, i = 0, k = 0, rt = 0; b < B; b++) {
        first_task[b] = i;
        if (BYROWS(b)) {
            rows_b[k] = b, rows_first[k++] = rt;
            rt += KVH * ((QLEN(b) * G + 15) / 16);
            continue;
        }
        for (int64_t c = 0; c < CHUNKS(b); c++, i++) {
            task_b[i] = b, task_c[i] = c, part_off[i] = floats;
            floats += KVH * QLEN(b) * G * (D + 2);
        }
    }
    first_task[B] = n_tasks;
    int failed = 0;
    /* kv heads per split-K task: all of them when there are enough requests to keep the threads busy
     * (a cache row's heads are then read together), else one */
    const int64_t per = B >= 2 * omp_get_max_threads() ? KVH : 1;
    float *parts = malloc(sizeof(float) * (size_t)(floats > 0 ? floats : 1));
    for (int64_t k = 0; k < n_rows; k++) {
        const int64_t ctx = ctx_lens[rows_b[k]];
        (void)ctx;
#if AMX_ATTN
        if (ROW_AMX(rows_b[k])) kv[k] = aligned_alloc(64, (size_t)(KVH * ((ctx + 31) / 32) * KV_BLOCK_BYTES(D)));
#endif
#if LANES_BUILT
        if (!ROW_AMX(rows_b[k])) kv[k] = aligned_alloc(64, (size_t)(KVH * ((ctx + LB - 1) / LB) * LANES_BLOCK_BYTES(D)));
#endif
        failed |= kv[k] == NULL;
    }
    if (parts == NULL || failed) {
        for (int64_t k = 0; k < n_rows; k++) free(kv[k]);
        free(parts);
        free(meta);
        free(kv);
        return 1;
    }
    _Pragma("omp parallel")
    {
        const unsigned int csr = flush_denormals();
#if AMX_ATTN
        amx_config saved;
        if (use_amx) saved = amx_borrow(7), amx_rows_now = 16; /* 0,1: S; 2: q; 3: Kᵀ; 4: P·V; 5: P; 6: V */
#endif
        /* the row-tile requests' keys and values, laid out once for the tiles or the lanes */
        for (int64_t k = 0; k < n_rows; k++) {
            const int64_t b = rows_b[k], ctx = ctx_lens[b], *table = block_tables + b * max_blocks;
            (void)ctx, (void)table; /* unused in builds with neither tiles nor lanes */
#if AMX_ATTN
            if (ROW_AMX(b)) {
                const int64_t nblk = (ctx + 31) / 32;
                _Pragma("omp for schedule(static) nowait")
                for (int64_t i = 0; i < KVH * nblk; i++) {
                    const int64_t kvh = i / nblk, j0 = i % nblk * 32, n = ctx - j0 < 32 ? ctx - j0 : 32;
                    uint8_t *blk = kv[k] + i * KV_BLOCK_BYTES(D);
                    amx_block_kv(D, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table, bs, KVH * D, kvh, j0,
                                 n, ctx, (uint16_t *)blk, (uint16_t *)(blk + D / 32 * 2 * 1024));
                }
                continue;
            }
#endif
#if LANES_BUILT
            const int64_t nblk = (ctx + LB - 1) / LB;
            _Pragma("omp for schedule(static) nowait")
            for (int64_t i = 0; i < KVH * nblk; i++) {
                const int64_t kvh = i / nblk, j0 = i % nblk * LB, n = ctx - j0 < LB ? ctx - j0 : LB;
                uint32_t *kt = (uint32_t *)(kv[k] + i * LANES_BLOCK_BYTES(D)), *vp = kt + D / 2 * LB;
                if (D == 64 && kv8) lanes_block(64, 1, k_cache, v_cache, table, bs, KVH, kvh, j0, n, ctx, kt, vp);
                else if (D == 64) lanes_block(64, 0, k_cache, v_cache, table, bs, KVH, kvh, j0, n, ctx, kt, vp);
                else if (D == 128 && kv8) lanes_block(128, 1, k_cache, v_cache, table, bs, KVH, kvh, j0, n, ctx, kt, vp);
                else if (D == 128) lanes_block(128, 0, k_cache, v_cache, table, bs, KVH, kvh, j0, n, ctx, kt, vp);
                else lanes_block(D, kv8, k_cache, v_cache, table, bs, KVH, kvh, j0, n, ctx, kt, vp);
            }
#endif
        }
        _Pragma("omp barrier")
        _Pragma("omp for schedule(dynamic, 1) nowait")
        for (int64_t t = 0; t < row_tasks; t++) {
            int64_t k = 0;
            while (k + 1 < n_rows && rows_first[k + 1] <= t) k++;
            const int64_t b = rows_b[k], RT = (QLEN(b) * G + 15) / 16, task = t - rows_first[k];
            int bad = 0;
            (void)RT, (void)task;
#if AMX_ATTN
            if (ROW_AMX(b))
                bad = rows_task(task, RT, D, (const uint16_t *)q, q_starts[b], QLEN(b), ctx_lens[b], kv[k], H, KVH, G,
                                scale, (uint16_t *)out, sinks);
#endif
#if LANES_BUILT
#define LANES_TASK(D) \
    lanes_rows_task(task, RT, D, q, q_starts[b], QLEN(b), ctx_lens[b], kv[k], H, KVH, G, scale, out, sinks)
            if (!ROW_AMX(b)) bad = D == 64 ? LANES_TASK(64) : D == 128 ? LANES_TASK(128) : LANES_TASK(D);
#undef LANES_TASK
#endif
            if (bad) {
                _Pragma("omp atomic write")
                failed = 1;
            }
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t task = 0; task < n_tasks * KVH / per; task++)
        for (int64_t kvh = task % (KVH / per) * per; kvh < (task % (KVH / per) + 1) * per; kvh++) {
            const int64_t i = task / (KVH / per), b = task_b[i], c = task_c[i], Q = QLEN(b);
            const int64_t j_begin = FIRST(b) + c * CHUNK, j_end = ctx_lens[b] < j_begin + CHUNK ? ctx_lens[b] : j_begin + CHUNK;
            const char *qp = q + (q_starts[b] * H + kvh * G) * D * es;
            float *acc = parts + part_off[i] + kvh * Q * G * (D + 2), *m = acc + Q * G * D, *l = m + Q * G;
#define CHUNK_ARGS qp, H * D, Q, ctx_lens[b], k_cache, v_cache, block_tables + b * max_blocks, bs, KVH, kvh, \
                   j_begin, j_end, G, scale, acc, m, l
#if AMX_ATTN
            if (use_amx && tiles[b]) {
                if (chunk_amx(D, (const uint16_t *)qp, H * D, Q, ctx_lens[b], (const uint16_t *)k_cache,
                              (const uint16_t *)v_cache, block_tables + b * max_blocks, bs, KVH, kvh, j_begin, j_end,
                              G, scale, acc, m, l)) {
                    _Pragma("omp atomic write")
                    failed = 1;
                }
                continue;
            }
#endif
#if LANES_BUILT
            if (bf16 && D % 32 == 0) { /* an int8 cache's rows become bf16 as they are laid out */
                if (D == 64 && kv8) chunk_lanes(64, 1, CHUNK_ARGS);
                else if (D == 64) chunk_lanes(64, 0, CHUNK_ARGS);
                else if (D == 128 && kv8) chunk_lanes(128, 1, CHUNK_ARGS);
                else if (D == 128) chunk_lanes(128, 0, CHUNK_ARGS);
                else chunk_lanes(D, kv8, CHUNK_ARGS);
                continue;
            }
#endif
            if (kv8) { /* the int8 cache: the rows widened to float32 times their scales */
                if (D == 64 && bf16) chunk(1, 64, 1, CHUNK_ARGS);
                else if (D == 64) chunk(0, 64, 1, CHUNK_ARGS);
                else if (D == 128 && bf16) chunk(1, 128, 1, CHUNK_ARGS);
                else if (D == 128) chunk(0, 128, 1, CHUNK_ARGS);
                else chunk(bf16, D, 1, CHUNK_ARGS);
                continue;
            }
            if (D == 64 && bf16) chunk(1, 64, 0, CHUNK_ARGS);
            else if (D == 64) chunk(0, 64, 0, CHUNK_ARGS);
            else if (D == 128 && bf16) chunk(1, 128, 0, CHUNK_ARGS);
            else if (D == 128) chunk(0, 128, 0, CHUNK_ARGS);
            else chunk(bf16, D, 0, CHUNK_ARGS);
#undef CHUNK_ARGS
        }
        /* combine each split-K request's chunks (chunk c's results KVH * size floats after c - 1's) */
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t pair = 0; pair < B * KVH; pair++) {
            const int64_t b = pair / KVH, kvh = pair % KVH, Q = QLEN(b), size = Q * G * (D + 2);
            const int64_t t0 = first_task[b], nc = first_task[b + 1] - t0;
            if (nc == 0) continue; /* taken by row tiles */
            const float *pc = parts + part_off[t0] + kvh * size;
            for (int64_t r = 0; r < Q * G; r++) {
                const int64_t t = r / G, h = r % G;
                combine_row(nc, pc + r * D, pc + Q * G * D + r, pc + Q * G * D + Q * G + r, KVH * size, D,
                            (char *)out + ((q_starts[b] + t) * H + kvh * G + h) * D * es, bf16,
                            sinks ? sinks + kvh * G + h : NULL);
            }
        }
#if AMX_ATTN
        if (use_amx) amx_return(&saved), amx_rows_now = 0;
#endif
        restore_csr(csr);
    }
#undef BYROWS
#undef CHUNKS
#undef FIRST
#undef ROW_AMX
    for (int64_t k = 0; k < n_rows; k++) free(kv[k]);
    free(parts);
    free(meta);
    free(kv);
    return failed;
}

#undef QLEN

#define FAST_OK (D % 16 == 0 && D <= MAXD && H / KVH <= MAXG)
#else
#define FAST_OK 0
#define attention512(...) 2
#endif

/* Decodes (one query token per request, at flat row rows[b]): the AVX-512 kernel when it applies. */
#define DEFINE_DECODE_ENTRY(NAME, T, BF16)                                                             \
    int NAME(const T *q, const void *k_cache, const void *v_cache, T *out, const int64_t *rows,        \
             const int64_t *block_tables, const int64_t *ctx_lens, int64_t B, int64_t max_blocks,      \
             int64_t block_size, int64_t H, int64_t KVH, int64_t D, float scale, int64_t kv8,          \
             const float *sinks, const int64_t *first) {                                               \
        if (FAST_OK)                                                                                   \
            return attention512(BF16, (const char *)q, (const char *)k_cache, (const char *)v_cache,   \
                                (char *)out, rows, NULL, block_tables, ctx_lens, NULL, B, max_blocks,  \
                                block_size, H, KVH, D, scale, (int)kv8, sinks, first);                 \
        return attention_portable(BF16, q, k_cache, v_cache, out, rows, NULL, block_tables, ctx_lens, B, \
                                  max_blocks, block_size, H, KVH, D, scale, (int)kv8, sinks, first);   \
    }
DEFINE_DECODE_ENTRY(pytgi_decode_attention_f32, float, 0)
DEFINE_DECODE_ENTRY(pytgi_decode_attention_bf16, uint16_t, 1)

/* Prefill chunks (and decodes) in place: request b's q_lens[b] query tokens are flat rows
 * q_starts[b] .. (see attention512; the portable kernel where it does not apply, tiles ignored). */
#define DEFINE_PREFILL(NAME, T, BF16)                                                                  \
    int NAME(const T *q, const void *k_cache, const void *v_cache, T *out, const int64_t *q_starts,    \
             const int64_t *q_lens, const int64_t *block_tables, const int64_t *ctx_lens,               \
             const int64_t *tiles, int64_t B, int64_t max_blocks, int64_t block_size, int64_t H,        \
             int64_t KVH, int64_t D, float scale, int64_t kv8, const float *sinks,                     \
             const int64_t *first) {                                                                   \
        (void)tiles;                                                                                   \
        if (!FAST_OK)                                                                                  \
            return attention_portable(BF16, q, k_cache, v_cache, out, q_starts, q_lens, block_tables,  \
                                      ctx_lens, B, max_blocks, block_size, H, KVH, D, scale, (int)kv8, sinks, first); \
        return attention512(BF16, (const char *)q, (const char *)k_cache, (const char *)v_cache,       \
                            (char *)out, q_starts, q_lens, block_tables, ctx_lens, tiles, B, max_blocks, \
                            block_size, H, KVH, D, scale, (int)kv8, sinks, first);                     \
    }
DEFINE_PREFILL(pytgi_paged_prefill_f32, float, 0)
DEFINE_PREFILL(pytgi_paged_prefill_bf16, uint16_t, 1)
