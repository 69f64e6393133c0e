/* The C kernels of stage_worker._kernels (module.c checks every argument, then calls them).
 *
 * Their translation units are compiled for their instructions through target pragmas below
 * (AVX-512 with bf16 for attention and the GEMV, AVX2 with FMA for the fused elementwise ops
 * and the float32 matmul),
 * not through global compiler flags, so that the module's own code (its init, the argument
 * checks) runs on any x86-64 CPU: a CPU without the instructions imports the module, is told
 * so by cpu_supported() and fused_supported(), and keeps the torch path.
 */
#ifndef SARATHI_KERNELS_H
#define SARATHI_KERNELS_H

#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SARATHI_HAVE_X86_KERNELS 1
#else
#define SARATHI_HAVE_X86_KERNELS 0
#endif

/* Everything between these two is compiled for AVX-512 with bf16, whatever the global flags. */
#if defined(__clang__)
#define SARATHI_AVX512_BEGIN                                                                   \
    _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512bf16\"))), \
            apply_to = function)")
#define SARATHI_AVX512_END _Pragma("clang attribute pop")
#else
#define SARATHI_AVX512_BEGIN                                                                   \
    _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512bf16\")")
#define SARATHI_AVX512_END _Pragma("GCC pop_options")
#endif

/* Everything between these two is compiled for AVX2 with FMA (fused_ops_bf16.c, fused_ops_f32.c,
 * sgemm_f32.c, paged_attention_avx2.c). */
#if defined(__clang__)
#define SARATHI_AVX2_BEGIN                                                                     \
    _Pragma("clang attribute push(__attribute__((target(\"avx2,fma\"))), apply_to = function)")
#define SARATHI_AVX2_END _Pragma("clang attribute pop")
#else
#define SARATHI_AVX2_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma\")")
#define SARATHI_AVX2_END _Pragma("GCC pop_options")
#endif

/* Before a loop over an array of vector accumulators: fully unrolled, so that each one stays a
 * register (a rolled loop over such an array makes GCC keep it in memory). */
#if defined(__clang__)
#define UNROLLED _Pragma("unroll")
#define UNROLLED_ALL _Pragma("unroll")
#else
#define UNROLLED _Pragma("GCC unroll 8")
#define UNROLLED_ALL _Pragma("GCC unroll 32") /* arrays of up to 32 vectors */
#endif

/* The widest head the attention kernels take (module.c refuses wider ones). */
#define SARATHI_MAX_HEAD_DIM 256

/* Query vectors the attention kernels take together in a tile of a prompt chunk's tokens
 * (chunk_attention_avx2.c, chunk_attention_avx512.c; a token has `group` of them, its query
 * heads of one KV head): tiles of sarathi_tile_tokens(group) tokens, at least one. */
#define SARATHI_TILE_VECTORS 24

static inline int64_t sarathi_tile_tokens(int64_t group) {
    return group >= SARATHI_TILE_VECTORS ? 1 : SARATHI_TILE_VECTORS / group;
}

/* float32 values of attention scratch a thread needs (scratch_floats below): one tile's scores
 * over the longest context, rounded up to 16 (module.c's attention_scratch_floats gives it to
 * Python). */
static inline int64_t sarathi_attention_scratch_floats(int64_t group, int64_t max_context) {
    return sarathi_tile_tokens(group) * group * ((max_context + 15) / 16 * 16);
}

/* See paged_attention.c. scratch: num_threads blocks of scratch_floats each. */
void paged_attention(const void *q, const void *k_cache, const void *v_cache,
                     const int64_t *block_table, const int64_t *context_lens, int64_t tokens,
                     int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, int64_t max_blocks, float scale, float *scratch,
                     int64_t scratch_floats, void *out, int is_bf16, int num_threads);

/* See chunk_attention_avx512.c: a tile of a prompt chunk's tokens, bf16 caches. */
void attend_tile_bf16(const uint16_t *q, int64_t q_stride, int64_t count, const int64_t *lens,
                      const char *kc, const char *vc, const int64_t *table, int64_t block_size,
                      int64_t row_bytes, int64_t head_bytes, int64_t group, int64_t head_dim,
                      float scale, float *scores, uint16_t *out);

/* See paged_attention_avx2.c: paged_attention for float32 caches, on AVX2 with FMA. */
void paged_attention_avx2(const float *q, const float *k_cache, const float *v_cache,
                          const int64_t *block_table, const int64_t *context_lens, int64_t tokens,
                          int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale, float *scratch,
                          int64_t scratch_floats, float *out, int num_threads);

