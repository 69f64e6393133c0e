/* float32 matmuls for CPU steps on AVX2 with FMA: y[m, n] = x[m, k] @ w[n, k].T, with w packed
 * once, at load time, into panels of PANEL outputs.
 *
 * Why not MKL (torch's F.linear for float32): on the AMD EPYC without AVX-512 it reads a decode
 * step's weights at 5-10 GB/s on one thread where the core copies at 22 GB/s, and a step of
 * 2 to 8 tokens costs twice one token's; at 128 tokens it reaches 47 GFLOP/s of this core's
 * ~80 (BENCHMARKS "A float32 matmul kernel for AVX2"). Both ends are the same kernel here:
 *
 * - Layout. A panel holds PANEL consecutive output features as [k][PANEL] floats, so the kernel
 *   reads the whole weight strictly in address order, one stream, which the hardware prefetcher
 *   follows best (as gemv_bf16.c found). The last panel is padded with zero rows.
 * - Tile. ROWS tokens against one panel: ROWS x 2 vector accumulators (12 of the 16 ymm
 *   registers), two weight vectors and one broadcast token value: each weight vector loaded is
 *   used by ROWS multiply-adds, so from 6 tokens up the FMA units, not the loads, set the pace.
 *   For fewer tokens the tile shrinks to them, and the step stays memory-bound: a decode step
 *   of 1 to 6 tokens reads the weight once, at the cost of one.
 * - Order. Panels outermost, each tile of tokens inside: a panel (k x 64 bytes, 36-98 KB for
 *   the demo model) is read from memory once and stays in L2 for every tile after the first.
 *   Threads take disjoint runs of panels (OpenMP, torch's own pool), so they never share an
 *   output.
 * - Prefetch. A step of one tile a panel (1 to 6 tokens) streams each panel, prefetched a little
 *   ahead of its loads. With several tiles a panel, each tile prefetches its share of the next
 *   panel, spread over its steps of k, so the memory streams all the while the tiles compute
 *   and the next panel's first tile finds it in cache. Otherwise a panel's first tile waits on
 *   the memory and the others compute from L2 with the memory idle: the two one after the
 *   other where they can overlap. That matters where a step is about as much compute as
 *   memory: 7 to 18 tokens, decodes of a moderate batch, 3-17% faster on a Zen 1 EPYC
 *   (BENCHMARKS "The matmul's prefetch spread over a panel's tiles").
 *
 * Sums are in float32 with fused multiply-adds, in k order: not MKL's order, so outputs differ
 * from F.linear's by rounding (about 1e-6 relative; tests/unit/stage_worker/test_cpu_matmul.py).
 *
 * Compiled for AVX2 with FMA (kernels.h); module.c calls it only where the CPU has both, after
 * it has checked every shape.
 */
#include "kernels.h"

#if SARATHI_HAVE_X86_KERNELS
#include <immintrin.h>
#include <string.h>

SARATHI_AVX2_BEGIN

#define PANEL SARATHI_SGEMM_PANEL /* outputs per panel: two 8-float vectors */
/* The panel is prefetched this far ahead of the loads (1 KB, 16 lines): one token read the
 * weight at 12 GB/s without, 17 with (256 floats measured best of 256 to 2,048). */
#define PREFETCH_FLOATS 256
#define ROWS 6 /* tokens per tile: 12 accumulators + 2 weights + 1 broadcast = 15 registers */
#define SPREAD_TILES 3 /* the most tiles a panel that spread their prefetch over the next panel */

/* Every loop over a tile's rows is UNROLLED (kernels.h), so that each accumulator is a
 * register: one loop left rolled (the tail's) made GCC keep the array in memory and store all
 * 12 accumulators on every step of k, which halved the speed. */

/* What a tile prefetches: at its step i of k, the panel line ahead + i, or, spread, the line
 * ahead + (i * lines_q16 >> 16): one line every T steps with lines_q16 = (1 << 16) / T. */
typedef struct {
    const float *ahead;
    int64_t lines_q16; /* 0: not spread */
} prefetch_t;

/* Tile: `rows` tokens (a constant after inlining) of x against one panel of k x PANEL weights;
 * y gets the first `cols` (1 to PANEL) outputs of each token. `spread` is a constant too, so
 * the common tile keeps its plain prefetch address. */
