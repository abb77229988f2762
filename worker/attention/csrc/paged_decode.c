/* Paged decode attention on CPU: each decode row's queries attend to its keys where they
 * lie, block by block through the block table, with no gather into a workspace.
 *
 * No torch headers: worker/attention/paged_decode.py loads this with ctypes and passes data
 * pointers. One task is one row's kv heads (all of them where its buffers hold them): each
 * kv head's `group` query heads meet each key once. Keys are taken a block (or the part of
 * one the row uses) at a time, every head of the task in turn on it (a block holds all of
 * a key's heads side by side, so the block is read once), while the next block the row's
 * table names is prefetched: per head, scores for the tile, an online softmax (running
 * max and sum, float32), then the tile's values weighted into a float32 accumulator.
 * Float32, bfloat16 and fp8 (e4m3fn, e5m2, with a per-layer scale each for K and V)
 * caches, read as float32 where they lie; queries and output in the compute dtype (the
 * 16/32-bit cache's own), the log-sum-exp of each query's scores in float32 (what cascade
 * attention's merge needs).
 * With AVX2, FMA and F16C (and a head size a multiple of 16) the tile's loops are written with
 * intrinsics: four keys' scores at a time in vertical accumulators, summed across lanes
 * once, and values into accumulators held in registers across the tile. Elsewhere, plain
 * C. The exp is a branch-free polynomial (Cephes' expf, a couple of ulp), eight lanes at a
 * time with AVX2; libm's would run one lane at a time.
 * With AVX-512 BF16, a bfloat16 cache (head size a multiple of 32) takes a faster path: the
 * scores by vdpbf16ps (the bf16 query and key multiplied exactly, in float32 sums, then
 * scaled), the values 16 lanes at a time: ~3x the AVX2 path's keys a second. A float32 cache
 * (head size a multiple of 16) takes the same 16-lane loops with FMA there. On those paths
 * a tile's scores are taken for every head of the task at once, key after key, while its
 * values are prefetched, and the next tile's keys a head's share at a time (tile512); the
 * exps 16 lanes at a time (exp512.h).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PAGED_DECODE_ABI 6
#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define TILE 64 /* keys per tile: a block, or a part of one when blocks are larger */

/* The cache's element: float32, bfloat16, or fp8 (e4m3fn, e5m2; then queries and output
 * are in the compute dtype, float32 or bfloat16). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2, KV_E5M2 = 3 };

int paged_decode_abi(void) { return PAGED_DECODE_ABI; }
int paged_decode_max_head_dim(void) { return MAX_HEAD_DIM; }
int paged_decode_max_group(void) { return MAX_GROUP; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* An fp8 byte's value (exact in float32), e4m3fn's times 2^-8 (the caller scales by 2^8):
 * the byte moved into a float16's fields, where its exponent's bias is 15 (e5m2's own;
 * e4m3fn's 7, hence 2^-8), subnormals included, then widened. NOTE: the NaN/inf patterns
 * read as finite, as worker.attention.kv_quant's dequantize reads them (the write
 * saturates), except e5m2's top exponent, inf/NaN in float16 as in e5m2. */
static inline float fp8_to_f32(uint8_t b, int kind) {
    uint16_t h = kind == KV_E5M2 ? (uint16_t)(b << 8) : (uint16_t)(((b & 0x7Fu) << 7) | ((b & 0x80u) << 8));
    const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
    float f = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(m | 0x400), e - 25);
    if (kind == KV_E5M2 && e == 0x1F) f = m ? NAN : INFINITY;
    return (h & 0x8000u) ? -f : f;
}

/* Element i of the cache as float32. */
static inline float load1(const void *p, int64_t i, int kind) {
    switch (kind) {
    case KV_F32: return ((const float *)p)[i];
    case KV_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    default: return fp8_to_f32(((const uint8_t *)p)[i], kind);
    }
}

/* float32 -> bfloat16, rounded to nearest even (c10::BFloat16's rounding; NaN kept NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e^x for x <= 0 (scores minus their running max); below -87.3 it is 0. */
static inline float exp_nonpositive(float x) {
    const float lo = -87.33654f;
    float keep = x < lo ? 0.0f : 1.0f;
    x = x < lo ? lo : x;
    /* x = n ln2 + r, |r| <= ln2 / 2; ln2 split in two for an exact n ln2 */
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, 4);
    return p * two_n * keep;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1

