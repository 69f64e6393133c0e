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
 *   output; one that finishes its run first takes the last panels of the others' (sgemm_f32).
 * - Prefetch. A step of one tile a panel (1 to 6 tokens) streams each panel, prefetched a little
 *   ahead of its loads. With several tiles a panel, each tile prefetches its share of the next
 *   panel, spread over its steps of k, so the memory streams all the while the tiles compute
 *   and the next panel's first tile finds it in cache. Otherwise a panel's first tile waits on
 *   the memory and the others compute from L2 with the memory idle: the two one after the
 *   other where they can overlap. That matters where a step is about as much compute as
 *   memory: 7 to 18 tokens, decodes of a moderate batch, 3-17% faster on a Zen 1 EPYC
 *   (BENCHMARKS "The matmul's prefetch spread over a panel's tiles").
 *
 * - bf16 panels. A float32 weight whose values are all bf16 values (a bf16 checkpoint served
 *   in float32, as on CPUs without bf16 arithmetic) is packed as bf16 (sgemm_f32_pack_bf16):
 *   each value is the top half of its float32, so widening it in a register is two unpacks and
 *   the sums are the float32 panels' to the bit. A step of 1 to 6 tokens, which streams the
 *   weight, reads half the bytes: the matmuls 1.3x-1.8x faster, a served step of one decode of
 *   the demo model 21 ms where it took 36 on the Zen 1 EPYC (BENCHMARKS "bf16 panels for bf16
 *   checkpoints served in float32"). From 7 tokens up the FMAs set the pace; there a panel's
 *   first tile widens it once into this thread's scratch for the others (panel_t), and the
 *   cost is 0-6%.
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
static inline int omp_thread(void) { return omp_get_thread_num(); }
#else
static inline int omp_thread(void) { return 0; }
#endif

SARATHI_AVX2_BEGIN
#include "avx2_math.h"

#define PANEL SARATHI_SGEMM_PANEL /* outputs per panel: two 8-float vectors */
/* The panel is prefetched this far ahead of the loads (1 KB, 16 lines): one token read the
 * weight at 12 GB/s without, 17 with (256 floats measured best of 256 to 2,048). */
#define PREFETCH_BYTES 1024
#define ROWS 6 /* tokens per tile: 12 accumulators + 2 weights + 1 broadcast = 15 registers */
#define SPREAD_TILES 3 /* the most tiles a panel that spread their prefetch over the next panel */

/* Every loop over a tile's rows is UNROLLED (kernels.h), so that each accumulator is a
 * register: one loop left rolled (the tail's) made GCC keep the array in memory and store all
 * 12 accumulators on every step of k, which halved the speed. */

/* What a tile prefetches: at its step i of k, the panel row ahead + i, or, spread, the row
 * ahead + (i * lines_q16 >> 16): one row every T steps with lines_q16 = (1 << 16) / T. Rows
 * are `stride` bytes apart (the panel prefetched may be bf16 where the tile reads float32). */
typedef struct {
    const char *ahead;
    int64_t stride;
    int64_t lines_q16; /* 0: not spread */
} prefetch_t;

/* Bytes of one step of k in a panel: PANEL weights, float32 or bf16. */
static inline int64_t row_bytes(int bf16) { return bf16 ? PANEL * 2 : PANEL * 4; }

/* Step i's PANEL weights as two float32 vectors (outputs 0-7 and 8-15). A bf16 panel holds its
 * row as outputs 0-3, 8-11, 4-7, 12-15 (sgemm_f32_pack_bf16), so that the two unpacks, which
 * work within 128-bit lanes, put the 16-bit values in the high halves of the right floats: a
 * bf16 value is the top half of the float32 it stands for. */
static inline __attribute__((always_inline)) void
panel_row(const char *panel, int64_t i, int bf16, __m256 *w0, __m256 *w1) {
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(panel + i * PANEL * 2));
        *w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), h));
        *w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), h));
        return;
    }
    *w0 = _mm256_loadu_ps((const float *)panel + i * PANEL);
    *w1 = _mm256_loadu_ps((const float *)panel + i * PANEL + 8);
}

