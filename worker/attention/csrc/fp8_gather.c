/* Gather fp8 KV blocks and dequantize them into the compute dtype in one pass.
 *
 * No torch headers: worker/attention/fp8_gather.py loads this with ctypes and passes data
 * pointers. Each output is the fallback's (kv_quant.dequantize) bit for bit: the fp8
 * value (exact in float32; e5m2's top exponent reads as inf/NaN only into float16, whose
 * exponent field it shares, as the fallback's moved fields do), times the scale in float32
 * (torch's scalar multiply: opmath float), rounded to the output dtype to nearest even
 * (bfloat16 as c10::BFloat16 rounds, float16 as c10::Half).
 * NOTE: built without -ffast-math and with -ffp-contract=off: the multiply and the
 * conversions must round as torch's do. Branch-free loops over bytes, so gcc vectorizes them (AVX-512 here).
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#endif

#define FP8_GATHER_ABI 5

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };

int fp8_gather_abi(void) { return FP8_GATHER_ABI; }

struct fp8_format {
    int mshift;
    uint32_t rebias, mant_end, top;
    float sub_min;
};

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* One block: n bytes -> n outputs, each the fp8 value times scale, rounded to float32
 * (torch's scalar multiply: opmath float), then stored by STORE.
 * NOTE: the value is built in float32 directly, normal for every fp8 byte: the fields
 * moved unbiased (as the fallback does) are float32 subnormals for small values, and
 * a multiply on a subnormal takes a microcode assist on x86, ~100x an ordinary one.
 * mshift: 23 - fp8 mantissa bits; rebias: (127 - fp8 bias) << 23; sub_min: 2^(1 - bias -
 * mantissa bits), the smallest subnormal; mant_end: 2^mantissa bits (below: exponent 0);
 * top: the byte bits of an inf/NaN pattern (0x7C for e5m2 into float16; else 0x100, never
 * all set). */
#define DEQUANT_LOOP(OUT_T, STORE)                                                   \
    static void dequant_##OUT_T(const uint8_t *restrict src, OUT_T *restrict dst,    \
                                int64_t n, const struct fp8_format *fmt, float scale) { \
        const int mshift = fmt->mshift;                                              \
        const uint32_t rebias = fmt->rebias, mant_end = fmt->mant_end, top = fmt->top; \
        const float sub_min = fmt->sub_min;                                          \
        for (int64_t j = 0; j < n; j++) {                                            \
            uint32_t b = src[j], em = b & 0x7Fu;                                     \
            uint32_t sub = to_bits((float)(int32_t)em * sub_min);                    \
            uint32_t is_sub = 0u - (uint32_t)(em < mant_end);  /* all ones or 0 */   \
            uint32_t bits = (sub & is_sub) | (((em << mshift) + rebias) & ~is_sub);  \
            uint32_t is_top = 0u - (uint32_t)((b & top) == top);                     \
            bits = ((0x7F800000u | (em << mshift)) & is_top) | (bits & ~is_top);     \
            float f = from_bits(bits | ((b & 0x80u) << 24)) * scale;                 \
            STORE;                                                                   \
        }                                                                            \
    }

typedef uint16_t bf16_t;
typedef uint16_t f16_t;


/* float -> IEEE half, to nearest even: c10::Half's fp16_ieee_from_fp32_value (from the FP16
 * library), written out because gcc does not vectorize the _Float16 conversion. */
static inline uint16_t half_from_float(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    uint32_t bits = to_bits(from_bits((bias >> 1) + 0x07800000u) + base);
    uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    /* NOTE: a NaN keeps its payload's top bits, as vcvtps2ph (torch's vector loop) does. */
    uint32_t nan = 0x7E00u | ((w >> 13) & 0x03FFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign));
}

DEQUANT_LOOP(float, dst[j] = f)
DEQUANT_LOOP(f16_t, dst[j] = half_from_float(f))
/* c10::BFloat16's round_to_nearest_even: NaN -> 0x7FC0, else round the low 16 bits away. */
DEQUANT_LOOP(bf16_t, {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    dst[j] = (f != f) ? (uint16_t)0x7FC0u : (uint16_t)r;
})

