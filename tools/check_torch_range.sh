#!/usr/bin/env bash
# The torch range pyproject.toml declares is the range tested: CI runs the newest allowed
# (the CPU build that `make install` puts in, TORCH_CPU in the Makefile); this runs the oldest
# allowed in a venv of its own, through the worker's tests (models against the transformers
# oracle, attention backends, sampler, kernels) and the engine's. `make check-torch-range`.
# PyPI's x86-64 torch wheels are CUDA builds: the first run downloads about 3 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_OLDEST=${TORCH_OLDEST:-torch==2.6.0}
VENV=${VENV:-.venv-torch-oldest}
PYTHON=${PYTHON:-python3}

declared=$(grep -o '"torch[^"]*"' pyproject.toml | tr -d '"')
echo "declared: $declared; testing the oldest allowed: $TORCH_OLDEST"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q "$TORCH_OLDEST"
"$VENV/bin/pip" install -q -e '.[dev]'
# The editable install leaves stage_worker/_kernels*.so in the tree: the kernels do not link
# torch, so the main venv's build and this one are the same file.
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit/stage_worker tests/unit/test_engine.py
