/* stage_worker._kernels: the worker's C kernels as a Python extension module, built with the
 * package (setup.py), never on a serving node.
 *
 * Every argument crosses as a DLPack capsule (torch.utils.dlpack.to_dlpack: a few hundred
 * nanoseconds, no copy), so this file sees each tensor's dtype, shape, strides and device and
 * refuses, with a ValueError naming the argument, anything the kernels would read out of
 * bounds: a wrong dtype or shape, a strided tensor, a block-table entry past the cache, a
 * context longer than its table, too little scratch. Only then does it release the GIL and
 * call the kernel. This file is compiled for plain x86-64 (the kernels alone are compiled for
 * AVX-512, kernels.h), so it imports on any CPU and says through cpu_supported() whether the
 * kernels can run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "kernels.h"

/* The DLPack ABI (dmlc/dlpack, v0.x "dltensor" capsules), as far as this module reads it. */
typedef struct {
    int32_t device_type; /* 1: CPU */
    int32_t device_id;
} dl_device;
typedef struct {
    uint8_t code; /* 0 int, 1 uint, 2 float, 4 bfloat */
    uint8_t bits;
    uint16_t lanes;
} dl_dtype;
typedef struct {
    void *data;
    dl_device device;
    int32_t ndim;
    dl_dtype dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL: compact row-major */
    uint64_t byte_offset;
} dl_tensor;
typedef struct dl_managed {
    dl_tensor tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *);
} dl_managed;

enum { DL_INT = 0, DL_FLOAT = 2, DL_BFLOAT = 4, DL_CPU = 1 };

/* A checked view of one argument: its data and shape (at most 4 dimensions). */
typedef struct {
    char *data;
    int ndim;
    int64_t shape[4];
    int is_bf16; /* for the float arguments: bf16 (1) or float32 (0) */
} view_t;

static int fail(const char *name, const char *what) {
    PyErr_Format(PyExc_ValueError, "%s: %s", name, what);
    return -1;
}

/* The tensor in capsule `obj` if it is a CPU tensor of `ndim` dimensions and dtype int64
 * (want_float = 0) or bf16/float32 (want_float = 1, v->is_bf16 set); else NULL with a
 * ValueError naming `name`. */
static const dl_tensor *tensor_of(PyObject *obj, const char *name, int ndim, int want_float,
                                  view_t *v) {
    dl_managed *managed = PyCapsule_GetPointer(obj, "dltensor");
    if (managed == NULL) {
        PyErr_Clear();
        fail(name, "expected an unused DLPack capsule (torch.utils.dlpack.to_dlpack)");
        return NULL;
    }
    const dl_tensor *t = &managed->tensor;
    if (t->device.device_type != DL_CPU) return fail(name, "not a CPU tensor"), NULL;
    if (t->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: %d dimensions, expected %d", name, t->ndim, ndim);
        return NULL;
    }
    const dl_dtype d = t->dtype;
    if (d.lanes != 1) return fail(name, "vector dtypes are not taken"), NULL;
    if (want_float) {
        if (d.code == DL_BFLOAT && d.bits == 16)
            v->is_bf16 = 1;
        else if (d.code == DL_FLOAT && d.bits == 32)
            v->is_bf16 = 0;
        else
            return fail(name, "dtype must be bfloat16 or float32"), NULL;
    } else if (d.code != DL_INT || d.bits != 64) {
        return fail(name, "dtype must be int64"), NULL;
    }
    for (int i = 0; i < ndim; ++i) {
        if (t->shape[i] < 0) return fail(name, "negative size"), NULL;
        v->shape[i] = t->shape[i];
    }
    v->ndim = ndim;
    v->data = (char *)t->data + t->byte_offset;
    return t;
}

/* Reads capsule `obj` into `v`: a CPU tensor of `ndim` dimensions, compact row-major, of
 * dtype int64 (want_float = 0) or bf16/float32 (want_float = 1). 0 on success; -1 with a
 * ValueError naming `name`. */