/* 8 elements from element i of the cache, as float32 (fp8: fp8_to_f32 on 8 lanes, F16C's widening). */
static inline __attribute__((always_inline)) __m256 load8(const void *p, int64_t i, int kind) {
    if (kind == KV_F32) return _mm256_loadu_ps((const float *)p + i);
    if (kind == KV_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)p + i)));
    __m128i h = kind == KV_E5M2 ? _mm_slli_epi16(b, 8)
                                : _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                                               _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    return _mm256_cvtph_ps(h);
}

/* The sums of a, b, c, d's lanes, in that order. */
static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

/* exp_nonpositive on 8 lanes, the same polynomial. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

/* Scores of 4 consecutive keys (element k0, stride ks) for GC (1 or 2) queries q, q + hd:
 * s[g][t .. t + 3]. hd: a multiple of 8. */
static inline __attribute__((always_inline)) void scores4(const float *q, int GC, int hd, const void *k, int64_t k0,
                                                          int64_t ks, int kind, float *s0, float *s1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int d = 0; d < hd; d += 8) {
        __m256 x0 = load8(k, k0 + d, kind), x1 = load8(k, k0 + ks + d, kind);
        __m256 x2 = load8(k, k0 + 2 * ks + d, kind), x3 = load8(k, k0 + 3 * ks + d, kind);
        __m256 q0 = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(q0, x0, a0);
        a1 = _mm256_fmadd_ps(q0, x1, a1);
        a2 = _mm256_fmadd_ps(q0, x2, a2);
        a3 = _mm256_fmadd_ps(q0, x3, a3);
        if (GC == 2) {
            __m256 q1 = _mm256_loadu_ps(q + hd + d);
            b0 = _mm256_fmadd_ps(q1, x0, b0);
            b1 = _mm256_fmadd_ps(q1, x1, b1);
            b2 = _mm256_fmadd_ps(q1, x2, b2);
            b3 = _mm256_fmadd_ps(q1, x3, b3);
        }
    }
    _mm_storeu_ps(s0, sum4(a0, a1, a2, a3));
    if (GC == 2) _mm_storeu_ps(s1, sum4(b0, b1, b2, b3));
}

/* acc[g][d .. d + 15] += sum over the tile's n keys of p[g][t] * v[t][d .. d + 15], for
 * GC (1..4) queries from g0. */
static inline __attribute__((always_inline)) void values16(float *acc, int hd, int g0, int GC, const float (*p)[TILE],
                                                           const void *v, int64_t v0, int64_t ks, int n, int d, int kind) {
    __m256 a[4][2];
    for (int g = 0; g < GC; g++) {
        a[g][0] = _mm256_loadu_ps(acc + (g0 + g) * hd + d);
        a[g][1] = _mm256_loadu_ps(acc + (g0 + g) * hd + d + 8);
    }
    for (int t = 0; t < n; t++) {
        __m256 x0 = load8(v, v0 + t * ks + d, kind), x1 = load8(v, v0 + t * ks + d + 8, kind);
        for (int g = 0; g < GC; g++) {
            __m256 w = _mm256_broadcast_ss(&p[g0 + g][t]);
            a[g][0] = _mm256_fmadd_ps(w, x0, a[g][0]);
            a[g][1] = _mm256_fmadd_ps(w, x1, a[g][1]);
        }
    }
    for (int g = 0; g < GC; g++) {
        _mm256_storeu_ps(acc + (g0 + g) * hd + d, a[g][0]);
        _mm256_storeu_ps(acc + (g0 + g) * hd + d + 8, a[g][1]);
    }
}

/* One tile with AVX2: scores into s, then (after the softmax, by the caller) values. */
static inline __attribute__((always_inline)) void tile_scores_avx2(const float *q, int group, int hd, const void *k,
                                                                   int64_t base, int64_t ks, int n, int kind,
                                                                   float (*s)[TILE]) {
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        int g = 0;
        for (; g + 2 <= group; g += 2) scores4(q + g * hd, 2, hd, k, base + t * ks, ks, kind, &s[g][t], &s[g + 1][t]);
        if (g < group) scores4(q + g * hd, 1, hd, k, base + t * ks, ks, kind, &s[g][t], NULL);
    }
    for (; t < n; t++) {
        for (int g = 0; g < group; g++) {
            __m256 a = _mm256_setzero_ps();
            for (int d = 0; d < hd; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d), load8(k, base + t * ks + d, kind), a);
            __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            x = _mm_hadd_ps(x, x);
            x = _mm_hadd_ps(x, x);
            s[g][t] = _mm_cvtss_f32(x);
        }
    }
}

