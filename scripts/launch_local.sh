#!/usr/bin/env bash
# Runs one training job as NPROC processes on this machine, one jax.distributed
# job over loopback (gloo CPU collectives), each process with its share of
# forced CPU devices, and one mesh spanning them all:
#
#   scripts/launch_local.sh NPROC [train flags]
#   scripts/launch_local.sh 2 --config=experiments/gpt_tiny.py:smoke --workdir=runs/mp
#
# Each process gets --cpu_devices=8/NPROC unless the flags give --cpu_devices.
# Output lines are prefixed with the process id; gloo's "[Gloo] Rank N is
# connected to M peer ranks" lines are dropped, and process 0's progress bar
# (the only one: the trainer shows none on the others) redraws in place. The
# coordinator binds 127.0.0.1 only (TRIAX_PORT picks its port; default: a free
# one). If any process fails, the others are killed (they would wait forever
# in a collective with a dead peer) and the script exits with its status.
# SIGINT/SIGTERM to the launcher is passed on to the trainers as SIGTERM: they
# finish the step, save it and exit 0 (a second one stops them at once). PYTHON overrides the trainer's interpreter (default:
# .venv/bin/python, else python3).
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

# The output filter: it prefixes every line, and every redraw of a progress
# bar (tqdm ends those with a carriage return, not a newline), as soon as it
# arrives, where a line-buffered sed would hold a bar until the run ends; and
# it drops gloo's connection lines (one per rank and communicator: about 40
# for 2 processes). Its own interpreter, not PYTHON's: that one runs the trainer.
FILTER_PY="$ROOT/.venv/bin/python"
[ -x "$FILTER_PY" ] || FILTER_PY=python3
filter='
import os, re, sys
prefix, out = sys.argv[1].encode(), sys.stdout.buffer
chatter = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
started = False  # the current line is out (prefixed) up to here
held = b""  # the start of a line that may yet turn out to be chatter
while data := os.read(0, 65536):
  *ended, rest = re.split(rb"(?<=[\r\n])", held + data)
  held = b""
  for piece in ended:
    if started or piece == b"\r":
      out.write(piece)
    elif not chatter.match(piece):
      out.write(prefix + piece)
    started = False
  if started:
    out.write(rest)
  elif b"[Gloo]".startswith(rest[:6]):
    held = rest
  else:
    out.write(prefix + rest)
    started = True
  out.flush()
out.write(prefix + held if held else b"")
'

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
    { "$PY" -m triax.cli.train "$@" "${device_flag[@]}" 2>&1 1>&3 3>&- |
        "$FILTER_PY" -c "$filter" "$prefix" >&2; } 3>&1 | "$FILTER_PY" -c "$filter" "$prefix"
  ) &
  pids+=($!)
done
set +m

kill_all() {
  for pid in "${pids[@]}"; do
    kill -KILL -- "-$pid" 2>/dev/null
  done
}
# A stop request goes to the trainers alone (not to the shells and output
# filters of their pipelines), which save and exit; the loop below waits.
stop_trainers() {
  for pid in "${pids[@]}"; do
    pkill -TERM -g "$pid" -f -- '-m triax\.cli\.train' 2>/dev/null
  done
}
trap stop_trainers INT TERM

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
      kill_all
    fi
  done
  running=("${still[@]}")
  (( ${#running[@]} > 0 )) && sleep 0.2
done
exit "$status"