static int view(PyObject *obj, const char *name, int ndim, int want_float, view_t *v) {
    const dl_tensor *t = tensor_of(obj, name, ndim, want_float, v);
    if (t == NULL) return -1;
    int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
        if (t->strides != NULL && t->shape[i] > 1 && t->strides[i] != expected)
            return fail(name, "must be contiguous");
        expected *= t->shape[i];
    }
    return 0;
}

/* Like view() for a bf16/float32 tensor whose last dimension alone must be contiguous; each
 * other dimension's stride (in elements, at least the span of the dimensions after it, so that
 * rows never overlap) goes to strides[i]. */
static int strided_view(PyObject *obj, const char *name, int ndim, view_t *v, int64_t *strides) {
    const dl_tensor *t = tensor_of(obj, name, ndim, 1, v);
    if (t == NULL) return -1;
    int64_t span = 1;
    for (int i = ndim - 1; i >= 0; --i) {
        const int64_t stride = t->strides != NULL ? t->strides[i] : span;
        if (i == ndim - 1 && t->shape[i] > 1 && stride != 1)
            return fail(name, "its last dimension must be contiguous");
        if (t->shape[i] > 1 && stride < span) return fail(name, "rows must not overlap");
        strides[i] = i == ndim - 1 ? 1 : stride;
        span = (t->shape[i] > 1 ? stride : span) * t->shape[i];
    }
    return 0;
}

/* b (named `name`) has the dtype of a (named `ref`). */
static int same_dtype(const view_t *a, const view_t *b, const char *name, const char *ref) {
    if (a->is_bf16 == b->is_bf16) return 0;
    PyErr_Format(PyExc_ValueError, "%s: dtype differs from %s's", name, ref);
    return -1;
}

static int kernels_run_here(void) {
#if SARATHI_HAVE_X86_KERNELS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

static int fused_run_here(void) {
#if SARATHI_HAVE_X86_KERNELS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static int refuse_on_this_cpu(void) {
    if (kernels_run_here()) return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "this CPU lacks AVX-512 with bf16 (or the module was built for another "
                    "architecture): the kernels cannot run here");
    return -1;
}

/* Every token's table covers its context and names blocks inside the cache. */
static int check_tables(const view_t *table, const view_t *lens, int64_t num_blocks,
                        int64_t block_size, int64_t *max_len) {
    const int64_t tokens = table->shape[0], max_blocks = table->shape[1];
    const int64_t *entries = (const int64_t *)table->data, *context = (const int64_t *)lens->data;
    *max_len = 0;
    for (int64_t b = 0; b < tokens; ++b) {
        const int64_t len = context[b];
        if (len < 1 || len > max_blocks * block_size)
            return fail("context_lens", "each must be >= 1 and covered by its table row");
        const int64_t used = (len + block_size - 1) / block_size;
        for (int64_t i = 0; i < used; ++i) {
            const int64_t block = entries[b * max_blocks + i];
            if (block < 0 || block >= num_blocks)
                return fail("block_table", "names a block outside the cache");
        }
        if (len > *max_len) *max_len = len;
    }
    return 0;
}

