#!/usr/bin/env bash
# Runs one training job as NPROC processes on this machine, one jax.distributed
# job over loopback (gloo CPU collectives), each process with its share of
# forced CPU devices, and one mesh spanning them all:
#
#   scripts/launch_local.sh NPROC [train flags]
#   scripts/launch_local.sh 2 --config=experiments/gpt_tiny.py:smoke --workdir=runs/mp
#
# Each process gets --cpu_devices=8/NPROC unless the flags give --cpu_devices.
# Output lines are prefixed with the process id. The coordinator binds
# 127.0.0.1 only (TRIAX_PORT picks its port; default: a free one). If any
# process fails, the others are stopped and the script exits with its status.
# PYTHON overrides the interpreter (default: .venv/bin/python, else python3).
set -uo pipefail

if [ $# -lt 1 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NPROC: give the number of processes first, e.g. scripts/launch_local.sh 2 --config=..." >&2
  exit 2
fi
nproc="$1"; shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"

device_flag=()
if ! printf '%s\n' "$@" | grep -q -- '^--cpu_devices='; then
  if (( 8 % nproc )); then
    echo "error: NPROC: 8 CPU devices do not split over $nproc processes; pass --cpu_devices=N (per process)" >&2
    exit 2
  fi
  device_flag=(--cpu_devices=$((8 / nproc)))
fi

port="${TRIAX_PORT:-}"
if [ -z "$port" ]; then
  port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi

# Each process runs in its own process group (set -m), so stopping one stops
# its output filters too.
set -m
pids=()
for ((i = 0; i < nproc; i++)); do
  (
    set +m   # the pipeline below stays in this job's process group
    export TRIAX_COORDINATOR="127.0.0.1:$port" TRIAX_NUM_PROCESSES="$nproc" TRIAX_PROCESS_ID="$i"
    prefix="[$i] "
    # stderr and stdout keep their streams, each line prefixed.
    { "$PY" -m triax.train "$@" "${device_flag[@]}" 2>&1 1>&3 3>&- |
        sed -u "s/^/$prefix/" >&2; } 3>&1 | sed -u "s/^/$prefix/"
  ) &
  pids+=($!)
done
set +m

stop_all() {
  for pid in "${pids[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null
  done
}
trap 'stop_all; exit 130' INT TERM

status=0
running=("${pids[@]}")
while (( ${#running[@]} > 0 )); do
  still=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then still+=("$pid"); continue; fi
    wait "$pid"
    rc=$?
    if (( rc != 0 && status == 0 )); then
      status=$rc
      echo "launch_local: process $pid exited with status $rc; stopping the others" >&2
      stop_all
    fi
  done
  running=("${still[@]}")
  (( ${#running[@]} > 0 )) && sleep 0.2
done
exit "$status"
