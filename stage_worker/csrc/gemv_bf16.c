/* bf16 matrix-vector products for CPU decode steps: y = x @ w.T for a few rows of x.
 *
 * A decode step reads every weight once for a handful of tokens, so it is bound by memory
 * bandwidth, not arithmetic. oneDNN's bf16 kernels stream about 9-14 GB/s for one token on one
 * AVX512-BF16 core, where the same core reads 26 GB/s. This kernel reads the weight strictly in
 * address order, one row at a time (interleaving several rows, as GEMM kernels do, halved the
 * rate: the hardware prefetcher follows one stream best), and applies each row to every token
 * while it sits in L1. Products are summed in float32 with AVX512-BF16 (vdpbf16ps), in two
 * partial sums per token so consecutive instructions do not wait on each other, and rounded to
 * bf16 (nearest, ties to even) once per output.
 *
 * Compiled into stage_worker._kernels for AVX-512 with bf16 (kernels.h), called only by
 * module.c after it has checked the shapes, dtypes and the CPU.
 */
#include "kernels.h"

#if SARATHI_HAVE_X86_KERNELS
#include <immintrin.h>
#include <string.h>

SARATHI_AVX512_BEGIN

#define TOKENS 3 /* tokens per pass over the weight (more ran slower: see gemv_bf16) */

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest, ties to even (no NaNs here) */
    return (uint16_t)(bits >> 16);
}

static inline __m512bh load32(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

static inline __m512bh load_masked(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void *)p);
}

/* Row w (k values) against nt tokens (a constant after inlining): y[t * ldy]. */
static inline __attribute__((always_inline)) void
row_dot(const uint16_t *x, int64_t ldx, int nt, const uint16_t *w, int64_t k, uint16_t *y,
        int64_t ldy) {
    __m512 even[TOKENS], odd[TOKENS]; /* two partial sums per token */
    for (int t = 0; t < nt; ++t) even[t] = odd[t] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        __m512bh w0 = load32(w + i), w1 = load32(w + i + 32);
        for (int t = 0; t < nt; ++t) {
            even[t] = _mm512_dpbf16_ps(even[t], w0, load32(x + t * ldx + i));
            odd[t] = _mm512_dpbf16_ps(odd[t], w1, load32(x + t * ldx + i + 32));
        }
    }
    for (; i < k; i += 32) { /* the last 1 to 63 values, 32 at a time, masked past k */
        int64_t left = k - i;
        __mmask32 mask = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
        __m512bh wv = load_masked(w + i, mask);
        for (int t = 0; t < nt; ++t)
            even[t] = _mm512_dpbf16_ps(even[t], wv, load_masked(x + t * ldx + i, mask));
    }
    for (int t = 0; t < nt; ++t)
        y[t * ldy] = to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(even[t], odd[t])));
}

/* x: [m, k] bf16, row stride ldx; w: [n, k] bf16, contiguous; y: [m, n] bf16, row stride ldy.
 * Tokens go in passes of up to TOKENS over the whole weight, each pass streaming it in address
 * order (passes after the first find a layer's matrix in the last-level cache). Holding a row
 * in L1 for more tokens instead was slower: the per-output reductions then dominate. */
void gemv_bf16(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *w, int64_t n,
               int64_t k, uint16_t *y, int64_t ldy) {
    for (int64_t t = 0; t < m; t += TOKENS) {
        const uint16_t *xt = x + t * ldx;
        uint16_t *yt = y + t * ldy;
        switch (m - t < TOKENS ? m - t : TOKENS) { /* constant counts: sums stay in registers */
        case 3:
            for (int64_t o = 0; o < n; ++o) row_dot(xt, ldx, 3, w + o * k, k, yt + o, ldy);
            break;
        case 2:
            for (int64_t o = 0; o < n; ++o) row_dot(xt, ldx, 2, w + o * k, k, yt + o, ldy);
            break;
        default:
            for (int64_t o = 0; o < n; ++o) row_dot(xt, ldx, 1, w + o * k, k, yt + o, ldy);
            break;
        }
    }
}

SARATHI_AVX512_END
#endif /* SARATHI_HAVE_X86_KERNELS */