/* Tile: `rows` tokens (a constant after inlining) of x against one panel of k x PANEL weights
 * (float32, or bf16 with `bf16`); y gets the first `cols` (1 to PANEL) outputs of each token, or
 * with `add` has them added (a residual stream: y + out, the sum torch's y.add_(out) makes).
 * With `widen`, a bf16 tile also stores the float32 weights it made to `widened` ([k][PANEL]),
 * for the panel's other tiles. `spread`, `bf16` and `widen` are constants too, so the common
 * tile keeps its plain prefetch address and plain loads. */
static inline __attribute__((always_inline)) void
tile(const float *x, int64_t ldx, int rows, const char *panel, int bf16, float *widened,
     int widen, prefetch_t pf, int spread, int64_t k, float *y, int64_t ldy, int cols, int add) {
    __m256 lo[ROWS], hi[ROWS];
    UNROLLED
    for (int r = 0; r < rows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
        const int64_t line = spread ? (i * pf.lines_q16) >> 16 : i;
        _mm_prefetch(pf.ahead + line * pf.stride, _MM_HINT_T0);
        __m256 w0, w1;
        panel_row(panel, i, bf16, &w0, &w1);
        if (widen) {
            _mm256_storeu_ps(widened + i * PANEL, w0);
            _mm256_storeu_ps(widened + i * PANEL + 8, w1);
        }
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
            if (add) {
                lo[r] = _mm256_add_ps(_mm256_loadu_ps(y + r * ldy), lo[r]);
                hi[r] = _mm256_add_ps(_mm256_loadu_ps(y + r * ldy + 8), hi[r]);
            }
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
    for (int r = 0; r < rows; ++r) {
        if (!add) {
            memcpy(y + r * ldy, out[r], (size_t)cols * sizeof(float));
            continue;
        }
        for (int c = 0; c < cols; ++c) y[r * ldy + c] += out[r][c];
    }
}

/* The tile for 1 to ROWS tokens, each count compiled with its own register allocation. */
#define TILE_CASES(bf16, widen, spread)                                                            \
    switch (rows) {                                                                                \
    case 1: tile(x, ldx, 1, panel, bf16, widened, widen, pf, spread, k, y, ldy, cols, add); break; \
    case 2: tile(x, ldx, 2, panel, bf16, widened, widen, pf, spread, k, y, ldy, cols, add); break; \
    case 3: tile(x, ldx, 3, panel, bf16, widened, widen, pf, spread, k, y, ldy, cols, add); break; \
    case 4: tile(x, ldx, 4, panel, bf16, widened, widen, pf, spread, k, y, ldy, cols, add); break; \
    case 5: tile(x, ldx, 5, panel, bf16, widened, widen, pf, spread, k, y, ldy, cols, add); break; \
    default:                                                                                       \
        tile(x, ldx, ROWS, panel, bf16, widened, widen, pf, spread, k, y, ldy, cols, add);         \
        break;                                                                                     \
    }
#define SPREAD_CASES(bf16, widen)                                                                  \
    if (pf.lines_q16) {                                                                            \
        TILE_CASES(bf16, widen, 1)                                                                 \
    } else {                                                                                       \
        TILE_CASES(bf16, widen, 0)                                                                 \
    }
/* widened: NULL, or where a bf16 tile stores its float32 weights (see tile). */
static void tile_of(const float *x, int64_t ldx, int rows, const char *panel, int bf16,
                    float *widened, prefetch_t pf, int64_t k, float *y, int64_t ldy, int cols,
                    int add) {
    if (!bf16) {
        SPREAD_CASES(0, 0)
    } else if (widened == NULL) {
        SPREAD_CASES(1, 0)
    } else {
        SPREAD_CASES(1, 1)
    }
}
#undef SPREAD_CASES
#undef TILE_CASES

/* Tile `index` of `tiles` against a panel: with one tile, the panel's own lines ahead; with two
 * or three, its share of the next panel's lines (the last panel, with none after it, its own).
 * From four tiles up (19 tokens) the compute outweighs the memory: spreading there gained
 * nothing and cost up to 5% at 64 tokens (next-panel lines pulled in early can push out lines
 * the current tiles still read). */
static prefetch_t prefetch_for(const char *panel, const char *next, int64_t k, int64_t index,
                               int64_t tiles, int bf16) {
    const int64_t stride = row_bytes(bf16);
    if (tiles == 1 || tiles > SPREAD_TILES || next == NULL)
        return (prefetch_t){panel + PREFETCH_BYTES, stride, 0};
    return (prefetch_t){next + index * k / tiles * stride, stride, (1 << 16) / tiles};
}

/* Where output c of a panel sits in a bf16 panel's row (see panel_row): the middle two groups
 * of four swapped. */
static inline int64_t bf16_position(int64_t c) {
    const int64_t group = c / 4;
    return (group == 1 ? 2 : group == 2 ? 1 : group) * 4 + c % 4;
}

/* w [n, k] -> panels of float32, or with `bf16` of each value's top 16 bits (exact for a value
 * that is a bf16 value), at bf16_position; the last panel's missing outputs are zeros. */
static void pack_panels(const float *w, int64_t n, int64_t k, void *packed, int bf16) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t first = p * PANEL;
        const int64_t cols = n - first < PANEL ? n - first : PANEL;
        for (int64_t i = 0; i < k; ++i) {
            const int64_t row = (p * k + i) * PANEL;
            for (int64_t c = 0; c < PANEL; ++c) {
                const float value = c < cols ? w[(first + c) * k + i] : 0.0f;
                if (!bf16) {
                    ((float *)packed)[row + c] = value;
                    continue;
                }
                uint32_t bits;
                memcpy(&bits, &value, sizeof bits);
                ((uint16_t *)packed)[row + bf16_position(c)] = (uint16_t)(bits >> 16);
            }
        }
    }
}

