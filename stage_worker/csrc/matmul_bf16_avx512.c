/* bf16 matmuls of a few tokens for CPU decode steps: y = x @ w.T, on AVX-512 with bf16.
 *
 * A decode step of a batch reads every weight once for its few tokens, and should cost about
 * what reading the weights costs. oneDNN's packed bf16 kernel (what the layers ran) reads a
 * lone token's weights at 31 GB/s on 2 Zen 5 cores, where a copy moves 45 or more, and its time
 * grows with the tokens well before the arithmetic is the limit: 8.4 ms for 12 tokens against
 * 6.7 for one on the demo model's layers (BENCHMARKS "A bf16 matmul for decode steps").
 *
 * The weight is packed once, at load, into panels of 16 outputs: [ceil(n / 16), ceil(k / 2),
 * 16, 2] bf16, zero-padded, so that one 64-byte load holds the 16 outputs' weights for two
 * inputs, the pair vdpbf16ps multiplies at once, and a panel is one stream in address order.
 * Each token keeps 16 sums in a register; its two inputs are broadcast from memory. Each
 * 64-byte step asks for the line AHEAD steps (8 KiB) further on: without it the kernel read
 * 26 GB/s at 12 tokens, where the arithmetic alone would take the cores half the time, since
 * the hardware prefetcher does not run far enough ahead of a stream consumed this fast (64
 * steps: 42-48 GB/s, 128: 50-55, 256: no faster). The threads take contiguous runs of
 * panels; tokens go in blocks of up to TOKENS_MAX, each block over the whole panel (a panel is
 * 18 to 48 KiB for the demo model: it stays in L1 or L2 for the next block). Sums are float32,
 * rounded to bf16 once per output (vcvtneps2bf16: nearest, ties to even), as oneDNN rounds;
 * the order of the sums differs, so outputs may differ from oneDNN's in their last bit. An LM
 * head asks for the float32 sums themselves (y_f32).
 *
 * Compiled into stage_worker._kernels for AVX-512 with bf16 (kernels.h), called only by
 * module.c after it has checked the shapes, dtypes and the CPU.
 */
#include "kernels.h"

#if SARATHI_HAVE_X86_KERNELS
#include <immintrin.h>
#include <string.h>

SARATHI_AVX512_BEGIN

#define PANEL 16
#define AHEAD 128 /* 64-byte steps between a weight line asked for and its use */
#define TOKENS_MAX 24 /* sums in registers: 24 of the 32, the rest for the weights */
#define SPLIT_BELOW 8 /* fewer tokens: two sums each (even and odd pairs), so that consecutive
                       * vdpbf16ps do not wait on each other */

/* The inputs 2p and 2p + 1 of token row x, as the 32 bits vdpbf16ps broadcasts. */
static inline int32_t input_pair(const uint16_t *x, int64_t p) {
    int32_t pair;
    memcpy(&pair, x + 2 * p, sizeof pair);
    return pair;
}

/* One panel (16 outputs, `outs` of them real) against nt tokens (a constant after inlining):
 * y[t * ldy + o] for o < outs, bf16 or (y_f32) float32. */
