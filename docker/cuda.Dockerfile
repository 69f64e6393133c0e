# syntax=docker/dockerfile:1
# GPU image for stage workers: CUDA PyTorch + flashinfer + sarathi-cluster.
# Build from the repository root (not built in this repository's CI: no Docker engine there):
#   docker build -f docker/cuda.Dockerfile -t ghcr.io/sarathi-cluster/sarathi-cluster:0.1.0-cuda .
# The devel base carries nvcc: flashinfer compiles the few kernels its JIT cache lacks at first use.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

# PyTorch and flashinfer wheels for the same CUDA minor version as the base image.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG FLASHINFER_INDEX=https://flashinfer.ai/whl/cu128
ARG TORCH_SPEC="torch>=2.6,<2.14"  # the range pyproject.toml declares

# flashinfer's JIT writes compiled kernels under $HOME, so HOME is the writable home of uid 1000.
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/sarathi

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc iproute2 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && (userdel -r ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --create-home --home-dir /home/sarathi sarathi

RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}" \
    && pip install flashinfer-python flashinfer-cubin \
    && pip install --index-url "${FLASHINFER_INDEX}" flashinfer-jit-cache

WORKDIR /opt/sarathi-cluster
COPY pyproject.toml setup.py README.md ./
COPY controller ./controller
COPY stage_worker ./stage_worker
COPY proto ./proto
COPY tools/sarathictl ./tools/sarathictl
# torch is already there, so the install adds only the project and its small dependencies;
# the CPU kernels are compiled here (SARATHI_REQUIRE_KERNELS=1: a failed build fails the image).
RUN SARATHI_REQUIRE_KERNELS=1 pip install ".[cuda]" \
    && python -c "import torch, controller, sarathi_proto, stage_worker._kernels; print(torch.__version__)"

USER 1000:1000
WORKDIR /home/sarathi
# The chart sets the command: `python -m controller ...` or stage-pod.sh (python -m stage_worker).
CMD ["python", "-m", "stage_worker", "--help"]
