/* A tile of a prompt chunk's query tokens against their sequence's paged rows, for one KV head,
 * on AVX2 with FMA (float32): what paged_attention_avx2.c hands it wherever consecutive query
 * tokens share a block table.
 *
 * Why: one token at a time (attend_head), each of a chunk's tokens reads every key and value
 * row of its prefix on its own, one query head at a time, and a 48-token chunk's attention
 * took about 30 ms of a 150 ms step of the demo model on the AMD EPYC without AVX-512
 * (BENCHMARKS "Prompt chunks' attention in tiles"). Here the tile's query vectors (its tokens
 * times the KV head's `group` query heads, SARATHI_TILE_VECTORS at most) meet each row while
 * it is in L1 (1.3x to 1.5x faster there):
 *   (1) scores: 4 key rows against 3 query vectors at a time, 12 FMA chains, 7 loads for 12
 *       FMAs where attend_head's dot8 needs 9 for 8;
 *   (2) each query vector's softmax numerators over its own causal length (a token attends its
 *       lens[] positions; its scores past it, computed with the tile's longest, are never read);
 *   (3) values: block by block, 3 query vectors times 32 outputs in registers, added into out,
 *       so a block's value rows are read from L1 by every three, each over its own length.
 * Each (query token, head) output equals what attend_head computes up to the order of its sums.
 */
#include "kernels.h"

#if SARATHI_HAVE_X86_KERNELS
#include <immintrin.h>

SARATHI_AVX2_BEGIN
#include "attention_avx2.h"

/* [sum(a[0]), ..., sum(a[3])]. */
static inline __m128 sums4(const __m256 *a) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* scale * (q_k . key_r) for the 4 rows at rows + r * row_bytes and the 3 query vectors q0..q2,
 * into s_k[0..4): 12 FMA chains, each key load feeding 3 of them. */
static inline void scores_3x4(const float *q0, const float *q1, const float *q2,
                              const char *rows, int64_t row_bytes, int64_t nv, __m256 scale,
                              float *s0, float *s1, float *s2) {
    __m256 acc[12];
    UNROLLED
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nv; ++j) {
        const __m256 a = _mm256_loadu_ps(q0 + 8 * j), b = _mm256_loadu_ps(q1 + 8 * j);
        const __m256 c = _mm256_loadu_ps(q2 + 8 * j);
        UNROLLED
        for (int r = 0; r < 4; ++r) {
            const __m256 k = _mm256_loadu_ps((const float *)(rows + r * row_bytes) + 8 * j);
            acc[r] = _mm256_fmadd_ps(k, a, acc[r]);
            acc[4 + r] = _mm256_fmadd_ps(k, b, acc[4 + r]);
            acc[8 + r] = _mm256_fmadd_ps(k, c, acc[8 + r]);
        }
    }
    const __m128 s = _mm256_castps256_ps128(scale);
    _mm_storeu_ps(s0, _mm_mul_ps(sums4(acc), s));
    _mm_storeu_ps(s1, _mm_mul_ps(sums4(acc + 4), s));
    _mm_storeu_ps(s2, _mm_mul_ps(sums4(acc + 8), s));
}

/* scores[i * stride + pos] for every query vector i < nqv and position pos < keys->len, three
 * vectors at a time; a last one or two make up the three by repeating (their rows are written
 * twice, alike). */
static void score_tile(const float *const *qv, int64_t nqv, const head_rows_t *keys, int64_t nv,
                       float scale, float *scores, int64_t stride) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t b = 0, pos = 0; pos < keys->len; ++b) {
        const char *rows = block_rows(keys, b);
        const int64_t n = keys->len - pos < keys->block_size ? keys->len - pos : keys->block_size;
        int64_t r = 0;
        for (; r + 4 <= n; r += 4) {
            const char *four = rows + r * keys->row_bytes;
            float *at = scores + pos + r;
            for (int64_t i = 0; i < nqv; i += 3) {
                const int64_t i1 = i + 1 < nqv ? i + 1 : i, i2 = i + 2 < nqv ? i + 2 : i1;
                scores_3x4(qv[i], qv[i1], qv[i2], four, keys->row_bytes, nv, vscale,
                           at + i * stride, at + i1 * stride, at + i2 * stride);
            }
        }
        for (; r < n; ++r) {
            const float *key = (const float *)(rows + r * keys->row_bytes);
            for (int64_t i = 0; i < nqv; ++i)
                scores[i * stride + pos + r] = scale * dot(qv[i], key, nv);
        }
        pos += n;
    }
}

/* The largest of scores[0..len), len >= 1. */
static float row_max(const float *scores, int64_t len) {
    __m256 m = _mm256_set1_ps(-3.0e38f);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(scores + i));
    float max = hmax8(m);
    for (; i < len; ++i) max = scores[i] > max ? scores[i] : max;
    return max;
}

/* o[k][0 .. 8 NV) += sum over rows r < n[k] of p[k][r] * value_r for the 3 query vectors k: NV
 * (a constant after inlining, 2 or 4) vectors of each one's output in registers, each value
 * load feeding 3 FMA chains. Rows past a vector's own n[k] (a later token's, in the tile's last
 * few positions) are left out of its sums, not weighted by zero: a non-finite value there must
 * not reach an earlier token, as it does not in attend_head. */
