/* The fused elementwise ops (fused_ops.c) for bf16 rows, written with AVX2 vectors.
 *
 * Each computes in float32 and rounds to bf16 where the torch path rounds (layers/norm.py,
 * layers/rotary.py, models/llama.py): to nearest, ties to even, NaN kept a NaN. Rotary then
 * equals torch bit for bit; RMSNorm sums its squares in another order and SiLU's exp is a
 * polynomial (expf for a row's last width % 8 values), so those stay within a rounding step or
 * two (tests/unit/stage_worker/test_cpu_fused_ops.py). Multiplies and adds are separate
 * instructions where the reference rounds between them.
 *
 * Per thread these run at the speed of the loops over float buffers they replace (a 512-token
 * layer chain of the demo model 1.15 ms against 1.14 on one thread, tools/bench_fused_ops.py):
 * the rounding's integer work costs more than the arithmetic either way. They are written out
 * so that each dtype has one plain pass per op, like fused_ops_f32.c; what made a bf16 prompt
 * step faster is fused_ops.c sharing the rows over the threads (BENCHMARKS "bf16 fused ops on
 * every thread"). Where the CPU has AVX-512 with bf16, fused_ops_bf16_avx512.c runs instead:
 * its one-instruction rounding (vcvtneps2bf16) made the chain 2.3x-2.8x faster there.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if SARATHI_HAVE_X86_KERNELS

SARATHI_AVX2_BEGIN
#include "avx2_math.h"

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest, ties to even (as torch's conversion); NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* 8 bf16 values [p, p + 8) as float32. */
static inline __m256 load8(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* f32_to_bf16 of each lane, in the lane's top 16 bits (the low 16 are zero). */
static inline __m256i rounded_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i even = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    return _mm256_and_si256(_mm256_blendv_epi8(even, quiet, nan),
                            _mm256_set1_epi32((int)0xffff0000u));
}

/* Each lane rounded to bf16 and back: what the reference holds after an op. */
static inline __m256 round8(__m256 v) { return _mm256_castsi256_ps(rounded_bits(v)); }

/* The 8 lanes rounded to bf16, stored at [p, p + 8). */
static inline void store8(uint16_t *p, __m256 v) {
    const __m256i bits = _mm256_srli_epi32(rounded_bits(v), 16); /* each <= 0xffff: no saturation */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                                    _mm256_extracti128_si256(bits, 1)));
}

void fused_rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t ld_x, const uint16_t *w,
                         int64_t hidden, float eps, uint16_t *out) {
    for (int64_t row = 0; row < rows; ++row) {
        const uint16_t *in = x + row * ld_x;
        uint16_t *dst = out + row * hidden;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16) { /* two chains: the adds' latency is not the limit */
            const __m256 a = load8(in + i), b = load8(in + i + 8);
            acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(a, a));
            acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(b, b));
        }
        float sum = hsum8(_mm256_add_ps(acc0, acc1));
        for (; i < hidden; ++i) sum += bf16_to_f32(in[i]) * bf16_to_f32(in[i]);
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= hidden; i += 8) {
            const __m256 normed = round8(_mm256_mul_ps(load8(in + i), vinv)); /* the model dtype */
            store8(dst + i, _mm256_mul_ps(normed, load8(w + i)));
        }
        for (; i < hidden; ++i)
            dst[i] = f32_to_bf16(round_bf16(bf16_to_f32(in[i]) * inv) * bf16_to_f32(w[i]));
    }
}

void fused_rotary_bf16(const uint16_t *x, int64_t tokens, int64_t heads, int64_t head_dim,
                       int64_t ld_token, int64_t ld_head, const uint16_t *cos,
                       const uint16_t *sin, uint16_t *out) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            const uint16_t *v = x + t * ld_token + h * ld_head;
            uint16_t *o = out + (t * heads + h) * head_dim;
            /* x * cos + cat(-x2, x1) * sin: each product rounded, then their sum */
            int64_t d = 0;
            for (; d + 8 <= half; d += 8) {
                const __m256 x1 = load8(v + d), x2 = load8(v + half + d);
                const __m256 neg_x2 = _mm256_xor_ps(x2, _mm256_set1_ps(-0.0f));
                store8(o + d, _mm256_add_ps(round8(_mm256_mul_ps(x1, load8(c + d))),
                                            round8(_mm256_mul_ps(neg_x2, load8(s + d)))));
                store8(o + half + d,
                       _mm256_add_ps(round8(_mm256_mul_ps(x2, load8(c + half + d))),
                                     round8(_mm256_mul_ps(x1, load8(s + half + d)))));
            }
            for (; d < half; ++d) {
                const float x1 = bf16_to_f32(v[d]), x2 = bf16_to_f32(v[half + d]);
                const float a = round_bf16(x1 * bf16_to_f32(c[d]));
                const float b = round_bf16(-x2 * bf16_to_f32(s[d]));
                const float a2 = round_bf16(x2 * bf16_to_f32(c[half + d]));
                const float b2 = round_bf16(x1 * bf16_to_f32(s[half + d]));
                o[d] = f32_to_bf16(a + b);
                o[half + d] = f32_to_bf16(a2 + b2);
            }
        }
    }
}

void fused_silu_mul_bf16(const uint16_t *x, int64_t rows, int64_t ld_x, int64_t width,
                         uint16_t *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t row = 0; row < rows; ++row) {
        const uint16_t *gate = x + row * ld_x, *up = gate + width;
        uint16_t *dst = out + row * width;
        int64_t i = 0;
        for (; i + 8 <= width; i += 8) {
            const __m256 silu = round8(silu_times(load8(gate + i), one)); /* the model dtype */
            store8(dst + i, _mm256_mul_ps(silu, load8(up + i)));
        }
        for (; i < width; ++i) {
            const float g = bf16_to_f32(gate[i]), e = expf(-fabsf(g));
            const float silu = round_bf16(g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e)));
            dst[i] = f32_to_bf16(silu * bf16_to_f32(up[i]));
        }
    }
}

SARATHI_AVX2_END

#endif
