/* What the AVX2 attention kernels share (paged_attention_avx2.c: one query token a call;
 * chunk_attention_avx2.c: a tile of a prompt chunk's tokens): where a KV head's rows lie, and
 * the vector pieces both passes use. Include it only between SARATHI_AVX2_BEGIN and
 * SARATHI_AVX2_END (kernels.h). */
#ifndef SARATHI_ATTENTION_AVX2_H
#define SARATHI_ATTENTION_AVX2_H

#include <immintrin.h>
#include <stdint.h>

#include "avx2_math.h"

/* Where one KV head's rows of a sequence lie: block b's row r at
 * cache + table[b] * block_bytes + r * row_bytes + head_bytes. */
typedef struct {
    const char *cache;
    const int64_t *table;
    int64_t len, block_size, block_bytes, row_bytes, head_bytes;
} head_rows_t;

static inline const char *block_rows(const head_rows_t *h, int64_t b) {
    return h->cache + h->table[b] * h->block_bytes + h->head_bytes;
}

/* probs[0..len) = e^(scores - max) in place; returns their sum. Whole vectors go with plain
 * loads and stores, the tail alone masked: with a masked store per 8 scores this pass took 21%
 * of the tile kernel's cycles on the AMD EPYC without AVX-512 (perf), 7% without. */
static inline float softmax_numerators(float *scores, int64_t len, float max) {
    const __m256 vmax = _mm256_set1_ps(max);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vmax));
        _mm256_storeu_ps(scores + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (i < len) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(len - i)), lane);
        __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(scores + i, m), vmax));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(m));
        _mm256_maskstore_ps(scores + i, m, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum8(sum);
}

/* q . k over nv vectors (nv even: head_dim is a multiple of 16), two chains in flight: the
 * score of a row left over after the tiles of 8 below. */
static inline float dot(const float *q, const float *k, int64_t nv) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (int64_t j = 0; j < nv; j += 2) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(k + 8 * j), _mm256_loadu_ps(q + 8 * j), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(k + 8 * j + 8), _mm256_loadu_ps(q + 8 * j + 8), b);
    }
    return hsum8(_mm256_add_ps(a, b));
}

/* [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in one transpose-and-add tree (7 ops where
 * eight hsum8 calls take 40). */
static inline __m256 sums8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The largest of v's eight lanes. */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* See chunk_attention_avx2.c. */
void attend_tile_avx2(const float *q, int64_t q_stride, int64_t count, const int64_t *lens,
                      const head_rows_t *keys, const head_rows_t *values, int64_t group,
                      int64_t head_dim, float scale, float *scores, float *out);

#endif