void sgemm_f32_pack(const float *w, int64_t n, int64_t k, float *packed) {
    pack_panels(w, n, k, packed, 0);
}

void sgemm_f32_pack_bf16(const float *w, int64_t n, int64_t k, uint16_t *packed) {
    pack_panels(w, n, k, packed, 1);
}

/* A matmul's operands, for the work on one panel (or pair of panels) at a time. */
typedef struct {
    const float *x;
    int64_t m, ldx;
    const char *packed;
    int bf16; /* packed holds bf16 weights (sgemm_f32_pack_bf16), not float32 */
    int64_t n, k; /* n: outputs of the packed weight (2F for the SiLU pair) */
    float *y;
    int64_t ldy;
    int add; /* y += the product (sgemm_f32's accumulate) */
} operands_t;

/* The tokens split into as few tiles as hold them, of sizes within one of each other: 8 tokens
 * as 4 + 4 rather than 6 + 2, whose 2-token tile would pay a full pass over the panel for a
 * third of the work. Tile `index` has tile_rows(...) rows. */
static inline int tile_rows(int64_t m, int64_t tiles, int64_t index) {
    return (int)(m / tiles + (index < m % tiles));
}

/* A panel as its tiles read it. A bf16 panel of more tiles than one is widened to float32 by
 * its first tile, into `widened` (this thread's scratch), and its other tiles read that from
 * L1 or L2 as a float32 panel: the widening paid once a panel rather than once a tile, which at
 * 64 tokens cost 2% of the matmul on the Zen 1 EPYC (now nothing), its unpacks competing with
 * the FMAs. One tile (up to 6 tokens) reads the bf16 panel itself. */
typedef struct {
    const char *packed;
    int bf16;
    float *widened; /* NULL: every tile reads `packed` */
} panel_t;

/* This thread's scratch of at least `floats` floats, kept for its later calls (torch's pool
 * threads live as long as the process), or NULL if it cannot be had. */
static float *thread_scratch(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t held = 0;
    if (floats > held) {
        free(buffer);
        const size_t bytes = ((size_t)floats * sizeof(float) + 63) / 64 * 64;
        buffer = aligned_alloc(64, bytes);
        held = buffer == NULL ? 0 : floats;
    }
    return buffer;
}

/* Where this thread widens `count` bf16 panels of the matmul (count x k x PANEL floats), or
 * NULL where none is to be widened: float32 panels, or one tile a panel. */
