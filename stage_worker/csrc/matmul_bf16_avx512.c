/* bf16 matmuls for CPU steps of any size: y = x @ w.T, on AVX-512 with bf16.
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
 * With many tokens the arithmetic, not the stream, is the limit, and the loads are:
 * panel_tokens issues a broadcast for every vdpbf16ps. matmul_grouped takes GROUP panels
 * against ROWS tokens at once instead (group_tokens), about as fast as oneDNN there: 1.04x-1.07x
 * its speed at 128 to 512 tokens on the demo model's layers on the Zen 5 EPYC (0.93x-1.01x on a
 * Mistral-7B layer's), where panel_tokens alone fell to 0.77x (0.35x)
 * (BENCHMARKS "The bf16 kernel at every step size"). So a CPU where it wins at every size may
 * hold each bf16 weight once, as panels (matmul_bf16_dispatch.py).
 *
 * Compiled into stage_worker._kernels for AVX-512 with bf16 (kernels.h), called only by
 * module.c after it has checked the shapes, dtypes and the CPU.
 */
#include "kernels.h"

#if SARATHI_HAVE_X86_KERNELS
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

SARATHI_AVX512_BEGIN

#define PANEL 16
#define AHEAD 128 /* 64-byte steps between a weight line asked for and its use */
#define TOKENS_MAX 24 /* sums in registers: 24 of the 32, the rest for the weights */
#define GROUP 4 /* panels a token block of group_tokens fills at once */
#define ROWS 6 /* tokens of such a block: GROUP * ROWS = 24 sums in registers */
/* matmul_grouped runs where a step has at least GROUPED_MIN_TOKENS tokens and they hold at
 * least GROUPED_MIN_INPUTS inputs (tokens times k); panel_tokens below. Measured on the Zen 5
 * EPYC, one weight of each k against oneDNN (BENCHMARKS "The bf16 kernel at every step size"):
 * panel_tokens leads up to 48 tokens at k = 576 and up to 24 at 1536, but from 16 tokens at k
 * = 4096 and 14336 (a 7B model's) it falls to 0.9x and, from 24, 0.4x-0.5x oneDNN, its token
 * rows too many streams beside the panel's; matmul_grouped holds 0.94x-1.2x there. At 8 tokens
 * panel_tokens leads at every k. */
#define GROUPED_MIN_TOKENS 16
#define K_BLOCK 1024 /* input pairs a pass of matmul_grouped takes: a group's panels, 256 KiB,
                      * stay in L2 for the token blocks after the first */
#define GROUPED_MIN_INPUTS (48 * 1024)
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

/* One pass of group_tokens over the input pairs [from, to). k takes several passes where a
 * group's panels would not stay in L2 between token blocks (K_BLOCK); the float32 sums then
 * wait between passes in `partial` ([ROWS][GROUP][PANEL] a token block), and only the last
 * pass takes an odd k's last input and writes y. */
typedef struct {
    int64_t from, to;
    float *partial; /* NULL where one pass takes all of k */
    int first, last;
} KPass;

/* GROUP panels (GROUP * 16 outputs, `np` of the panels real, the last with `outs_last` real
 * outputs) against nt <= ROWS tokens, np and nt constants after inlining. Each input pair
 * broadcast serves np panels and each weight load nt tokens: 10 loads for 24 vdpbf16ps at 4 x
 * 6, where panel_tokens issues 25, so that many tokens are held by the arithmetic rather than
 * the loads. The group's panels are read from memory by the first token block and from L2 by
 * the others. */
