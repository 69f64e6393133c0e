/* A tile of a prompt chunk's query tokens against their sequence's paged rows, for one KV head,
 * bf16 caches on AVX-512 with bf16: what paged_attention.c hands it wherever consecutive query
 * tokens share a block table.
 *
 * Why: one token at a time (attend_head in paged_attention.c), each of a chunk's tokens reads
 * every key and value row of its prefix on its own, and each of its scores is two vdpbf16ps
 * followed by a share of a 16-way horizontal sum: the sums and the value rows' widening, not the
 * products, took the time, and a chunk's attention cost about twice a whole prompt's per (token,
 * position) pair (BENCHMARKS "Prompt chunks' attention in tiles on AVX-512"). Here the tile's
 * query vectors (its tokens times the KV head's `group` query heads, SARATHI_TILE_VECTORS at
 * most) share the work of every 16 positions:
 *   (1) scores: the 16 key rows transposed once into D / 2 vectors of 32-bit value pairs, a
 *       lane per position (transpose16), so that a query vector's 16 scores are D / 2 vdpbf16ps
 *       against its own value pairs broadcast, already in lanes: no horizontal sum. SCORE_CHAINS
 *       query vectors at a time, independent chains sharing each transposed vector;
 *   (2) each query vector's softmax numerators over its own causal length (its scores past
 *       it, computed with the tile's longest, are never read);
 *   (3) values: each value row widened to float32 once for value_vectors(NV) query vectors,
 *       their sums in registers, each over its own causal length.
 * The value pass sums in attend_head's order; the scores' sums run in another, so outputs may
 * differ from attend_head's in the last bit of bf16
 * (tests/unit/stage_worker/test_cpu_attention_kernel.py).
 */
#include "kernels.h"
#include "paged_rows.h"

#if SARATHI_HAVE_X86_KERNELS
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

SARATHI_AVX512_BEGIN
#include "attention_avx512.h"

#define SCORE_CHAINS 12 /* query vectors scored together: 12 chains hide vdpbf16ps' latency */
#define VALUE_SUMS 24  /* float32 vectors of output sums kept in registers by the value pass */

/* r[p] = 16 32-bit words of row p -> r[w] = word w of rows 0..15 (lane p: row p's): unpacks of
 * 32- then 64-bit elements within 128-bit lanes, then two rounds of 128-bit lane shuffles. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    UNROLLED_ALL
    for (int k = 0; k < 8; ++k) {
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    UNROLLED_ALL
    for (int k = 0; k < 4; ++k) {
        b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    /* b[4k + m], 128-bit lane L: word 4L + m of rows 4k..4k+3 */
    UNROLLED_ALL
    for (int m = 0; m < 4; ++m) {
        const __m512i c0 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x44);
        const __m512i c1 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xEE);
        const __m512i c2 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x44);
        const __m512i c3 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xEE);
        r[m] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        r[8 + m] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

/* kt[w], w < words: lane p = the w-th pair of values of rows[p] (words = head_dim / 2). */
static void transpose_keys(const char *const rows[16], int64_t words, __m512i *kt) {
    for (int64_t c = 0; c < words; c += 16) {
        const int64_t n = words - c < 16 ? words - c : 16; /* 16, or 8 at the end */
        const __mmask16 m = first16(n);
        __m512i r[16];
        UNROLLED_ALL
        for (int p = 0; p < 16; ++p)
            r[p] = _mm512_maskz_loadu_epi32(m, (const uint32_t *)rows[p] + c);
        transpose16(r);
        for (int64_t w = 0; w < n; ++w) kt[c + w] = r[w];
    }
}

/* The w-th pair of a bf16 vector's values as one 32-bit word, broadcast to every lane. */
static inline __m512bh pair(const uint16_t *q, int64_t w) {
    int32_t word;
    memcpy(&word, q + 2 * w, sizeof word); /* a load, without reading bf16 data as int32 */
    return (__m512bh)_mm512_set1_epi32(word);
}

/* scale * scores of SCORE_CHAINS query vectors (q[i]: bf16) against the 16 positions whose
 * transposed keys are kt -> s[i][0..16). */
