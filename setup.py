"""The C extension stage_worker._kernels (stage_worker/csrc); everything else is in
pyproject.toml.

The kernels are compiled here, when the wheel or image is built, so a serving node needs no
compiler. Where the build cannot compile them (no C compiler, a compiler without the AVX-512
target pragmas) the package still installs, without the module: a worker then says so once and
runs the torch path (stage_worker/native.py). Building with SARATHI_REQUIRE_KERNELS=1 makes a
failed build an error instead (the images and the wheel test set it).
"""

from __future__ import annotations

import os

from setuptools import Extension, setup

REQUIRED = os.environ.get("SARATHI_REQUIRE_KERNELS") == "1"

kernels = Extension(
    "stage_worker._kernels",
    sources=[
        "stage_worker/csrc/module.c",
        "stage_worker/csrc/paged_attention.c",
        "stage_worker/csrc/paged_attention_avx2.c",
        "stage_worker/csrc/chunk_attention_avx2.c",
        "stage_worker/csrc/chunk_attention_avx512.c",
        "stage_worker/csrc/gemv_bf16.c",
        "stage_worker/csrc/matmul_bf16_avx512.c",
        "stage_worker/csrc/fused_ops.c",
        "stage_worker/csrc/fused_ops_bf16.c",
        "stage_worker/csrc/fused_ops_bf16_avx512.c",
        "stage_worker/csrc/fused_ops_f32.c",
        "stage_worker/csrc/sgemm_f32.c",
    ],
    depends=[
        "stage_worker/csrc/kernels.h",
        "stage_worker/csrc/paged_rows.h",
        "stage_worker/csrc/avx2_math.h",
        "stage_worker/csrc/attention_avx2.h",
        "stage_worker/csrc/attention_avx512.h",
        "stage_worker/csrc/attention_runs.h",
    ],
    # No -march: the kernels pick their instructions with target pragmas (kernels.h) so the
    # module itself runs on any x86-64 CPU. OpenMP threads the attention, matmul and fused
    # kernels; loaded after torch, the module shares torch's libgomp (same soname), so there is
    # one thread pool.
    extra_compile_args=["-O3", "-fopenmp", "-std=c11", "-Wall"],
    extra_link_args=["-fopenmp"],
    optional=not REQUIRED,
)

setup(ext_modules=[kernels])
