/* What the AVX-512 kernels share (paged_attention.c: one query token a call;
 * chunk_attention_avx512.c: a tile of a prompt chunk's tokens, bf16 caches;
 * fused_ops_bf16_avx512.c): loading a row as float32, bf16 rounding, the exponential, the
 * softmax numerators, prefetching rows and lane masks. Include it only between
 * SARATHI_AVX512_BEGIN and SARATHI_AVX512_END (kernels.h). */
#ifndef SARATHI_ATTENTION_AVX512_H
#define SARATHI_ATTENTION_AVX512_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "paged_rows.h"

/* The first n of 16 lanes (all 16 from n = 16 up). */
static inline __mmask16 first16(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* 16 float32 values of a bf16 (is_bf16) or float32 row. */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int is_bf16) {
    if (is_bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps(p);
}

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest, ties to even (no NaNs here) */
    return (uint16_t)(bits >> 16);
}

/* e^x for x <= 0 (scores minus their maximum), relative error about 1e-7: x = n ln2 + r with
 * |r| <= ln2/2, e^r by its degree-6 Taylor polynomial, times 2^n. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f)); /* e^-87 is ~0 and 2^n stays normal */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x); /* ln2, high part */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);      /* ln2, low part */
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* probs[0..len) = e^(scores - max) in place; returns their sum. */
static inline float softmax_numerators(float *scores, int64_t len, float max) {
    __m512 vmax = _mm512_set1_ps(max), sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 m = first16(len - i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + i), vmax));
        _mm512_mask_storeu_ps(scores + i, m, e);
        sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* Asks for the rows of the walk's next n positions (and moves it on), `bytes` of each: into L1
 * (to_l2 = 0) or L2 (to_l2 = 1). A sequence's blocks lie anywhere in the cache, where the
 * hardware's prefetcher cannot follow: without it the attention passes waited on each new
 * block (BENCHMARKS "Decode attention prefetched"). */
static inline void prefetch_rows(const char *cache, rows_t *walk, int64_t block_size, int64_t n,
                                 int64_t bytes, int to_l2) {
    for (int64_t p = 0; p < n; ++p) {
        const char *row = cache + next_row(walk, block_size);
        /* every line the row touches, from the one it starts in (rows need not be aligned) */
        const char *line = (const char *)((uintptr_t)row & ~(uintptr_t)63);
        for (; line < row + bytes; line += 64) {
            if (to_l2)
                _mm_prefetch(line, _MM_HINT_T1);
            else
                _mm_prefetch(line, _MM_HINT_T0);
        }
    }
}

#endif