static float *widening_scratch(const operands_t *o, int64_t tiles, int count) {
    return o->bf16 && tiles > 1 ? thread_scratch(count * o->k * PANEL) : NULL;
}

/* Tile `index` of `tiles` of the panel; next: the panel the thread will take after it, or NULL
 * (see prefetch_for). */
static void panel_tile(const operands_t *o, const panel_t *panel, const char *next, int64_t index,
                       int64_t tiles, const float *x, int rows, float *y, int64_t ldy, int cols,
                       int add) {
    const prefetch_t pf = prefetch_for(panel->packed, next, o->k, index, tiles, panel->bf16);
    if (panel->widened == NULL)
        tile_of(x, o->ldx, rows, panel->packed, panel->bf16, NULL, pf, o->k, y, ldy, cols, add);
    else if (index == 0)
        tile_of(x, o->ldx, rows, panel->packed, 1, panel->widened, pf, o->k, y, ldy, cols, add);
    else
        tile_of(x, o->ldx, rows, (const char *)panel->widened, 0, NULL, pf, o->k, y, ldy, cols,
                add);
}

/* Panel `p` for every tile of the m tokens; `next` is the panel this thread will most likely
 * take after it (-1: none known), whose lines the tiles of a step of 7 to 18 tokens prefetch. */
static void panel_work(const operands_t *o, int64_t p, int64_t next) {
    const int64_t tiles = (o->m + ROWS - 1) / ROWS, first = p * PANEL;
    const int64_t panel_bytes = o->k * row_bytes(o->bf16);
    const panel_t panel = {o->packed + p * panel_bytes, o->bf16, widening_scratch(o, tiles, 1)};
    const char *after = next < 0 ? NULL : o->packed + next * panel_bytes;
    const int cols = (int)(o->n - first < PANEL ? o->n - first : PANEL);
    for (int64_t t = 0, index = 0; t < o->m; ++index) {
        const int rows = tile_rows(o->m, tiles, index);
        panel_tile(o, &panel, after, index, tiles, o->x + t * o->ldx, rows,
                   o->y + t * o->ldy + first, o->ldy, cols, o->add);
        t += rows;
    }
}

/* Gate panel p and up panel p + F / PANEL for every tile, then y's 16 columns from p * PANEL on
 * = silu(gate) * up (o->n = 2F). Each tile's two products wait in L1 for the SiLU. */
static void silu_pair_work(const operands_t *o, int64_t p, int64_t next) {
    const int64_t half = o->n / 2 / PANEL, tiles = (o->m + ROWS - 1) / ROWS;
    const int64_t panel_bytes = o->k * row_bytes(o->bf16);
    float *scratch = widening_scratch(o, tiles, 2);
    const panel_t gate = {o->packed + p * panel_bytes, o->bf16, scratch};
    const panel_t up = {o->packed + (p + half) * panel_bytes, o->bf16,
                        scratch == NULL ? NULL : scratch + o->k * PANEL};
    const char *gate_after = next < 0 ? NULL : o->packed + next * panel_bytes;
    const char *up_after = next < 0 ? NULL : gate_after + half * panel_bytes;
    float g[ROWS][PANEL], u[ROWS][PANEL];
    for (int64_t t = 0, index = 0; t < o->m; ++index) {
        const int rows = tile_rows(o->m, tiles, index);
        const float *x = o->x + t * o->ldx;
        panel_tile(o, &gate, gate_after, index, tiles, x, rows, g[0], PANEL, PANEL, 0);
        panel_tile(o, &up, up_after, index, tiles, x, rows, u[0], PANEL, PANEL, 0);
        for (int r = 0; r < rows; ++r) {
            float *dst = o->y + (t + r) * o->ldy + p * PANEL;
            for (int c = 0; c < PANEL; c += 8)
                _mm256_storeu_ps(dst + c, silu_times(_mm256_loadu_ps(g[r] + c),
                                                     _mm256_loadu_ps(u[r] + c)));
        }
        t += rows;
    }
}

/* One thread's share of the work, taken from both ends: its owner from the front, any thread
 * that has run out of its own from the back. `taken` counts the front's claims in its low 32
 * bits and the back's in its high 32; a claim is good while the two sum to under `count`. A
 * cache line each, so that claims on two shares never contend. */
