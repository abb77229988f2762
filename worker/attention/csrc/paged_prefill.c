/* Paged prefill attention on CPU: every prefill chunk of a step, causal (and within a
 * sliding window), reading K and V where they lie through the block table, for AVX-512
 * (F for float32 caches, BF16 for bfloat16 ones).
 *
 * No torch headers: worker/attention/paged_prefill.py loads this with ctypes and passes
 * data pointers. The torch path gathers each chunk's blocks and calls SDPA once per chunk;
 * at the tens of queries a chunk of a shared-prefix batch has, SDPA's CPU kernel spends
 * most of its time outside its products. Here one task is (chunk, kv head, tile of up to
 * 64 query rows): the `group` query heads of that kv head for up to 64 / group queries.
 * The task's rows are the lanes of up to 4 vectors, and the keys come 32 at a time
 * ("key-major"), so the softmax's running max and sum are per-lane operations, with no
 * reduction across lanes:
 *   scores  S[j][r] = k_j . q_r       the key's elements broadcast, the queries packed
 *                                     once per task ([hd/2][rows][2] for vdpbf16ps);
 *   softmax m, l, p per lane, float32 (online over the key tiles, as SDPA's flash kernel);
 *   values  O[d][r] += sum_j v_j[d] p[j][r]   the values broadcast (bf16: two keys'
 *                                     values paired per tile), p packed per tile.
 * bfloat16 as torch's CPU flash attention computes it: products of bf16 values summed in
 * float32, the scores scaled in float32, the probabilities rounded to bf16 for the values'
 * product, the output divided by the float32 sum and rounded once. float32 throughout
 * with FMA for a float32 cache. The tasks run over num_threads OpenMP threads, the longest
 * (last queries of a chunk) first.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PAGED_PREFILL_ABI 1
#define MAX_HEAD_DIM 256
#define MAX_ROWS 64 /* query rows (queries x the heads of one kv head) per task: 4 vectors */
#define KT 32       /* keys per tile */