static inline __attribute__((always_inline)) void
values_3xNV(const char *rows, int64_t row_bytes, const int64_t n[3], const float *const *p,
            float *const *o, int NV) {
    __m256 acc[3][4];
    UNROLLED
    for (int j = 0; j < NV; ++j)
        for (int i = 0; i < 3; ++i) acc[i][j] = _mm256_loadu_ps(o[i] + 8 * j);
    int64_t shortest = n[0] < n[1] ? n[0] : n[1], longest = n[0] > n[1] ? n[0] : n[1];
    shortest = n[2] < shortest ? n[2] : shortest;
    longest = n[2] > longest ? n[2] : longest;
    int64_t r = 0;
    for (; r < shortest; ++r) {
        const float *value = (const float *)(rows + r * row_bytes);
        const __m256 a = _mm256_broadcast_ss(p[0] + r), b = _mm256_broadcast_ss(p[1] + r);
        const __m256 c = _mm256_broadcast_ss(p[2] + r);
        UNROLLED
        for (int j = 0; j < NV; ++j) {
            const __m256 v = _mm256_loadu_ps(value + 8 * j);
            acc[0][j] = _mm256_fmadd_ps(a, v, acc[0][j]);
            acc[1][j] = _mm256_fmadd_ps(b, v, acc[1][j]);
            acc[2][j] = _mm256_fmadd_ps(c, v, acc[2][j]);
        }
    }
    for (; r < longest; ++r) { /* the tile's last few positions: each vector up to its own n */
        const float *value = (const float *)(rows + r * row_bytes);
        UNROLLED
        for (int i = 0; i < 3; ++i) {
            if (r >= n[i]) continue;
            const __m256 w = _mm256_broadcast_ss(p[i] + r);
            UNROLLED
            for (int j = 0; j < NV; ++j)
                acc[i][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(value + 8 * j), acc[i][j]);
        }
    }
    UNROLLED
    for (int j = 0; j < NV; ++j)
        for (int i = 0; i < 3; ++i) _mm256_storeu_ps(o[i] + 8 * j, acc[i][j]);
}

/* out_i = sum over pos < len_i of probs_i[pos] * value(pos), block by block, out_i zeroed first,
 * where len_i = lens[i / group] is query vector i's causal length (values->len, the tile's
 * longest, bounds them all); three vectors at a time, made up by repeating as in score_tile. */
static void value_tile(float *const *out, const float *probs, int64_t stride, int64_t nqv,
                       const int64_t *lens, int64_t group, const head_rows_t *values, int64_t nv) {
    for (int64_t i = 0; i < nqv; ++i)
        for (int64_t j = 0; j < nv; ++j) _mm256_storeu_ps(out[i] + 8 * j, _mm256_setzero_ps());
    for (int64_t b = 0, pos = 0; pos < values->len; ++b) {
        const char *rows = block_rows(values, b);
        const int64_t n =
            values->len - pos < values->block_size ? values->len - pos : values->block_size;
        for (int64_t i = 0; i < nqv; i += 3) {
            const int64_t i1 = i + 1 < nqv ? i + 1 : i, i2 = i + 2 < nqv ? i + 2 : i1;
            const float *p[3] = {probs + i * stride + pos, probs + i1 * stride + pos,
                                 probs + i2 * stride + pos};
            int64_t own[3]; /* rows of this block each of the three attends */
            const int64_t vec[3] = {i, i1, i2};
            for (int k = 0; k < 3; ++k) {
                const int64_t left = lens[vec[k] / group] - pos;
                own[k] = left < 0 ? 0 : left < n ? left : n;
            }
            for (int64_t j = 0; j < nv; j += 4) { /* nv is even: 4 vectors, or 2 at the end */
                const char *at = rows + j * 8 * (int64_t)sizeof(float);
                float *o[3] = {out[i] + 8 * j, out[i1] + 8 * j, out[i2] + 8 * j};
                if (nv - j >= 4)
                    values_3xNV(at, values->row_bytes, own, p, o, 4);
                else
                    values_3xNV(at, values->row_bytes, own, p, o, 2);
            }
        }
        pos += n;
    }
}

/* count query tokens with the same table, token t's `group` query vectors at q + t * q_stride
 * (head after head, head_dim floats each) and its output at out + t * q_stride, attending
 * lens[t] positions; keys and values: that table's rows of one KV head, their len set to the
 * tile's longest. scores: count * group rows of round_up(longest, 16) floats. */
void attend_tile_avx2(const float *q, int64_t q_stride, int64_t count, const int64_t *lens,
                      const head_rows_t *keys, const head_rows_t *values, int64_t group,
                      int64_t head_dim, float scale, float *scores, float *out) {
    const float *qv[64];
    float *ov[64];
    const int64_t nqv = count * group, nv = head_dim / 8, stride = (keys->len + 15) / 16 * 16;
    for (int64_t i = 0; i < nqv; ++i) {
        qv[i] = q + (i / group) * q_stride + (i % group) * head_dim;
        ov[i] = out + (i / group) * q_stride + (i % group) * head_dim;
    }
    score_tile(qv, nqv, keys, nv, scale, scores, stride);
    float inv_sum[64];
    for (int64_t i = 0; i < nqv; ++i) {
        float *probs = scores + i * stride;
        const int64_t len = lens[i / group];
        inv_sum[i] = 1.0f / softmax_numerators(probs, len, row_max(probs, len));
    }
    value_tile(ov, scores, stride, nqv, lens, group, values, nv);
    for (int64_t i = 0; i < nqv; ++i) {
        const __m256 s = _mm256_set1_ps(inv_sum[i]);
        for (int64_t j = 0; j < nv; ++j)
            _mm256_storeu_ps(ov[i] + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(ov[i] + 8 * j), s));
    }
}

SARATHI_AVX2_END
#endif /* SARATHI_HAVE_X86_KERNELS */
