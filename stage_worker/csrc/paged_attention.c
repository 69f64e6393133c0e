/* Paged attention on the CPU for every token of a step: each query token against its own
 * context (a decode's whole sequence, or a prompt token's causal prefix), keys and values read
 * in place through its sequence's block table. Prefill chunks and decodes go through the same
 * loop: a chunk's tokens are rows with the chunk's table and growing context lengths, and read
 * the same rows one after another while they sit in the core's caches.
 *
 * The plain-torch path first gathers each sequence's blocks into a padded [B, L, Hkv, D] copy
 * and then lets matmul copy them again into the layout a batched product wants: at a batch of
 * 32 over 600-token contexts those two copies were 85% of a bf16 decode step of the demo model
 * (BENCHMARKS.md). Here every key and value row is read once, where it lies, and never written.
 *
 * Per query token and KV head: (1) the scores of the head's group of query heads against every
 * position, each key row loaded once for the whole group; (2) softmax in float32 with a
 * vectorized exp; (3) the values weighted by the probabilities, each value row loaded once for
 * the group. The scores of one token and head stay in a caller-given float32 buffer (a few
 * KiB: it stays in L1/L2 between the passes). Everything is summed in float32 and the output is
 * rounded once (to bf16, nearest, ties to even, for a bf16 cache).
 *
 * That per-token path (attend_head) takes the decodes, and every token of a float32 cache. With
 * a bf16 cache, consecutive tokens with one table, a prompt chunk's, go in tiles to
 * chunk_attention_avx512.c instead, which shares each 16 key rows and each value row among the
 * tile's tokens; the tiles are handed to the threads before the single tokens.
 *
 * Threads: the work items ((query token or tile, KV head) pairs) are shared out among OpenMP
 * threads, each with its own block of the scratch; an item's work is independent of every
 * other's, so the output is the same whatever the thread count.
 *
 * Compiled into stage_worker._kernels for AVX-512 with bf16 (kernels.h), called only by
 * module.c after it has checked every shape, dtype, table entry and the CPU; head_dim is a
 * multiple of 16.
 */
#include "kernels.h"
#include "paged_rows.h"

#ifdef _OPENMP
#include <omp.h>
static inline int omp_thread(void) { return omp_get_thread_num(); }
#else
static inline int omp_thread(void) { return 0; }
#endif

#if SARATHI_HAVE_X86_KERNELS
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

SARATHI_AVX512_BEGIN

#include "attention_avx512.h"
#include "attention_runs.h"

/* How far ahead of the scores the key rows are asked into L2, in positions: a block of 16
 * positions scores in a few tens of ns, where a row from memory takes longer, so the next
 * block's rows (asked into L1) were still on their way when needed. 64 read a decode step's
 * caches at 24-27 against 21-22 GB/s; 128 and 256 were no faster (BENCHMARKS "Decode attention's
 * keys asked for further ahead"). */
#define KEYS_FAR_AHEAD 64

/* lane i = the sum of v[i]'s 16 lanes: a transposing tree of 15 shuffle-and-add steps, where
 * 16 separate reductions take about 4 times the instructions. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i) /* 128-bit lane k: v[2i], v[2i+1] over two element pairs */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { /* 128-bit lane k: v[4i..4i+3] over elements 4k..4k+3 */
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), /* moves as pairs, */
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b))); /* adds as floats */
    }
    /* then across the four 128-bit lanes, two at a time */
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                              _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                              _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

/* The dot product of query head q with one key row, as 16 partial sums. bf16: q and the row
 * are bf16, multiplied exactly and summed in float32 by vdpbf16ps, 32 values an instruction;
 * float32: q is float32. */
static inline __attribute__((always_inline)) __m512 dot16(const void *q, const char *row, int nv,
                                                          int is_bf16) {
    __m512 acc = _mm512_setzero_ps();
    if (is_bf16) {
        const uint16_t *qb = (const uint16_t *)q, *kb = (const uint16_t *)row;
        int j = 0;
        for (; j + 2 <= nv; j += 2)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kb + j * 16),
                                   (__m512bh)_mm512_loadu_si512(qb + j * 16));
        if (j < nv) /* an odd number of 16-value pieces: the last one alone */
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, kb + j * 16),
                                   (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, qb + j * 16));
        return acc;
    }
    const float *qf = (const float *)q, *kf = (const float *)row;
    for (int j = 0; j < nv; ++j)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(kf + j * 16), _mm512_loadu_ps(qf + j * 16), acc);
    return acc;
}

/* Scores of `group` query heads (q: [group, D], the cache's dtype) against positions [0, len),
 * times scale -> scores: [group, len], and each head's maximum -> max. Sixteen positions at a
 * time: their key rows sit in L1 while every head of the group reads them. */
