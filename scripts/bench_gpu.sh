#!/usr/bin/env bash
# What one GPU does with triax, in one command (about 10 minutes on an H200):
# writes docs/bench_gpu.md, and docs/bench_checkpoint_gpu.md through
# scripts/bench_checkpoint.py. In order, each section appended as it ends (a
# run cut short keeps what it finished):
#   1. --compile_only of experiments/llama_1b.py on the local GPU: XLA:GPU's
#      bytes per device and the fit against what XLA may allocate there;
#   2. scripts/gpu_bench.sh --config=llama_1b: tokens/s and bf16 MFU;
#   3. the same with --config.model.fp8=tensorwise (FP8 weight matmuls), then
#      one line with both tokens/s and their ratio; MFU still of the bf16 peak,
#      so the two MFUs differ by that ratio (docs/design/planner_costs.md);
#   4. scripts/bench_checkpoint.py on experiments/gpt_1b.py: what asynchronous
#      saves cost a step (issue 28's 3%);
#   5. scripts/gpu_bench.sh (gpt_1b): tokens/s and bf16 MFU;
#   6. --compile_only of experiments/llama_8b.py on one GPU: its fp32 state
#      alone is 128 GB, so the expected answer is "does not fit" and exit 3;
#   7. MaxText 0.2.5's own train loop with llama_1b's keys on the same GPU
#      (scripts/bench_peers.py --one_device): its tokens/s and MFU beside
#      section 2's. Its python is TRIAX_MAXTEXT_PYTHON (a venv with
#      maxtext and a CUDA jax; the GPU machine may have no network to build
#      one), else .bench/maxtext-venv; without one the section says so.
#      Rehearsed on CPU: python scripts/bench_peers.py --one_device --smoke.
#
#   scripts/bench_gpu.sh [--out_dir=docs] [--runs=runs/bench_gpu]
#
# TRIAX_SKIP_ENV=1 uses the python on PATH instead of setting up .venv (a GPU
# machine whose image carries a CUDA jax).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out_dir="$ROOT/docs"
runs="$ROOT/runs/bench_gpu/$(date +%Y%m%d-%H%M%S)"
for arg in "$@"; do
  case "$arg" in
    --out_dir=*) out_dir="${arg#--out_dir=}" ;;
    --runs=*) runs="${arg#--runs=}" ;;
    *) echo "error: $arg: unknown flag; scripts/bench_gpu.sh takes --out_dir=DIR and --runs=DIR" >&2; exit 2 ;;
  esac
done
case "$out_dir" in /*) ;; *) out_dir="$PWD/$out_dir" ;; esac
case "$runs" in /*) ;; *) runs="$PWD/$runs" ;; esac
if [ -e "$runs" ]; then
  echo "error: --runs: $runs exists; give a new directory" >&2
  exit 2
fi
if [ -z "${TRIAX_SKIP_ENV:-}" ]; then
  source "$ROOT/scripts/env.sh" ""
else
  cd "$ROOT"
fi
export TRIAX_SKIP_ENV=1   # the scripts called below use this python
backend="$(python -c 'import jax; print(jax.default_backend())')"
if [ "$backend" != gpu ]; then
  echo "error: scripts/bench_gpu.sh: jax sees no GPU (backend $backend); run it where one is" >&2
  exit 2
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
mkdir -p "$out_dir" "$runs/tmp"
# Compiled once for all sections: the benchmarks repeat the compile-only programs.
export JAX_COMPILATION_CACHE_DIR="$runs/jax_cache"
# The checkpoint benchmark's workdirs on the runs' disk, not a RAM-backed /tmp.
export TMPDIR="$runs/tmp"
doc="$out_dir/bench_gpu.md"

section() {   # section TITLE COMMAND...: the command's output under a heading, as it ends
  local title="$1" rc=0 started=$SECONDS
  shift
  echo "== $title"
  "$@" >"$runs/section.log" 2>&1 || rc=$?
  cat "$runs/section.log"
  {
    echo
    echo "## $title"
    echo
    echo "\`$*\` (exit $rc, $((SECONDS - started)) s wall)"
    echo
    echo '```'
    grep -v -E '^(WARNING|I[0-9]{4}|W[0-9]{4})' "$runs/section.log" | tail -n 25
    echo '```'
  } >>"$doc"
}

fp8_against_bf16() {   # one line: sections 2 and 3's tokens/s and MFU, and their ratio
  python - "$runs/llama_1b" "$runs/llama_1b_fp8" <<'PY'
import sys
from triax.sweeps import results
bf16, fp8 = (results.summarize_run(w) for w in sys.argv[1:])
if bf16.tokens_per_sec is None or fp8.tokens_per_sec is None:
  print('FP8 against bf16 (llama_1b): n/a, a run logged no steps (sections 2 and 3)')
else:
  mfu = lambda r: 'n/a' if r.mfu is None else f'{100 * r.mfu:.1f}%'
  print(
    f'FP8 against bf16 (llama_1b, sections 3 and 2): {fp8.tokens_per_sec:,.0f} against '
    f'{bf16.tokens_per_sec:,.0f} tokens/s, {fp8.tokens_per_sec / bf16.tokens_per_sec:.2f}x; '
    f'MFU {mfu(fp8)} against {mfu(bf16)}, both of the bf16 peak'
  )
PY
}

{
  echo "# triax on one GPU"
  echo
  echo "Written by \`scripts/bench_gpu.sh\` on $(date -u +%Y-%m-%d): $(python -c '
import jax
d = jax.devices()[0]
print(f"{jax.device_count()} x {d.device_kind}, jax {jax.__version__}")')."
  echo "Each section is one command's output (its last 25 lines, log noise left out)."
} >"$doc"

section "compile only: llama_1b on the local GPU" \
  python -m triax train --config=experiments/llama_1b.py --compile_only --workdir="$runs/llama_1b_aot"
section "llama_1b: tokens/s and MFU" \
  bash scripts/gpu_bench.sh --config=llama_1b --workdir="$runs/llama_1b"
section "llama_1b with FP8 weight matmuls (model.fp8=tensorwise): tokens/s and MFU" \
  bash scripts/gpu_bench.sh --config=llama_1b --workdir="$runs/llama_1b_fp8" \
    --config.model.fp8=tensorwise
line="$(fp8_against_bf16)" || line="FP8 against bf16 (llama_1b): n/a (see the log above)"
echo "$line"
printf '\n%s\n' "$line" >>"$doc"
section "asynchronous checkpoints: gpt_1b" \
  python scripts/bench_checkpoint.py --config=experiments/gpt_1b.py --steps=40 --every=20 \
    --repeats=1 --no-warmup --out="$out_dir/bench_checkpoint_gpu.md"
section "gpt_1b: tokens/s and MFU" \
  bash scripts/gpu_bench.sh --workdir="$runs/gpt_1b"
section "compile only: llama_8b on one GPU (expected: does not fit, exit 3)" \
  python -m triax train --config=experiments/llama_8b.py --compile_only --workdir="$runs/llama_8b_aot"
section "MaxText 0.2.5: llama_1b's keys on the same GPU (beside section 2)" \
  python scripts/bench_peers.py --one_device
echo "wrote $doc"
