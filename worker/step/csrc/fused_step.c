/* A step's decoder layers in one native call: for each layer, RMSNorm, the fused q/k/v
 * projection, the rotary embedding, the paged KV write, paged attention (decode rows by the
 * decode kernel, chunks of several tokens by the prefill kernel), the
 * o projection and its residual add, RMSNorm, gate/up, SiLU-and-multiply, down and its
 * residual add -- the same kernels, in the same order, with the same roundings, as
 * worker/models/decoder.py's forward runs them one Python call at a time.
 *
 * No torch headers: worker/step/fused_step.py loads this with ctypes. It computes nothing
 * of its own but the KV write (a row copy per token) and the residual adds; the rest it calls
 * through the function pointers it is given, the entry points of the kernels' own libraries
 * (packed_gemm, rms_norm, silu_mul, rope_bf16, paged_decode, paged_prefill), so there is
 * one copy of each.
 * What it saves is the interpreter between them: a decode step of a 30-layer model made
 * some 400 Python calls, each a few microseconds, a fifth of a small batch's step.
 *
 * bfloat16 only (the model, its packed weights and its KV cache). A residual add is
 * x = bf16(float(x) + float(y)), rounded to nearest even as torch's bfloat16 add rounds.
 */
#include <stdint.h>
#include <string.h>

#define FUSED_STEP_ABI 2

int fused_step_abi(void) { return FUSED_STEP_ABI; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

int fused_step_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

typedef int (*gemm_fn)(int, const void *, int64_t, int64_t, int64_t, const void *, const void *, int64_t, void *, int64_t,
                       int);
typedef int (*norm_fn)(int, const void *, int64_t, int64_t, int64_t, const void *, float, void *, int64_t, int);
typedef int (*silu_fn)(int, const void *, int64_t, int64_t, int64_t, void *, int64_t, int);
typedef int (*rope_fn)(const void *, int64_t, int64_t, int64_t, int64_t, const void *, const void *, void *, int);
typedef int (*decode_fn)(const void *, int64_t, const void *, const void *, int, float, float, int64_t, int, int, int,
                         int, const int32_t *, int64_t, int64_t, const int64_t *, const int64_t *, const int64_t *,
                         const int64_t *, int64_t, float, int, void *, float *, int);
typedef int (*prefill_fn)(int, const void *, int64_t, const void *, const void *, int64_t, int, int, int, int,
                          const int32_t *, int64_t, int64_t, const int64_t *, const int64_t *, const int64_t *,
                          const int64_t *, int64_t, int64_t, float, void *, int64_t, int);

/* The kernels, in this order, as addresses (fused_step.py's FusedStep.kernels);
 * K_PREFILL may be NULL for a step without chunks. */
enum { K_GEMM, K_NORM, K_SILU, K_ROPE, K_DECODE, K_PREFILL, NUM_KERNELS };

/* The step's rows as the attention kernels read them (fused_step.py's StepRows): the
 * first num_decode tokens are decode rows (paged_decode's arguments), then num_chunks
 * chunks (paged_prefill's), all through one block table. */
struct step_rows {
    const int32_t *table;
    int64_t table_rows, table_cols;
    int64_t num_decode;
    const int64_t *d_row, *d_first_col, *d_nkeys, *d_lead;
    int64_t num_chunks;
    const int64_t *p_row, *p_first, *p_n, *p_off;
    int64_t window;
};

/* A layer's pointers, in this order (fused_step.py's LAYER_FIELDS); a bias may be NULL. */
enum { L_INPUT_NORM, L_QKV, L_QKV_BIAS, L_O, L_O_BIAS, L_POST_NORM, L_GATE_UP, L_DOWN, L_K_CACHE, L_V_CACHE, NUM_FIELDS };

/* The shapes, in this order (fused_step.py's DIMS). */
enum { D_T, D_H, D_NH, D_KVH, D_HD, D_INTER, D_NUM_BLOCKS, D_BS, NUM_DIMS };

#define KV_BF16 1 /* paged_decode.c's kind of a bfloat16 cache */
/* gate/up and the activation run over at most this many rows at a time, so that a long
 * prefill's (rows, 2 inter) product stays in cache (worker/models/layers.py's MLP_CHUNK_ROWS). */
#define MLP_CHUNK_ROWS 256

/* x[i] = bf16(x[i] + y[i]) for n bfloat16 elements. */
static void add_bf16(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + i)), 16));
        __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, y + i)), 16));
        _mm256_mask_storeu_epi16(x + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, b)));
    }
}

/* One layer's attention of the step's tokens: decode rows, then chunks. */
static int attend(const void *const *kernels, const struct step_rows *r, const uint16_t *qk, int64_t qk_row,
                  const void *kc, const void *vc, int64_t nb, int64_t bs, int64_t kvh, int64_t hd, int64_t nh,
                  float scale, uint16_t *att, int nt) {
    int rc = 0;
    if (r->num_decode > 0)
        rc = ((decode_fn)kernels[K_DECODE])(qk, qk_row, kc, vc, KV_BF16, 1.0f, 1.0f, nb, (int)bs, (int)kvh, (int)hd,
                                            (int)nh, r->table, r->table_rows, r->table_cols, r->d_row, r->d_first_col,
                                            r->d_nkeys, r->d_lead, r->num_decode, scale, 1, att, NULL, nt);
    if (rc == 0 && r->num_chunks > 0)
        rc = kernels[K_PREFILL] == NULL
                 ? -2
                 : ((prefill_fn)kernels[K_PREFILL])(1, qk, qk_row, kc, vc, nb, (int)bs, (int)kvh, (int)hd, (int)nh,
                                                    r->table, r->table_rows, r->table_cols, r->p_row, r->p_first,
                                                    r->p_n, r->p_off, r->num_chunks, r->window, scale, att, nh * hd, nt);
    return rc;
}