static PyObject *py_paged_attention(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *q_obj, *k_obj, *v_obj, *table_obj, *lens_obj, *scratch_obj, *out_obj;
    float scale;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOfi:paged_attention", &q_obj, &k_obj, &v_obj, &table_obj,
                          &lens_obj, &scratch_obj, &out_obj, &scale, &num_threads))
        return NULL;
    view_t q, k, v, table, lens, scratch, out;
    if (view(q_obj, "q", 3, 1, &q) || view(k_obj, "k_cache", 4, 1, &k) ||
        view(v_obj, "v_cache", 4, 1, &v) || view(table_obj, "block_table", 2, 0, &table) ||
        view(lens_obj, "context_lens", 1, 0, &lens) ||
        view(scratch_obj, "scratch", 1, 1, &scratch) || view(out_obj, "out", 3, 1, &out))
        return NULL;
    if (same_dtype(&q, &k, "k_cache", "q") || same_dtype(&q, &v, "v_cache", "q") ||
        same_dtype(&q, &out, "out", "q"))
        return NULL;
    const int64_t tokens = q.shape[0], hq = q.shape[1], head_dim = q.shape[2];
    const int64_t num_blocks = k.shape[0], block_size = k.shape[1], hkv = k.shape[2];
    for (int i = 0; i < 4; ++i)
        if (v.shape[i] != k.shape[i]) return fail("v_cache", "shape differs from k_cache's"), NULL;
    for (int i = 0; i < 3; ++i)
        if (out.shape[i] != q.shape[i]) return fail("out", "shape differs from q's"), NULL;
    if (k.shape[3] != head_dim) return fail("k_cache", "head_dim differs from q's"), NULL;
    if (hkv < 1 || block_size < 1 || hq % hkv != 0 || hq / hkv > 64)
        return fail("q", "query heads must be 1 to 64 times the KV heads"), NULL;
    if (head_dim % 16 != 0 || head_dim < 16 || head_dim > SARATHI_MAX_HEAD_DIM)
        return fail("q", "head_dim must be a multiple of 16 from 16 to 256"), NULL;
    if (scratch.is_bf16) return fail("scratch", "dtype must be float32"), NULL;
    if (table.shape[0] != tokens || lens.shape[0] != tokens)
        return fail("block_table", "needs one row (and context length) per query token"), NULL;
    if (num_threads < 1) return fail("num_threads", "must be >= 1"), NULL;
    int64_t max_len;
    if (check_tables(&table, &lens, num_blocks, block_size, &max_len)) return NULL;
    const int64_t per_thread = sarathi_attention_scratch_floats(hq / hkv, max_len);
    if (scratch.shape[0] < per_thread * num_threads)
        return fail("scratch", "too small for the context and thread count"), NULL;
    /* AVX-512 with bf16 runs both dtypes; AVX2 with FMA alone, float32 caches */
    const int avx512 = kernels_run_here(), avx2 = !q.is_bf16 && fused_run_here();
    if (!avx512 && !avx2) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this CPU runs the attention kernel on neither AVX-512 with bf16 nor "
                        "(for float32 caches) AVX2 with FMA");
        return NULL;
    }
#if SARATHI_HAVE_X86_KERNELS
    Py_BEGIN_ALLOW_THREADS;
    if (avx512)
        paged_attention(q.data, k.data, v.data, (const int64_t *)table.data,
                        (const int64_t *)lens.data, tokens, hq, hkv, head_dim, block_size,
                        table.shape[1], scale, (float *)scratch.data, per_thread, out.data,
                        q.is_bf16, num_threads);
    else
        paged_attention_avx2((const float *)q.data, (const float *)k.data,
                             (const float *)v.data, (const int64_t *)table.data,
                             (const int64_t *)lens.data, tokens, hq, hkv, head_dim, block_size,
                             table.shape[1], scale, (float *)scratch.data, per_thread,
                             (float *)out.data, num_threads);
    Py_END_ALLOW_THREADS;
#endif
    Py_RETURN_NONE;
}

static PyObject *py_gemv_bf16(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x_obj, *w_obj, *y_obj;
    if (!PyArg_ParseTuple(args, "OOO:gemv_bf16", &x_obj, &w_obj, &y_obj)) return NULL;
    view_t x, w, y;
    if (view(x_obj, "x", 2, 1, &x) || view(w_obj, "weight", 2, 1, &w) ||
        view(y_obj, "out", 2, 1, &y))
        return NULL;
    if (!x.is_bf16 || !w.is_bf16 || !y.is_bf16)
        return fail("x", "x, weight and out must all be bfloat16"), NULL;
    const int64_t m = x.shape[0], k = x.shape[1], n = w.shape[0];
    if (w.shape[1] != k) return fail("weight", "its inputs differ from x's features"), NULL;
    if (y.shape[0] != m || y.shape[1] != n) return fail("out", "must be [x rows, weight rows]"), NULL;
    if (refuse_on_this_cpu()) return NULL;
#if SARATHI_HAVE_X86_KERNELS
    Py_BEGIN_ALLOW_THREADS;
    gemv_bf16((const uint16_t *)x.data, m, k, (const uint16_t *)w.data, n, k,
              (uint16_t *)y.data, n);
    Py_END_ALLOW_THREADS;
#endif
    Py_RETURN_NONE;
}

