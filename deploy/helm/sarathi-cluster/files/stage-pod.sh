#!/bin/bash
# Entry point of one pipeline-stage pod: starts one `python -m stage_worker` per TP rank (one per
# GPU: cuda:R, or cpu) with the arguments given here, and exits as soon as any worker exits, with
# that worker's status. A stage missing one TP rank cannot serve, so the whole pod must restart.
#
# Environment: SARATHI_TP (workers to start), SARATHI_DEVICE (cuda or cpu), SARATHI_STAGE (the
# pipeline stage; default: the StatefulSet ordinal at the end of the hostname), SARATHI_PYTHON.
set -uo pipefail

tp="${SARATHI_TP:?SARATHI_TP must be set}"
device="${SARATHI_DEVICE:-cuda}"
stage="${SARATHI_STAGE:-${HOSTNAME##*-}}"
python="${SARATHI_PYTHON:-python}"

if ! [[ "$tp" =~ ^[1-9][0-9]*$ ]]; then
  echo "stage-pod: SARATHI_TP=$tp is not a positive integer" >&2
  exit 2
fi
if ! [[ "$stage" =~ ^[0-9]+$ ]]; then
  echo "stage-pod: stage '$stage' is not a number (set SARATHI_STAGE)" >&2
  exit 2
fi

pids=()
stop_all() {
  # SIGTERM reaches only this script (PID 1); pass it on so workers leave torch.distributed cleanly.
  kill -TERM "${pids[@]}" 2>/dev/null
}
trap stop_all TERM INT

for ((rank = 0; rank < tp; rank++)); do
  if [[ "$device" == cuda ]]; then worker_device="cuda:$rank"; else worker_device=cpu; fi
  "$python" -m stage_worker "$@" --stage "$stage" --tp-rank "$rank" --device "$worker_device" &
  pids+=("$!")
done
echo "stage-pod: stage $stage started $tp workers on $device (pids ${pids[*]})" >&2

# `wait -n` returns when the first worker exits (or a trapped signal arrives).
wait -n "${pids[@]}"
status=$?
echo "stage-pod: a worker exited with status $status; stopping the others" >&2
stop_all
wait
exit "$status"
