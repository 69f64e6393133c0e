#!/usr/bin/env bash
# The GPU path in one go, on a machine with an NVIDIA GPU (issue 20 in BENCHMARKS.md's GPU
# section): installs what that machine lacks from wheels given to it, then runs its parts and
# writes everything to OUT_DIR:
#   tests  tests/gpu (JUnit XML and a log), the PP 2 local cluster on one GPU among them;
#   bench  the stage benchmarks of a Mistral-7B-shaped model with random bf16 weights (JSON and
#          a table each), torch attention and flashinfer, each decode point eager and from a
#          CUDA graph;
#   bench-chunks  what the chunked policy's steps cost over long prompts, after its GPU test
#          (tests/gpu/test_chunk_attention_cuda.py, seconds; if it fails, the live parts are
#          skipped): chunks of 128 and 512 tokens after 3,072 cached tokens of their prompt
#          beside the prompt's first 512 and a decode
#          batch of 32 over 3,072-token contexts, torch attention (GPU_BENCH_ATTENTION for others),
#          and one layer's chunk attention with the boolean mask against a causal bias;
#   bench-unfused  the torch one again with --no-fused-ops (torch's own elementwise ops);
#   bench-no-decode-kernel  the torch one again with --no-decode-kernel (torch's paged_decode
#          in the graphs, not the Triton kernel);
#   bench-decode-splits  its decode points again with each context split GPU_DECODE_SPLITS
#          ways (default "2 4 8"), to find the rule by batch that the kernel lacks;
#   profile  where a decode step's time goes, batch 1 and 32 (tools/gpu_decode_profile.py; the
#          backends in GPU_PROFILE_ATTENTION, default "torch flashinfer");
#   live-sarathi, live-vllm
#          each policy's capacity on a local cluster (PP 1) of that model at the strict SLO,
#          lengths from the arxiv trace (JSON and a log); a part each, to fit a call.
#
#   tools/gpu_check.sh OUT_DIR [WHEEL_DIR]
#
# WHEEL_DIR (default .whl) holds the wheels to install with --no-deps into a private folder
# (flashinfer-python and apache-tvm-ffi, pyzmq, the HTTP and gRPC stack at this project's
# versions); pip is not asked to reach any index. Fetched, for a GPU machine's Python 3.12, with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl flashinfer-python==0.6.0 apache-tvm-ffi pyzmq \
#     grpcio==1.85.1 grpcio-health-checking grpcio-reflection protobuf llguidance aetcd gguf \
#     starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
# (25 MB; flashinfer 0.7's wheel alone is 62 MB, too large for a device call's 64 MB).
# GPU_CHECK_PARTS (default "tests bench bench-chunks bench-unfused profile live-sarathi live-vllm") picks
# parts, so that each fits a call's time limit. The live parts write their model once, to GPU_CHECK_MODEL_DIR (default
# /tmp/gpu_check_model, 14.5 GB), and keep the strict SLO the first of them measured there, so
# that both policies are held to the same one. GPU_CHECK_DEVICE (default cuda) and
# GPU_CHECK_SHAPE (default mistral-7b) let them run on the CPU with a small shape as a dry run;
# GPU_LIVE_SEARCH_S (default 300) bounds each policy's search (`--search-time-s`: the JSON then
# has the bracket found, marked not converged, where the search needed longer); a probe past
# capacity stops once its miss is certain, and the first policy's cluster measures the strict
# SLO. So the two parts should fit one 15-minute lease, one call each (not yet timed on a GPU:
# the searches' 300 s each, plus the model's writing and each cluster's start, a minute or two).
# GPU_LIVE_ARGS is appended to their `bench capacity` command (the last of a repeated flag wins),
# GPU_BENCH_ARGS to the stage benchmarks' (e.g. --repeats 20); GPU_BENCH_ATTENTION (default
# "torch flashinfer") picks the backends the bench part times.
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

parts=" ${GPU_CHECK_PARTS:-tests bench bench-chunks bench-unfused profile live-sarathi live-vllm} "
status=0
if [[ $parts == *" tests "* ]]; then
  # flashinfer's tests last: its first use compiles its kernels (minutes), and a run cut short
  # by the timeout should still have the others' results.
  timeout "${GPU_TESTS_TIMEOUT_S:-420}" python3 -m pytest -v -p no:cacheprovider \
    $(ls tests/gpu/test_*.py | grep -v test_attention_cuda) tests/gpu/test_attention_cuda.py \
    --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" || status=1
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

