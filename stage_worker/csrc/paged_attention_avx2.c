/* Paged attention for float32 caches on CPUs with AVX2 and FMA but no AVX-512: the same
 * contract and the same three passes as paged_attention.c (read it first), 8 floats a vector.
 *
 * Without it such a CPU ran the torch path, which gathers every sequence's blocks into a
 * padded copy and copies them again for its batched products: at a decode of 4 sequences over
 * 128-token contexts that was about 20 ms of the demo model's 76 ms float32 step on the AMD
 * EPYC without AVX-512 (BENCHMARKS "Attention in place on AVX2"). Here each key and value row is
 * read where it lies.
 *
 * Per query token and KV head: (1) key rows eight at a time within a block against each query
 * head of the group: eight FMA chains, one a row, then one transpose-and-add tree for their
 * eight sums. One row at a time, each dot product ending in its own horizontal sum, the pass
 * was latency-bound and attention ran at half the speed (BENCHMARKS "Attention in tiles of
 * eight rows"); (2) softmax numerators with a vectorized exp; (3) for each query head, up to 64
 * of its output values at a time in registers, weighting every value row.
 * Sums are float32; the output is float32 (bf16 caches stay on the AVX-512 kernel).
 *
 * Compiled for AVX2 with FMA (kernels.h); module.c calls it only where the CPU has both and the
 * caches are float32, after it has checked every shape and table entry; head_dim is a multiple
 * of 16.
 */
#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if SARATHI_HAVE_X86_KERNELS
#include <immintrin.h>

SARATHI_AVX2_BEGIN

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* e^x for x <= 0, as paged_attention.c's exp512: x = n ln2 + r, e^r by its degree-6 Taylor
 * polynomial, times 2^n built in the exponent bits (AVX2 has no scalef). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f)); /* n >= -126: 2^n stays a normal float */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x); /* ln2, high part */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);      /* ln2, low part */
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* probs[0..len) = e^(scores - max) in place; returns their sum. */
static float softmax_numerators(float *scores, int64_t len, float max) {
    const __m256 vmax = _mm256_set1_ps(max);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < len; i += 8) {
        const int left = len - i < 8 ? (int)(len - i) : 8;
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane);
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

/* q . key_i for the 8 rows at rows + i * row_bytes: one accumulator a row, so eight independent
 * FMA chains share each load of q, and one sums8 replaces eight horizontal sums. */
static inline __m256 dot8(const float *q, const char *rows, int64_t row_bytes, int64_t nv) {
    __m256 acc[8];
    UNROLLED
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nv; ++j) {
        const __m256 qj = _mm256_loadu_ps(q + 8 * j);
        UNROLLED
        for (int i = 0; i < 8; ++i)
            acc[i] = _mm256_fmadd_ps(
                _mm256_loadu_ps((const float *)(rows + i * row_bytes) + 8 * j), qj, acc[i]);
    }
    return sums8(acc);
}

/* The largest of v's eight lanes. */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

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

/* scores[g, pos] = scale * q_g . key(pos) for the group's heads over [0, len); max[g] each.
 * Rows go 8 at a time within a block (dot8), the rest one at a time. */
static void score_pass(const float *q, const head_rows_t *keys, int64_t group, int64_t nv,
                       float scale, float *scores, float *max) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t g = 0; g < group; ++g) max[g] = -3.0e38f;
    for (int64_t b = 0, pos = 0; pos < keys->len; ++b) {
        const char *rows = block_rows(keys, b);
        const int64_t n = keys->len - pos < keys->block_size ? keys->len - pos : keys->block_size;
        int64_t r = 0;
        for (; r + 8 <= n; r += 8) {
            for (int64_t g = 0; g < group; ++g) {
                const __m256 s = _mm256_mul_ps(
                    vscale, dot8(q + g * nv * 8, rows + r * keys->row_bytes, keys->row_bytes, nv));
                _mm256_storeu_ps(scores + g * keys->len + pos + r, s);
                const float m = hmax8(s);
                max[g] = m > max[g] ? m : max[g];
            }
        }
        for (; r < n; ++r) {
            const float *key = (const float *)(rows + r * keys->row_bytes);
            for (int64_t g = 0; g < group; ++g) {
                const float s = scale * dot(q + g * nv * 8, key, nv);
                scores[g * keys->len + pos + r] = s;
                max[g] = s > max[g] ? s : max[g];
            }
        }
        pos += n;
    }
}

