"""XLA:GPU's per-device bytes of triax's train steps for H100s, compiled on this
CPU host (no GPU), against the planner's prediction: docs/bench_gpu_compile.md.

Each row is `triax train --compile_only --topology=h100:...` (compiled/aot.py)
through jax's CUDA plugin, the test extra's copy in .venv/xla-cuda/
(scripts/env.sh; TRIAX_XLA_CUDA_PLUGIN names another). The planner's peak is
plan/cost/memory.py's for the same layout on experiments/clusters/dgx_h100.yaml
(analytic profile), as docs/bench_tpu_compile.md holds it against XLA:TPU.
XLA attention (cuDNN's needs a GPU to build), full remat, the Llama 3.2 1B
and 3.1 8B shapes, 8 sequences x 2048 tokens, bf16 compute, fp32 state.

  python scripts/bench_gpu_compile.py [--rows=fsdp8,tp8] [--out=docs/bench_gpu_compile.md]

The FP8 rows (model.fp8, FP8_ROWS) are the same steps with FP8 weight matmuls, and
say which matmuls of the optimised program run on two FP8 operands: their FLOPs as
executed (compiled/hlo_work.py, every scanned layer counted) against the layers'
weight matmuls' (model/flops.py: forward, both backward GEMMs, what remat
recomputes), and how XLA:GPU runs them (cuBLASLt's FP8 GEMM custom calls or dots
in its Triton GEMM fusions).

Every figure is kept in exact bytes in docs/bench_gpu_compile.json; `--rows=''`
rewrites the page from it, compiling nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import bench_tpu_compile as tpu  # its row compiler and the planner's peak
from bench_harness import ROOT, fail

GiB = tpu.GiB
LLAMA_1B = 'experiments/llama_1b.py:attention=xla,remat=full'
LLAMA_8B = 'experiments/llama_8b.py:attention=xla,remat=full'
CLUSTER = 'dgx_h100'
PLUGIN = os.path.join(ROOT, '.venv', 'xla-cuda', 'jax_plugins', 'xla_cuda12', 'xla_cuda_plugin.so')
# name -> (what, topology, (config, overrides)).
ROWS = {
  'fsdp8': ('FSDP 8', 'h100:8', (LLAMA_1B, {'mesh.data': 8, 'mesh.fsdp': True})),
  'tp8': ('TP 8', 'h100:8', (LLAMA_1B, {'mesh.data': 1, 'mesh.tensor': 8})),
  'dp2tp4': ('DP 2 x TP 4', 'h100:8', (LLAMA_1B, {'mesh.data': 2, 'mesh.tensor': 4})),
  'tp2pp4': (
    'TP 2 x PP 4, m=8, 1f1b',
    'h100:8',
    (LLAMA_1B, {'mesh.data': 1, 'mesh.tensor': 2, 'mesh.pipe': 4, 'pipeline.microbatches': 8}),
  ),
  'pp8_zb': (
    'PP 8, m=8, zb_h1',
    'h100:8',
    (
      LLAMA_1B,
      {'mesh.data': 1, 'mesh.pipe': 8, 'pipeline.microbatches': 8, 'pipeline.schedule': 'zb_h1'},
    ),
  ),
  'tp8_8b': ('8B shape, TP 8', 'h100:8', (LLAMA_8B, {'mesh.data': 1, 'mesh.tensor': 8})),
  'tp4pp2_8b': (
    '8B shape, TP 4 x PP 2, m=8, 1f1b',
    'h100:8',
    (LLAMA_8B, {'mesh.data': 1, 'mesh.tensor': 4, 'mesh.pipe': 2, 'pipeline.microbatches': 8}),
  ),
  'fsdp16_8b': (
    '8B shape, FSDP 16 on 2 hosts',
    'h100:2x8',
    (LLAMA_8B, {'mesh.data': 16, 'mesh.fsdp': True, 'train.global_batch_size': 16}),
  ),
}
# FP8 rows: name -> (the row it repeats, model.fp8 recipe).
FP8_ROWS = {
  'fsdp8_fp8': ('fsdp8', 'tensorwise'),
  'fsdp8_fp8_rowwise': ('fsdp8', 'rowwise'),
  'tp8_8b_fp8': ('tp8_8b', 'tensorwise'),
}


def row_spec(name: str) -> tuple[str, str, tuple[str, dict]]:
  """(what, topology, (config, overrides)) of a row of ROWS or FP8_ROWS."""
  if name in ROWS:
    return ROWS[name]
  if name not in FP8_ROWS:
    fail('--rows', f'no row {name!r}; name rows of {", ".join([*ROWS, *FP8_ROWS])}')
  base, recipe = FP8_ROWS[name]
  what, topology, (config, overrides) = ROWS[base]
  return f'{what}, fp8 {recipe}', topology, (config, {**overrides, 'model.fp8': recipe})


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.path.join(ROOT, 'docs', 'bench_gpu_compile.md'))
  parser.add_argument(
    '--rows', default=','.join([*ROWS, *FP8_ROWS]), help="rows to compile; '' for none"
  )
  args = parser.parse_args()
  plugin = os.environ.setdefault('TRIAX_XLA_CUDA_PLUGIN', PLUGIN)  # the rows' processes inherit it
  results_path = os.path.splitext(args.out)[0] + '.json'
  results = {}
  if os.path.exists(results_path):
    with open(results_path) as f:
      results = json.load(f)
  from triax.compiled import buffers

  names = list(filter(None, args.rows.split(',')))
  specs = {name: row_spec(name) for name in names}  # every name checked before compiling
  for name in names:
    what, topology, (config, overrides) = specs[name]
    row = f'gpu-{name}'
    stats = tpu.triax_row(row, topology, config, overrides, sys.executable)
    results[name] = {
      'temp': stats['temp_bytes'],
      'argument': stats['argument_bytes'],
      'heap': stats['temp_heap_bytes'],
      'live': buffers.live_peak(tpu.dump_dir(row)),
      'device_kind': stats['device_kind'],
      'largest': stats['largest_buffers'][:3],
    }
    if name in FP8_ROWS:
      results[name].update(fp8_matmuls(tpu.dump_dir(row)))
    print(name, {k: v for k, v in results[name].items() if k != 'largest'}, flush=True)
  results['versions'] = versions(plugin)
  with open(results_path, 'w') as f:
    json.dump(results, f, indent=1)
    f.write('\n')
  write_doc(args.out, results)


def fp8_matmuls(dump: str) -> dict:
  """The train step's matmul FLOPs as executed, all and on FP8 operands, and its
  FP8 GEMMs by how XLA:GPU runs them, from its optimised HLO in `dump`."""
  from triax.compiled import gemms, hlo_work

  with open(hlo_work.after_optimizations(dump)) as f:
    hlo = f.read()
  work = hlo_work.work(hlo)
  return {'flops': work.flops, 'fp8_flops': work.fp8_flops, 'fp8_gemms': gemms.fp8_gemms(hlo)}


def model_matmul_flops(topology: str, config: str, overrides: dict) -> tuple[float, float]:
  """(the layers' weight matmuls', the rest's: the attention core's and the head's)
  FLOPs per device in the row's step, by model/flops.py's rules (hardware FLOPs)."""
  from triax.model import flops, registry

  chips = tpu._chips(topology)
  cfg = tpu.row_config(config, overrides, chips)
  model = registry.build(registry.spec_from_config(cfg.model))
  batch = cfg.train.global_batch_size
  weights = flops.weight_matmul_flops(model, batch)
  return weights / chips, (flops.step_flops(model, batch)['hardware'] - weights) / chips


def versions(plugin: str) -> str:
  """jax's version here and the plugin's (its wheel's dist-info beside jax_plugins/)."""
  import glob

  import jax

  top = os.path.dirname(os.path.dirname(os.path.dirname(plugin)))
  found = glob.glob(os.path.join(top, 'jax_cuda12_pjrt-*.dist-info'))
  pjrt = os.path.basename(found[0])[len('jax_cuda12_pjrt-') : -len('.dist-info')] if found else '?'
  return f'jax {jax.__version__}, jax-cuda12-pjrt {pjrt}'


def write_doc(path: str, results: dict) -> None:
  lines = [
    '# triax on XLA:GPU (compiled here, no GPU)',
    '',
    'Written by `scripts/bench_gpu_compile.py` from docs/bench_gpu_compile.json (exact',
    "bytes; `--rows=''` rewrites this page from it). Each row is the train step XLA:GPU",
    "compiles for H100s (`triax train --compile_only --topology=h100:8`: jax's CUDA plugin",
    'told the GPU by `topology.GPU_KINDS`, no GPU, driver or CUDA library here), per',
    'device, GiB: its arguments (parameters, Adam state, batch), temporaries',
    '(memory_analysis()) and the heap of its buffer assignment; what is live at once at',
    "the step's peak by XLA's own live-range analysis of its schedule (`live`: arguments",
    "and temporaries at the worst point, without the heap's holes; buffers.live_peak);",
    "the planner's predicted peak for the same layout (plan/cost/memory.py, analytic profile,",
    f'{CLUSTER}.yaml) against arguments + temporaries and against the live bytes, which',
    'are what it models. XLA attention (cuDNN attention is built on a GPU),',
    'full remat; the 1B shape is Llama 3.2 1B, the 8B Llama 3.1 8B; 8 sequences x 2048',
    f'tokens (16 on 2 hosts), bf16 compute, fp32 state. {results.get("versions", "")}.',
    '',
    '| layout | topology | arguments | temp | heap | XLA:GPU peak | live | planner '
    '| planner / XLA:GPU | planner / live |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  within = within_live = priced = 0
  for name in [*ROWS, *FP8_ROWS]:
    what, topology, (config, overrides) = row_spec(name)
    r = results.get(name)
    if r is None:
      continue
    compiled = (r['argument'] + r['temp']) / GiB
    predicted = tpu.planner_peak(topology, config, overrides, CLUSTER) / GiB
    priced += 1
    within += 0.9 <= predicted / compiled <= 1.1
    live = r['live'] / GiB
    within_live += 0.9 <= predicted / live <= 1.1
    lines.append(
      f'| {what} | {topology} | {r["argument"] / GiB:.2f} | {r["temp"] / GiB:.2f} '
      f'| {r["heap"] / GiB:.2f} | {compiled:.2f} | {live:.2f} | {predicted:.2f} '
      f'| {predicted / compiled:.3f} | {predicted / live:.3f} |'
    )
  lines += [
    '',
    f'Within 10%: {within} of {priced} against XLA:GPU, {within_live} of {priced} against the live bytes.',
    '',
  ]
  lines += fp8_table(results)
  lines += ['## The largest buffers of each step', '']
  for name in [*ROWS, *FP8_ROWS]:
    what = row_spec(name)[0]
    if name in results:
      biggest = '; '.join(
        f'{b["shape"]} {b["bytes"] / GiB:.2f} GiB' for b in results[name]['largest']
      )
      lines.append(f'- {what}: {biggest}')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))


def fp8_table(results: dict) -> list[str]:
  """The FP8 rows' matmuls: what runs on FP8 operands, and what is left in bf16."""
  rows = [name for name in FP8_ROWS if name in results]
  if not rows:
    return []
  lines = [
    '## Which matmuls run in FP8 (model.fp8)',
    '',
    'Per device, TFLOP per step as executed (loops by their trips, compiled/hlo_work.py):',
    'every matmul, those on two FP8 operands, and those left in bf16; beside them, by the',
    "model's shapes (model/flops.py's hardware FLOPs), the layers' weight matmuls (forward,",
    "dx, dw and full remat's second forward) and the rest (the attention core and the",
    "head, which model.fp8 leaves in bf16); then XLA:GPU's FP8 GEMMs in the program text",
    "(a scanned layer's once): cuBLASLt's custom calls, dots in Triton GEMM fusions.",
    'bf16 / rest 1.000: every matmul left in bf16 is the attention core or the head, so',
    "every weight matmul runs in FP8. The FP8 FLOPs fall short of the weight matmuls' by",
    "the down projection's second forward, which XLA drops as dead (the backward needs its",
    "input, not its output): model/flops.py's full-remat figure counts it.",
    '',
    '| layout | all matmuls | on FP8 operands | weight matmuls (model) | left in bf16 '
    '| rest (model) | bf16 / rest | FP8 GEMMs: cuBLASLt | Triton |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for name in rows:
    what, topology, (config, overrides) = row_spec(name)
    r = results[name]
    weights, rest = model_matmul_flops(topology, config, overrides)
    bf16 = r['flops'] - r['fp8_flops']
    lines.append(
      f'| {what} | {r["flops"] / 1e12:.2f} | {r["fp8_flops"] / 1e12:.2f} | {weights / 1e12:.2f} '
      f'| {bf16 / 1e12:.2f} | {rest / 1e12:.2f} | {bf16 / rest:.3f} '
      f'| {r["fp8_gemms"]["cublaslt"]} | {r["fp8_gemms"]["triton"]} |'
    )
  return lines + ['']


if __name__ == '__main__':
  main()