static inline __attribute__((always_inline)) void tile_values_avx2(float *acc, int group, int hd, const float (*p)[TILE],
                                                                   const void *v, int64_t base, int64_t ks, int n,
                                                                   int kind) {
    for (int d = 0; d < hd; d += 16) {
        int g = 0;
        for (; g + 4 <= group; g += 4) values16(acc, hd, g, 4, p, v, base, ks, n, d, kind);
        switch (group - g) {
        case 3: values16(acc, hd, g, 3, p, v, base, ks, n, d, kind); break;
        case 2: values16(acc, hd, g, 2, p, v, base, ks, n, d, kind); break;
        case 1: values16(acc, hd, g, 1, p, v, base, ks, n, d, kind); break;
        default: break;
        }
    }
}
#endif

#if defined(HAVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512BF16 1

/* The upper 8 lanes of a, added to its lower 8. */
static inline __m256 fold16(__m512 a) {
    __m256 hi = _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(a), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(a), hi);
}

/* Prefetch the values of keys t .. t + 3 of a tile (pv: its first key's value at the task's
 * first head; row: bytes from one key to the next; span: the task's heads' bytes): the
 * values pass reads them after the scores, so they arrive meanwhile. */
static inline __attribute__((always_inline)) void prefetch_values4(const char *pv, int64_t row, int64_t span, int t) {
    const char *p1 = pv + (t + 3) * row + span;
    for (const char *p = pv + t * row; p < p1; p += 64) __builtin_prefetch(p, 0, 2);
}

/* One chunk of a query-key dot product into a: 32 bfloat16 pairs multiplied exactly and
 * summed in float32 (vdpbf16ps), or 16 floats (FMA); k, q at the chunk's first element. */
static inline __attribute__((always_inline)) __m512 dot_chunk(__m512 a, const void *k, const void *q, int bf16) {
    if (bf16) return _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k), (__m512bh)_mm512_loadu_si512(q));
    return _mm512_fmadd_ps(_mm512_loadu_ps((const float *)k), _mm512_loadu_ps((const float *)q), a);
}

/* A tile's scores for the task's nkv heads: s[x * group + g][t] = qs * (q[x][g] . k[t][x]),
 * four keys at a time, each key's heads in turn (they lie side by side, so the tile is read
 * front to back), its values prefetched meanwhile (pv: the tile's first value at the task's
 * first head). A bfloat16 cache (bf16: q its queries as they came, qs their scale; hd a
 * multiple of 32) or a float32 one (q scaled already, qs 1; hd a multiple of 16). */
static inline __attribute__((always_inline)) void tile_scores512(const void *q, int group, int nkv, int hd, float qs,
                                                                 const void *k, int64_t base, int64_t ks, int n,
                                                                 float (*s)[TILE], const char *pv, int bf16) {
    const int64_t es = bf16 ? 2 : 4; /* bytes an element */
    const int step = bf16 ? 32 : 16; /* elements a chunk */
    const char *kb = (const char *)k, *qb = (const char *)q;
    const __m128 scale4 = _mm_set1_ps(qs);
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        prefetch_values4(pv, ks * es, (int64_t)nkv * hd * es, t);
        for (int x = 0; x < nkv; x++) {
            const char *k0 = kb + (base + t * ks + x * hd) * es;
            for (int g = 0; g < group; g++) {
                const char *qg = qb + (int64_t)(x * group + g) * hd * es;
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int d = 0; d < hd; d += step) {
                    a0 = dot_chunk(a0, k0 + d * es, qg + d * es, bf16);
                    a1 = dot_chunk(a1, k0 + (ks + d) * es, qg + d * es, bf16);
                    a2 = dot_chunk(a2, k0 + (2 * ks + d) * es, qg + d * es, bf16);
                    a3 = dot_chunk(a3, k0 + (3 * ks + d) * es, qg + d * es, bf16);
                }
                _mm_storeu_ps(&s[x * group + g][t], _mm_mul_ps(sum4(fold16(a0), fold16(a1), fold16(a2), fold16(a3)), scale4));
            }
        }
    }
    for (; t < n; t++)
        for (int x = 0; x < nkv; x++)
            for (int g = 0; g < group; g++) {
                const char *kt = kb + (base + t * ks + x * hd) * es, *qg = qb + (int64_t)(x * group + g) * hd * es;
                __m512 a = _mm512_setzero_ps();
                for (int d = 0; d < hd; d += step) a = dot_chunk(a, kt + d * es, qg + d * es, bf16);
                s[x * group + g][t] = qs * _mm512_reduce_add_ps(a);
            }
}

