"""The work triax's and MaxText's train steps execute per device, read from
XLA's optimised HLO (compiled/hlo_work.py): matmul FLOPs with every loop
trip and every taken branch counted, bytes accessed, collective bytes.

  .venv/bin/python scripts/bench_peers_work.py [--rows=pp4,tp4,gpu-tp8,...] \
      [--results=docs/bench_peers_work.json]

Rows: bench_tpu_compile.py's ROWS (XLA:TPU v5p, triax and MaxText 0.2.5
alike) and, named `gpu-NAME`, bench_gpu_compile.py's (XLA:GPU h100, triax
only: MaxText 0.2.5's train_compile builds its topology with
jax.experimental.topologies for TPU names only (`compile_topology=v5p-8`);
not tried further here). A row's dump is reused when it exists
(.bench/triax/NAME-xla-dump, .bench/maxtext-out/NAME-xla-dump), else
compiled, one at a time (minutes each on a small host). MaxText's column
needs its venv (.bench/maxtext-venv with `.installed`; never built here)
and a libtpu that reads its jax's Pallas kernels: on 2026-12-06 libtpu
0.0.52, the newest, refused jax 0.12's (a `debug_locations` field, then,
without it, an unknown Mosaic attribute), so no MaxText row was compiled.

triax's tick loop runs one cond per action kind per tick: each branch is
weighted by how often the row's stages run it (executor.branch_counts, from
the lowered schedule of the row's config). The stages of a pipeline execute
different work (only the first embeds, only the last runs the head), so
a triax row reports the mean over stages (the step's executed work / the
device count) and the busiest stage's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import bench_gpu_compile as gpu
import bench_tpu_compile as tpu
from bench_harness import ROOT

BENCH = tpu.BENCH
RESULTS = os.path.join(ROOT, 'docs', 'bench_peers_work.json')


def rows() -> dict:
  """name -> (what, platform, topology, (triax config, overrides), MaxText overrides or None)."""
  out = {}
  for name, (what, topology, triax, mt) in tpu.ROWS.items():
    out[name] = (what, 'tpu', topology, triax, mt)
  for name, (what, topology, triax) in gpu.ROWS.items():
    out[f'gpu-{name}'] = (what, 'gpu', topology, triax, None)
  return out


def model_flops(cfg, chips: int) -> dict[str, float]:
  """model/flops.py's step FLOPs of `cfg`'s model, per device."""
  from triax.model import flops as flops_lib
  from triax.model import registry

  model = registry.build(registry.spec_from_config(cfg.model))
  step = flops_lib.step_flops(model, cfg.train.global_batch_size)
  return {k: v / chips for k, v in step.items()}


def triax_work(dump: str, cfg) -> dict:
  """Executed work per device of triax's step dumped in `dump`."""
  from triax.compiled import hlo_work, step
  from triax.pipeline import executor

  with open(hlo_work.after_optimizations(dump)) as f:
    hlo = f.read()
  program = step.program_of(cfg)
  if program is None:
    return _figures([hlo_work.work(hlo)])
  # The edge rows' cond exists only where the step makes the edges'
  # gradients after the loop (and pads its rows).
  counts = executor.branch_counts(program, executor.MARK_EDGE_ROW in hlo)
  return _figures([hlo_work.work(hlo, c) for c in counts], counts)


def maxtext_work(dump: str) -> dict:
  from triax.compiled import hlo_work

  with open(hlo_work.after_optimizations(dump)) as f:
    return _figures([hlo_work.work(f.read())])


def _figures(stages: list, counts: list | None = None) -> dict:
  """Mean and busiest of per-stage Work (replicas execute alike)."""
  n = len(stages)
  mean = stages[0] * (1 / n)
  for w in stages[1:]:
    mean.add(w, 1 / n)
  busiest = max(stages, key=lambda w: w.flops)
  out = {
    'flops': mean.flops,
    'flops_max': busiest.flops,
    'bytes': mean.bytes,
    'collective_bytes': mean.collective_bytes,
    'collective_counts': mean.collective_counts,
    'unweighted_conditionals': max(w.unweighted_conditionals for w in stages),
    'opaque_calls': mean.opaque_calls,
    # Where the FLOPs are: op_names cut to their last three components.
    'top_ops': [[k, v] for k, v in mean.top_ops(12, depth=3)],
  }
  if counts is not None:
    out['branch_counts'] = counts
  return out


def _has_dump(dump: str) -> bool:
  from triax.compiled import hlo_work

  return os.path.isdir(dump) and hlo_work.after_optimizations(dump) is not None


