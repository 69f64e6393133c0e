/* The fused elementwise ops (fused_ops.c) for float32 rows, written with AVX2 vectors.
 *
 * The loops over float buffers that fused_ops.c once ran for both dtypes, left to GCC's
 * vectorizer, ran float32 at about 1 ns an element on the AMD EPYC without AVX-512: 100 us for
 * a SiLU of 49 tokens of the demo model, 28 us for an RMSNorm, about 15 ms of a prompt chunk's
 * 150 ms step over the 30 layers (BENCHMARKS "Prompt chunks' attention in tiles, and float32
 * fused ops as vectors": a layer's chain 1.4x to 1.7x faster). Here each is one pass over its
 * rows, 8 floats a vector, with the same products, sums and quotients as the reference
 * (layers/norm.py, layers/rotary.py, models/llama.py): rotary equals torch bit for bit; RMSNorm
 * sums its squares in another order and SiLU's exp is a polynomial, so those stay within a
 * rounding step or two (tests/unit/stage_worker/test_cpu_fused_ops.py). Multiplies and adds are
 * separate instructions where the reference rounds between them.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#if SARATHI_HAVE_X86_KERNELS

SARATHI_AVX2_BEGIN
#include "avx2_math.h"

void fused_rms_norm_f32(const float *x, int64_t rows, int64_t ld_x, const float *w,
                        int64_t hidden, float eps, float *out) {
    for (int64_t row = 0; row < rows; ++row) {
        const float *in = x + row * ld_x;
        float *dst = out + row * hidden;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16) { /* two chains: the adds' latency is not the limit */
            const __m256 a = _mm256_loadu_ps(in + i), b = _mm256_loadu_ps(in + i + 8);
            acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(a, a));
            acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(b, b));
        }
        float sum = hsum8(_mm256_add_ps(acc0, acc1));
        for (; i < hidden; ++i) sum += in[i] * in[i];
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= hidden; i += 8) {
            const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(in + i), vinv);
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(normed, _mm256_loadu_ps(w + i)));
        }
        for (; i < hidden; ++i) dst[i] = in[i] * inv * w[i];
    }
}

void fused_rotary_f32(const float *x, int64_t tokens, int64_t heads, int64_t head_dim,
                      int64_t ld_token, int64_t ld_head, const float *cos, const float *sin,
                      float *out) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            const float *v = x + t * ld_token + h * ld_head;
            float *o = out + (t * heads + h) * head_dim;
            /* x * cos + cat(-x2, x1) * sin: each product rounded, then their sum */
            int64_t d = 0;
            for (; d + 8 <= half; d += 8) {
                const __m256 x1 = _mm256_loadu_ps(v + d), x2 = _mm256_loadu_ps(v + half + d);
                const __m256 neg_x2 = _mm256_xor_ps(x2, _mm256_set1_ps(-0.0f));
                _mm256_storeu_ps(o + d,
                                 _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + d)),
                                               _mm256_mul_ps(neg_x2, _mm256_loadu_ps(s + d))));
                _mm256_storeu_ps(
                    o + half + d,
                    _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + d)),
                                  _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + d))));
            }
            for (; d < half; ++d) {
                const float a = v[d] * c[d], b = -v[half + d] * s[d];
                const float a2 = v[half + d] * c[half + d], b2 = v[d] * s[half + d];
                o[d] = a + b;
                o[half + d] = a2 + b2;
            }
        }
    }
}

void fused_silu_mul_f32(const float *x, int64_t rows, int64_t ld_x, int64_t width, float *out) {
    for (int64_t row = 0; row < rows; ++row) {
        const float *gate = x + row * ld_x, *up = gate + width;
        float *dst = out + row * width;
        int64_t i = 0;
        for (; i + 8 <= width; i += 8)
            _mm256_storeu_ps(dst + i,
                             silu_times(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
        for (; i < width; ++i) {
            const float g = gate[i], e = expf(-fabsf(g));
            dst[i] = g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e)) * up[i];
        }
    }
}

SARATHI_AVX2_END

#endif