/* 16-bit outputs through a 256-entry table of the loops' own results (made per call),
 * read as two 256-byte tables (low and high bytes) with AVX-512 VBMI's 128-byte permutes:
 * 64 bytes a few instructions, where the arithmetic takes dozens. */
static void lut16(const uint8_t *restrict src, uint16_t *restrict dst, int64_t n, const uint16_t *table) {
    int64_t j = 0;
#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
    uint8_t lo[256], hi[256];
    for (int i = 0; i < 256; i++) lo[i] = (uint8_t)table[i], hi[i] = (uint8_t)(table[i] >> 8);
    __m512i l0 = _mm512_loadu_si512(lo), l1 = _mm512_loadu_si512(lo + 64);
    __m512i l2 = _mm512_loadu_si512(lo + 128), l3 = _mm512_loadu_si512(lo + 192);
    __m512i h0 = _mm512_loadu_si512(hi), h1 = _mm512_loadu_si512(hi + 64);
    __m512i h2 = _mm512_loadu_si512(hi + 128), h3 = _mm512_loadu_si512(hi + 192);
    /* NOTE: unpack{lo,hi}_epi8 interleave within 128-bit lanes; the bytes are first placed
     * so that lane k's low half holds elements 8k.. and its high half elements 32 + 8k... */
    uint8_t order[64];
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 8; i++) order[16 * k + i] = (uint8_t)(8 * k + i), order[16 * k + 8 + i] = (uint8_t)(32 + 8 * k + i);
    __m512i perm = _mm512_loadu_si512(order);
    for (; j + 64 <= n; j += 64) {
        __m512i idx = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(src + j));
        __mmask64 top = _mm512_movepi8_mask(idx); /* bit 7: the upper 128 entries */
        __m512i vl = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(l0, idx, l1), _mm512_permutex2var_epi8(l2, idx, l3));
        __m512i vh = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(h0, idx, h1), _mm512_permutex2var_epi8(h2, idx, h3));
        _mm512_storeu_si512(dst + j, _mm512_unpacklo_epi8(vl, vh));
        _mm512_storeu_si512(dst + j + 32, _mm512_unpackhi_epi8(vl, vh));
    }
#endif
    for (; j < n; j++) dst[j] = table[src[j]];
}

/* out[i, :] = dequant(cache[ids[i], :]) for i < m (ids NULL: block first + i).
 * fp8_mant, fp8_bias: the format's (3, 7: e4m3; 2, 15: e5m2); inf_nan_top: read e5m2's top
 * exponent as inf/NaN (into float16, as the fallback's moved fields do), else as finite.
 * cache: (num_blocks, block_elems) bytes, contiguous; out: (m, block_elems), contiguous.
 * Returns 0, or -1 when an id is out of range (nothing written), -2 for a bad out kind. */
int fp8_gather_dequant(const uint8_t *cache, int64_t num_blocks, int64_t block_elems,
                       const int64_t *ids, int64_t first, int64_t m, void *out, int out_kind,
                       int fp8_mant, int fp8_bias, int inf_nan_top, float scale, int num_threads) {
    if (out_kind < OUT_F32 || out_kind > OUT_F16) return -2;
    struct fp8_format fmt = {23 - fp8_mant, (uint32_t)(127 - fp8_bias) << 23, 1u << fp8_mant,
                             inf_nan_top ? 0x7Cu : 0x100u, 1.0f};
    for (int e = 0; e < fp8_bias - 1 + fp8_mant; e++) fmt.sub_min *= 0.5f; /* exact */
    uint8_t every_byte[256];
    uint16_t table[256];
    for (int i = 0; i < 256; i++) every_byte[i] = (uint8_t)i;
    if (out_kind == OUT_BF16) dequant_bf16_t(every_byte, table, 256, &fmt, scale);
    if (out_kind == OUT_F16) dequant_f16_t(every_byte, table, 256, &fmt, scale);
    if (ids != NULL) {
        for (int64_t i = 0; i < m; i++)
            if (ids[i] < 0 || ids[i] >= num_blocks) return -1;
    } else if (first < 0 || first + m > num_blocks) {
        return -1;
    }
    /* NOTE: one thread for small gathers: starting the team costs more than it saves. */
    int nt = (m * block_elems < (1 << 16) || num_threads < 1) ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < m; i++) {
        int64_t id = ids != NULL ? ids[i] : first + i;
        const uint8_t *src = cache + id * block_elems;
        if (out_kind == OUT_F32)
            dequant_float(src, (float *)out + i * block_elems, block_elems, &fmt, scale);
        else
            lut16(src, (uint16_t *)out + i * block_elems, block_elems, table);
    }
    return 0;
}

