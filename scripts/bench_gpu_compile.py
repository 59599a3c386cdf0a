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

Every figure is kept in exact bytes in docs/bench_gpu_compile.json; `--rows=''`
rewrites the page from it, compiling nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import bench_tpu_compile as tpu  # its row compiler and the planner's peak
from bench_harness import ROOT

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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.path.join(ROOT, 'docs', 'bench_gpu_compile.md'))
  parser.add_argument('--rows', default=','.join(ROWS), help="rows to compile; '' for none")
  args = parser.parse_args()
  plugin = os.environ.setdefault('TRIAX_XLA_CUDA_PLUGIN', PLUGIN)  # the rows' processes inherit it
  results_path = os.path.splitext(args.out)[0] + '.json'
  results = {}
  if os.path.exists(results_path):
    with open(results_path) as f:
      results = json.load(f)
  from triax.compiled import buffers

  for name in filter(None, args.rows.split(',')):
    what, topology, (config, overrides) = ROWS[name]
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
    print(name, {k: v for k, v in results[name].items() if k != 'largest'}, flush=True)
  results['versions'] = versions(plugin)
  with open(results_path, 'w') as f:
    json.dump(results, f, indent=1)
    f.write('\n')
  write_doc(args.out, results)


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
  for name, (what, topology, (config, overrides)) in ROWS.items():
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
    '## The largest buffers of each step',
    '',
  ]
  for name, (what, *_) in ROWS.items():
    if name in results:
      biggest = '; '.join(
        f'{b["shape"]} {b["bytes"] / GiB:.2f} GiB' for b in results[name]['largest']
      )
      lines.append(f'- {what}: {biggest}')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))


if __name__ == '__main__':
  main()