def run_row(name: str, row, skip_maxtext: bool) -> dict:
  what, platform, topology, (config, overrides), mt = row
  chips = tpu._chips(topology)  # v5p:2x2x1 and h100:8 alike
  cfg = tpu.row_config(config, overrides, chips)
  figures = model_flops(cfg, chips)
  out = {'what': what, 'platform': platform, 'topology': topology, 'devices': chips}
  out['model_flops'], out['hardware_flops'] = figures['model'], figures['hardware']
  dump = tpu.dump_dir(name)
  if not _has_dump(dump):
    if platform == 'gpu':
      os.environ.setdefault('TRIAX_XLA_CUDA_PLUGIN', gpu.PLUGIN)
    tpu.triax_row(name, topology, config, overrides, sys.executable)
  out['triax'] = triax_work(dump, cfg)
  venv = os.path.join(BENCH, 'maxtext-venv')
  if mt is not None and not skip_maxtext and os.path.exists(os.path.join(venv, '.installed')):
    mt_dump = os.path.join(BENCH, 'maxtext-out', f'{name}-xla-dump')
    if not _has_dump(mt_dump):
      tpu.maxtext_row(name, topology, config, mt, os.path.join(venv, 'bin', 'python'))
    out['maxtext'] = maxtext_work(mt_dump)
  for side in ('triax', 'maxtext'):
    if side in out:
      out[side]['executed_over_model'] = out[side]['flops'] / out['model_flops']
  return out


def work_table(results: dict) -> list[str]:
  """Markdown lines: a paragraph saying what the columns are, then the table."""
  lines = [
    "Per device, one train step, from XLA's optimised HLO (compiled/hlo_work.py;",
    'scripts/bench_peers_work.py, exact figures in docs/bench_peers_work.json).',
    '*Executed* TFLOPs are the matmul FLOPs (dot, convolution, library GEMMs, Pallas',
    'kernels by their cost estimate) of every instruction the device runs: loop bodies',
    "times their trip counts, and triax's tick branches times the ticks that run them",
    "(from the schedule's tick tables; the mean over pipeline stages, the busiest in",
    "brackets). *Model* TFLOPs are model/flops.py's step figure (forward and backward",
    'matmuls, no recomputation) / devices. Executed/model above 1 is recomputation',
    '(full remat: about 4/3), pipeline bubble compute and redundant work; below 1,',
    'work a formula counts that XLA does not run. *Bytes*: operands and outputs of',
    "each executed top-level instruction (a fusion's, not its inside), as XLA's",
    'cost analysis counts bytes accessed. *Collective* GiB: the data collectives move',
    '(all-gather: its output; the others: their operand), all kinds together.',
    '',
    'On XLA:TPU the rows use splash attention, a Pallas kernel that carries no cost',
    'estimate: its calls are *opaque* (counted, their FLOPs not), so those rows hold',
    "the matmuls outside attention against model FLOPs that include attention's; the",
    'XLA:GPU rows use XLA attention, every matmul counted.',
    '',
    '| row | what | side | executed TFLOP | model TFLOP | executed/model | bytes GiB '
    '| collective GiB | opaque kernels | unweighted conds |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for name, row in results.items():
    if not isinstance(row, dict) or 'model_flops' not in row:
      continue
    for side in ('triax', 'maxtext'):
      w = row.get(side)
      if not w:
        continue
      busiest = f' ({w["flops_max"] / 1e12:.2f})' if w['flops_max'] > w['flops'] * 1.0005 else ''
      lines.append(
        f'| {name} | {row["what"]} | {side} | {w["flops"] / 1e12:.2f}{busiest} '
        f'| {row["model_flops"] / 1e12:.2f} | {w["executed_over_model"]:.3f} '
        f'| {w["bytes"] / 2**30:.1f} | {sum(w["collective_bytes"].values()) / 2**30:.2f} '
        f'| {w["opaque_calls"]:.0f} | {w["unweighted_conditionals"]} |'
      )
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rows', default=','.join(tpu.ROWS), help='row names (gpu-NAME for GPU)')
  parser.add_argument('--results', default=RESULTS)
  parser.add_argument('--skip_maxtext', action='store_true')
  args = parser.parse_args()
  results = {}
  if os.path.exists(args.results):
    with open(args.results) as f:
      results = json.load(f)
  table = rows()
  for name in filter(None, args.rows.split(',')):
    results[name] = run_row(name, table[name], args.skip_maxtext)
    with open(args.results, 'w') as f:
      json.dump(results, f, indent=1)
      f.write('\n')
    print(name, json.dumps({k: v for k, v in results[name].items()}, default=str)[:400], flush=True)
  print('\n'.join(work_table(results)))


if __name__ == '__main__':
  main()