static inline void score_chains(const uint16_t *const *q, const __m512i *kt, int64_t words,
                                __m512 scale, float *const *s) {
    __m512 acc[SCORE_CHAINS];
    UNROLLED_ALL
    for (int i = 0; i < SCORE_CHAINS; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t w = 0; w < words; ++w) {
        const __m512bh k = (__m512bh)kt[w];
        UNROLLED_ALL
        for (int i = 0; i < SCORE_CHAINS; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], k, pair(q[i], w));
    }
    UNROLLED_ALL
    for (int i = 0; i < SCORE_CHAINS; ++i) _mm512_storeu_ps(s[i], _mm512_mul_ps(acc[i], scale));
}

/* scores[i * stride + pos] for every query vector i < nqv and position pos < longest, 16
 * positions at a time; the last chains of a round are made up by repeating (their rows are
 * written twice, alike). Positions past longest in the last 16 read row 0 again: their scores
 * land in the row's padding (stride is longest rounded up to 16) and are never read. */
static void score_tile(const uint16_t *const *qv, int64_t nqv, const char *kc,
                       const int64_t *table, int64_t longest, int64_t block_size,
                       int64_t row_bytes, int64_t head_bytes, int64_t words, float scale,
                       float *scores, int64_t stride, __m512i *kt) {
    const __m512 vscale = _mm512_set1_ps(scale);
    rows_t walk = rows_from(table, block_size, row_bytes, head_bytes);
    for (int64_t pos0 = 0; pos0 < longest; pos0 += 16) {
        const int64_t n = longest - pos0 < 16 ? longest - pos0 : 16;
        const char *rows[16];
        for (int64_t p = 0; p < 16; ++p)
            rows[p] = p < n ? kc + next_row(&walk, block_size) : rows[0];
        transpose_keys(rows, words, kt);
        for (int64_t i = 0; i < nqv; i += SCORE_CHAINS) {
            const uint16_t *q[SCORE_CHAINS];
            float *s[SCORE_CHAINS];
            for (int64_t c = 0; c < SCORE_CHAINS; ++c) {
                const int64_t at = i + c < nqv ? i + c : nqv - 1;
                q[c] = qv[at];
                s[c] = scores + at * stride + pos0;
            }
            score_chains(q, kt, words, vscale, s);
        }
    }
}

/* The largest of scores[0..len), len >= 1. */
static float row_max(const float *scores, int64_t len) {
    __m512 m = _mm512_set1_ps(-3.0e38f);
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 k = first16(len - i);
        m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, scores + i));
    }
    return _mm512_reduce_max_ps(m);
}

/* Query vectors whose output sums the value pass keeps in registers: VALUE_SUMS / NV. */
static inline int value_vectors(int nv) { return nv >= VALUE_SUMS ? 1 : VALUE_SUMS / nv; }

/* out[k] = inv_sum[k] * sum over pos < lens[k] of p[k][pos] * value(pos), rounded to bf16,
 * for the value_vectors(NV) query vectors k; NV = head_dim / 16, a constant after inlining.
 * Each value row is widened once for all of them. Rows a vector does not attend (a later
 * token's, in the tile's last few positions) are left out of its sums, not weighted by zero:
 * a non-finite value there must not reach an earlier token, as it does not in attend_head. */
static inline __attribute__((always_inline)) void
value_vectors_pass(const char *vc, const int64_t *table, const int64_t *lens, int64_t block_size,
                   int64_t row_bytes, int64_t head_bytes, const float *const *p,
                   const float *inv_sum, uint16_t *const *out, int NV) {
    const int NG = value_vectors(NV);
    int64_t shortest = lens[0], longest = lens[0];
    for (int g = 1; g < NG; ++g) {
        shortest = lens[g] < shortest ? lens[g] : shortest;
        longest = lens[g] > longest ? lens[g] : longest;
    }
    __m512 acc[VALUE_SUMS];
    UNROLLED_ALL
    for (int i = 0; i < NG * NV; ++i) acc[i] = _mm512_setzero_ps();
    rows_t walk = rows_from(table, block_size, row_bytes, head_bytes);
    for (int64_t pos = 0; pos < longest; ++pos) {
        const char *vrow = vc + next_row(&walk, block_size);
        __m512 v[16];
        UNROLLED_ALL
        for (int j = 0; j < NV; ++j) v[j] = load16(vrow + j * 32, 1);
        UNROLLED_ALL
        for (int g = 0; g < NG; ++g) {
            if (pos >= shortest && pos >= lens[g]) continue; /* past this vector's context */
            const __m512 pg = _mm512_set1_ps(p[g][pos]);
            UNROLLED_ALL
            for (int j = 0; j < NV; ++j)
                acc[g * NV + j] = _mm512_fmadd_ps(pg, v[j], acc[g * NV + j]);
        }
    }
    for (int g = 0; g < NG; ++g) {
        const __m512 scale = _mm512_set1_ps(inv_sum[g]);
        for (int j = 0; j < NV; ++j) {
            float tmp[16];
            _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[g * NV + j], scale));
            for (int d = 0; d < 16; ++d) out[g][j * 16 + d] = to_bf16(tmp[d]);
        }
    }
}