/* out[0 .. 8 * NV) = inv_sum * sum over pos of probs[pos] * value(pos)[offset ...]: NV (a
 * constant after inlining, at most 8) vectors of one query head's output in registers, the
 * values' head_bytes moved to this chunk's offset. */
static inline __attribute__((always_inline)) void
value_chunk(const head_rows_t *values, const float *probs, float inv_sum, float *out,
            int NV) {
    __m256 acc[8];
    UNROLLED
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0, pos = 0; pos < values->len; ++b) {
        const char *rows = block_rows(values, b);
        const int64_t n =
            values->len - pos < values->block_size ? values->len - pos : values->block_size;
        for (int64_t r = 0; r < n; ++r) {
            const float *value = (const float *)(rows + r * values->row_bytes);
            const __m256 p = _mm256_broadcast_ss(probs + pos + r);
            UNROLLED
            for (int j = 0; j < NV; ++j)
                acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 8 * j), acc[j]);
        }
        pos += n;
    }
    const __m256 scale = _mm256_set1_ps(inv_sum);
    UNROLLED
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(acc[j], scale));
}

/* One query token, one KV head (its rows start head_bytes into each cache row), its `group`
 * query heads q: [group, D] -> out: [group, D]; scores: [group, len] float32 scratch. */
static void attend_head(const float *q, const char *kc, const char *vc, const int64_t *table,
                        int64_t len, int64_t block_size, int64_t row_bytes, int64_t head_bytes,
                        int64_t group, int64_t head_dim, float scale, float *scores, float *out) {
    float max[64];
    const int64_t nv = head_dim / 8;
    const head_rows_t keys = {kc, table, len, block_size, block_size * row_bytes, row_bytes,
                              head_bytes};
    score_pass(q, &keys, group, nv, scale, scores, max);
    for (int64_t g = 0; g < group; ++g) {
        float *probs = scores + g * len;
        const float inv_sum = 1.0f / softmax_numerators(probs, len, max[g]);
        for (int64_t j0 = 0; j0 < nv; j0 += 8) { /* 8 vectors (64 values) at a time */
            const head_rows_t values = {
                vc, table, len, block_size, block_size * row_bytes, row_bytes,
                head_bytes + j0 * 8 * (int64_t)sizeof(float)};
            float *o = out + g * head_dim + j0 * 8;
            switch (nv - j0 < 8 ? nv - j0 : 8) { /* nv is even */
            case 2: value_chunk(&values, probs, inv_sum, o, 2); break;
            case 4: value_chunk(&values, probs, inv_sum, o, 4); break;
            case 6: value_chunk(&values, probs, inv_sum, o, 6); break;
            default: value_chunk(&values, probs, inv_sum, o, 8); break;
            }
        }
    }
}

/* Arguments as paged_attention's (paged_attention.c), float32 throughout. */
void paged_attention_avx2(const float *q, const float *k_cache, const float *v_cache,
                          const int64_t *block_table, const int64_t *context_lens, int64_t tokens,
                          int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale, float *scratch,
                          int64_t scratch_floats, float *out, int num_threads) {
    const int64_t group = num_q_heads / num_kv_heads;
    const int64_t row_bytes = num_kv_heads * head_dim * (int64_t)sizeof(float);
    const int64_t pairs = tokens * num_kv_heads;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (num_threads > 1)
    for (int64_t pair = 0; pair < pairs; ++pair) {
        const int64_t b = pair / num_kv_heads, h = pair % num_kv_heads;
#ifdef _OPENMP
        float *mine = scratch + (int64_t)omp_get_thread_num() * scratch_floats;
#else
        float *mine = scratch;
#endif
        const int64_t first = (b * num_q_heads + h * group) * head_dim;
        attend_head(q + first, (const char *)k_cache, (const char *)v_cache,
                    block_table + b * max_blocks, context_lens[b], block_size, row_bytes,
                    h * head_dim * (int64_t)sizeof(float), group, head_dim, scale, mine,
                    out + first);
    }
}

SARATHI_AVX2_END
#endif /* SARATHI_HAVE_X86_KERNELS */
