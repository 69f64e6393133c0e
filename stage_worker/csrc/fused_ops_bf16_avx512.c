/* The bf16 fused ops (fused_ops_bf16.c: read it first) on AVX-512 with bf16, 16 values a vector,
 * for CPUs that have it; fused_ops.c picks them there.
 *
 * Why: in fused_ops_bf16.c the rounding to bf16 (an add, a shift, a compare and a blend a
 * vector, twice in SiLU and rotary) costs more than the arithmetic; vcvtneps2bf16 rounds 16
 * floats in one instruction, to nearest, ties to even, a NaN kept a (quiet) NaN, as torch does.
 * It does flush a denormal input to zero, where torch keeps the nearest bf16 denormal: only
 * results below 1.2e-38 in magnitude differ, and those by less than 1.2e-38. The same values
 * are rounded at the same places as in fused_ops_bf16.c, so rotary still equals torch bit for
 * bit; RMSNorm's sum of squares and SiLU's exp (paged attention's exp512) follow their own
 * order and polynomial, within a rounding step or two of torch
 * (tests/unit/stage_worker/test_cpu_fused_ops.py runs both files).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if SARATHI_HAVE_X86_KERNELS
#include <immintrin.h>

SARATHI_AVX512_BEGIN
#include "attention_avx512.h"

/* 16 bf16 values [p, p + 16) as float32; masked: the first n of them, zeros after. */
static inline __m512 load16_bf16(const uint16_t *p, __mmask16 m) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Each lane rounded to bf16 and back: what the reference holds after an op. */
static inline __m512 round16(__m512 v) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The 16 lanes rounded to bf16, stored at [p, p + 16) where m says. */
static inline void store16_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* -v and -|v| by the sign bit (integer ops: the float ones need AVX512DQ). */
static inline __m512 negated(__m512 v) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}

static inline __m512 minus_abs(__m512 v) {
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}

void fused_rms_norm_bf16_avx512(const uint16_t *x, int64_t rows, int64_t ld_x,
                                const uint16_t *w, int64_t hidden, float eps, uint16_t *out) {
    for (int64_t row = 0; row < rows; ++row) {
        const uint16_t *in = x + row * ld_x;
        uint16_t *dst = out + row * hidden;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 32 <= hidden; i += 32) { /* two chains: the adds' latency is not the limit */
            const __m512 a = load16_bf16(in + i, 0xFFFF), b = load16_bf16(in + i + 16, 0xFFFF);
            acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(a, a));
            acc1 = _mm512_add_ps(acc1, _mm512_mul_ps(b, b));
        }
        for (; i < hidden; i += 16) { /* masked lanes load as zeros */
            const __m512 a = load16_bf16(in + i, first16(hidden - i));
            acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(a, a));
        }
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(sum / (float)hidden + eps));
        for (i = 0; i < hidden; i += 16) {
            const __mmask16 m = first16(hidden - i);
            const __m512 normed = round16(_mm512_mul_ps(load16_bf16(in + i, m), inv)); /* dtype */
            store16_bf16(dst + i, _mm512_mul_ps(normed, load16_bf16(w + i, m)), m);
        }
    }
}

void fused_rotary_bf16_avx512(const uint16_t *x, int64_t tokens, int64_t heads,
                              int64_t head_dim, int64_t ld_token, int64_t ld_head,
                              const uint16_t *cos, const uint16_t *sin, uint16_t *out) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            const uint16_t *v = x + t * ld_token + h * ld_head;
            uint16_t *o = out + (t * heads + h) * head_dim;
            /* x * cos + cat(-x2, x1) * sin: each product rounded, then their sum */
            for (int64_t d = 0; d < half; d += 16) {
                const __mmask16 m = first16(half - d);
                const __m512 x1 = load16_bf16(v + d, m), x2 = load16_bf16(v + half + d, m);
                const __m512 neg_x2 = negated(x2);
                store16_bf16(o + d,
                             _mm512_add_ps(round16(_mm512_mul_ps(x1, load16_bf16(c + d, m))),
                                           round16(_mm512_mul_ps(neg_x2, load16_bf16(s + d, m)))),
                             m);
                store16_bf16(
                    o + half + d,
                    _mm512_add_ps(round16(_mm512_mul_ps(x2, load16_bf16(c + half + d, m))),
                                  round16(_mm512_mul_ps(x1, load16_bf16(s + half + d, m)))),
                    m);
            }
        }
    }
}

void fused_silu_mul_bf16_avx512(const uint16_t *x, int64_t rows, int64_t ld_x, int64_t width,
                                uint16_t *out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t row = 0; row < rows; ++row) {
        const uint16_t *gate = x + row * ld_x, *up = gate + width;
        uint16_t *dst = out + row * width;
        for (int64_t i = 0; i < width; i += 16) {
            const __mmask16 m = first16(width - i);
            const __m512 g = load16_bf16(gate + i, m);
            /* g * sigmoid(g), from e = exp(-|g|) so that exp never overflows */
            const __m512 e = exp512(minus_abs(g));
            const __mmask16 nonnegative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
            const __m512 sigmoid =
                _mm512_div_ps(_mm512_mask_blend_ps(nonnegative, e, one), _mm512_add_ps(one, e));
            const __m512 silu = round16(_mm512_mul_ps(g, sigmoid)); /* the model dtype */
            store16_bf16(dst + i, _mm512_mul_ps(silu, load16_bf16(up + i, m)), m);
        }
    }
}

SARATHI_AVX512_END
#endif /* SARATHI_HAVE_X86_KERNELS */