/* panels of matmul_bf16_pack for a weight [n, k]: [ceil(n / 16), ceil(k / 2), 16, 2] bf16. */
static int check_bf16_panels(const view_t *panels, int64_t n, int64_t k) {
    if (!panels->is_bf16) return fail("panels", "dtype must be bfloat16");
    if (panels->shape[2] != 16 || panels->shape[3] != 2)
        return fail("panels", "its last dimensions must be [16, 2]");
    if (panels->shape[1] != (k + 1) / 2)
        return fail("panels", "must hold ceil(inputs / 2) pairs, the weight's or x's inputs");
    if (panels->shape[0] != (n + 15) / 16) return fail("panels", "must hold ceil(outputs / 16)");
    return 0;
}

static PyObject *py_matmul_bf16_pack(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *w_obj, *panels_obj;
    if (!PyArg_ParseTuple(args, "OO:matmul_bf16_pack", &w_obj, &panels_obj)) return NULL;
    view_t w, panels;
    if (view(w_obj, "weight", 2, 1, &w) || view(panels_obj, "panels", 4, 1, &panels)) return NULL;
    if (!w.is_bf16) return fail("weight", "dtype must be bfloat16"), NULL;
    if (check_bf16_panels(&panels, w.shape[0], w.shape[1]) || refuse_on_this_cpu()) return NULL;
#if SARATHI_HAVE_X86_KERNELS
    Py_BEGIN_ALLOW_THREADS;
    matmul_bf16_pack((const uint16_t *)w.data, w.shape[0], w.shape[1], (uint16_t *)panels.data);
    Py_END_ALLOW_THREADS;
#endif
    Py_RETURN_NONE;
}

static PyObject *py_matmul_bf16(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x_obj, *panels_obj, *y_obj;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOi:matmul_bf16", &x_obj, &panels_obj, &y_obj, &num_threads))
        return NULL;
    view_t x, panels, y;
    int64_t x_strides[2];
    if (strided_view(x_obj, "x", 2, &x, x_strides) || view(panels_obj, "panels", 4, 1, &panels) ||
        view(y_obj, "out", 2, 1, &y))
        return NULL;
    if (!x.is_bf16) return fail("x", "dtype must be bfloat16"), NULL;
    if (y.shape[0] != x.shape[0]) return fail("out", "must have x's rows"), NULL;
    if (num_threads < 1) return fail("num_threads", "must be >= 1"), NULL;
    const int64_t m = x.shape[0], k = x.shape[1], n = y.shape[1];
    if (check_bf16_panels(&panels, n, k) || refuse_on_this_cpu()) return NULL;
#if SARATHI_HAVE_X86_KERNELS
    Py_BEGIN_ALLOW_THREADS;
    matmul_bf16((const uint16_t *)x.data, m, x_strides[0], (const uint16_t *)panels.data, n, k,
                y.data, n, !y.is_bf16, num_threads);
    Py_END_ALLOW_THREADS;
#endif
    Py_RETURN_NONE;
}

static int refuse_fused_on_this_cpu(void) {
    if (fused_run_here()) return 0;
    PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX2 with FMA: the fused ops cannot run");
    return -1;
}

/* Steps this large (elements) release the GIL; smaller ones return before that would pay. */
#define RELEASE_GIL_FROM 65536