/* See gemv_bf16.c. */
void gemv_bf16(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *w, int64_t n, int64_t k,
               uint16_t *y, int64_t ldy);

/* See matmul_bf16_avx512.c: weights packed as [ceil(n / 16), ceil(k / 2), 16, 2] bf16. */
void matmul_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *panels);
void matmul_bf16(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *panels, int64_t n,
                 int64_t k, void *y, int64_t ldy, int y_f32, int num_threads);

/* See sgemm_f32.c: weights packed as [ceil(n / PANEL), k, PANEL] floats, zero-padded; or, for a
 * float32 weight whose every value is a bf16 value, as the same panels of bf16 (half the
 * bytes, the same products). */
#define SARATHI_SGEMM_PANEL 16
void sgemm_f32_pack(const float *w, int64_t n, int64_t k, float *packed);
void sgemm_f32_pack_bf16(const float *w, int64_t n, int64_t k, uint16_t *packed);
/* y = x @ w.T, or with `accumulate` y += x @ w.T (y a residual stream, updated in place). */
void sgemm_f32(const float *x, int64_t m, int64_t ldx, const void *packed, int packed_bf16,
               int64_t n, int64_t k, float *y, int64_t ldy, int accumulate, int num_threads);
/* act[m, F] = silu(x @ gate.T) * (x @ up.T), packed holding [gate; up] ([2F, k], F a multiple of
 * the panel). */
void sgemm_f32_silu_mul(const float *x, int64_t m, int64_t ldx, const void *packed,
                        int packed_bf16, int64_t f, int64_t k, float *act, int64_t ld_act,
                        int num_threads);

/* See fused_ops.c. x's rows (and rotary's heads) may be strided; out is compact. Ops large
 * enough share their rows out over num_threads (>= 1) threads. */
void fused_rms_norm(const void *x, int64_t rows, int64_t ld_x, const void *w, int64_t hidden,
                    float eps, void *out, int is_bf16, int num_threads);
void fused_rotary(const void *x, int64_t tokens, int64_t heads, int64_t head_dim,
                  int64_t ld_token, int64_t ld_head, const void *cos, const void *sin,
                  void *out, int is_bf16, int num_threads);
void fused_silu_mul(const void *x, int64_t rows, int64_t ld_x, int64_t width, void *out,
                    int is_bf16, int num_threads);

/* See fused_ops_bf16.c: the same three for bf16 rows, which the functions above hand them. */
void fused_rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t ld_x, const uint16_t *w,
                         int64_t hidden, float eps, uint16_t *out);
void fused_rotary_bf16(const uint16_t *x, int64_t tokens, int64_t heads, int64_t head_dim,
                       int64_t ld_token, int64_t ld_head, const uint16_t *cos,
                       const uint16_t *sin, uint16_t *out);
void fused_silu_mul_bf16(const uint16_t *x, int64_t rows, int64_t ld_x, int64_t width,
                         uint16_t *out);

/* See fused_ops_bf16_avx512.c: the same three on AVX-512 with bf16, which the functions above
 * hand bf16 rows where sarathi_fused_avx512 is set (module.c sets it where the CPU runs them;
 * its fused_avx512() switches it, for tests and benchmarks). */
extern int sarathi_fused_avx512;
void fused_rms_norm_bf16_avx512(const uint16_t *x, int64_t rows, int64_t ld_x,
                                const uint16_t *w, int64_t hidden, float eps, uint16_t *out);
void fused_rotary_bf16_avx512(const uint16_t *x, int64_t tokens, int64_t heads,
                              int64_t head_dim, int64_t ld_token, int64_t ld_head,
                              const uint16_t *cos, const uint16_t *sin, uint16_t *out);
void fused_silu_mul_bf16_avx512(const uint16_t *x, int64_t rows, int64_t ld_x, int64_t width,
                                uint16_t *out);

/* See fused_ops_f32.c: the same three for float32, which the functions above hand them. */
void fused_rms_norm_f32(const float *x, int64_t rows, int64_t ld_x, const float *w,
                        int64_t hidden, float eps, float *out);
void fused_rotary_f32(const float *x, int64_t tokens, int64_t heads, int64_t head_dim,
                      int64_t ld_token, int64_t ld_head, const float *cos, const float *sin,
                      float *out);
void fused_silu_mul_f32(const float *x, int64_t rows, int64_t ld_x, int64_t width, float *out);

#endif