/* 16 bfloat16 values from v as float32. */
static inline __m512 load16_bf16(const uint16_t *v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)v)), 16));
}

/* acc[g][d0 .. d0 + 16 NC) += sum over the tile's n keys of p[g][t] * v[t][...], for GC
 * (1..4) queries from g0, NC (1..4) chunks of 16 dims held in registers across the tile. */
static inline __attribute__((always_inline)) void values512(float *acc, int hd, int g0, int GC, int NC,
                                                            const float (*p)[TILE], const void *v, int64_t v0,
                                                            int64_t ks, int n, int d0, int bf16) {
    __m512 a[4][4];
    for (int g = 0; g < GC; g++)
        for (int c = 0; c < NC; c++) a[g][c] = _mm512_loadu_ps(acc + (g0 + g) * hd + d0 + 16 * c);
    for (int t = 0; t < n; t++) {
        __m512 x[4];
        for (int c = 0; c < NC; c++) {
            const int64_t at = v0 + t * ks + d0 + 16 * c;
            x[c] = bf16 ? load16_bf16((const uint16_t *)v + at) : _mm512_loadu_ps((const float *)v + at);
        }
        for (int g = 0; g < GC; g++) {
            __m512 w = _mm512_set1_ps(p[g0 + g][t]);
            for (int c = 0; c < NC; c++) a[g][c] = _mm512_fmadd_ps(w, x[c], a[g][c]);
        }
    }
    for (int g = 0; g < GC; g++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc + (g0 + g) * hd + d0 + 16 * c, a[g][c]);
}

#define VALUES_NC(GC, NC) values512(acc, hd, g, GC, NC, p, v, base, ks, n, d0, bf16)
#define VALUES_GC(NC)                                                                                                  \
    do {                                                                                                               \
        int g = 0;                                                                                                     \
        for (; g + 4 <= group; g += 4) VALUES_NC(4, NC);                                                               \
        switch (group - g) {                                                                                           \
        case 3: VALUES_NC(3, NC); break;                                                                               \
        case 2: VALUES_NC(2, NC); break;                                                                               \
        case 1: VALUES_NC(1, NC); break;                                                                               \
        default: break;                                                                                                \
        }                                                                                                              \
    } while (0)

/* The tile's values, 16 lanes at a time: a bfloat16 cache (bf16, hd a multiple of 32) or a
 * float32 one (hd a multiple of 16). */
static inline __attribute__((always_inline)) void tile_values512(float *acc, int group, int hd, const float (*p)[TILE],
                                                                 const void *v, int64_t base, int64_t ks, int n,
                                                                 int bf16) {
    int d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) VALUES_GC(4);
    for (; d0 + 32 <= hd; d0 += 32) VALUES_GC(2);
    if (d0 < hd) VALUES_GC(1); /* 16 left */
}

#include "../../csrc/exp512.h"

/* tile_softmax (below), 16 lanes at a time: the running max and the exps. */
static void tile_softmax512(float (*s)[TILE], int group, int hd, int n, float *m, float *l, float *acc) {
    for (int g = 0; g < group; g++) {
        __m512 vmx = _mm512_set1_ps(m[g]);
        int t = 0;
        for (; t + 16 <= n; t += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(&s[g][t]));
        const __mmask16 tail = (__mmask16)((1u << (n - t)) - 1u);
        if (t < n) vmx = _mm512_mask_max_ps(vmx, tail, vmx, _mm512_maskz_loadu_ps(tail, &s[g][t]));
        const float mx = _mm512_reduce_max_ps(vmx);
        const float corr = exp_nonpositive(m[g] - mx); /* m[g] = -inf: 0 */
        vmx = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (t = 0; t + 16 <= n; t += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(&s[g][t]), vmx));
            _mm512_storeu_ps(&s[g][t], e);
            vsum = _mm512_add_ps(vsum, e);
        }
        if (t < n) {
            const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, &s[g][t]), vmx)));
            _mm512_mask_storeu_ps(&s[g][t], tail, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        l[g] = l[g] * corr + _mm512_reduce_add_ps(vsum);
        m[g] = mx;
        if (corr != 1.0f)
            for (int d = 0; d < hd; d++) acc[g * hd + d] *= corr;
    }
}
#endif

