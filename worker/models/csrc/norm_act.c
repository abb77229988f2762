/* The decoder's elementwise steps, each in one pass over its rows, for AVX-512 (F, BF16):
 * RMSNorm and SiLU-and-multiply, with transformers' roundings, and the rotary embedding
 * of a bfloat16 model with worker/models/rope.py's.
 *
 * No torch headers: worker/models/norm_act.py loads this with ctypes and passes data
 * pointers. torch runs each as several ops (RMSNorm: widen, square, mean, add, rsqrt,
 * multiply, narrow, multiply), each a pass over memory and a dispatch; here one.
 * bfloat16 values are widened exactly, computed in float32, and rounded to nearest even
 * (vcvtneps2bf16) where transformers' bfloat16 model rounds:
 *   rms_norm:  y = bf16(w * bf16(x * 1 / sqrt(sum(x^2) / D + eps)))
 *   silu_mul:  y = bf16(bf16(g / (1 + e^-g)) * u)
 *   rope:      y1 = bf16(bf16(x1 c) - x2 s), y2 = bf16(bf16(x2 c) + x1 s)  (a head's halves x1, x2)
 * float32 alike without the roundings (rope: bfloat16 only). The sum of squares runs in
 * another order than torch's (16 lanes, then across them), and e^x is a polynomial (Cephes' expf, ~2 ulp,
 * scaled by vscalefps), so a result may sit one float32 ulp from torch's, which a
 * bfloat16 rounding almost always absorbs.
 */
#include <math.h>
#include <stdint.h>

#define NORM_ACT_ABI 2

int norm_act_abi(void) { return NORM_ACT_ABI; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

int norm_act_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

/* n (< 16) lanes from i on, as a mask. */
static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

static inline __m512 load(const void *p, int64_t i, int bf16, __mmask16 m) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* A float32 vector rounded to bfloat16 and widened back (bf16 ? that : as it is). */
static inline __m512 round_to(__m512 x, int bf16) {
    if (!bf16) return x;
    __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store(void *p, int64_t i, __m512 x, int bf16, __mmask16 m) {
    if (!bf16)
        _mm512_mask_storeu_ps((float *)p + i, m, x);
    else
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, (__m256i)_mm512_cvtneps_pbh(x));
}

#include "../../csrc/exp512.h"

/* Elements from which a call runs on its threads (a quarter of it for silu_mul, whose
 * exps cost more): below it, waking the second thread took longer than the work (a
 * decode step's few rows; docs/benchmarks.md, "2026-12-07, 06:00"). */
#define PARALLEL_MIN_ELEMENTS (1 << 15)

/* y[r] = RMSNorm(x[r]) * w for the rows (row strides xs, ys in elements; w: d). */
int rms_norm(int bf16, const void *x, int64_t xs, int64_t rows, int64_t d, const void *w, float eps, void *y, int64_t ys,
             int num_threads) {
    if (rows < 0 || d < 1) return -2;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) if (num_threads > 1 && rows > 1 && rows * d >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t xo = r * xs, yo = r * ys;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __m512 v = load(x, xo + i, bf16, lanes(d - i));
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)d + eps);
        const __m512 s = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < d; i += 16) {
            __mmask16 m = lanes(d - i);
            __m512 h = round_to(_mm512_mul_ps(load(x, xo + i, bf16, m), s), bf16);
            store(y, yo + i, _mm512_mul_ps(load(w, i, bf16, m), h), bf16, m);
        }
    }
    return 0;
}

/* y[r][j] = silu(gu[r][j]) * gu[r][inter + j] for j < inter (row strides gs, ys). */
int silu_mul(int bf16, const void *gu, int64_t gs, int64_t rows, int64_t inter, void *y, int64_t ys, int num_threads) {
    if (rows < 0 || inter < 1) return -2;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) if (num_threads > 1 && rows > 1 && rows * inter >= PARALLEL_MIN_ELEMENTS / 4)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t go = r * gs, yo = r * ys;
        for (int64_t i = 0; i < inter; i += 16) {
            __mmask16 m = lanes(inter - i);
            __m512 g = load(gu, go + i, bf16, m), u = load(gu, go + inter + i, bf16, m);
            __m512 a = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            store(y, yo + i, _mm512_mul_ps(round_to(a, bf16), u), bf16, m);
        }
    }
    return 0;
}
/* y (rows, heads, hd) contiguous = x (rows, heads, hd; row stride xs elements, heads
 * contiguous) rotated by cos, sin (rows, hd / 2) contiguous, all bfloat16: each head's
 * halves x1, x2 as rope.py's two torch ops round them (the bf16 products x2 s, x1 s are
 * exact in float32, so one float32 sum then one rounding is what addcmul_ gives). */
int rope_bf16(const void *x, int64_t xs, int64_t rows, int64_t heads, int64_t hd, const void *cos, const void *sin, void *y,
              int num_threads) {
    if (rows < 0 || heads < 1 || hd < 2 || hd % 2 != 0) return -2;
    const int64_t half = hd / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) if (num_threads > 1 && rows > 1 && rows * heads * hd >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < half; i += 16) {
            const __mmask16 m = lanes(half - i);
            const __m512 c = load(cos, r * half + i, 1, m), sn = load(sin, r * half + i, 1, m);
            for (int64_t h = 0; h < heads; h++) {
                const int64_t xo = r * xs + h * hd + i, yo = (r * heads + h) * hd + i;
                const __m512 x1 = load(x, xo, 1, m), x2 = load(x, xo + half, 1, m);
                store(y, yo, _mm512_sub_ps(round_to(_mm512_mul_ps(x1, c), 1), _mm512_mul_ps(x2, sn)), 1, m);
                store(y, yo + half, _mm512_add_ps(round_to(_mm512_mul_ps(x2, c), 1), _mm512_mul_ps(x1, sn)), 1, m);
            }
        }
    }
    return 0;
}
#else
int norm_act_available(void) { return 0; }
int rope_bf16(const void *x, int64_t xs, int64_t rows, int64_t heads, int64_t hd, const void *cos, const void *sin, void *y,
              int num_threads) {
    return -3;
}
int rms_norm(int bf16, const void *x, int64_t xs, int64_t rows, int64_t d, const void *w, float eps, void *y, int64_t ys,
             int num_threads) {
    return -3;
}
int silu_mul(int bf16, const void *gu, int64_t gs, int64_t rows, int64_t inter, void *y, int64_t ys, int num_threads) {
    return -3;
}
#endif