static PyObject *py_fused_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x_obj, *w_obj, *out_obj;
    float eps;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOfi:fused_rms_norm", &x_obj, &w_obj, &out_obj, &eps,
                          &num_threads))
        return NULL;
    if (num_threads < 1) return fail("num_threads", "must be >= 1"), NULL;
    view_t x, w, out;
    int64_t x_strides[2];
    if (strided_view(x_obj, "x", 2, &x, x_strides) || view(w_obj, "weight", 1, 1, &w) ||
        view(out_obj, "out", 2, 1, &out))
        return NULL;
    if (same_dtype(&x, &w, "weight", "x") || same_dtype(&x, &out, "out", "x")) return NULL;
    const int64_t rows = x.shape[0], hidden = x.shape[1];
    if (w.shape[0] != hidden) return fail("weight", "must be [hidden]"), NULL;
    if (out.shape[0] != rows || out.shape[1] != hidden) return fail("out", "must be x's shape"), NULL;
    if (refuse_fused_on_this_cpu()) return NULL;
#if SARATHI_HAVE_X86_KERNELS
    if (rows * hidden >= RELEASE_GIL_FROM) {
        Py_BEGIN_ALLOW_THREADS;
        fused_rms_norm(x.data, rows, x_strides[0], w.data, hidden, eps, out.data, x.is_bf16,
                       num_threads);
        Py_END_ALLOW_THREADS;
    } else {
        fused_rms_norm(x.data, rows, x_strides[0], w.data, hidden, eps, out.data, x.is_bf16,
                       num_threads);
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *py_fused_rotary(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x_obj, *cos_obj, *sin_obj, *out_obj;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOOi:fused_rotary", &x_obj, &cos_obj, &sin_obj, &out_obj,
                          &num_threads))
        return NULL;
    if (num_threads < 1) return fail("num_threads", "must be >= 1"), NULL;
    view_t x, cos, sin, out;
    int64_t x_strides[3];
    if (strided_view(x_obj, "x", 3, &x, x_strides) || view(cos_obj, "cos", 2, 1, &cos) ||
        view(sin_obj, "sin", 2, 1, &sin) || view(out_obj, "out", 3, 1, &out))
        return NULL;
    if (same_dtype(&x, &cos, "cos", "x") || same_dtype(&x, &sin, "sin", "x") ||
        same_dtype(&x, &out, "out", "x"))
        return NULL;
    const int64_t tokens = x.shape[0], heads = x.shape[1], head_dim = x.shape[2];
    if (head_dim % 2 || head_dim > 1024) return fail("x", "head_dim must be even, at most 1024"), NULL;
    if (cos.shape[0] != tokens || cos.shape[1] != head_dim || sin.shape[0] != tokens ||
        sin.shape[1] != head_dim)
        return fail("cos", "cos and sin must be [tokens, head_dim]"), NULL;
    for (int i = 0; i < 3; ++i)
        if (out.shape[i] != x.shape[i]) return fail("out", "must be x's shape"), NULL;
    if (refuse_fused_on_this_cpu()) return NULL;
#if SARATHI_HAVE_X86_KERNELS
    if (tokens * heads * head_dim >= RELEASE_GIL_FROM) {
        Py_BEGIN_ALLOW_THREADS;
        fused_rotary(x.data, tokens, heads, head_dim, x_strides[0], x_strides[1], cos.data,
                     sin.data, out.data, x.is_bf16, num_threads);
        Py_END_ALLOW_THREADS;
    } else {
        fused_rotary(x.data, tokens, heads, head_dim, x_strides[0], x_strides[1], cos.data,
                     sin.data, out.data, x.is_bf16, num_threads);
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *py_fused_silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x_obj, *out_obj;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOi:fused_silu_mul", &x_obj, &out_obj, &num_threads))
        return NULL;
    if (num_threads < 1) return fail("num_threads", "must be >= 1"), NULL;
    view_t x, out;
    int64_t x_strides[2];
    if (strided_view(x_obj, "gate_up", 2, &x, x_strides) || view(out_obj, "out", 2, 1, &out))
        return NULL;
    if (same_dtype(&x, &out, "out", "x")) return NULL;
    const int64_t rows = x.shape[0], width = x.shape[1] / 2;
    if (x.shape[1] % 2) return fail("gate_up", "its width must be even"), NULL;
    if (out.shape[0] != rows || out.shape[1] != width)
        return fail("out", "must be [rows, width / 2]"), NULL;
    if (refuse_fused_on_this_cpu()) return NULL;
#if SARATHI_HAVE_X86_KERNELS
    if (rows * width >= RELEASE_GIL_FROM) {
        Py_BEGIN_ALLOW_THREADS;
        fused_silu_mul(x.data, rows, x_strides[0], width, out.data, x.is_bf16, num_threads);
        Py_END_ALLOW_THREADS;
    } else {
        fused_silu_mul(x.data, rows, x_strides[0], width, out.data, x.is_bf16, num_threads);
    }
#endif
    Py_RETURN_NONE;
}

