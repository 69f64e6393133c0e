#!/usr/bin/env bash
# lm-evaluation-harness in a venv of its own (never a dependency of the project), for
# `make bench-lm-eval`. Usage: install_lm_eval.sh VENV [PYTHON]. Does nothing when
# VENV/.installed exists. torch goes in first, pinned, so pip takes the CPU build on disk
# instead of pulling CUDA's.
set -euo pipefail

VENV=${1:?usage: install_lm_eval.sh VENV [PYTHON]}
PYTHON=${2:-python3}
LM_EVAL_VERSION=${LM_EVAL_VERSION:-0.4.13}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
STAMP="$VENV/.installed"

if [ -f "$STAMP" ]; then
  echo "[install-lm-eval] $VENV already has lm-eval $(cat "$STAMP"); delete it to reinstall"
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
echo "[install-lm-eval] torch==$TORCH_VERSION (CPU build), then lm-eval==$LM_EVAL_VERSION"
"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" "lm-eval[api,hf]==$LM_EVAL_VERSION" "torch==$TORCH_VERSION" transformers
echo "$LM_EVAL_VERSION" > "$STAMP"