/* The paged write's quantize (kv_quant.quantize with toward_zero, vLLM's CPU kernel's
 * rounding), fused with the scatter: cache[slots[t], :] = fp8(src[t, :] / scale), for
 * t < T; src: (T, row) float32 (in_kind 0) or bfloat16 (1), contiguous; cache: (num_slots,
 * row) bytes. Each value: x / scale in float32 (torch's division by a scalar), clamped to
 * the largest finite value, then truncated to the fp8 grid (the byte the fallback's
 * round-to-nearest-then-step-back gives); NaN -> 0x7F with its sign, as c10's casts.
 * Returns 0, or -1 when a slot is out of range (nothing written). */
#define QUANT_LOOP(IN_T, LOAD)                                                              \
    static void quant_##IN_T(const IN_T *restrict src, uint8_t *restrict dst, int64_t n,    \
                             int fp8_mant, int fp8_bias, float scale, float top, int divide) { \
        const uint32_t min_normal = (uint32_t)(127 + 1 - fp8_bias) << 23;                   \
        const uint32_t rebias = (uint32_t)(127 - fp8_bias) << fp8_mant;                     \
        const int mshift = 23 - fp8_mant;                                                   \
        float to_sub = 1.0f; /* 2^(bias - 1 + mant): the smallest subnormal -> 1 */         \
        for (int e = 0; e < fp8_bias - 1 + fp8_mant; e++) to_sub *= 2.0f;                  \
        for (int64_t j = 0; j < n; j++) {                                                   \
            float x = LOAD;                                                                 \
            x = divide ? x / scale : x;                                                     \
            x = x > top ? top : x;                                                          \
            x = x < -top ? -top : x;                                                        \
            uint32_t bits = to_bits(x), a = bits & 0x7FFFFFFFu;                             \
            uint32_t sign = (bits >> 24) & 0x80u;                                           \
            uint32_t normal = ((a >> mshift) - rebias) & 0x7Fu;                             \
            uint32_t sub = (uint32_t)(int32_t)(from_bits(a) * to_sub);                      \
            uint32_t q = a >= min_normal ? normal : sub;                                    \
            q = a > 0x7F800000u ? 0x7Fu : q;                                                \
            dst[j] = (uint8_t)(q | sign);                                                   \
        }                                                                                   \
    }

QUANT_LOOP(float, src[j])
QUANT_LOOP(bf16_t, from_bits((uint32_t)src[j] << 16))

int fp8_quantize_write(const void *src, int in_kind, int64_t T, int64_t row, const int64_t *slots,
                       uint8_t *cache, int64_t num_slots, int fp8_mant, int fp8_bias, float scale,
                       float top, int num_threads) {
    if (in_kind < 0 || in_kind > 1) return -2;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    int nt = (T * row < (1 << 16) || num_threads < 1) ? 1 : num_threads;
    int divide = scale != 1.0f;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t t = 0; t < T; t++) {
        uint8_t *dst = cache + slots[t] * row;
        if (in_kind == 0)
            quant_float((const float *)src + t * row, dst, row, fp8_mant, fp8_bias, scale, top, divide);
        else
            quant_bf16_t((const bf16_t *)src + t * row, dst, row, fp8_mant, fp8_bias, scale, top, divide);
    }
    return 0;
}
