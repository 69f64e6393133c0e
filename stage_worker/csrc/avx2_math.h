/* Vector math shared by the AVX2 kernels (attention, fused_ops_f32.c, sgemm_f32.c). Include it
 * only between SARATHI_AVX2_BEGIN and SARATHI_AVX2_END (kernels.h), so that these inline
 * functions are compiled for AVX2 with FMA like their callers. */
#ifndef SARATHI_AVX2_MATH_H
#define SARATHI_AVX2_MATH_H

#include <immintrin.h>

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

/* silu(g) * up for 8 gates: g * sigmoid(g), sigmoid from e = exp(-|g|) so exp never overflows:
 * 1 / (1 + e) for g >= 0, e / (1 + e) below. */
static inline __m256 silu_times(__m256 g, __m256 up) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp256(_mm256_or_ps(g, _mm256_set1_ps(-0.0f))); /* e^-|g| */
    const __m256 nonnegative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(e, one, nonnegative),
                                         _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), up);
}

#endif
