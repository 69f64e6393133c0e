# syntax=docker/dockerfile:1
# CPU image: the controller (it runs no model) and CPU stage workers (gloo; tests and demos).
# Build from the repository root (not built in this repository's CI: no Docker engine there):
#   docker build -f docker/cpu.Dockerfile -t ghcr.io/sarathi-cluster/sarathi-cluster:0.1.0-cpu .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch>=2.4"

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/sarathi

RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv \
    && useradd --uid 1000 --create-home --home-dir /home/sarathi sarathi

# The CPU build of torch first: a bare `torch` from PyPI would pull the multi-GB CUDA build.
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"

WORKDIR /opt/sarathi-cluster
COPY pyproject.toml README.md ./
COPY controller ./controller
COPY stage_worker ./stage_worker
COPY proto ./proto
COPY tools/sarathictl ./tools/sarathictl
RUN pip install . \
    && python -c "import controller, stage_worker, sarathi_proto, torch; print(torch.__version__)"

USER 1000:1000
WORKDIR /home/sarathi
CMD ["python", "-m", "controller", "--help"]
