/* How fast one core can read a paged KV cache in the orders a decode's attention could take,
 * with no attention at all: the floor under the AVX2 decode kernel (BENCHMARKS "Decode attention
 * on AVX2", session 37). Shapes are the demo model's float32 cache, as in
 * tools/bench_cpu_attention.py: 30 layers, 3 KV heads of 64, 16-token blocks in shuffled order,
 * 32 sequences of 512 tokens (755 MB, far past the last level cache).
 *
 *     gcc -O2 -mavx2 -mfma -fopenmp tools/kv_read_floor.c -o /tmp/kv_read_floor
 *     OMP_NUM_THREADS=1 /tmp/kv_read_floor
 *
 * Prints GB/s (the best of 5 passes) for each order:
 *   heads         per (sequence, KV head), its keys then its values, block by block, that
 *                 head's 256 bytes of each 768-byte row, a row after the other;
 *   tiles         the kernel's order: heads, but 8 rows at a time, each vector of the 8 rows
 *                 in turn (dot8 in stage_worker/csrc/paged_attention_avx2.c);
 *   rows          per sequence, keys then values, each block's rows whole, in address order;
 *   rows+3fma     rows, with 3 FMAs on each vector loaded (a query head of the group each), as
 *                 a kernel reading whole rows would do them;
 *   rows+3fma+pf  rows+3fma, asking for the bytes 1 KB ahead (prefetcht0) as it goes (past a
 *                 block's end that is another block's memory: a floor, not a design).
 * Sequences are shared among OpenMP's threads.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { LAYERS = 30, SEQS = 32, BLOCKS_PER_SEQ = 32, BLOCK = 16, KV_HEADS = 3, DIM = 64 };
enum { ROW = KV_HEADS * DIM, BLOCK_FLOATS = BLOCK * ROW };
enum { HEADS, TILES, ROWS, ROWS_FMA, ROWS_FMA_PF, ORDERS };
static const char *NAMES[ORDERS] = {"heads", "tiles", "rows", "rows+3fma", "rows+3fma+pf"};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Reads `count` runs of 8 vectors from p on (stride `stride` floats between runs) into acc,
 * with `fma` FMAs per vector loaded and, if asked, a prefetch of the run 1 KB on. */
static inline void read_runs(const float *p, int count, int stride, int fma, int prefetch,
                             __m256 *acc, __m256 *work) {
    const __m256 q = _mm256_set1_ps(1.0001f);
    for (int r = 0; r < count; ++r, p += stride) {
        if (prefetch)
            for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)p + 1024 + o, _MM_HINT_T0);
        for (int j = 0; j < 8; ++j) {
            const __m256 x = _mm256_load_ps(p + 8 * j);
            acc[j] = _mm256_add_ps(acc[j], x);
            for (int f = 0; f < fma; ++f) work[(j + f) & 7] = _mm256_fmadd_ps(x, q, work[(j + f) & 7]);
        }
    }
}

/* The 8 rows from p on (a row apart), each vector of the 8 in turn. */
static inline void read_tile(const float *p, __m256 *acc) {
    for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_add_ps(acc[i], _mm256_load_ps(p + i * ROW + 8 * j));
}

/* One pass over every layer's caches in the given order; returns a sum so nothing is elided. */
static float pass(float *const *caches, const int64_t *table, int order) {
    const int fma = order >= ROWS_FMA ? 3 : 0, prefetch = order == ROWS_FMA_PF;
    const int tiled = order == TILES, by_head = tiled || order == HEADS;
    float total = 0;
    for (int l = 0; l < LAYERS; ++l)
#pragma omp parallel for schedule(dynamic) reduction(+ : total)
        for (int s = 0; s < SEQS; ++s) {
            __m256 acc[8], work[8];
            for (int j = 0; j < 8; ++j) acc[j] = work[j] = _mm256_setzero_ps();
            for (int h = 0; h < (by_head ? KV_HEADS : 1); ++h)
                for (int kv = 0; kv < 2; ++kv)
                    for (int b = 0; b < BLOCKS_PER_SEQ; ++b) {
                        const float *block =
                            caches[2 * l + kv] + table[s * BLOCKS_PER_SEQ + b] * BLOCK_FLOATS;
                        if (tiled)
                            for (int r = 0; r < BLOCK; r += 8)
                                read_tile(block + r * ROW + h * DIM, acc);
                        else if (by_head) /* 16 runs of one head's 64 floats, a row apart */
                            read_runs(block + h * DIM, BLOCK, ROW, fma, prefetch, acc, work);
                        else /* the block's 48 runs of 64 floats, back to back */
                            read_runs(block, BLOCK * KV_HEADS, DIM, fma, prefetch, acc, work);
                    }
            float out[8]; /* every accumulator counts, so no load is dead code */
            for (int j = 0; j < 8; ++j) {
                _mm256_storeu_ps(out, _mm256_add_ps(acc[j], work[j]));
                for (int i = 0; i < 8; ++i) total += out[i];
            }
        }
    return total;
}

int main(void) {
    const size_t blocks = SEQS * BLOCKS_PER_SEQ, bytes = blocks * BLOCK_FLOATS * sizeof(float);
    float *caches[2 * LAYERS];
    int64_t *table = malloc(blocks * sizeof(int64_t));
    for (size_t i = 0; i < blocks; ++i) table[i] = (int64_t)i;
    srand(1);
    for (size_t i = blocks - 1; i > 0; --i) { /* blocks lie anywhere, as the allocator leaves them */
        const size_t j = (size_t)rand() % (i + 1);
        const int64_t t = table[i];
        table[i] = table[j], table[j] = t;
    }
    for (int c = 0; c < 2 * LAYERS; ++c) {
        caches[c] = aligned_alloc(64, bytes);
        for (size_t i = 0; i < bytes / sizeof(float); ++i) caches[c][i] = 1e-3f * (float)(i % 7);
    }
    float sink = 0;
    for (int order = 0; order < ORDERS; ++order) {
        double best = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
            const double t0 = now_s();
            sink += pass(caches, table, order);
            const double t = now_s() - t0;
            best = t < best ? t : best;
        }
        printf("%-13s %5.1f GB/s  (%.0f ms a pass)\n", NAMES[order],
               2.0 * LAYERS * (double)bytes / best / 1e9, best * 1e3);
    }
    return sink == 12345.0f; /* never: keeps the sums live */
}