/* Scores of the tile's n keys for the group's queries: s[g][t] (generic C). */
static void tile_scores(const float *q, int group, int hd, const void *k, int64_t base, int64_t ks, int n, int kind,
                        float (*s)[TILE]) {
    float key[MAX_HEAD_DIM];
    for (int t = 0; t < n; t++) {
        for (int d = 0; d < hd; d++)
            key[d] = load1(k, base + t * ks + d, kind);
        for (int g = 0; g < group; g++) {
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot += q[g * hd + d] * key[d];
            s[g][t] = dot;
        }
    }
}

/* acc[g] += sum over the tile's keys of p[g][t] * v[t] (generic C). */
static void tile_values(float *acc, int group, int hd, const float (*p)[TILE], const void *v, int64_t base, int64_t ks,
                        int n, int kind) {
    float val[MAX_HEAD_DIM];
    for (int t = 0; t < n; t++) {
        for (int d = 0; d < hd; d++)
            val[d] = load1(v, base + t * ks + d, kind);
        for (int g = 0; g < group; g++)
            for (int d = 0; d < hd; d++) acc[g * hd + d] += p[g][t] * val[d];
    }
}

/* s[g][t] = e^(s[g][t] - max), the tile folded into each query's running max m and sum l
 * (acc rescaled to the new max). */
static void tile_softmax(float (*s)[TILE], int group, int hd, int n, float *m, float *l, float *acc) {
    for (int g = 0; g < group; g++) {
        float mx = m[g];
        for (int t = 0; t < n; t++) mx = s[g][t] > mx ? s[g][t] : mx;
        float corr = exp_nonpositive(m[g] - mx); /* m[g] = -inf: 0 */
        float sum = 0.0f;
        int t = 0;
#ifdef HAVE_AVX2
        __m256 vsum = _mm256_setzero_ps(), vmx = _mm256_set1_ps(mx);
        for (; t + 8 <= n; t += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&s[g][t]), vmx));
            _mm256_storeu_ps(&s[g][t], e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vsum);
        for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
        for (; t < n; t++) {
            s[g][t] = exp_nonpositive(s[g][t] - mx);
            sum += s[g][t];
        }
        l[g] = l[g] * corr + sum;
        m[g] = mx;
        if (corr != 1.0f)
            for (int d = 0; d < hd; d++) acc[g * hd + d] *= corr;
    }
}

/* s[g][t] *= ss for the group's queries over the tile's n keys (ss 1: nothing). */
static inline void scale_scores(float (*s)[TILE], int group, int n, float ss) {
    if (ss == 1.0f) return;
    for (int g = 0; g < group; g++)
        for (int t = 0; t < n; t++) s[g][t] *= ss;
}

/* One tile of one kv head: its n keys from element `base` of k and v, for the group's
 * queries, folded into the head's running softmax (m, l) and accumulator acc; the scores
 * times ss (the scale on the logits, 1 where the queries carry it). */
static inline __attribute__((always_inline)) void tile(const float *q, int group, int hd,
                                                      const void *k, const void *v, int kind, int64_t base, int64_t ks,
                                                      int n, float ss, float (*s)[TILE], float *acc, float *m, float *l) {
#ifdef HAVE_AVX2
    if (hd % 16 == 0) {
        tile_scores_avx2(q, group, hd, k, base, ks, n, kind, s);
        scale_scores(s, group, n, ss);
        tile_softmax(s, group, hd, n, m, l, acc);
        tile_values_avx2(acc, group, hd, (const float (*)[TILE])s, v, base, ks, n, kind);
        return;
    }
#endif
    tile_scores(q, group, hd, k, base, ks, n, kind, s);
    scale_scores(s, group, n, ss);
    tile_softmax(s, group, hd, n, m, l, acc);
    tile_values(acc, group, hd, (const float (*)[TILE])s, v, base, ks, n, kind);
}

/* The keys of the tile from key j of a row of nkeys: the rest of j's block, at most TILE. */
static inline int tile_keys(int64_t j, int bs, int64_t nkeys) {
    int64_t n = bs - j % bs;
    if (n > TILE) n = TILE;
    return (int)(n < nkeys - j ? n : nkeys - j);
}

