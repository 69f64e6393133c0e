/* Fused elementwise kernels for CPU steps: RMSNorm with its scale, rotary on q and k, and
 * SiLU(gate) times up. Each replaces two to five torch ops, whose dispatch costs more than
 * their arithmetic at decode sizes (about 3 ms a decode step of the demo model, BENCHMARKS.md).
 *
 * This file picks the dtype's vectors (fused_ops_bf16.c, or fused_ops_bf16_avx512.c where the
 * CPU runs AVX-512 with bf16; fused_ops_f32.c) and shares the rows
 * out over the threads where an op has enough elements (PARALLEL_FROM_ELEMENTS): a prompt
 * chunk's have, and on one thread they took about 35 ms of a 512-token step of the demo model in
 * bf16 while the other core waited (BENCHMARKS "bf16 fused ops on every thread"); those of a few
 * decodes have not, and stay on the calling thread. Every row is computed alone, so the result
 * does not depend on the thread count.
 */
#include <stdint.h>

#include "kernels.h"

int sarathi_fused_avx512 = 0; /* outside the #if: module.c reads it on every architecture */

#if SARATHI_HAVE_X86_KERNELS

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

/* Ops over fewer elements than this run on the calling thread: a parallel region's start and
 * join (a few microseconds) would cost more than the half of the work it moves. */
#define PARALLEL_FROM_ELEMENTS 32768

static int threads_for(int64_t rows, int64_t elements, int num_threads) {
    if (elements < PARALLEL_FROM_ELEMENTS || num_threads < 2) return 1;
    return rows < num_threads ? (int)rows : num_threads;
}

/* This thread's rows [*first, *end) of `rows`: contiguous, shares differing by one at most. */
static void my_rows(int64_t rows, int64_t *first, int64_t *end) {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    *first = rows * t / n;
    *end = rows * (t + 1) / n;
}

/* Which file's vectors an op runs on: chosen once per op, before its threads start, so that a
 * switch of sarathi_fused_avx512 (tests, benchmarks) falls between ops, never within one. */
typedef enum { F32, BF16_AVX2, BF16_AVX512 } vectors_t;

static vectors_t vectors_for(int is_bf16) {
    return !is_bf16 ? F32 : sarathi_fused_avx512 ? BF16_AVX512 : BF16_AVX2;
}

static inline const void *at(const void *p, int64_t elements, vectors_t v) {
    return (const char *)p + elements * (v == F32 ? 4 : 2);
}

static inline void *at_out(void *p, int64_t elements, vectors_t v) {
    return (char *)p + elements * (v == F32 ? 4 : 2);
}

/* Each op: its rows [first, end) (one thread's share), then the op over every row, on the
 * calling thread where threads_for says 1 (no parallel region to enter: a decode step's ops
 * are microseconds) or over the threads. */

static void rms_norm_rows(const void *x, int64_t ld_x, const void *w, int64_t hidden, float eps,
                          void *out, vectors_t v, int64_t first, int64_t end) {
    const void *in = at(x, first * ld_x, v);
    void *dst = at_out(out, first * hidden, v);
    if (v == BF16_AVX512)
        fused_rms_norm_bf16_avx512(in, end - first, ld_x, w, hidden, eps, dst);
    else if (v == BF16_AVX2)
        fused_rms_norm_bf16(in, end - first, ld_x, w, hidden, eps, dst);
    else
        fused_rms_norm_f32(in, end - first, ld_x, w, hidden, eps, dst);
}

void fused_rms_norm(const void *x, int64_t rows, int64_t ld_x, const void *w, int64_t hidden,
                    float eps, void *out, int is_bf16, int num_threads) {
    const int threads = threads_for(rows, rows * hidden, num_threads);
    const vectors_t v = vectors_for(is_bf16);
    if (threads == 1) {
        rms_norm_rows(x, ld_x, w, hidden, eps, out, v, 0, rows);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t first, end;
        my_rows(rows, &first, &end);
        rms_norm_rows(x, ld_x, w, hidden, eps, out, v, first, end);
    }
}

static void rotary_rows(const void *x, int64_t heads, int64_t head_dim, int64_t ld_token,
                        int64_t ld_head, const void *cos, const void *sin, void *out, vectors_t v,
                        int64_t first, int64_t end) {
    const void *in = at(x, first * ld_token, v);
    const void *c = at(cos, first * head_dim, v), *s = at(sin, first * head_dim, v);
    void *dst = at_out(out, first * heads * head_dim, v);
    if (v == BF16_AVX512)
        fused_rotary_bf16_avx512(in, end - first, heads, head_dim, ld_token, ld_head, c, s, dst);
    else if (v == BF16_AVX2)
        fused_rotary_bf16(in, end - first, heads, head_dim, ld_token, ld_head, c, s, dst);
    else
        fused_rotary_f32(in, end - first, heads, head_dim, ld_token, ld_head, c, s, dst);
}

void fused_rotary(const void *x, int64_t tokens, int64_t heads, int64_t head_dim,
                  int64_t ld_token, int64_t ld_head, const void *cos, const void *sin,
                  void *out, int is_bf16, int num_threads) {
    const int threads = threads_for(tokens, tokens * heads * head_dim, num_threads);
    const vectors_t v = vectors_for(is_bf16);
    if (threads == 1) {
        rotary_rows(x, heads, head_dim, ld_token, ld_head, cos, sin, out, v, 0, tokens);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t first, end;
        my_rows(tokens, &first, &end);
        rotary_rows(x, heads, head_dim, ld_token, ld_head, cos, sin, out, v, first, end);
    }
}

static void silu_mul_rows(const void *x, int64_t ld_x, int64_t width, void *out, vectors_t v,
                          int64_t first, int64_t end) {
    const void *in = at(x, first * ld_x, v);
    void *dst = at_out(out, first * width, v);
    if (v == BF16_AVX512)
        fused_silu_mul_bf16_avx512(in, end - first, ld_x, width, dst);
    else if (v == BF16_AVX2)
        fused_silu_mul_bf16(in, end - first, ld_x, width, dst);
    else
        fused_silu_mul_f32(in, end - first, ld_x, width, dst);
}

void fused_silu_mul(const void *x, int64_t rows, int64_t ld_x, int64_t width, void *out,
                    int is_bf16, int num_threads) {
    const int threads = threads_for(rows, rows * width, num_threads);
    const vectors_t v = vectors_for(is_bf16);
    if (threads == 1) {
        silu_mul_rows(x, ld_x, width, out, v, 0, rows);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t first, end;
        my_rows(rows, &first, &end);
        silu_mul_rows(x, ld_x, width, out, v, first, end);
    }
}

#endif
