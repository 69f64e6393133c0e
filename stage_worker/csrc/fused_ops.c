/* Fused elementwise kernels for CPU steps: RMSNorm with its scale, rotary on q and k, and
 * SiLU(gate) times up. Each replaces two to five torch ops, whose dispatch costs more than
 * their arithmetic at decode sizes (about 3 ms a decode step of the demo model, BENCHMARKS.md).
 *
 * Each computes in float32 and rounds where the torch path rounds (layers/norm.py,
 * layers/rotary.py, models/llama.py): a bf16 value the reference stores is rounded to bf16
 * here too (to nearest, ties to even), so rotary equals torch bit for bit and the others within
 * two rounding steps (their sums and exp are ordered and approximated differently). No
 * multiply-add contraction (-std=c11 keeps -ffp-contract=off): products round as torch's do.
 *
 * Written as loops of one type each over float buffers, which GCC vectorizes for AVX2 (the
 * target pragma below); module.c runs them only where the CPU has AVX2 and FMA. float32 rows
 * go to fused_ops_f32.c's explicit vectors instead, several times faster than these loops.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if SARATHI_HAVE_X86_KERNELS

SARATHI_AVX2_BEGIN
#if defined(__GNUC__) && !defined(__clang__)
/* Lets GCC turn SiLU's and the clamp's selects into vector blends (nothing here reads the
 * floating-point exception flags); clang does so by default. */
#pragma GCC optimize("no-trapping-math")
#endif

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

/* Up to CHUNK elements at a time go through float buffers: the conversions and the arithmetic
 * are then separate loops of one type each, which GCC vectorizes (a dtype branch inside one
 * loop kept it scalar, about 3x slower than torch's own ops at 64 tokens). */
#define CHUNK 1024

static void to_f32(const void *src, int64_t n, int is_bf16, float *dst) {
    if (is_bf16) {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static void from_f32(const float *src, int64_t n, int is_bf16, void *dst) {
    if (is_bf16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* Each value rounded to the storage dtype and back: what the reference holds after an op. */
static void round_to(float *v, int64_t n, int is_bf16) {
    if (is_bf16)
        for (int64_t i = 0; i < n; ++i) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
}

static inline const void *at(const void *p, int64_t i, int is_bf16) {
    return (const char *)p + i * (is_bf16 ? 2 : 4);
}

static inline void *at_out(void *p, int64_t i, int is_bf16) {
    return (char *)p + i * (is_bf16 ? 2 : 4);
}

/* exp(x) for x <= 0 (SiLU's exp(-|g|)), within 2 float32 ulps: 2^n * e^r with |r| <= ln2 / 2,
 * e^r by its degree-6 Taylor polynomial, n rounded by the 1.5 * 2^23 trick. No calls and no
 * branches, so the loop vectorizes. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 in two parts */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

void fused_rms_norm(const void *x, int64_t rows, int64_t ld_x, const void *w, int64_t hidden,
                    float eps, void *out, int is_bf16) {
    if (!is_bf16) {
        fused_rms_norm_f32(x, rows, ld_x, w, hidden, eps, out);
        return;
    }
    float v[CHUNK], scale[CHUNK];
    for (int64_t row = 0; row < rows; ++row) {
        const void *in = at(x, row * ld_x, is_bf16);
        void *dst = at_out(out, row * hidden, is_bf16);
        float partial[8] = {0};
        for (int64_t c = 0; c < hidden; c += CHUNK) {
            const int64_t n = hidden - c < CHUNK ? hidden - c : CHUNK;
            to_f32(at(in, c, is_bf16), n, is_bf16, v);
            int64_t i = 0;
            for (; i + 8 <= n; i += 8)
                for (int j = 0; j < 8; ++j) partial[j] += v[i + j] * v[i + j];
            for (; i < n; ++i) partial[0] += v[i] * v[i];
        }
        float sum = 0.0f;
        for (int j = 0; j < 8; ++j) sum += partial[j];
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t c = 0; c < hidden; c += CHUNK) {
            const int64_t n = hidden - c < CHUNK ? hidden - c : CHUNK;
            to_f32(at(in, c, is_bf16), n, is_bf16, v);
            to_f32(at(w, c, is_bf16), n, is_bf16, scale);
            for (int64_t i = 0; i < n; ++i) v[i] *= inv;
            round_to(v, n, is_bf16); /* the normed activations, in the model dtype */
            for (int64_t i = 0; i < n; ++i) v[i] *= scale[i];
            from_f32(v, n, is_bf16, at_out(dst, c, is_bf16));
        }
    }
}

void fused_rotary(const void *x, int64_t tokens, int64_t heads, int64_t head_dim,
                  int64_t ld_token, int64_t ld_head, const void *cos, const void *sin,
                  void *out, int is_bf16) {
    if (!is_bf16) {
        fused_rotary_f32(x, tokens, heads, head_dim, ld_token, ld_head, cos, sin, out);
        return;
    }
    const int64_t half = head_dim / 2;
    float c[CHUNK], s[CHUNK], v[CHUNK], a[CHUNK], b[CHUNK];
    if (head_dim > CHUNK) return; /* module.c refuses such heads before calling */
    for (int64_t t = 0; t < tokens; ++t) {
        to_f32(at(cos, t * head_dim, is_bf16), head_dim, is_bf16, c);
        to_f32(at(sin, t * head_dim, is_bf16), head_dim, is_bf16, s);
        for (int64_t h = 0; h < heads; ++h) {
            to_f32(at(x, t * ld_token + h * ld_head, is_bf16), head_dim, is_bf16, v);
            /* the reference: x * cos + cat(-x2, x1) * sin, each product and the sum rounded */
            for (int64_t d = 0; d < half; ++d) {
                a[d] = v[d] * c[d];
                b[d] = -v[half + d] * s[d];
                a[half + d] = v[half + d] * c[half + d];
                b[half + d] = v[d] * s[half + d];
            }
            round_to(a, head_dim, is_bf16);
            round_to(b, head_dim, is_bf16);
            for (int64_t d = 0; d < head_dim; ++d) a[d] += b[d];
            from_f32(a, head_dim, is_bf16, at_out(out, (t * heads + h) * head_dim, is_bf16));
        }
    }
}

void fused_silu_mul(const void *x, int64_t rows, int64_t ld_x, int64_t width, void *out,
                    int is_bf16) {
    if (!is_bf16) {
        fused_silu_mul_f32(x, rows, ld_x, width, out);
        return;
    }
    float g[CHUNK], up[CHUNK];
    for (int64_t row = 0; row < rows; ++row) {
        const void *in = at(x, row * ld_x, is_bf16);
        for (int64_t c = 0; c < width; c += CHUNK) {
            const int64_t n = width - c < CHUNK ? width - c : CHUNK;
            to_f32(at(in, c, is_bf16), n, is_bf16, g);
            to_f32(at(in, width + c, is_bf16), n, is_bf16, up);
            for (int64_t i = 0; i < n; ++i) {
                /* silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) so exp never overflows */
                const float e = exp_nonpositive(-fabsf(g[i]));
                const float sigmoid = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
                g[i] *= sigmoid;
            }
            round_to(g, n, is_bf16); /* silu(gate), in the model dtype */
            for (int64_t i = 0; i < n; ++i) g[i] *= up[i];
            from_f32(g, n, is_bf16, at_out(out, row * width + c, is_bf16));
        }
    }
}

SARATHI_AVX2_END

#endif