#ifdef HAVE_AVX512BF16
/* One tile of the task's nkv heads with AVX-512, a bfloat16 cache (bf16 queries qb, their
 * scale qs; hd a multiple of 32) or a float32 one (q; hd a multiple of 16): every head's
 * scores (the tile read front to back), then each head's softmax and values. next_k, next_n:
 * the next tile's K (from its first key's head h0) and its bytes, or NULL. The tile's values
 * are prefetched during its scores.
 * NOTE: the next tile's K is prefetched a head's share at a time, before each head's
 * values: one burst of every line stalled the core until most had arrived (the loads
 * wait for free miss buffers), which made the prefetch a synchronous read; spread
 * out, it overlaps the arithmetic (docs/benchmarks.md, "2026-12-07, 06:00"). */
static inline __attribute__((always_inline)) void tile512(const float *q, const uint16_t *qb, float qs, int group,
                                                         int nkv, int hd, const void *k, const void *v, int bf16,
                                                         int64_t base, int64_t ks, int n, const char *next_k,
                                                         int64_t next_bytes, float (*s)[TILE], float *acc, float *m,
                                                         float *l) {
    const int gh = group * hd;
    tile_scores512(bf16 ? (const void *)qb : (const void *)q, group, nkv, hd, bf16 ? qs : 1.0f, k, base, ks, n, s,
                   (const char *)v + base * (bf16 ? 2 : 4), bf16);
    for (int x = 0; x < nkv; x++) {
        if (next_k)
            for (int64_t b = next_bytes * x / nkv; b < next_bytes * (x + 1) / nkv; b += 64) __builtin_prefetch(next_k + b, 0, 2);
        tile_softmax512(s + x * group, group, hd, n, m + x * group, l + x * group, acc + x * gh);
        tile_values512(acc + x * gh, group, hd, (const float (*)[TILE])(s + x * group), v, base + x * hd, ks, n, bf16);
    }
}
#endif

/* Ask for the tile of keys from j on (its K and V, heads [h0, h0 + nkv)) to be brought
 * into the cache while the current one is computed.
 * NOTE: a row's blocks lie anywhere in the cache, so the hardware's prefetchers, which
 * follow addresses, cannot see the next one coming; the block table can. */
static inline __attribute__((always_inline)) void prefetch_tile(const void *k, const void *v, int kind,
                                                               const int32_t *table, int64_t first_col, int64_t j,
                                                               int64_t nkeys, int64_t num_blocks, int bs, int kvh,
                                                               int hd, int h0, int nkv) {
    int64_t blk = table[first_col + j / bs];
    if (blk < 0 || blk >= num_blocks) return; /* the loop reports it when it gets there */
    const int off = (int)(j % bs);
    const int64_t n = tile_keys(j, bs, nkeys);
    const int64_t esize = kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1;
    const int64_t first = ((blk * bs + off) * kvh + h0) * hd * esize;
    const int64_t last = first + ((n - 1) * kvh * hd + (int64_t)nkv * hd) * esize; /* one past */
    for (int64_t b = first; b < last; b += 64) {
        __builtin_prefetch((const char *)k + b, 0, 2);
        __builtin_prefetch((const char *)v + b, 0, 2);
    }
}

/* One row, kv heads [h0, h0 + nkv). q: their queries (nkv x group x hd, already in float32;
 * scaled, but for an fp8 cache); qb: a bfloat16 cache's, as they came (bfloat16; AVX-512
 * BF16 reads them); qs: the scale of q.k where the queries do not carry it (a bfloat16 or
 * fp8 cache's); k, v: the cache's K and V of this layer, (num_blocks, bs,
 * kvh, hd), of `kind`; table: the row's block ids, read from column first_col; keys
 * [lead, nkeys) of those columns. acc, m, l: per head, as q. Returns -1 on a block id
 * outside the cache.
 * NOTE: the heads are the inner loop, so a tile's keys, every head's side by side in the
 * cache, are read from memory once, together, rather than a head's slice at a time. */
