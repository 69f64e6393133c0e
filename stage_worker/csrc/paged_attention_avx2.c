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
 * That per-token path (attend_head) takes the decodes. Consecutive tokens with one table, a
 * prompt chunk's, go in tiles to chunk_attention_avx2.c instead, which reads each row once for
 * the whole tile; the tiles are handed to the threads before the single tokens.
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
#include <stdlib.h>
#include <string.h>

SARATHI_AVX2_BEGIN
#include "attention_avx2.h"
#include "attention_runs.h"

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

/* Arguments as paged_attention's (paged_attention.c), float32 throughout; scratch_floats
 * (sarathi_attention_scratch_floats) holds one tile's scores. */
void paged_attention_avx2(const float *q, const float *k_cache, const float *v_cache,
                          const int64_t *block_table, const int64_t *context_lens, int64_t tokens,
                          int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale, float *scratch,
                          int64_t scratch_floats, float *out, int num_threads) {
    const int64_t group = num_q_heads / num_kv_heads;
    const int64_t row_bytes = num_kv_heads * head_dim * (int64_t)sizeof(float);
    const int64_t q_stride = num_q_heads * head_dim;
    int64_t *runs = malloc((size_t)tokens * 2 * sizeof(int64_t));
    /* without the memory for the list, every token goes on its own (attend_head) */
    const int64_t num_runs =
        runs == NULL ? tokens
                     : split_into_runs(block_table, context_lens, tokens, max_blocks, block_size,
                                       sarathi_tile_tokens(group), runs);
    const int64_t items = num_runs * num_kv_heads;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (num_threads > 1)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t run = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t b = runs == NULL ? run : runs[2 * run];
        const int64_t count = runs == NULL ? 1 : runs[2 * run + 1];
#ifdef _OPENMP
        float *mine = scratch + (int64_t)omp_get_thread_num() * scratch_floats;
#else
        float *mine = scratch;
#endif
        const int64_t first = b * q_stride + h * group * head_dim;
        const int64_t *table = block_table + b * max_blocks;
        const int64_t head_bytes = h * head_dim * (int64_t)sizeof(float);
        if (count == 1) {
            attend_head(q + first, (const char *)k_cache, (const char *)v_cache, table,
                        context_lens[b], block_size, row_bytes, head_bytes, group, head_dim,
                        scale, mine, out + first);
            continue;
        }
        int64_t longest = 0;
        for (int64_t t = b; t < b + count; ++t)
            longest = context_lens[t] > longest ? context_lens[t] : longest;
        const head_rows_t keys = {(const char *)k_cache, table, longest, block_size,
                                  block_size * row_bytes, row_bytes, head_bytes};
        const head_rows_t values = {(const char *)v_cache, table, longest, block_size,
                                    block_size * row_bytes, row_bytes, head_bytes};
        attend_tile_avx2(q + first, q_stride, count, context_lens + b, &keys, &values, group,
                         head_dim, scale, mine, out + first);
    }
    free(runs);
}

SARATHI_AVX2_END
#endif /* SARATHI_HAVE_X86_KERNELS */