static inline __attribute__((always_inline)) void
panel_tokens(const uint16_t *x, int64_t ldx, int nt, int64_t k, const uint16_t *panel,
             void *y, int64_t ldy, int outs, int y_f32) {
    const int split = nt < SPLIT_BELOW;
    __m512 even[TOKENS_MAX], odd[SPLIT_BELOW];
    for (int t = 0; t < nt; ++t) even[t] = _mm512_setzero_ps();
    for (int t = 0; t < (split ? nt : 0) && t < SPLIT_BELOW; ++t) odd[t] = _mm512_setzero_ps();
    const int64_t whole = k / 2; /* pairs of two inputs; with k odd, the last input alone */
    int64_t p = 0;
    if (split) {
        for (; p + 2 <= whole; p += 2) {
            _mm_prefetch((const char *)(panel + (p + AHEAD) * 2 * PANEL), _MM_HINT_T0);
            _mm_prefetch((const char *)(panel + (p + AHEAD + 1) * 2 * PANEL), _MM_HINT_T0);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * PANEL);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + (p + 1) * 2 * PANEL);
            _Pragma("GCC unroll 24") for (int t = 0; t < nt; ++t) {
                const uint16_t *xt = x + t * ldx;
                even[t] = _mm512_dpbf16_ps(even[t], w0,
                                           (__m512bh)_mm512_set1_epi32(input_pair(xt, p)));
                odd[t] = _mm512_dpbf16_ps(odd[t], w1,
                                          (__m512bh)_mm512_set1_epi32(input_pair(xt, p + 1)));
            }
        }
    }
    for (; p < whole; ++p) {
        _mm_prefetch((const char *)(panel + (p + AHEAD) * 2 * PANEL), _MM_HINT_T0);
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + p * 2 * PANEL);
        _Pragma("GCC unroll 24") for (int t = 0; t < nt; ++t)
            even[t] = _mm512_dpbf16_ps(even[t], w,
                                       (__m512bh)_mm512_set1_epi32(input_pair(x + t * ldx, p)));
    }
    if (k % 2) { /* the last input, paired with a zero (its partner's weights are zero too) */
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + whole * 2 * PANEL);
        for (int t = 0; t < nt; ++t)
            even[t] = _mm512_dpbf16_ps(even[t], w,
                                       (__m512bh)_mm512_set1_epi32(x[t * ldx + k - 1]));
    }
    const __mmask16 mask = outs >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << outs) - 1);
    for (int t = 0; t < nt; ++t) {
        const __m512 sum = split && t < SPLIT_BELOW ? _mm512_add_ps(even[t], odd[t]) : even[t];
        if (y_f32)
            _mm512_mask_storeu_ps((float *)y + t * ldy, mask, sum);
        else
            _mm256_mask_storeu_epi16((uint16_t *)y + t * ldy, mask,
                                     (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

/* panel_tokens for each token count. */
#define CASE(NT)                                                                               \
    case NT:                                                                                   \
        panel_tokens(x, ldx, NT, k, panel, y, ldy, outs, y_f32);                               \
        break;

static void panel_any(const uint16_t *x, int64_t ldx, int nt, int64_t k, const uint16_t *panel,
                      void *y, int64_t ldy, int outs, int y_f32) {
    switch (nt) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
        CASE(17) CASE(18) CASE(19) CASE(20) CASE(21) CASE(22) CASE(23) CASE(24)
    }
}
#undef CASE

/* w: [n, k] bf16, contiguous -> panels: [ceil(n / 16), ceil(k / 2), 16, 2], zero-padded. */
void matmul_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *panels) {
    const int64_t pairs = (k + 1) / 2, num_panels = (n + PANEL - 1) / PANEL;
    memset(panels, 0, (size_t)(num_panels * pairs * 2 * PANEL) * sizeof(uint16_t));
    for (int64_t o = 0; o < n; ++o) {
        uint16_t *panel = panels + (o / PANEL) * pairs * 2 * PANEL + (o % PANEL) * 2;
        for (int64_t i = 0; i < k; ++i) panel[(i / 2) * 2 * PANEL + (i % 2)] = w[o * k + i];
    }
}

/* x: [m, k] bf16, row stride ldx; panels: w ([n, k]) as matmul_bf16_pack lays it out; y: [m,
 * n], row stride ldy: bf16, or with y_f32 the float32 sums unrounded (an LM head's logits,
 * where rounding to bf16 would make near-ties exact ties). The threads take contiguous runs
 * of panels. */
void matmul_bf16(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *panels, int64_t n,
                 int64_t k, void *y, int64_t ldy, int y_f32, int num_threads) {
    const int64_t elem = y_f32 ? 4 : 2;
    const int64_t num_panels = (n + PANEL - 1) / PANEL, panel_size = (k + 1) / 2 * 2 * PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i < num_panels; ++i) {
        const int outs = n - i * PANEL < PANEL ? (int)(n - i * PANEL) : PANEL;
        for (int64_t t = 0; t < m; t += TOKENS_MAX) {
            const int nt = m - t < TOKENS_MAX ? (int)(m - t) : TOKENS_MAX;
            panel_any(x + t * ldx, ldx, nt, k, panels + i * panel_size,
                      (char *)y + (t * ldy + i * PANEL) * elem, ldy, outs, y_f32);
        }
    }
}

SARATHI_AVX512_END
#endif /* SARATHI_HAVE_X86_KERNELS */
