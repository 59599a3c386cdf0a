#!/usr/bin/env bash
# Trains experiments/gpt_1b.py (~1B parameters, bf16 compute, cuDNN fused attention,
# one device), or experiments/llama_1b.py with --config=llama_1b (Llama 3.2 1B's
# shape), for 40 steps and prints tokens/s and MFU: medians over the logged
# steps after the first, MFU against the device kind's peak bf16 FLOP/s
# (triax/model/flops.py). A few minutes on one H200, compilation included.
#
#   scripts/gpu_bench.sh                      # the benchmark (needs a GPU)
#   scripts/gpu_bench.sh --smoke              # a tiny model on one CPU device, < 1 min
#   scripts/gpu_bench.sh --config=llama_1b    # the Llama benchmark (--smoke works too)
#   scripts/gpu_bench.sh --workdir=runs/b1 --config.train.global_batch_size=24
#
# Other flags go to `triax train`. The workdir (default runs/gpu_bench/<time>) must
# be new: an existing one would resume instead of measuring from the start. Its
# checkpoint is deleted at the end (12 GB at full size, after 40 steps).
# TRIAX_SKIP_ENV=1 uses the python on PATH instead of setting up .venv (tests).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
smoke=0
workdir=""
name=gpt_1b
extra=()
for arg in "$@"; do
  case "$arg" in
    --smoke) smoke=1 ;;
    --workdir=*) workdir="${arg#--workdir=}" ;;
    --config=*) name="${arg#--config=}" ;;
    *) extra+=("$arg") ;;
  esac
done
case "$name" in
  gpt_1b|llama_1b) ;;
  *) echo "error: --config: $name is not a benchmark; choose gpt_1b or llama_1b" >&2; exit 2 ;;
esac
if [ -z "$workdir" ]; then
  if [ "$smoke" = 1 ]; then run=gpu_bench_smoke; else run=gpu_bench; fi
  workdir="$ROOT/runs/$run/$name-$(date +%Y%m%d-%H%M%S)"
fi
case "$workdir" in /*) ;; *) workdir="$PWD/$workdir" ;; esac   # before env.sh changes directory
if [ -e "$workdir" ]; then
  echo "error: --workdir: $workdir exists; a benchmark starts from scratch, give a new one" >&2
  exit 2
fi
if [ -z "${TRIAX_SKIP_ENV:-}" ]; then
  source "$ROOT/scripts/env.sh" ""   # "": the sourced script must not see our arguments
else
  cd "$ROOT"
fi

if [ "$smoke" = 1 ]; then
  python -m triax train --config="experiments/$name.py:smoke" --workdir="$workdir" \
      --cpu_devices=1 --progress=false ${extra[@]+"${extra[@]}"}
else
  backend="$(python -c 'import jax; print(jax.default_backend(), jax.devices()[0].device_kind)')"
  echo "device: $backend"
  if [ "${backend%% *}" != "gpu" ]; then
    echo "error: scripts/gpu_bench.sh: jax sees no GPU (backend ${backend%% *}); install a CUDA" \
         "jax into .venv (.venv/bin/pip install -U 'jax[cuda12]'), or use --smoke on CPU" >&2
    exit 2
  fi
  # The whole GPU for this one process; the default 75% would waste 35 GB of an H200.
  # No XLA_FLAGS: with one device there is no communication to overlap, and an
  # unknown flag aborts XLA on a jaxlib that has dropped it.
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
  python -m triax train --config="experiments/$name.py" --workdir="$workdir" \
      --config.train.steps=40 ${extra[@]+"${extra[@]}"}
fi
python - "$workdir" <<'PY'
import sys
from triax.sweeps import results
print(results.benchmark_report(sys.argv[1]))
PY
# 40 steps of weights and Adam state (12 GB at full size) are not worth the disk;
# metrics.jsonl, compile_stats.json and tb/ stay.
rm -rf "$workdir/checkpoints"
echo "run: $workdir"