static inline __attribute__((always_inline)) void
group_tokens(const uint16_t *x, int64_t ldx, int nt, int np, int64_t k, const uint16_t *panels,
             int64_t panel_size, KPass pass, void *y, int64_t ldy, int outs_last, int y_f32) {
    __m512 sum[ROWS][GROUP];
    for (int t = 0; t < nt; ++t)
        for (int j = 0; j < np; ++j)
            sum[t][j] = pass.first ? _mm512_setzero_ps()
                                   : _mm512_loadu_ps(pass.partial + (t * GROUP + j) * PANEL);
    for (int64_t p = pass.from; p < pass.to; ++p) {
        __m512bh w[GROUP];
        for (int j = 0; j < np; ++j)
            w[j] = (__m512bh)_mm512_loadu_si512(panels + j * panel_size + p * 2 * PANEL);
        for (int t = 0; t < nt; ++t) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32(input_pair(x + t * ldx, p));
            for (int j = 0; j < np; ++j) sum[t][j] = _mm512_dpbf16_ps(sum[t][j], w[j], pair);
        }
    }
    if (!pass.last) {
        for (int t = 0; t < nt; ++t)
            for (int j = 0; j < np; ++j)
                _mm512_storeu_ps(pass.partial + (t * GROUP + j) * PANEL, sum[t][j]);
        return;
    }
    if (k % 2) {
        const int64_t whole = k / 2;
        for (int j = 0; j < np; ++j) {
            const __m512bh w =
                (__m512bh)_mm512_loadu_si512(panels + j * panel_size + whole * 2 * PANEL);
            for (int t = 0; t < nt; ++t)
                sum[t][j] = _mm512_dpbf16_ps(sum[t][j], w,
                                             (__m512bh)_mm512_set1_epi32(x[t * ldx + k - 1]));
        }
    }
    for (int j = 0; j < np; ++j) {
        const int outs = j == np - 1 ? outs_last : PANEL;
        const __mmask16 mask = outs >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << outs) - 1);
        for (int t = 0; t < nt; ++t) {
            if (y_f32)
                _mm512_mask_storeu_ps((float *)y + t * ldy + j * PANEL, mask, sum[t][j]);
            else
                _mm256_mask_storeu_epi16((uint16_t *)y + t * ldy + j * PANEL, mask,
                                         (__m256i)_mm512_cvtneps_pbh(sum[t][j]));
        }
    }
}

#define CASE(NT, NP)                                                                           \
    case NT:                                                                                   \
        group_tokens(x, ldx, NT, NP, k, panels, panel_size, pass, y, ldy, outs_last, y_f32);   \
        break;
#define GROUP_CASE(NP)                                                                         \
    case NP:                                                                                   \
        switch (nt) { CASE(1, NP) CASE(2, NP) CASE(3, NP) CASE(4, NP) CASE(5, NP) CASE(6, NP) } \
        break;

static void group_any(const uint16_t *x, int64_t ldx, int nt, int np, int64_t k,
                      const uint16_t *panels, int64_t panel_size, KPass pass, void *y,
                      int64_t ldy, int outs_last, int y_f32) {
    switch (np) { GROUP_CASE(1) GROUP_CASE(2) GROUP_CASE(3) GROUP_CASE(4) }
}
#undef GROUP_CASE
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

/* matmul_bf16 for steps of many tokens (GROUPED_MIN_*): each thread takes a contiguous run
 * of panels, GROUP at a time, and every token block of ROWS against the group, in passes of
 * up to K_BLOCK input pairs. */
static void matmul_grouped(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *panels,
                           int64_t n, int64_t k, void *y, int64_t ldy, int y_f32,
                           int num_threads) {
    const int64_t elem = y_f32 ? 4 : 2;
    const int64_t num_panels = (n + PANEL - 1) / PANEL, panel_size = (k + 1) / 2 * 2 * PANEL;
    const int64_t whole = k / 2;
    const int threads = num_threads > 1 ? num_threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int id = 0, team = 1; /* the team the runtime gave, which may be fewer than asked */
#ifdef _OPENMP
        id = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        /* every token's sums for one group between passes; one pass where there is no room */
        float *partial = whole > K_BLOCK
                             ? malloc((size_t)m * GROUP * PANEL * sizeof(float))
                             : NULL;
        const int64_t step = partial != NULL ? K_BLOCK : (whole > 0 ? whole : 1);
        const int64_t first = num_panels * id / team, end = num_panels * (id + 1) / team;
        for (int64_t g = first; g < end; g += GROUP) {
            const int np = end - g < GROUP ? (int)(end - g) : GROUP;
            const int64_t last = g + np - 1;
            const int outs_last = n - last * PANEL < PANEL ? (int)(n - last * PANEL) : PANEL;
            for (int64_t from = 0; from == 0 || from < whole; from += step) {
                const int64_t to = whole - from < step ? whole : from + step;
                for (int64_t t = 0; t < m; t += ROWS) {
                    const int nt = m - t < ROWS ? (int)(m - t) : ROWS;
                    const KPass pass = {from, to, partial ? partial + t * GROUP * PANEL : NULL,
                                        from == 0, to == whole};
                    group_any(x + t * ldx, ldx, nt, np, k, panels + g * panel_size, panel_size,
                              pass, (char *)y + (t * ldy + g * PANEL) * elem, ldy, outs_last,
                              y_f32);
                }
            }
        }
        free(partial);
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
    if (m >= GROUPED_MIN_TOKENS && m * k >= GROUPED_MIN_INPUTS) {
        matmul_grouped(x, m, ldx, panels, n, k, y, ldy, y_f32, num_threads);
        return;
    }
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