/* value_vectors_pass for every query vector, value_vectors(nv) at a time, made up by repeating
 * the last (its output written twice, alike). */
static void value_tile(const char *vc, const int64_t *table, const int64_t *lens, int64_t group,
                       int64_t block_size, int64_t row_bytes, int64_t head_bytes,
                       const float *scores, int64_t stride, const float *inv_sum, int64_t nqv,
                       uint16_t *const *ov, int nv) {
    const int ng = value_vectors(nv);
    for (int64_t i = 0; i < nqv; i += ng) {
        const float *p[VALUE_SUMS];
        float inv[VALUE_SUMS];
        uint16_t *o[VALUE_SUMS];
        int64_t len[VALUE_SUMS];
        for (int g = 0; g < ng; ++g) {
            const int64_t at = i + g < nqv ? i + g : nqv - 1;
            p[g] = scores + at * stride;
            inv[g] = inv_sum[at];
            o[g] = ov[at];
            len[g] = lens[at / group];
        }
#define CASE(NV)                                                                               \
    case NV:                                                                                   \
        value_vectors_pass(vc, table, len, block_size, row_bytes, head_bytes, p, inv, o, NV);  \
        break;
        switch (nv) {
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
        }
#undef CASE
    }
}

/* count query tokens with one table (a prompt chunk's), token t's `group` query vectors at q +
 * t * q_stride (head after head, head_dim bf16 values each), its output at out + t * q_stride,
 * attending lens[t] positions; kc, vc: the caches; row_bytes: a cache row (every KV head) in
 * bytes; head_bytes: this KV head's offset in a row. scores: count * group rows of
 * round_up(longest, 16) floats (sarathi_attention_scratch_floats). */
void attend_tile_bf16(const uint16_t *q, int64_t q_stride, int64_t count, const int64_t *lens,
                      const char *kc, const char *vc, const int64_t *table, int64_t block_size,
                      int64_t row_bytes, int64_t head_bytes, int64_t group, int64_t head_dim,
                      float scale, float *scores, uint16_t *out) {
    const uint16_t *qv[SARATHI_TILE_VECTORS];
    uint16_t *ov[SARATHI_TILE_VECTORS];
    float inv_sum[SARATHI_TILE_VECTORS];
    __m512i kt[SARATHI_MAX_HEAD_DIM / 2]; /* head_dim / 2 transposed key vectors: 8 KiB */
    const int64_t nqv = count * group;
    int64_t longest = 0;
    for (int64_t t = 0; t < count; ++t) longest = lens[t] > longest ? lens[t] : longest;
    const int64_t stride = (longest + 15) / 16 * 16;
    for (int64_t i = 0; i < nqv; ++i) {
        qv[i] = q + (i / group) * q_stride + (i % group) * head_dim;
        ov[i] = out + (i / group) * q_stride + (i % group) * head_dim;
    }
    score_tile(qv, nqv, kc, table, longest, block_size, row_bytes, head_bytes, head_dim / 2,
               scale, scores, stride, kt);
    for (int64_t i = 0; i < nqv; ++i) {
        float *probs = scores + i * stride;
        const int64_t len = lens[i / group];
        inv_sum[i] = 1.0f / softmax_numerators(probs, len, row_max(probs, len));
    }
    value_tile(vc, table, lens, group, block_size, row_bytes, head_bytes, scores, stride,
               inv_sum, nqv, ov, (int)(head_dim / 16));
}

SARATHI_AVX512_END
#endif /* SARATHI_HAVE_X86_KERNELS */