static inline __attribute__((always_inline)) int attend(const float *q, const uint16_t *qb, float qs, int group, int hd,
                                                        const void *k, const void *v, int kind, const int32_t *table,
                                                        int64_t first_col, int64_t nkeys, int64_t lead,
                                                        int64_t num_blocks, int bs, int kvh, int h0, int nkv, float *acc,
                                                        float *m, float *l) {
    float s[MAX_GROUP * MAX_HEAD_DIM / 16][TILE]; /* scores of the task's queries (every head's on AVX-512) */
    const int64_t ks = (int64_t)kvh * hd; /* elements from one key to the next */
    const int gh = group * hd;
    for (int g = 0; g < nkv * group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int e = 0; e < nkv * gh; e++) acc[e] = 0.0f;
    for (int64_t j = lead; j < nkeys;) {
        int64_t col = first_col + j / bs;
        int off = (int)(j % bs);
        int n = tile_keys(j, bs, nkeys);
        int64_t blk = table[col];
        if (blk < 0 || blk >= num_blocks) return -1;
#ifdef HAVE_AVX512BF16
        if ((kind == KV_BF16 && hd % 32 == 0) || (kind == KV_F32 && hd % 16 == 0)) {
            const int esize = kind == KV_BF16 ? 2 : 4;
            const char *next_k = NULL;
            int64_t next_bytes = 0;
            const int64_t nblk = j + n < nkeys ? table[first_col + (j + n) / bs] : -1;
            if (nblk >= 0 && nblk < num_blocks) { /* a bad id: the loop reports it when it gets there */
                next_k = (const char *)k + ((nblk * bs + (j + n) % bs) * kvh + h0) * hd * esize;
                next_bytes = ((int64_t)(tile_keys(j + n, bs, nkeys) - 1) * ks + (int64_t)nkv * hd) * esize;
            }
            tile512(q, qb, qs, group, nkv, hd, k, v, kind == KV_BF16, ((blk * bs + off) * kvh + h0) * hd, ks, n, next_k,
                    next_bytes, s, acc, m, l);
            j += n;
            continue;
        }
#endif
        if (j + n < nkeys) prefetch_tile(k, v, kind, table, first_col, j + n, nkeys, num_blocks, bs, kvh, hd, h0, nkv);
        for (int x = 0; x < nkv; x++) {
            int64_t base = ((blk * bs + off) * kvh + h0 + x) * hd; /* element index of the tile's first key */
            tile(q + x * gh, group, hd, k, v, kind, base, ks, n, kind >= KV_E4M3 ? qs : 1.0f, s, acc + x * gh, m + x * group,
                 l + x * group);
        }
        j += n;
    }
    return 0;
}

/* out[i] = attention of q[i] over its row's keys, for the B decode rows i.
 * q: (B, nh, hd) with row stride q_row (elements), heads contiguous; out: (B, nh, hd)
 * contiguous; both float32 (out_bf16 = 0) or bfloat16 (1). k, v: (num_blocks, bs, kvh, hd)
 * contiguous, of `kind`; an fp8 cache's values are times k_scale, v_scale (1 otherwise).
 * table: int32 (rows, table_cols) contiguous. Per row i: rows[i] its table row,
 * first_col[i] the first column it reads, nkeys[i] the keys from that column's first on
 * (>= 1), lead[i] the leading ones of those it skips (before its window). lse: (B, kvh,
 * group) float32, or NULL. Returns 0, -1 (a block id outside the cache) or -2 (bad
 * arguments). */