static inline __attribute__((always_inline)) void
score_pass(const char *q, const char *kc, const char *vc, const int64_t *table, int64_t len,
           int64_t block_size, int64_t row_stride, int64_t h, int64_t group, float scale,
           float *scores, float *max, int nv, int is_bf16) {
    const int64_t head_dim = nv * 16, elem = is_bf16 ? 2 : 4;
    const __m512 vscale = _mm512_set1_ps(scale);
    rows_t walk = rows_from(table, block_size, row_stride * elem, h * head_dim * elem);
    rows_t keys_ahead = walk, values_ahead = walk, keys_far = walk;
    prefetch_rows(kc, &keys_far, block_size, len < KEYS_FAR_AHEAD ? len : KEYS_FAR_AHEAD,
                  head_dim * elem, 1);
    prefetch_rows(kc, &keys_ahead, block_size, len < 16 ? len : 16, head_dim * elem, 0);
    for (int64_t g = 0; g < group; ++g) max[g] = -3.0e38f;
    for (int64_t pos0 = 0; pos0 < len; pos0 += 16) {
        const int64_t n = len - pos0 < 16 ? len - pos0 : 16;
        /* the next 16 key rows into L1 while these are scored, these 16 value rows into L2
         * for value_pass: a block's rows lie together, but the blocks anywhere in the cache,
         * where the hardware's prefetcher cannot follow */
        const int64_t next = len - pos0 - n < 16 ? len - pos0 - n : 16;
        prefetch_rows(kc, &keys_ahead, block_size, next, head_dim * elem, 0);
        const int64_t far_left = len - pos0 - KEYS_FAR_AHEAD; /* <= 0: all asked for */
        prefetch_rows(kc, &keys_far, block_size, far_left < 16 ? far_left : 16,
                      head_dim * elem, 1);
        prefetch_rows(vc, &values_ahead, block_size, n, head_dim * elem, 1);
        const __mmask16 m = first16(n);
        const char *rows[16];
        for (int64_t p = 0; p < 16; ++p) /* past len: the first row again, masked off */
            rows[p] = p < n ? kc + next_row(&walk, block_size) : rows[0];
        for (int64_t g = 0; g < group; ++g) {
            const char *qg = q + g * head_dim * elem;
            __m512 dots[16];
            for (int p = 0; p < 16; ++p) dots[p] = dot16(qg, rows[p], nv, is_bf16);
            __m512 s = _mm512_mul_ps(sum16(dots), vscale);
            _mm512_mask_storeu_ps(scores + g * len + pos0, m, s);
            float block_max = _mm512_mask_reduce_max_ps(m, s);
            max[g] = block_max > max[g] ? block_max : max[g];
        }
    }
}

/* out rows of query heads [g0, g0 + ng) = their probabilities (scores) times the value rows,
 * divided by their sums. ng * nv <= 16: the sums stay in registers across positions. */
static inline __attribute__((always_inline)) void
value_pass(const char *vc, const int64_t *table, int64_t len, int64_t block_size,
           int64_t row_stride, int64_t h, const float *scores, const float *inv_sum, int64_t g0,
           int ng, char *out_head0, int nv, int is_bf16) {
    const int64_t head_dim = nv * 16, elem = is_bf16 ? 2 : 4;
    __m512 acc[16];
    for (int i = 0; i < ng * nv; ++i) acc[i] = _mm512_setzero_ps();
    rows_t walk = rows_from(table, block_size, row_stride * elem, h * head_dim * elem);
    for (int64_t pos = 0; pos < len; ++pos) {
        const char *vrow = vc + next_row(&walk, block_size);
        for (int j = 0; j < nv; ++j) {
            __m512 v = load16(vrow + j * 16 * elem, is_bf16);
            for (int g = 0; g < ng; ++g)
                acc[g * nv + j] =
                    _mm512_fmadd_ps(_mm512_set1_ps(scores[(g0 + g) * len + pos]), v, acc[g * nv + j]);
        }
    }
    for (int g = 0; g < ng; ++g) {
        char *o = out_head0 + (g0 + g) * head_dim * elem;
        __m512 scale = _mm512_set1_ps(inv_sum[g0 + g]);
        for (int j = 0; j < nv; ++j) {
            float tmp[16];
            _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[g * nv + j], scale));
            for (int d = 0; d < 16; ++d) {
                if (is_bf16)
                    ((uint16_t *)o)[j * 16 + d] = to_bf16(tmp[d]);
                else
                    ((float *)o)[j * 16 + d] = tmp[d];
            }
        }
    }
}

/* One query token, one KV head h, its `group` query heads; nv = head_dim / 16 is a constant
 * after inlining, so the key, value and sum vectors live in registers. q: [group, D] in the
 * cache's dtype; scale: applied to the scores; scores: [group, len] float32 scratch; out_head0:
 * the output row of the group's first query head. */
