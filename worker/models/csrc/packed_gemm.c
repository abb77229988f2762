/* y = x @ W.T (+ bias) on the CPU over a weight packed once at load, for AVX-512 (F for
 * float32, BF16 for bfloat16).
 *
 * No torch headers: worker/models/packed_gemm.py loads this with ctypes and passes data
 * pointers. The weight (N, K) is packed in panels of 32 outputs, each panel contiguous:
 *   bfloat16: [N / 32][K / 2][32][2]  (vdpbf16ps takes pairs of k),
 *   float32:  [N / 32][K][32],
 * so a panel streams from memory in order. Each panel meets up to 8 rows of x at a time,
 * 16 accumulators (8 rows x 2 vectors of 16 outputs) held in registers across k: per k
 * (pair) two loads of the weight, one broadcast of each row's x, 16 fused multiply-adds.
 * At the few rows of a decode step the product is bound by reading the weight, and this
 * reads it at the memory's pace, where oneDNN's matmul (torch 2.13, Zen 4) reached half
 * of it; at prefill sizes the panel is re-read from cache for each 8 rows.
 * Sums in float32; a bfloat16 output is rounded once, to nearest even (vcvtneps2bf16, as
 * oneDNN rounds). The panels run in parallel over num_threads OpenMP threads.
 */
#include <stdint.h>
#include <string.h>

#define PACKED_GEMM_ABI 1
#define PANEL 32 /* outputs per panel */
#define ROWS 8   /* rows of x per pass over a panel */

int packed_gemm_abi(void) { return PACKED_GEMM_ABI; }
int packed_gemm_panel(void) { return PANEL; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* 1 where the CPU running this has the instructions it was compiled for (a library
 * built on another machine, -march=native, may not). */
int packed_gemm_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

/* mc (1..ROWS) rows of x (bf16, row stride xs) times one bf16 panel (K/2 x 32 x 2), into
 * y[i][0..31] (row stride ys); bias: 32 bf16 or NULL. */
static inline __attribute__((always_inline)) void panel_bf16(const uint16_t *x, int64_t xs, int mc, int64_t K,
                                                             const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                                             int64_t ys) {
    __m512 a0[ROWS], a1[ROWS];
    for (int i = 0; i < ROWS; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < K / 2; k2++) {
        const uint16_t *wk = w + k2 * 2 * PANEL;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)wk);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wk + PANEL));
        for (int i = 0; i < mc; i++) {
            int32_t pair;
            memcpy(&pair, x + i * xs + 2 * k2, 4);
            __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
            a0[i] = _mm512_dpbf16_ps(a0[i], b, w0);
            a1[i] = _mm512_dpbf16_ps(a1[i], b, w1);
        }
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = b0;
    if (bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias)), 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + 16))), 16));
    }
    for (int i = 0; i < mc; i++) {
        _mm256_storeu_si256((__m256i *)(y + i * ys), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a0[i], b0)));
        _mm256_storeu_si256((__m256i *)(y + i * ys + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a1[i], b1)));
    }
}

/* The same for float32: a panel is K x 32. */
static inline __attribute__((always_inline)) void panel_f32(const float *x, int64_t xs, int mc, int64_t K,
                                                            const float *w, const float *bias, float *y, int64_t ys) {
    __m512 a0[ROWS], a1[ROWS];
    for (int i = 0; i < ROWS; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * PANEL;
        __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
        for (int i = 0; i < mc; i++) {
            __m512 b = _mm512_set1_ps(x[i * xs + k]);
            a0[i] = _mm512_fmadd_ps(b, w0, a0[i]);
            a1[i] = _mm512_fmadd_ps(b, w1, a1[i]);
        }
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = b0;
    if (bias) {
        b0 = _mm512_loadu_ps(bias);
        b1 = _mm512_loadu_ps(bias + 16);
    }
    for (int i = 0; i < mc; i++) {
        _mm512_storeu_ps(y + i * ys, _mm512_add_ps(a0[i], b0));
        _mm512_storeu_ps(y + i * ys + 16, _mm512_add_ps(a1[i], b1));
    }
}

#define DISPATCH(fn, mc, ...)                                                                                          \
    switch (mc) {                                                                                                      \
    case 1: fn(__VA_ARGS__, 1); break;                                                                                 \
    case 2: fn(__VA_ARGS__, 2); break;                                                                                 \
    case 3: fn(__VA_ARGS__, 3); break;                                                                                 \
    case 4: fn(__VA_ARGS__, 4); break;                                                                                 \
    case 5: fn(__VA_ARGS__, 5); break;                                                                                 \
    case 6: fn(__VA_ARGS__, 6); break;                                                                                 \
    case 7: fn(__VA_ARGS__, 7); break;                                                                                 \
    default: fn(__VA_ARGS__, 8); break;                                                                                \
    }
/* NOTE: mc last, a constant in each case, so every row count gets its own unrolled loop. */
#define CALL_BF16(x, xs, K, w, bias, y, ys, mc) panel_bf16(x, xs, mc, K, w, bias, y, ys)
#define CALL_F32(x, xs, K, w, bias, y, ys, mc) panel_f32(x, xs, mc, K, w, bias, y, ys)

/* y (M, N) = x (M, K) @ W.T + bias. x, y: row strides xs, ys (elements), rows contiguous;
 * wp: the packed weight; bias: N elements or NULL; N a multiple of PANEL, K (bf16) even.
 * bf16: x, wp, bias, y bfloat16 (uint16); else all float32. Returns 0, or -2 on bad
 * arguments. */
int packed_gemm(int bf16, const void *x, int64_t xs, int64_t M, int64_t K, const void *wp, const void *bias, int64_t N,
                void *y, int64_t ys, int num_threads) {
    if (M < 0 || K < 1 || N < PANEL || N % PANEL != 0 || (bf16 && K % 2 != 0)) return -2;
    const int64_t panels = N / PANEL;
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > panels) nt = (int)panels;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t m = 0; m < M; m += ROWS) {
            const int mc = (int)(M - m < ROWS ? M - m : ROWS);
            if (bf16) {
                const uint16_t *w = (const uint16_t *)wp + p * K * PANEL;
                const uint16_t *b = bias ? (const uint16_t *)bias + p * PANEL : NULL;
                DISPATCH(CALL_BF16, mc, (const uint16_t *)x + m * xs, xs, K, w, b, (uint16_t *)y + m * ys + p * PANEL, ys)
            } else {
                const float *w = (const float *)wp + p * K * PANEL;
                const float *b = bias ? (const float *)bias + p * PANEL : NULL;
                DISPATCH(CALL_F32, mc, (const float *)x + m * xs, xs, K, w, b, (float *)y + m * ys + p * PANEL, ys)
            }
        }
    }
    return 0;
}
#else
int packed_gemm_available(void) { return 0; }
int packed_gemm(int bf16, const void *x, int64_t xs, int64_t M, int64_t K, const void *wp, const void *bias, int64_t N,
                void *y, int64_t ys, int num_threads) {
    return -3;
}
#endif