/* Runs the L layers over x (T, H) bfloat16 in place, for the step's T tokens.
 * kernels: NUM_KERNELS addresses; layers: L * NUM_FIELDS addresses; dims: NUM_DIMS.
 * cos, sin: (T, hd / 2); slots: (T,) the tokens' KV slots; rows: which token attends how.
 * scratch: bfloat16 room for T * (2 H + q + 2 kv + (nh + kvh) hd + nh hd + inter) +
 * min(T, MLP_CHUNK_ROWS) * 2 inter elements. Returns 0, or the first
 * failing kernel's code (-1: a block or slot outside the cache, -2: bad arguments) with
 * its layer in *where. */
int fused_step(const void *const *kernels, const void *const *layers, int64_t L, const int64_t *dims, float eps,
                 float scale, uint16_t *x, const void *cos, const void *sin, const int64_t *slots,
                 const struct step_rows *rows, uint16_t *scratch, int num_threads, int64_t *where) {
    const gemm_fn gemm = (gemm_fn)kernels[K_GEMM];
    const norm_fn norm = (norm_fn)kernels[K_NORM];
    const silu_fn silu = (silu_fn)kernels[K_SILU];
    const rope_fn rope = (rope_fn)kernels[K_ROPE];
    const int64_t T = dims[D_T], H = dims[D_H], nh = dims[D_NH], kvh = dims[D_KVH], hd = dims[D_HD];
    const int64_t inter = dims[D_INTER], nb = dims[D_NUM_BLOCKS], bs = dims[D_BS];
    const int64_t q_size = nh * hd, kv_size = kvh * hd, qkv_size = q_size + 2 * kv_size, qk_row = (nh + kvh) * hd;
    if (T < 1 || H < 1 || nh < 1 || kvh < 1 || hd < 2 || inter < 1 || L < 1) return -2;
    if (rows->num_decode < 0 || rows->num_chunks < 0 || (rows->num_chunks == 0 && rows->num_decode != T)) return -2;
    uint16_t *h = scratch;                 /* (T, H) the normed input of a sublayer */
    uint16_t *qkv = h + T * H;             /* (T, q + 2 kv) */
    uint16_t *qk = qkv + T * qkv_size;     /* (T, nh + kvh, hd) rotated q and k */
    uint16_t *att = qk + T * qk_row;       /* (T, nh, hd) */
    uint16_t *y = att + T * q_size;        /* (T, H) a sublayer's output */
    uint16_t *act = y + T * H;             /* (T, inter) */
    uint16_t *gu = act + T * inter;        /* (MLP_CHUNK_ROWS, 2 inter) */
    for (int64_t l = 0; l < L; l++) {
        *where = l;
        const void *const *w = layers + l * NUM_FIELDS;
        int rc = norm(1, x, H, T, H, w[L_INPUT_NORM], eps, h, H, num_threads);
        if (rc == 0) rc = gemm(1, h, H, T, H, w[L_QKV], w[L_QKV_BIAS], qkv_size, qkv, qkv_size, num_threads);
        if (rc == 0) rc = rope(qkv, qkv_size, T, nh + kvh, hd, cos, sin, qk, num_threads);
        if (rc != 0) return rc;
        uint16_t *kc = (uint16_t *)w[L_K_CACHE], *vc = (uint16_t *)w[L_V_CACHE];
        for (int64_t t = 0; t < T; t++) {
            if (slots[t] < 0 || slots[t] >= nb * bs) return -1;
            memcpy(kc + slots[t] * kv_size, qk + t * qk_row + q_size, (size_t)kv_size * 2);
            memcpy(vc + slots[t] * kv_size, qkv + t * qkv_size + q_size + kv_size, (size_t)kv_size * 2);
        }
        rc = attend(kernels, rows, qk, qk_row, kc, vc, nb, bs, kvh, hd, nh, scale, att, num_threads);
        if (rc == 0) rc = gemm(1, att, q_size, T, q_size, w[L_O], w[L_O_BIAS], H, y, H, num_threads);
        if (rc != 0) return rc;
        add_bf16(x, y, T * H);
        rc = norm(1, x, H, T, H, w[L_POST_NORM], eps, h, H, num_threads);
        for (int64_t s = 0; rc == 0 && s < T; s += MLP_CHUNK_ROWS) {
            const int64_t n = T - s < MLP_CHUNK_ROWS ? T - s : MLP_CHUNK_ROWS;
            rc = gemm(1, h + s * H, H, n, H, w[L_GATE_UP], NULL, 2 * inter, gu, 2 * inter, num_threads);
            if (rc == 0) rc = silu(1, gu, 2 * inter, n, inter, act + s * inter, inter, num_threads);
        }
        if (rc == 0) rc = gemm(1, act, inter, T, inter, w[L_DOWN], NULL, H, y, H, num_threads);
        if (rc != 0) return rc;
        add_bf16(x, y, T * H);
    }
    return 0;
}
#else
struct step_rows;
int fused_step_available(void) { return 0; }
int fused_step(const void *const *kernels, const void *const *layers, int64_t L, const int64_t *dims, float eps,
                 float scale, uint16_t *x, const void *cos, const void *sin, const int64_t *slots,
                 const struct step_rows *rows, uint16_t *scratch, int num_threads, int64_t *where) {
    return -3;
}
#endif