/* The weight's [n, k] float32 rows and its packed panels [ceil(n / 16), k, 16] (float32, or bf16
 * from sgemm_f32_pack_bf16) agree. */
static int check_packed(const view_t *packed, int64_t n, int64_t k) {
    if (packed->shape[2] != SARATHI_SGEMM_PANEL)
        return fail("packed", "its last dimension must be the panel width (16)");
    if (packed->shape[1] != k) return fail("packed", "its inputs differ from the weight's or x's");
    if (packed->shape[0] != (n + SARATHI_SGEMM_PANEL - 1) / SARATHI_SGEMM_PANEL)
        return fail("packed", "must hold ceil(outputs / 16) panels");
    return 0;
}

static PyObject *py_sgemm_f32_pack(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *w_obj, *packed_obj;
    if (!PyArg_ParseTuple(args, "OO:sgemm_f32_pack", &w_obj, &packed_obj)) return NULL;
    view_t w, packed;
    if (view(w_obj, "weight", 2, 1, &w) || view(packed_obj, "packed", 3, 1, &packed)) return NULL;
    if (w.is_bf16) return fail("weight", "dtype must be float32"), NULL;
    if (check_packed(&packed, w.shape[0], w.shape[1])) return NULL;
    if (refuse_fused_on_this_cpu()) return NULL; /* compiled for AVX2 too */
#if SARATHI_HAVE_X86_KERNELS
    Py_BEGIN_ALLOW_THREADS;
    if (packed.is_bf16)
        sgemm_f32_pack_bf16((const float *)w.data, w.shape[0], w.shape[1],
                            (uint16_t *)packed.data);
    else
        sgemm_f32_pack((const float *)w.data, w.shape[0], w.shape[1], (float *)packed.data);
    Py_END_ALLOW_THREADS;
#endif
    Py_RETURN_NONE;
}

/* The operands of a float32 matmul call, checked: x [m, k] (rows may be strided), out [m, n],
 * both float32, num_threads >= 1. Returns -1 with the exception set. */
static int matmul_operands(PyObject *x_obj, PyObject *packed_obj, PyObject *y_obj,
                           int num_threads, view_t *x, int64_t *x_strides, view_t *packed,
                           view_t *y) {
    if (strided_view(x_obj, "x", 2, x, x_strides) || view(packed_obj, "packed", 3, 1, packed) ||
        view(y_obj, "out", 2, 1, y))
        return -1;
    if (x->is_bf16 || y->is_bf16) return fail("x", "x and out must be float32"), -1;
    if (y->shape[0] != x->shape[0]) return fail("out", "must have x's rows"), -1;
    if (num_threads < 1) return fail("num_threads", "must be >= 1"), -1;
    return 0;
}