int paged_prefill_abi(void) { return PAGED_PREFILL_ABI; }
int paged_prefill_max_head_dim(void) { return MAX_HEAD_DIM; }
int paged_prefill_max_group(void) { return MAX_ROWS; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "../../csrc/exp512.h"

/* 1 where the CPU running this has the instructions it was compiled for. */
int paged_prefill_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

typedef struct {
    int bf16, kvh, hd, nh, group, bs;
    int64_t num_blocks, qs, os, tcols, window;
    float scale;
    const void *q, *kc, *vc;
    const int32_t *table;
    void *out;
} Args;

/* One thread's scratch, sized for the largest head and a full tile. */
typedef struct {
    float qp[MAX_HEAD_DIM * MAX_ROWS];  /* queries packed: bf16 [hd/2][64][2] or f32 [hd][64] */
    float st[KT * MAX_ROWS];            /* a tile's scores, then its probabilities (f32) */
    uint32_t pp[KT / 2 * MAX_ROWS];     /* bf16: the probabilities packed [KT/2][64][2] */
    uint32_t vi[KT / 2 * MAX_HEAD_DIM]; /* bf16: the values of key pairs interleaved [KT/2][hd][2] */
    float o[MAX_HEAD_DIM * MAX_ROWS];   /* the output, [hd][64] */
    const void *kp[KT], *vp[KT];        /* the tile's key and value rows */
} Scratch;

static const uint16_t ZERO_ROW[MAX_HEAD_DIM * 2] __attribute__((aligned(64)));

/* Scores of keys [j, j + 4) against the task's rows (nz vectors of 16), scaled, into st. */
static inline __attribute__((always_inline)) void scores4(const Args *a, Scratch *s, int j, int nz) {
    __m512 acc[4][4];
    for (int jj = 0; jj < 4; jj++)
        for (int z = 0; z < nz; z++) acc[jj][z] = _mm512_setzero_ps();
    if (a->bf16) {
        const uint32_t *k[4];
        for (int jj = 0; jj < 4; jj++) k[jj] = (const uint32_t *)s->kp[j + jj];
        const uint32_t *qp = (const uint32_t *)s->qp;
        for (int k2 = 0; k2 < a->hd / 2; k2++) {
            __m512bh qv[4];
            for (int z = 0; z < nz; z++) qv[z] = (__m512bh)_mm512_load_si512(qp + k2 * MAX_ROWS + z * 16);
            for (int jj = 0; jj < 4; jj++) {
                __m512bh kb = (__m512bh)_mm512_set1_epi32((int)k[jj][k2]);
                for (int z = 0; z < nz; z++) acc[jj][z] = _mm512_dpbf16_ps(acc[jj][z], kb, qv[z]);
            }
        }
    } else {
        const float *k[4];
        for (int jj = 0; jj < 4; jj++) k[jj] = (const float *)s->kp[j + jj];
        for (int d = 0; d < a->hd; d++) {
            __m512 qv[4];
            for (int z = 0; z < nz; z++) qv[z] = _mm512_load_ps(s->qp + d * MAX_ROWS + z * 16);
            for (int jj = 0; jj < 4; jj++) {
                __m512 kb = _mm512_set1_ps(k[jj][d]);
                for (int z = 0; z < nz; z++) acc[jj][z] = _mm512_fmadd_ps(kb, qv[z], acc[jj][z]);
            }
        }
    }
    const __m512 sc = _mm512_set1_ps(a->scale);
    for (int jj = 0; jj < 4; jj++)
        for (int z = 0; z < nz; z++) _mm512_store_ps(s->st + (j + jj) * MAX_ROWS + z * 16, _mm512_mul_ps(acc[jj][z], sc));
}

/* o[d][r] = o[d][r] * alpha[r] + sum over the tile's keys of v_j[d] p[j][r], for d in
 * [d0, d0 + 4). nkp: key pairs (bf16) or keys (f32) of the tile. */
static inline __attribute__((always_inline)) void values4(const Args *a, Scratch *s, int d0, int nz, int nkp,
                                                          const __m512 *alpha) {
    __m512 acc[4][4];
    for (int dd = 0; dd < 4; dd++)
        for (int z = 0; z < nz; z++) acc[dd][z] = _mm512_mul_ps(_mm512_load_ps(s->o + (d0 + dd) * MAX_ROWS + z * 16), alpha[z]);
    if (a->bf16) {
        for (int jp = 0; jp < nkp; jp++) {
            __m512bh pv[4];
            for (int z = 0; z < nz; z++) pv[z] = (__m512bh)_mm512_load_si512(s->pp + jp * MAX_ROWS + z * 16);
            const uint32_t *v = s->vi + jp * MAX_HEAD_DIM + d0;
            for (int dd = 0; dd < 4; dd++) {
                __m512bh vb = (__m512bh)_mm512_set1_epi32((int)v[dd]);
                for (int z = 0; z < nz; z++) acc[dd][z] = _mm512_dpbf16_ps(acc[dd][z], vb, pv[z]);
            }
        }
    } else {
        for (int j = 0; j < nkp; j++) {
            __m512 pv[4];
            for (int z = 0; z < nz; z++) pv[z] = _mm512_load_ps(s->st + j * MAX_ROWS + z * 16);
            const float *v = (const float *)s->vp[j] + d0;
            for (int dd = 0; dd < 4; dd++) {
                __m512 vb = _mm512_set1_ps(v[dd]);
                for (int z = 0; z < nz; z++) acc[dd][z] = _mm512_fmadd_ps(vb, pv[z], acc[dd][z]);
            }
        }
    }
    for (int dd = 0; dd < 4; dd++)
        for (int z = 0; z < nz; z++) _mm512_store_ps(s->o + (d0 + dd) * MAX_ROWS + z * 16, acc[dd][z]);
}

/* The bf16 values of keys 2jp and 2jp + 1 interleaved: vi[jp][d] = (v_2jp[d], v_2jp+1[d]). */
static void pair_values(const Args *a, Scratch *s, int nkp) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                         36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int jp = 0; jp < nkp; jp++) {
        const uint16_t *v0 = (const uint16_t *)s->vp[2 * jp], *v1 = (const uint16_t *)s->vp[2 * jp + 1];
        uint32_t *dst = s->vi + jp * MAX_HEAD_DIM;
        for (int d = 0; d < a->hd; d += 32) {
            __m512i x = _mm512_loadu_si512(v0 + d), y = _mm512_loadu_si512(v1 + d);
            _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

/* The online softmax over one tile of nk keys from position kt0: masks the scores in st
 * (causal, the window, padding), updates m and l, leaves p in st (f32) and, for bf16, in
 * pp; alpha: each lane's rescale of the output so far. full: no key of the tile is masked
 * for any row (it is all before the first query, and within the last one's window). */
static inline __attribute__((always_inline)) void softmax_tile(const Args *a, Scratch *s, int64_t kt0, int nk, int nz,
                                                               const __m512i *pos, __m512 *m, __m512 *l, __m512 *alpha,
                                                               int full) {
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    for (int z = 0; z < nz; z++) {
        __m512 bm = ninf;
        if (full) {
            for (int j = 0; j < nk; j++) bm = _mm512_max_ps(bm, _mm512_load_ps(s->st + j * MAX_ROWS + z * 16));
        } else {
            for (int j = 0; j < nk; j++) {
                const __m512i kp = _mm512_set1_epi32((int)(kt0 + j));
                __mmask16 ok = _mm512_cmple_epi32_mask(kp, pos[z]);
                if (a->window) ok &= _mm512_cmpgt_epi32_mask(kp, _mm512_sub_epi32(pos[z], _mm512_set1_epi32((int)a->window)));
                float *sj = s->st + j * MAX_ROWS + z * 16;
                __m512 v = _mm512_mask_mov_ps(ninf, ok, _mm512_load_ps(sj));
                _mm512_store_ps(sj, v);
                bm = _mm512_max_ps(bm, v);
            }
        }
        const __m512 mn = _mm512_max_ps(m[z], bm);
        /* A lane with no key yet (-inf): its p are 0 and its alpha is moot (o and l are 0). */
        const __mmask16 live = _mm512_cmp_ps_mask(mn, ninf, _CMP_NEQ_OQ);
        const __m512 base = _mm512_maskz_mov_ps(live, mn);
        alpha[z] = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(m[z], base)));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < nk; j++) {
            float *sj = s->st + j * MAX_ROWS + z * 16;
            const __m512 v = _mm512_load_ps(sj);
            const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ), exp16(_mm512_sub_ps(v, base)));
            _mm512_store_ps(sj, p);
            sum = _mm512_add_ps(sum, p);
        }
        for (int j = nk; j < KT; j++) _mm512_store_ps(s->st + j * MAX_ROWS + z * 16, _mm512_setzero_ps());
        l[z] = _mm512_add_ps(_mm512_mul_ps(l[z], alpha[z]), sum);
        m[z] = mn;
        if (a->bf16) {
            /* (p_2jp, p_2jp+1) per lane, rounded to bf16: one vector of pairs per key pair. */
            const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                   6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            for (int jp = 0; jp < (nk + 1) / 2; jp++) {
                const __m512 p0 = _mm512_load_ps(s->st + 2 * jp * MAX_ROWS + z * 16);
                const __m512 p1 = _mm512_load_ps(s->st + (2 * jp + 1) * MAX_ROWS + z * 16);
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* p0 in the low half */
                _mm512_store_si512(s->pp + jp * MAX_ROWS + z * 16, _mm512_permutexvar_epi16(inter, both));
            }
        }
    }
}