int paged_decode(const void *q, int64_t q_row, const void *k, const void *v, int kind, float k_scale, float v_scale,
                 int64_t num_blocks, int bs, int kvh, int hd, int nh, const int32_t *table, int64_t table_rows,
                 int64_t table_cols, const int64_t *rows, const int64_t *first_col, const int64_t *nkeys,
                 const int64_t *lead, int64_t B, float scale, int out_bf16, void *out, float *lse, int num_threads) {
    if (hd < 1 || hd > MAX_HEAD_DIM || kvh < 1 || nh % kvh != 0 || nh / kvh > MAX_GROUP || bs < 1) return -2;
    if (kind < KV_F32 || kind > KV_E5M2 || (kind == KV_F32 && out_bf16) || (kind == KV_BF16 && !out_bf16)) return -2;
    for (int64_t i = 0; i < B; i++) {
        if (rows[i] < 0 || rows[i] >= table_rows || first_col[i] < 0 || lead[i] < 0 || lead[i] >= nkeys[i]) return -2;
        if (first_col[i] + (nkeys[i] + bs - 1) / bs > table_cols) return -2;
    }
    const int group = nh / kvh;
    /* A task is a row's kv heads, as many as its buffers hold; fewer rows than threads
     * split each row's heads further, so that every thread has a task (a step of one row
     * on two threads: SmolLM2's 3 kv heads as 2 and 1). */
    const int threads = num_threads < 1 ? 1 : num_threads;
    const int fit = MAX_GROUP * MAX_HEAD_DIM / (group * hd);
    int per_task = fit < kvh ? fit : kvh;
    if (B > 0 && B < threads) {
        int want = (int)((threads + B - 1) / B); /* parts a row needs */
        want = want < kvh ? want : kvh;
        const int split = (kvh + want - 1) / want;
        per_task = split < per_task ? split : per_task;
    }
    const int parts = (kvh + per_task - 1) / per_task;
    const int64_t tasks = B * parts;
    /* NOTE: an fp8 cache's scales as vLLM's CPU kernel applies them (cpu_attn_vec.hpp,
     * scale_on_logits): the queries unscaled, q.k of the raw values times scale * k_scale
     * (and fp8_to_f32's 2^8), the value scale onto each output (sum p (v s) = s sum p v).
     * A float32 cache's queries carry the scale, as vLLM's do (copy_q_heads_tile). */
    const float fp8_unit = kind == KV_E4M3 ? 256.0f : 1.0f; /* fp8_to_f32 reads e4m3fn times 2^-8 */
    const float q_scale = scale * (kind >= KV_E4M3 ? k_scale * fp8_unit : 1.0f);
    const float o_scale = kind >= KV_E4M3 ? v_scale * fp8_unit : 1.0f;
    int err = 0;
    int nt = threads;
    if (nt > tasks) nt = (int)tasks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) reduction(min : err)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t i = task / parts;
        int h0 = (int)(task % parts) * per_task;
        int nkv = kvh - h0 < per_task ? kvh - h0 : per_task;
        float qf[MAX_GROUP * MAX_HEAD_DIM];
        float acc[MAX_GROUP * MAX_HEAD_DIM];
        float m[MAX_GROUP * MAX_HEAD_DIM], l[MAX_GROUP * MAX_HEAD_DIM];
        const int elems = nkv * group * hd;
        int64_t q0 = i * q_row + (int64_t)h0 * group * hd; /* the heads' first query element */
        for (int e = 0; e < elems; e++)
            qf[e] = (kind >= KV_E4M3 ? 1.0f : q_scale) * (out_bf16 ? bf16_to_f32(((const uint16_t *)q)[q0 + e]) : ((const float *)q)[q0 + e]);
        const uint16_t *qb = out_bf16 ? (const uint16_t *)q + q0 : NULL;
        const int32_t *trow = table + rows[i] * table_cols;
        int rc;
        /* NOTE: one call per kind, so each is compiled for its element */
        switch (kind) {
        case KV_F32: rc = attend(qf, qb, q_scale, group, hd, k, v, KV_F32, trow, first_col[i], nkeys[i], lead[i], num_blocks, bs, kvh, h0, nkv, acc, m, l); break;
        case KV_BF16: rc = attend(qf, qb, q_scale, group, hd, k, v, KV_BF16, trow, first_col[i], nkeys[i], lead[i], num_blocks, bs, kvh, h0, nkv, acc, m, l); break;
        case KV_E4M3: rc = attend(qf, qb, q_scale, group, hd, k, v, KV_E4M3, trow, first_col[i], nkeys[i], lead[i], num_blocks, bs, kvh, h0, nkv, acc, m, l); break;
        default: rc = attend(qf, qb, q_scale, group, hd, k, v, KV_E5M2, trow, first_col[i], nkeys[i], lead[i], num_blocks, bs, kvh, h0, nkv, acc, m, l); break;
        }
        if (rc != 0) {
            err = rc < err ? rc : err;
            continue;
        }
        int64_t o0 = i * (int64_t)nh * hd + (int64_t)h0 * group * hd;
        for (int g = 0; g < nkv * group; g++) {
            float inv = o_scale / l[g];
            for (int d = 0; d < hd; d++) {
                float x = acc[g * hd + d] * inv;
                if (out_bf16)
                    ((uint16_t *)out)[o0 + g * hd + d] = f32_to_bf16(x);
                else
                    ((float *)out)[o0 + g * hd + d] = x;
            }
            if (lse) lse[(i * kvh + h0) * group + g] = m[g] + logf(l[g]);
        }
    }
    return err;
}

/* 1 where the CPU running this has the instructions it was compiled for (the library is
 * built with -march=native; one built on another machine may not run here). */
int paged_decode_available(void) {
    __builtin_cpu_init();
#ifdef HAVE_AVX512BF16
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16")) return 0;
#endif
#ifdef HAVE_AVX2
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
#endif
    return 1;
}