typedef struct {
    int64_t first, count;
    uint64_t taken;
    char pad[64 - 2 * sizeof(int64_t) - sizeof(uint64_t)];
} share_t;

#define FRONT 1ull
#define BACK (1ull << 32)

/* The index within the share that a claim from `end` (FRONT or BACK) got, or -1: none left. */
static int64_t claim(share_t *share, uint64_t end) {
    const uint64_t before = __atomic_fetch_add(&share->taken, end, __ATOMIC_RELAXED);
    const int64_t front = (int64_t)(before & 0xffffffffu), back = (int64_t)(before >> 32);
    if (front + back >= share->count) return -1;
    return end == FRONT ? front : share->count - 1 - back;
}

/* work(o, unit, next) for every unit < units on num_threads threads (OpenMP, torch's pool).
 *
 * Why not OpenMP's static schedule (fixed halves): on a CPU of two cores, anything else that
 * runs during a step (the controller, the client, the worker's own I/O thread) preempts one of
 * the two, and with fixed halves the other then waits at the end of every matmul. Here each
 * thread still reads its own run of panels front to back, in address order, with the next one
 * known for the prefetch; only the last few go to whichever thread is free (BENCHMARKS "The
 * gate_up matmul's SiLU on every thread, and matmul panels taken from both ends"). */
static void for_each_unit(int64_t units, int num_threads, const operands_t *o,
                          void (*work)(const operands_t *, int64_t, int64_t)) {
    const int threads = num_threads < 1 ? 1 : num_threads;
    share_t shares[threads];
    for (int t = 0; t < threads; ++t) {
        shares[t].first = units * t / threads;
        shares[t].count = units * (t + 1) / threads - shares[t].first;
        shares[t].taken = 0;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* A team smaller than asked for leaves some shares ownerless: the others take their
         * units from the back. */
        share_t *own = &shares[omp_thread()];
        for (int64_t i = claim(own, FRONT); i >= 0; i = claim(own, FRONT)) {
            const uint64_t taken = __atomic_load_n(&own->taken, __ATOMIC_RELAXED);
            const int known = i + 1 + (int64_t)(taken >> 32) < own->count;
            work(o, own->first + i, known ? own->first + i + 1 : -1);
        }
        for (int step = 1; step < threads; ++step) {
            share_t *other = &shares[(omp_thread() + step) % threads];
            for (int64_t i = claim(other, BACK); i >= 0; i = claim(other, BACK))
                work(o, other->first + i, -1);
        }
    }
}

void sgemm_f32(const float *x, int64_t m, int64_t ldx, const void *packed, int packed_bf16,
               int64_t n, int64_t k, float *y, int64_t ldy, int accumulate, int num_threads) {
    if (m == 0) return;
    const operands_t o = {x, m, ldx, packed, packed_bf16, n, k, y, ldy, accumulate};
    for_each_unit((n + PANEL - 1) / PANEL, num_threads, &o, panel_work);
}

/* Why fused: the SiLU pass over the gate_up product ran on one thread, from memory, after the
 * matmul: 154 of a layer's 327 us of elementwise work at 64 tokens on the Zen 1 EPYC, its
 * exponentials and divisions on 128-bit units. Here it runs on every thread, on products still
 * in L1, and the [m, 2F] product is never written: a prompt chunk's step 6% shorter there
 * (BENCHMARKS "The gate_up matmul's SiLU on every thread"). The outputs are those of sgemm_f32
 * then fused_silu_mul_f32 to the bit (same sums, same silu_times). */
void sgemm_f32_silu_mul(const float *x, int64_t m, int64_t ldx, const void *packed,
                        int packed_bf16, int64_t f, int64_t k, float *act, int64_t ld_act,
                        int num_threads) {
    if (m == 0) return;
    const operands_t o = {x, m, ldx, packed, packed_bf16, 2 * f, k, act, ld_act, 0};
    for_each_unit(f / PANEL, num_threads, &o, silu_pair_work);
}

SARATHI_AVX2_END

#endif