/* One task: rows of queries [q0, q0 + nq) of the chunk at table row `row`, first query at
 * position `first`, tokens from `off` in q and out, kv head h. */
static void task(const Args *a, Scratch *s, int64_t row, int64_t first, int64_t off, int64_t q0, int nq, int h) {
    const int G = a->group, R = nq * G, nz = (R + 15) / 16, hd = a->hd;
    const int64_t kvstride = (int64_t)a->kvh * hd;
    /* Pack the queries: row r = (query r / G, head h * G + r % G), lanes past R zero. */
    memset(s->qp, 0, sizeof(float) * hd * MAX_ROWS);
    for (int r = 0; r < R; r++) {
        const int64_t t = off + q0 + r / G, head = (int64_t)h * G + r % G;
        if (a->bf16) {
            const uint32_t *src = (const uint32_t *)((const uint16_t *)a->q + t * a->qs + head * hd);
            uint32_t *qp = (uint32_t *)s->qp;
            for (int k2 = 0; k2 < hd / 2; k2++) qp[k2 * MAX_ROWS + r] = src[k2];
        } else {
            const float *src = (const float *)a->q + t * a->qs + head * hd;
            for (int d = 0; d < hd; d++) s->qp[d * MAX_ROWS + r] = src[d];
        }
    }
    memset(s->o, 0, sizeof(float) * hd * MAX_ROWS);
    __m512i pos[4];
    __m512 m[4], l[4], alpha[4];
    for (int z = 0; z < nz; z++) {
        int32_t p[16];
        for (int i = 0; i < 16; i++) {
            const int r = z * 16 + i;
            p[i] = r < R ? (int32_t)(first + q0 + r / G) : -1; /* -1: padding, sees no key */
        }
        pos[z] = _mm512_loadu_si512(p);
        m[z] = _mm512_set1_ps(-__builtin_inff());
        l[z] = _mm512_setzero_ps();
    }
    const int64_t kend = first + q0 + nq; /* past the last query's position */
    int64_t kstart = a->window ? first + q0 - a->window + 1 : 0;
    if (kstart < 0) kstart = 0;
    const int esize = a->bf16 ? 2 : 4;
    for (int64_t kt0 = kstart; kt0 < kend; kt0 += KT) {
        const int nk = (int)(kend - kt0 < KT ? kend - kt0 : KT);
        /* The tile's rows: a block's keys are consecutive rows of kvstride elements. */
        int64_t col = kt0 / a->bs, in = kt0 % a->bs;
        const char *kb = NULL, *vb = NULL;
        for (int j = 0; j < nk; j++, in++) {
            if (j == 0 || in == a->bs) {
                if (in == a->bs) col++, in = 0;
                const int64_t blk = a->table[row * a->tcols + col]; /* checked by the caller */
                const int64_t at = (blk * a->bs * kvstride + (int64_t)h * hd) * esize;
                kb = (const char *)a->kc + at;
                vb = (const char *)a->vc + at;
            }
            s->kp[j] = kb + in * kvstride * esize;
            s->vp[j] = vb + in * kvstride * esize;
        }
        for (int j = nk; j < KT; j++) s->kp[j] = s->vp[j] = ZERO_ROW;
        const int nk4 = (nk + 3) & ~3;
        for (int j = 0; j < nk4; j += 4) {
            switch (nz) {
            case 1: scores4(a, s, j, 1); break;
            case 2: scores4(a, s, j, 2); break;
            case 3: scores4(a, s, j, 3); break;
            default: scores4(a, s, j, 4); break;
            }
        }
        /* Every real row sees every key of the tile: no mask (padding lanes, all zero
         * queries, get finite scores that are never written out). */
        const int full = kt0 + nk - 1 <= first + q0 && (!a->window || kt0 > first + q0 + nq - 1 - a->window);
        softmax_tile(a, s, kt0, nk, nz, pos, m, l, alpha, full);
        const int nkp = a->bf16 ? (nk + 1) / 2 : nk;
        if (a->bf16) pair_values(a, s, nkp);
        for (int d0 = 0; d0 < hd; d0 += 4) {
            switch (nz) {
            case 1: values4(a, s, d0, 1, nkp, alpha); break;
            case 2: values4(a, s, d0, 2, nkp, alpha); break;
            case 3: values4(a, s, d0, 3, nkp, alpha); break;
            default: values4(a, s, d0, 4, nkp, alpha); break;
            }
        }
    }
    /* out = o / l, each row's head written back in place. */
    float inv[MAX_ROWS];
    for (int z = 0; z < nz; z++) {
        const __m512 lz = l[z];
        const __mmask16 seen = _mm512_cmp_ps_mask(lz, _mm512_setzero_ps(), _CMP_GT_OQ);
        _mm512_storeu_ps(inv + z * 16, _mm512_maskz_div_ps(seen, _mm512_set1_ps(1.0f), lz));
    }
    for (int r = 0; r < R; r++) {
        const int64_t t = off + q0 + r / G, head = (int64_t)h * G + r % G;
        float row_out[MAX_HEAD_DIM];
        for (int d = 0; d < hd; d++) row_out[d] = s->o[d * MAX_ROWS + r] * inv[r];
        if (a->bf16) {
            uint16_t *dst = (uint16_t *)a->out + t * a->os + head * hd;
            for (int d = 0; d < hd; d += 16)
                _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row_out + d)));
        } else {
            memcpy((float *)a->out + t * a->os + head * hd, row_out, sizeof(float) * hd);
        }
    }
}

