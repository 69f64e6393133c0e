#!/usr/bin/env bash
# The GPU path in one go, on a machine with an NVIDIA GPU (issue 20 in BENCHMARKS.md's GPU
# section): installs what that machine lacks from wheels given to it, runs tests/gpu, then the
# stage benchmarks of a Mistral-7B-shaped model with random bf16 weights, and writes everything
# to OUT_DIR (tests as JUnit XML and a log, each benchmark as JSON and a table).
#
#   tools/gpu_check.sh OUT_DIR [WHEEL_DIR]
#
# WHEEL_DIR (default .whl) holds the wheels to install with --no-deps into a private folder
# (flashinfer-python and apache-tvm-ffi, pyzmq, the HTTP and gRPC stack at this project's
# versions); pip is not asked to reach any index.
set -uo pipefail

out=${1:?usage: tools/gpu_check.sh OUT_DIR [WHEEL_DIR]}
wheels=${2:-.whl}
mkdir -p "$out"
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 1

export HOME=${GPU_CHECK_HOME:-/tmp/gpu_check_home}  # JIT caches (flashinfer, triton) live here
mkdir -p "$HOME"
site=/tmp/gpu_check_site
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl || exit 1
  export PYTHONPATH=$site
fi
export PYTHONPATH=$repo:$repo/proto:$repo/tools${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2>&1 | tail -1
} | tee "$out/device.txt"

status=0
timeout "${GPU_TESTS_TIMEOUT_S:-420}" python3 -m pytest tests/gpu -v -p no:cacheprovider \
  --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" || status=1
[ "${PIPESTATUS[0]}" = 0 ] || status=1

bench() {  # bench NAME ARGS...: the stage benchmark as JSON and as a table
  local name=$1
  shift
  python3 -c 'import sys; from sarathictl.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench stage --device cuda --random-shape mistral-7b --decode-batches 1,8,32,128 \
    --prefill-chunks 128,512,2048 --context-tokens 512 "$@" --json >"$out/$name.json" || status=1
  python3 - "$out/$name.json" <<'PY' | tee "$out/$name.md"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['model']} on {r['device_name']}, attention={r['attention']}: copy {r['copy_bandwidth_gb_s']:.0f} GB/s, "
      f"decode floor {r['decode_floor_ms']:.2f} ms, matmul {r['matmul_tflop_s']:.0f} TFLOP/s, "
      f"prefill ceiling {r['prefill_ceiling_tokens_s']:,.0f} tokens/s")
for row in r["rows"]:
    g = row["graph_ms"]
    best = min(row["step_ms"], g or row["step_ms"])
    extra = (f"{best / r['decode_floor_ms']:.2f}x floor" if row["kind"] == "decode"
             else f"{row['tokens'] / best * 1e3 / r['prefill_ceiling_tokens_s']:.0%} of ceiling")
    print(f"| {row['kind']} | {row['tokens']} | {row['step_ms']:.2f} | {'-' if g is None else f'{g:.2f}'} | {extra} |")
PY
}
if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
  bench stage-torch --attention torch
  bench stage-flashinfer --attention flashinfer --no-cuda-graphs
fi
echo "gpu_check: status $status; results in $out"
exit $status