static inline __attribute__((always_inline)) void
attend_head(const char *q, const char *kc, const char *vc, const int64_t *table, int64_t len,
            int64_t block_size, int64_t row_stride, int64_t h, int64_t group, float scale,
            float *scores, char *out_head0, int nv, int is_bf16) {
    float max[64], inv_sum[64];
    score_pass(q, kc, vc, table, len, block_size, row_stride, h, group, scale, scores, max, nv,
               is_bf16);
    for (int64_t g = 0; g < group; ++g)
        inv_sum[g] = 1.0f / softmax_numerators(scores + g * len, len, max[g]);
    const int per_pass = nv >= 16 ? 1 : 16 / nv; /* query heads whose sums fit 16 registers */
    for (int64_t g0 = 0; g0 < group; g0 += per_pass) {
        int ng = group - g0 < per_pass ? (int)(group - g0) : per_pass;
        value_pass(vc, table, len, block_size, row_stride, h, scores, inv_sum, g0, ng, out_head0,
                   nv, is_bf16);
    }
}

/* attend_head specialized for each head_dim / 16 and cache dtype. */
#define CASE(NV)                                                                               \
    case NV:                                                                                   \
        if (is_bf16)                                                                           \
            attend_head(q, kc, vc, table, len, block_size, row_stride, h, group, scale,        \
                        scores, out, NV, 1);                                                   \
        else                                                                                   \
            attend_head(q, kc, vc, table, len, block_size, row_stride, h, group, scale,        \
                        scores, out, NV, 0);                                                   \
        break;

static void attend_any(const char *q, const char *kc, const char *vc, const int64_t *table,
                       int64_t len, int64_t block_size, int64_t row_stride, int64_t h,
                       int64_t group, float scale, float *scores, char *out, int nv,
                       int is_bf16) {
    switch (nv) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
    }
}
#undef CASE

/* One work item of paged_attention: `count` consecutive tokens from token b, KV head h; more
 * than one (bf16 caches only) go as a tile to chunk_attention_avx512.c. */
static void attend_item(const char *q, const char *kc, const char *vc, const int64_t *block_table,
                        const int64_t *context_lens, int64_t b, int64_t count, int64_t h,
                        int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, int64_t max_blocks, float scale, float *scratch,
                        char *out, int is_bf16) {
    const int64_t group = num_q_heads / num_kv_heads, elem = is_bf16 ? 2 : 4;
    const int64_t row_stride = num_kv_heads * head_dim;
    const int64_t first_row = (b * num_q_heads + h * group) * head_dim * elem;
    const int64_t *table = block_table + b * max_blocks;
    if (count == 1) {
        attend_any(q + first_row, kc, vc, table, context_lens[b], block_size, row_stride, h,
                   group, scale, scratch, out + first_row, (int)(head_dim / 16), is_bf16);
        return;
    }
    attend_tile_bf16((const uint16_t *)(q + first_row), num_q_heads * head_dim, count,
                     context_lens + b, kc, vc, table, block_size, row_stride * elem,
                     h * head_dim * elem, group, head_dim, scale, scratch,
                     (uint16_t *)(out + first_row));
}

/* q: [T, Hq, D] contiguous, one row per query token, same dtype as the caches; k_cache,
 * v_cache: [num_blocks, block_size, Hkv, D] contiguous; block_table: [T, max_blocks] int64, the
 * table of each token's sequence; context_lens: [T] int64, the positions each token attends
 * (each >= 1 and covered by its row of the table); scratch: float32, num_threads blocks of
 * scratch_floats >= sarathi_attention_scratch_floats(group, max context_len) values; out: [T,
 * Hq, D] contiguous, the caches' dtype. Hq = Hkv * group with group <= 64; D a multiple of 16,
 * at most 256 (module.c checks all of it). With bf16 caches, consecutive tokens with one table
 * (a prompt chunk's) go in tiles of up to sarathi_tile_tokens(group), the tiles handed out
 * first; every other token (a decode, a float32 cache's) goes alone. */
void paged_attention(const void *q, const void *k_cache, const void *v_cache,
                     const int64_t *block_table, const int64_t *context_lens, int64_t tokens,
                     int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, int64_t max_blocks, float scale, float *scratch,
                     int64_t scratch_floats, void *out, int is_bf16, int num_threads) {
    const int64_t group = num_q_heads / num_kv_heads;
    int64_t *runs = is_bf16 ? malloc((size_t)tokens * 2 * sizeof(int64_t)) : NULL;
    /* without the memory for the list, every token goes on its own */
    const int64_t num_runs =
        runs == NULL ? tokens
                     : split_into_runs(block_table, context_lens, tokens, max_blocks, block_size,
                                       sarathi_tile_tokens(group), runs);
    const int64_t items = num_runs * num_kv_heads;
    /* dynamic: a prompt chunk's later tokens attend longer contexts than its first ones */
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (num_threads > 1)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t run = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t b = runs == NULL ? run : runs[2 * run];
        const int64_t count = runs == NULL ? 1 : runs[2 * run + 1];
        attend_item((const char *)q, (const char *)k_cache, (const char *)v_cache, block_table,
                    context_lens, b, count, h, num_q_heads, num_kv_heads, head_dim, block_size,
                    max_blocks, scale, scratch + (int64_t)omp_thread() * scratch_floats,
                    (char *)out, is_bf16);
    }
    free(runs);
}

SARATHI_AVX512_END
#endif /* SARATHI_HAVE_X86_KERNELS */
