/* Gather fp8 KV blocks and dequantize them into the compute dtype in one pass.
 *
 * No torch headers: worker/attention/fp8_gather.py loads this with ctypes and passes data
 * pointers. The arithmetic is the torch fallback's (kv_quant.dequantize), step for step,
 * so the bits are the same:
 *   a = the fp8 byte's sign, exponent and mantissa fields moved into a float32 and times
 *       2^(127 - fp8 bias): the fp8 value, subnormals included, exactly (e5m2's top
 *       exponent reads as inf/NaN only into float16, whose exponent field it shares),
 *   a * scale in float32 (torch's scalar multiply: opmath float), rounded to the output
 *   dtype to nearest even (bfloat16 as c10::BFloat16 rounds, float16 as c10::Half).
 * NOTE: built without -ffast-math and with -ffp-contract=off: the two multiplies must
 * round as torch's do. Plain loops over bytes, so gcc vectorizes them (AVX-512 here).
 */
#include <stdint.h>
#include <string.h>

#define FP8_GATHER_ABI 2

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };

int fp8_gather_abi(void) { return FP8_GATHER_ABI; }

/* One block: n bytes -> n outputs. mshift: 20 for e4m3 (3 mantissa bits), 21 for e5m2;
 * top: the byte bits that make an inf/NaN pattern (0x7C for e5m2 into float16; else 0x100,
 * never all set); pre: 2^(127 - fp8 bias). */
#define DEQUANT_LOOP(OUT_T, STORE)                                                  \
    static void dequant_##OUT_T(const uint8_t *restrict src, OUT_T *restrict dst,   \
                                int64_t n, int mshift, uint32_t top, float pre,     \
                                float scale) {                                      \
        for (int64_t j = 0; j < n; j++) {                                           \
            uint32_t b = src[j];                                                    \
            uint32_t bits = ((b & 0x80u) << 24) | ((b & 0x7Fu) << mshift);          \
            bits |= (b & top) == top ? 0x7F800000u : 0u;                            \
            float a;                                                                \
            memcpy(&a, &bits, 4);                                                   \
            float f = (a * pre) * scale;                                            \
            STORE;                                                                  \
        }                                                                           \
    }

typedef uint16_t bf16_t;
typedef uint16_t f16_t;

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

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

/* out[i, :] = dequant(cache[ids[i], :]) for i < m (ids NULL: block first + i).
 * cache: (num_blocks, block_elems) bytes, contiguous; out: (m, block_elems), contiguous.
 * Returns 0, or -1 when an id is out of range (nothing written), -2 for a bad out kind. */
int fp8_gather_dequant(const uint8_t *cache, int64_t num_blocks, int64_t block_elems,
                       const int64_t *ids, int64_t first, int64_t m, void *out, int out_kind,
                       int mshift, uint32_t top, float pre, float scale, int num_threads) {
    if (out_kind < OUT_F32 || out_kind > OUT_F16) return -2;
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
            dequant_float(src, (float *)out + i * block_elems, block_elems, mshift, top, pre, scale);
        else if (out_kind == OUT_BF16)
            dequant_bf16_t(src, (bf16_t *)out + i * block_elems, block_elems, mshift, top, pre, scale);
        else
            dequant_f16_t(src, (f16_t *)out + i * block_elems, block_elems, mshift, top, pre, scale);
    }
    return 0;
}