bench() {  # bench NAME ARGS...: the stage benchmark as JSON and as a table
  local name=$1
  shift
  python3 -c 'import sys; from sarathictl.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench stage --device cuda --random-shape mistral-7b --decode-batches 1,8,32,128 \
    --prefill-chunks 128,512,2048 --context-tokens 512 "$@" ${GPU_BENCH_ARGS:-} --json \
    >"$out/$name.json" || status=1
  python3 - "$out/$name.json" <<'PY' | tee "$out/$name.md"
import json, sys
r = json.load(open(sys.argv[1]))
ceiling = r["prefill_ceiling_tokens_s"]
print(f"{r['model']} on {r['device_name']}, attention={r['attention']}, fused ops {r['fused_ops']}, "
      f"decode kernel {r['decode_kernel']} (splits {r['decode_splits'] or 'by length'}): copy "
      f"{r['copy_bandwidth_gb_s']:.0f} GB/s, decode floor {r['decode_floor_ms']:.2f} ms"
      + ("" if ceiling is None else f", matmul {r['matmul_tflop_s']:.0f} TFLOP/s, "
         f"prefill ceiling {ceiling:,.0f} tokens/s"))
for row in r["rows"]:
    g = row["graph_ms"]
    best = min(row["step_ms"], g or row["step_ms"])
    extra = (f"{best / r['decode_floor_ms']:.2f}x floor" if row["kind"] == "decode"
             else f"{row['tokens'] / best * 1e3 / r['prefill_ceiling_tokens_s']:.0%} of ceiling")
    print(f"| {row['kind']} | {row['tokens']} | {row['step_ms']:.2f} | {'-' if g is None else f'{g:.2f}'} | {extra} |")
PY
}
if [[ $parts == *" bench "* ]]; then
  for attention in ${GPU_BENCH_ATTENTION:-torch flashinfer}; do
    bench "stage-$attention" --attention "$attention"
  done
fi
if [[ $parts == *" bench-chunks "* ]]; then
  # first, that a later chunk's attention is right on this GPU (seconds; the live parts need it)
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_chunk_attention_cuda.py 2>&1 \
    | tee "$out/chunk-tests.log" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || { status=1; chunk_test_failed=1; }
  for attention in ${GPU_BENCH_ATTENTION:-torch}; do
    bench "stage-chunks-$attention" --attention "$attention" --context-tokens 3072 \
      --decode-batches 32 --prefill-chunks 512 --later-chunks 128,512
  done
  # one layer's chunk attention: the torch path's boolean mask against a causal bias
  python3 tools/bench_chunk_attention.py | tee "$out/chunk-attention.md" || status=1
fi
if [[ $parts == *" bench-unfused "* ]]; then
  bench stage-torch-unfused --attention torch --no-fused-ops
fi
if [[ $parts == *" bench-no-decode-kernel "* ]]; then
  bench stage-torch-no-decode-kernel --attention torch --no-decode-kernel
fi
if [[ $parts == *" bench-decode-splits "* ]]; then
  for splits in ${GPU_DECODE_SPLITS:-2 4 8}; do
    bench "stage-torch-splits$splits" --attention torch --decode-splits "$splits" \
      --prefill-chunks ''
  done
fi
if [[ $parts == *" profile "* ]]; then
  # where a decode step's time goes: kernels, kernel time and wall time, fused or not
  for attention in ${GPU_PROFILE_ATTENTION:-torch flashinfer}; do
    for batch in 1 32; do
      python3 tools/gpu_decode_profile.py --attention "$attention" --batch $batch \
        >"$out/profile-$attention-b$batch.md" || status=1
    done
  done
fi

# An array, not a function: `timeout` runs commands, and cannot run a shell function.
sarathictl=(python3 -c 'import sys; from sarathictl.cli import main; sys.exit(main(sys.argv[1:]))')
live() {  # live POLICY PP: the policy's capacity at the strict SLO, live
  local policy=$1 pp=$2 model=${GPU_CHECK_MODEL_DIR:-/tmp/gpu_check_model}
  local name=live-pp$2-$1
  if [ ! -f "$model/config.json" ]; then
    "${sarathictl[@]}" model random-llama "$model" --shape "${GPU_CHECK_SHAPE:-mistral-7b}" \
      --device "${GPU_CHECK_DEVICE:-cuda}" || { status=1; return; }
  fi
  # The strict SLO: 5x the decode step of a batch of 32, measured by the first live part.
  local slo_file=$model/strict_tbt_slo_s slo=strict
  [ -s "$slo_file" ] && slo=$(cat "$slo_file")
  # The paper's strict-SLO setting for Mistral-7B: budget 512; prompts and outputs within the
  # model's 8192 positions.
  # shellcheck disable=SC2086  # GPU_LIVE_ARGS is a list of flags
  # --search-time-s ends the search with the bracket it has (converged false in the JSON)
  # before the timeout would end it with nothing (300 s a policy: both should fit one lease).
  timeout "${GPU_LIVE_TIMEOUT_S:-540}" "${sarathictl[@]}" bench capacity --local \
    --device "${GPU_CHECK_DEVICE:-cuda}" --model "$model" --pp "$pp" --policies "$policy" \
    --tbt-slo "$slo" --budget 512 --trace arxiv --max-total-tokens 8192 --num-requests 128 \
    --max-probe-s 30 --granularity 0.1 --search-time-s "${GPU_LIVE_SEARCH_S:-300}" \
    ${GPU_LIVE_ARGS:-} --json \
    >"$out/$name.json" 2> >(tee "$out/$name.log" >&2) || { status=1; return; }
  if [ "$slo" = strict ]; then
    python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["tbt_slo_s"])' \
      "$out/$name.json" >"$slo_file"
  fi
}
for policy in sarathi vllm; do
  if [[ $parts == *" live-$policy "* ]]; then
    if [ -n "${chunk_test_failed:-}" ]; then
      # the chunked policy's steps would attend wrongly on this GPU: a search would measure
      # nothing worth the lease (chunk-tests.log says what failed)
      echo "gpu_check: live-$policy skipped: the chunk attention test failed"
      continue
    fi
    live "$policy" 1
  fi
done
echo "gpu_check: status $status; results in $out"
exit $status