static PyObject *py_sgemm_f32(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x_obj, *packed_obj, *y_obj;
    int num_threads, accumulate = 0;
    if (!PyArg_ParseTuple(args, "OOOi|p:sgemm_f32", &x_obj, &packed_obj, &y_obj, &num_threads,
                          &accumulate))
        return NULL;
    view_t x, packed, y;
    int64_t x_strides[2];
    if (matmul_operands(x_obj, packed_obj, y_obj, num_threads, &x, x_strides, &packed, &y))
        return NULL;
    const int64_t m = x.shape[0], k = x.shape[1], n = y.shape[1];
    if (check_packed(&packed, n, k) || refuse_fused_on_this_cpu()) return NULL;
#if SARATHI_HAVE_X86_KERNELS
    Py_BEGIN_ALLOW_THREADS;
    sgemm_f32((const float *)x.data, m, x_strides[0], packed.data, packed.is_bf16, n, k,
              (float *)y.data, n, accumulate, num_threads);
    Py_END_ALLOW_THREADS;
#endif
    Py_RETURN_NONE;
}

static PyObject *py_sgemm_f32_silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x_obj, *packed_obj, *act_obj;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOi:sgemm_f32_silu_mul", &x_obj, &packed_obj, &act_obj,
                          &num_threads))
        return NULL;
    view_t x, packed, act;
    int64_t x_strides[2];
    if (matmul_operands(x_obj, packed_obj, act_obj, num_threads, &x, x_strides, &packed, &act))
        return NULL;
    const int64_t m = x.shape[0], k = x.shape[1], f = act.shape[1];
    if (f % SARATHI_SGEMM_PANEL != 0)
        return fail("out", "columns (F) must be a multiple of the panel, 16"), NULL;
    if (check_packed(&packed, 2 * f, k) || refuse_fused_on_this_cpu()) return NULL;
#if SARATHI_HAVE_X86_KERNELS
    Py_BEGIN_ALLOW_THREADS;
    sgemm_f32_silu_mul((const float *)x.data, m, x_strides[0], packed.data, packed.is_bf16, f,
                       k, (float *)act.data, f, num_threads);
    Py_END_ALLOW_THREADS;
#endif
    Py_RETURN_NONE;
}

static PyObject *py_fused_supported(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyBool_FromLong(fused_run_here());
}

static PyObject *py_cpu_supported(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyBool_FromLong(kernels_run_here());
}

static PyObject *py_fused_avx512(PyObject *self, PyObject *args) {
    (void)self;
    int on = -1;
    if (!PyArg_ParseTuple(args, "|p:fused_avx512", &on)) return NULL;
    const int was = sarathi_fused_avx512;
    if (on == 1 && !kernels_run_here()) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX-512 with bf16");
        return NULL;
    }
    if (on != -1) sarathi_fused_avx512 = on;
    return PyBool_FromLong(was);
}

static PyObject *py_attention_scratch_floats(PyObject *self, PyObject *args) {
    (void)self;
    long long hq, hkv, max_context;
    if (!PyArg_ParseTuple(args, "LLL:attention_scratch_floats", &hq, &hkv, &max_context))
        return NULL;
    if (hkv < 1 || hq < hkv || hq % hkv != 0)
        return fail("num_q_heads", "must be a multiple of num_kv_heads >= 1"), NULL;
    if (max_context < 0) return fail("max_context", "must be >= 0"), NULL;
    return PyLong_FromLongLong(sarathi_attention_scratch_floats(hq / hkv, max_context));
}