/* out[t] = causal attention of q[t] over its chunk's keys, for every chunk c: queries at
 * positions [first[c], first[c] + n[c]) of block table row row[c], tokens [off[c],
 * off[c] + n[c]) of q and out, each attending to positions p' <= p (and p' > p - window
 * when window > 0). q, out: (T, nh, hd), token strides qs, os (elements), heads contiguous;
 * kc, vc: a layer's K and V, (num_blocks, bs, kvh, hd) each, contiguous; table: (trows,
 * tcols) int32. bf16: every array bfloat16 (uint16), else float32. Returns 0; -1 for a
 * block id outside the cache; -2 for bad arguments (a row, a column past the table, heads
 * it cannot take). */
int paged_prefill(int bf16, const void *q, int64_t qs, const void *kc, const void *vc, int64_t num_blocks, int bs, int kvh,
                  int hd, int nh, const int32_t *table, int64_t trows, int64_t tcols, const int64_t *row,
                  const int64_t *first, const int64_t *n, const int64_t *off, int64_t nchunks, int64_t window, float scale,
                  void *out, int64_t os, int num_threads) {
    if (kvh < 1 || nh % kvh != 0 || hd < 32 || hd > MAX_HEAD_DIM || hd % 32 != 0 || bs < 1 || window < 0) return -2;
    const int G = nh / kvh;
    if (G > MAX_ROWS) return -2;
    const int qt = MAX_ROWS / G; /* queries per task */
    int64_t ntasks = 0;
    for (int64_t c = 0; c < nchunks; c++) {
        if (row[c] < 0 || row[c] >= trows || first[c] < 0 || n[c] < 0 || off[c] < 0) return -2;
        if (n[c] > 0 && (first[c] + n[c] - 1) / bs >= tcols) return -2;
        ntasks += (n[c] + qt - 1) / qt * kvh;
    }
    /* Every block a chunk reads, checked before any is read (an error writes nothing). */
    for (int64_t c = 0; c < nchunks; c++) {
        if (n[c] == 0) continue;
        int64_t k0 = window ? first[c] - window + 1 : 0;
        for (int64_t col = (k0 < 0 ? 0 : k0) / bs; col <= (first[c] + n[c] - 1) / bs; col++) {
            const int32_t blk = table[row[c] * tcols + col];
            if (blk < 0 || blk >= num_blocks) return -1;
        }
    }
    if (ntasks == 0) return 0;
    /* task i: chunk, kv head, query tile; listed chunk by chunk, tiles in order. */
    int64_t *tc = malloc(sizeof(int64_t) * ntasks * 2);
    if (!tc) return -3;
    int64_t i = 0;
    for (int64_t c = 0; c < nchunks; c++)
        for (int64_t t = 0; t < (n[c] + qt - 1) / qt; t++)
            for (int h = 0; h < kvh; h++, i++) tc[2 * i] = c, tc[2 * i + 1] = t * kvh + h;
    const Args a = {bf16, kvh, hd, nh, G, bs, num_blocks, qs, os, tcols, window, scale, q, kc, vc, table, out};
    int bad = 0;
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > ntasks) nt = (int)ntasks;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        Scratch *s = aligned_alloc(64, (sizeof(Scratch) + 63) & ~(size_t)63);
        if (!s) {
#pragma omp atomic write
            bad = -3;
        }
        /* NOTE: the last tasks first: a chunk's last tiles read the most keys. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = ntasks - 1; k >= 0; k--) {
            if (!s) continue;
            const int64_t c = tc[2 * k], t = tc[2 * k + 1] / kvh;
            const int h = (int)(tc[2 * k + 1] % kvh);
            const int64_t q0 = t * qt;
            const int nq = (int)(n[c] - q0 < qt ? n[c] - q0 : qt);
            task(&a, s, row[c], first[c], off[c], q0, nq, h);
        }
        free(s);
    }
    free(tc);
    return bad;
}
#else
int paged_prefill_available(void) { return 0; }
int paged_prefill(int bf16, const void *q, int64_t qs, const void *kc, const void *vc, int64_t num_blocks, int bs, int kvh,
                  int hd, int nh, const int32_t *table, int64_t trows, int64_t tcols, const int64_t *row,
                  const int64_t *first, const int64_t *n, const int64_t *off, int64_t nchunks, int64_t window, float scale,
                  void *out, int64_t os, int num_threads) {
    return -3;
}
#endif