static inline __attribute__((always_inline)) void
tile(const float *x, int64_t ldx, int rows, const float *panel, prefetch_t pf, int spread,
     int64_t k, float *y, int64_t ldy, int cols) {
    __m256 lo[ROWS], hi[ROWS];
    UNROLLED
    for (int r = 0; r < rows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
        const int64_t line = spread ? (i * pf.lines_q16) >> 16 : i;
        _mm_prefetch((const char *)(pf.ahead + line * PANEL), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(panel + i * PANEL);
        const __m256 w1 = _mm256_loadu_ps(panel + i * PANEL + 8);
        UNROLLED
        for (int r = 0; r < rows; ++r) {
            const __m256 v = _mm256_broadcast_ss(x + r * ldx + i);
            lo[r] = _mm256_fmadd_ps(v, w0, lo[r]);
            hi[r] = _mm256_fmadd_ps(v, w1, hi[r]);
        }
    }
    if (cols == PANEL) {
        UNROLLED
        for (int r = 0; r < rows; ++r) {
            _mm256_storeu_ps(y + r * ldy, lo[r]);
            _mm256_storeu_ps(y + r * ldy + 8, hi[r]);
        }
        return;
    }
    float out[ROWS][PANEL]; /* the last panel: padded outputs are not stored */
    UNROLLED
    for (int r = 0; r < rows; ++r) {
        _mm256_storeu_ps(out[r], lo[r]);
        _mm256_storeu_ps(out[r] + 8, hi[r]);
    }
    for (int r = 0; r < rows; ++r) memcpy(y + r * ldy, out[r], (size_t)cols * sizeof(float));
}

/* The tile for 1 to ROWS tokens, each count compiled with its own register allocation. */
#define TILE_CASES(spread)                                                                     \
    switch (rows) {                                                                            \
    case 1: tile(x, ldx, 1, panel, pf, spread, k, y, ldy, cols); break;                        \
    case 2: tile(x, ldx, 2, panel, pf, spread, k, y, ldy, cols); break;                        \
    case 3: tile(x, ldx, 3, panel, pf, spread, k, y, ldy, cols); break;                        \
    case 4: tile(x, ldx, 4, panel, pf, spread, k, y, ldy, cols); break;                        \
    case 5: tile(x, ldx, 5, panel, pf, spread, k, y, ldy, cols); break;                        \
    default: tile(x, ldx, ROWS, panel, pf, spread, k, y, ldy, cols); break;                    \
    }
static void tile_of(const float *x, int64_t ldx, int rows, const float *panel, prefetch_t pf,
                    int64_t k, float *y, int64_t ldy, int cols) {
    if (pf.lines_q16) {
        TILE_CASES(1)
    } else {
        TILE_CASES(0)
    }
}
#undef TILE_CASES

/* Tile `index` of `tiles` against a panel: with one tile, the panel's own lines ahead; with two
 * or three, its share of the next panel's lines (the last panel, with none after it, its own).
 * From four tiles up (19 tokens) the compute outweighs the memory: spreading there gained
 * nothing and cost up to 5% at 64 tokens (next-panel lines pulled in early can push out lines
 * the current tiles still read). */
static prefetch_t prefetch_for(const float *panel, const float *next, int64_t k, int64_t index,
                               int64_t tiles) {
    if (tiles == 1 || tiles > SPREAD_TILES || next == NULL)
        return (prefetch_t){panel + PREFETCH_FLOATS, 0};
    return (prefetch_t){next + index * k / tiles * PANEL, (1 << 16) / tiles};
}

void sgemm_f32_pack(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; ++p) {
        float *dst = packed + p * k * PANEL;
        const int64_t first = p * PANEL;
        const int64_t cols = n - first < PANEL ? n - first : PANEL;
        for (int64_t i = 0; i < k; ++i) {
            for (int64_t c = 0; c < cols; ++c) dst[i * PANEL + c] = w[(first + c) * k + i];
            for (int64_t c = cols; c < PANEL; ++c) dst[i * PANEL + c] = 0.0f;
        }
    }
}

void sgemm_f32(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
               int64_t k, float *y, int64_t ldy, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    /* The tokens split into as few tiles as hold them, of sizes within one of each other:
     * 8 tokens as 4 + 4 rather than 6 + 2, whose 2-token tile would pay a full pass over the
     * panel for a third of the work. */
    const int64_t tiles = (m + ROWS - 1) / ROWS;
    const int64_t base = tiles ? m / tiles : 0, extra = tiles ? m % tiles : 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t p = 0; p < panels; ++p) {
        const float *panel = packed + p * k * PANEL;
        const float *next = p + 1 < panels ? panel + k * PANEL : NULL;
        const int64_t first = p * PANEL;
        const int cols = (int)(n - first < PANEL ? n - first : PANEL);
        for (int64_t t = 0, tile_index = 0; t < m; ++tile_index) {
            const int rows = (int)(base + (tile_index < extra));
            tile_of(x + t * ldx, ldx, rows, panel, prefetch_for(panel, next, k, tile_index, tiles),
                    k, y + t * ldy + first, ldy, cols);
            t += rows;
        }
    }
}

SARATHI_AVX2_END

#endif