static PyObject *py_openmp(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"paged_attention", py_paged_attention, METH_VARARGS,
     "paged_attention(q, k_cache, v_cache, block_table, context_lens, scratch, out, scale, "
     "num_threads): DLPack capsules of q [T, Hq, D], caches [blocks, block_size, Hkv, D] "
     "(bf16 or float32, all alike), block_table [T, max_blocks] int64, context_lens [T] int64, "
     "scratch float32, out [T, Hq, D]; out is written."},
    {"gemv_bf16", py_gemv_bf16, METH_VARARGS,
     "gemv_bf16(x, weight, out): DLPack capsules of x [m, k], weight [n, k] and out [m, n], "
     "all bf16 and contiguous; out = x @ weight.T."},
    {"fused_rms_norm", py_fused_rms_norm, METH_VARARGS,
     "fused_rms_norm(x, weight, out, eps, num_threads): x [rows, hidden] (rows may be "
     "strided), weight [hidden], out [rows, hidden], all bf16 or all float32; out = weight * "
     "rms_norm(x). Large ones share their rows over num_threads threads (as do the two below)."},
    {"fused_rotary", py_fused_rotary, METH_VARARGS,
     "fused_rotary(x, cos, sin, out, num_threads): x [T, heads, D] (token and head strides "
     "free), cos and "
     "sin [T, D], out [T, heads, D]; out = x rotated, rotate-half form."},
    {"fused_silu_mul", py_fused_silu_mul, METH_VARARGS,
     "fused_silu_mul(gate_up, out, num_threads): gate_up [rows, 2F] (rows may be strided), "
     "out [rows, F]; "
     "out = silu(gate) * up."},
    {"matmul_bf16_pack", py_matmul_bf16_pack, METH_VARARGS,
     "matmul_bf16_pack(weight, panels): DLPack capsules of weight [n, k] and panels [ceil(n / "
     "16), ceil(k / 2), 16, 2], both bfloat16; fills panels (AVX-512 with bf16 only)."},
    {"matmul_bf16", py_matmul_bf16, METH_VARARGS,
     "matmul_bf16(x, panels, out, num_threads): x [m, k] (rows may be strided) and panels from "
     "matmul_bf16_pack, bfloat16; out [m, n], bfloat16 or float32 (the sums unrounded); "
     "out = x @ weight.T (AVX-512 with bf16 only)."},
    {"sgemm_f32_pack", py_sgemm_f32_pack, METH_VARARGS,
     "sgemm_f32_pack(weight, packed): DLPack capsules of weight [n, k] (float32) and packed "
     "[ceil(n / 16), k, 16], contiguous; packed is written (zero-padded). A bf16 packed takes "
     "each weight's top 16 bits: exact only for a weight whose values are all bf16 values."},
    {"sgemm_f32", py_sgemm_f32, METH_VARARGS,
     "sgemm_f32(x, packed, out, num_threads, accumulate=False): x [m, k] (rows may be "
     "strided), packed from sgemm_f32_pack (float32 or bf16), out [m, n], x and out float32; "
     "out = x @ weight.T, or with accumulate out += x @ weight.T (out must not overlap x)."},
    {"sgemm_f32_silu_mul", py_sgemm_f32_silu_mul, METH_VARARGS,
     "sgemm_f32_silu_mul(x, packed, out, num_threads): packed from sgemm_f32_pack of a [2F, k] "
     "gate_up weight (F a multiple of 16), out [m, F]: out = silu(x @ gate.T) * (x @ up.T), "
     "equal to sgemm_f32 then fused_silu_mul."},
    {"fused_supported", py_fused_supported, METH_NOARGS,
     "Whether this CPU runs the fused ops and the float32 matmul (AVX2 and FMA on x86-64)."},
    {"cpu_supported", py_cpu_supported, METH_NOARGS,
     "Whether this CPU runs the kernels (AVX-512 F, BW, VL and BF16 on x86-64)."},
    {"fused_avx512", py_fused_avx512, METH_VARARGS,
     "fused_avx512([on]): whether the bf16 fused ops run on AVX-512 (on where the CPU has it "
     "with bf16, else on AVX2), as it was before the call; `on` switches it (tests, "
     "benchmarks)."},
    {"attention_scratch_floats", py_attention_scratch_floats, METH_VARARGS,
     "attention_scratch_floats(num_q_heads, num_kv_heads, max_context): float32 values of "
     "scratch paged_attention needs a thread, the size it checks scratch against."},
    {"openmp", py_openmp, METH_NOARGS, "Whether the module was built with OpenMP."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "stage_worker._kernels",
    "The worker's C kernels (stage_worker/csrc), built with the package.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    sarathi_fused_avx512 = kernels_run_here();
    return PyModule_Create(&module);
}
