"""The work triax's and MaxText's train steps execute per device, read from
XLA's optimised HLO (compiled/hlo_work.py): matmul FLOPs with every loop
trip and every taken branch counted, bytes accessed, collective bytes.

  .venv/bin/python scripts/bench_peers_work.py [--rows=pp4_xla_attn,pp4,gpu-tp8,...] \
      [--results=docs/bench_peers_work.json]

Rows, three kinds:

- `NAME_xla_attn`: bench_tpu_compile.py's row NAME (its mesh, layout,
  schedule, remat, batch and topology) with XLA's own attention on both
  sides, triax `attention=xla` and MaxText `attention=dot_product`, both
  compiled by MaxText's venv (its jax and libtpu: one XLA:TPU compiler; triax
  from src/ as bench_tpu_compile's `same compiler` column). No Pallas kernel
  is involved: libtpu 0.0.52 refuses jax 0.12's Pallas kernels (MaxText's
  splash and flash attention: a `debug_locations` field, then an unknown
  Mosaic attribute), and a Pallas call carries at best a cost estimate; here
  every matmul of both steps is counted. Only these rows have both columns
  (pp4_zb has no MaxText counterpart). `NAME_loop_xla_attn`: the pipelined
  ones with `pipeline.edge_grads=loop` (bench_tpu_compile's EDGE_ROWS), triax
  only, to set against NAME_xla_attn's MaxText column.
- `NAME`: the row as bench_tpu_compile compiles it (splash attention), triax
  only, in triax's venv: splash's calls are opaque (their FLOPs not counted).
- `gpu-NAME`: bench_gpu_compile.py's rows (XLA:GPU h100, XLA attention),
  triax only: MaxText 0.2.5's train_compile builds its topology with
  jax.experimental.topologies for TPU names only (`compile_topology=v5p-8`).

A row's dump is reused when it exists (.bench/triax/NAME-xla-dump, with
`-maxtext-venv` before `-xla-dump` for the same-compiler compiles, and
.bench/maxtext-out/NAME-xla-dump), else compiled, one at a time (minutes
each on a small host). MaxText's venv is .bench/maxtext-venv with
`.installed` (bench_tpu_compile.py builds it; this script never does).

triax's tick loop runs one cond per action kind per tick: each branch is
weighted by how often the row's stages run it (executor.branch_counts, from
the lowered schedule of the row's config). The stages of a pipeline execute
different work (only the first embeds, only the last runs the head), so
a triax row reports the mean over stages (the step's executed work / the
device count) and the busiest stage's. MaxText's step has no branch that
depends on the stage, so each of its devices executes the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing

import bench_gpu_compile as gpu
import bench_tpu_compile as tpu
from bench_harness import ROOT

BENCH = tpu.BENCH
RESULTS = os.path.join(ROOT, 'docs', 'bench_peers_work.json')
MAXTEXT_VENV = os.path.join(BENCH, 'maxtext-venv')
# hlo_work's rules a row was counted by: 2 counts fused reduce-scatters (XLA:TPU's)
# and in-place updates by their slice; rows without it were counted before.
COUNTING = 2
# The suffix of the rows compiled with XLA's attention on both sides.
XLA_ATTN = '_xla_attn'


class Row(typing.NamedTuple):
  what: str
  platform: str  # 'tpu' or 'gpu'
  topology: str
  triax: tuple  # (config, overrides)
  maxtext: dict | None  # MaxText's overrides; None: triax only
  same_compiler: bool  # triax compiled by MaxText's venv
  base: str  # bench_tpu_compile's or bench_gpu_compile's row name


def rows() -> dict[str, Row]:
  out = {}
  for name, (what, topology, (config, overrides), mt) in tpu.ROWS.items():
    xla = config.replace('attention=splash', 'attention=xla')
    mt_xla = None if mt is None else {**mt, 'attention': 'dot_product'}
    out[f'{name}{XLA_ATTN}'] = Row(what, 'tpu', topology, (xla, overrides), mt_xla, True, name)
  # pipeline.edge_grads=loop on the pipelined rows (no edge rows after the
  # loop: the last stage makes the head's weight gradient in it), triax only.
  for name, (what, topology, (config, overrides), base) in tpu.EDGE_ROWS.items():
    xla = config.replace('attention=splash', 'attention=xla')
    what = f'{what}, edge gradients in the loop'
    out[f'{name}{XLA_ATTN}'] = Row(what, 'tpu', topology, (xla, overrides), None, True, base)
  for name, (what, topology, triax, _) in tpu.ROWS.items():
    out[name] = Row(what, 'tpu', topology, triax, None, False, name)
  for name, (what, topology, triax) in gpu.ROWS.items():
    out[f'gpu-{name}'] = Row(what, 'gpu', topology, triax, None, False, name)
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
  from triax.compiled import hlo_work
  from triax.pipeline import executor
  from triax.training import step

  with open(hlo_work.after_optimizations(dump)) as f:
    hlo = f.read()
  program = step.program_of(cfg)
  if program is None:
    return _figures([hlo_work.work(hlo)])
  # The edge rows' cond exists only where the step makes the edges'
  # gradients after the loop (and pads its rows).
  counts = executor.branch_counts(program, executor.MARK_EDGE_ROW in hlo)
  stages = [hlo_work.work(hlo, c) for c in counts]
  out = _figures(stages, counts)
  out['stages'] = [_where(w, executor.MARK_EDGE_ROW) for w in stages]
  return out


def _where(w, edge_row: str) -> dict:
  """One stage's FLOPs, and of them the head's (op_names under the model's
  `Head`) in the tick loop and everything in the edge rows after it."""
  head = sum(v for k, v in w.flops_by_op.items() if 'Head' in k and edge_row not in k)
  edge = sum(v for k, v in w.flops_by_op.items() if edge_row in k)
  return {'flops': w.flops, 'head_in_loop': head, 'edge_rows': edge}


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


def maxtext_python() -> str:
  """MaxText's venv's python; BadInput without it (never built here)."""
  if not os.path.exists(os.path.join(MAXTEXT_VENV, '.installed')):
    raise BadInput(
      'MaxText venv',
      f'no {MAXTEXT_VENV}/.installed: build it with scripts/bench_tpu_compile.py (the NAME rows need none)',
    )
  return os.path.join(MAXTEXT_VENV, 'bin', 'python')


class BadInput(Exception):
  def __init__(self, key: str, message: str):
    super().__init__(f'{key}: {message}')


def run_row(name: str, row: Row, skip_maxtext: bool, stored: dict | None = None) -> dict:
  """The row's figures; with `skip_maxtext`, MaxText's are the `stored` row's, if it
  has them counted by these rules (its step does not change with triax's)."""
  chips = tpu._chips(row.topology)  # v5p:2x2x1 and h100:8 alike
  config, overrides = row.triax
  cfg = tpu.row_config(config, overrides, chips)
  figures = model_flops(cfg, chips)
  out = {'what': row.what, 'platform': row.platform, 'topology': row.topology, 'devices': chips}
  out['counting'] = COUNTING
  out['model_flops'], out['hardware_flops'] = figures['model'], figures['hardware']
  python, env = sys.executable, None
  if row.same_compiler:
    python, env = maxtext_python(), tpu.MAXTEXT_ENV
    out['attention'] = 'xla'
    out['compiler'] = tpu.versions(python)
  dump = tpu.dump_dir(name if env is None else f'{name}-maxtext-venv')
  if not _has_dump(dump):
    if row.platform == 'gpu':
      os.environ.setdefault('TRIAX_XLA_CUDA_PLUGIN', gpu.PLUGIN)
    tpu.triax_row(name, row.topology, config, overrides, python, env)
  out['triax'] = triax_work(dump, cfg)
  if row.maxtext is not None and not skip_maxtext:
    mt_dump = os.path.join(BENCH, 'maxtext-out', f'{name}-xla-dump')
    if not _has_dump(mt_dump):
      # MaxText's model keys are those of the bench_tpu_compile row's config.
      model = tpu.ROWS[row.base][2][0]
      tpu.maxtext_row(name, row.topology, model, row.maxtext, maxtext_python())
    out['maxtext'] = maxtext_work(mt_dump)
  elif stored and 'maxtext' in stored and stored.get('counting') == COUNTING:
    out['maxtext'] = stored['maxtext']
  for side in ('triax', 'maxtext'):
    if side in out:
      out[side]['executed_over_model'] = out[side]['flops'] / out['model_flops']
  return out


def _tflop(w: dict) -> str:
  """Executed TFLOP, the busiest stage's in brackets where it is more."""
  busiest = f' ({w["flops_max"] / 1e12:.2f})' if w['flops_max'] > w['flops'] * 1.0005 else ''
  return f'{w["flops"] / 1e12:.2f}{busiest}'


def _collective(w: dict) -> float:
  return sum(w['collective_bytes'].values()) / 2**30


def _beyond_maxtext(both: dict) -> list[str]:
  """Where triax's busiest stage executes more than MaxText's device: the
  head's share of the busiest stage, in the tick loop and after it."""
  lines = []
  for name, row in both.items():
    t, m = row['triax'], row.get('maxtext')
    if m is None or t['flops_max'] <= m['flops_max'] or 'stages' not in t:
      continue
    k, s = max(enumerate(t['stages']), key=lambda ks: ks[1]['flops'])
    mean_edge = sum(x['edge_rows'] for x in t['stages']) / len(t['stages'])
    lines.append(
      f'- {name}: stage {k} executes {(s["flops"] - m["flops_max"]) / 1e12:+.2f} TFLOP beyond '
      f"MaxText's device: of its {s['flops'] / 1e12:.2f}, the head's matmuls in the tick loop "
      f"(every micro-batch's forward and input gradient) take {s['head_in_loop'] / 1e12:.2f} and "
      f"its edge rows after the loop {s['edge_rows'] / 1e12:.2f} (every stage's: "
      f'{mean_edge / 1e12:.2f} on the mean).'
    )
  if lines:
    lines = [
      '',
      "Where triax's busiest stage executes more than MaxText's devices (each of them runs",
      "the same; its head is split over them): the edge rows re-run the head's forward for",
      "1/p of the micro-batches to make the head matrix's weight gradient (two of the head's",
      'three matmuls; `pipeline.edge_grads` after the loop), on top of the in-loop head of the',
      'last stage.',
      '',
      *lines,
    ]
  return lines


def work_table(results: dict) -> list[str]:
  """Markdown lines: what the columns are, the rows with XLA attention on
  both sides (triax and MaxText), then triax's own rows."""
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
  ]
  both = {k: r for k, r in results.items() if isinstance(r, dict) and r.get('attention') == 'xla'}
  if both:
    compiler = next(iter(both.values())).get('compiler', '')
    lines += [
      '',
      '### With XLA attention on both sides',
      '',
      "bench_tpu_compile's rows (the same mesh, layout, schedule, remat, batch and",
      "topology) with XLA's own attention on both sides (triax `attention=xla`, MaxText",
      '`attention=dot_product`): no Pallas kernel, so every matmul of both steps is counted',
      'and MaxText compiles (its splash kernels do not on this libtpu). One compiler:',
      f"MaxText's venv ({compiler}), triax from src/. Cells are triax / MaxText;",
      '*triax - MaxText* is the executed TFLOPs triax runs beyond MaxText per device (mean;',
      "busiest in brackets). Rows named `_loop_` make the edges' gradients in the tick loop",
      '(`pipeline.edge_grads=loop`; triax only, against the MaxText column of the row',
      "without `_loop`): no edge rows after the loop, so their mean is the unpipelined rows'",
      "and the last stage makes the head's weight gradient.",
      '',
      '| row | what | executed TFLOP | model TFLOP | executed/model | bytes GiB '
      '| collective GiB | triax - MaxText TFLOP |',
      '|---|---|---|---|---|---|---|---|',
    ]
    for name, row in both.items():
      t, m = row['triax'], row.get('maxtext')
      if m is None:
        mt = {'tflop': '-', 'ratio': '-', 'bytes': '-', 'coll': '-'}
        extra = '-'
      else:
        mt = {
          'tflop': _tflop(m),
          'ratio': f'{m["executed_over_model"]:.3f}',
          'bytes': f'{m["bytes"] / 2**30:.1f}',
          'coll': f'{_collective(m):.2f}',
        }
        extra = f'{(t["flops"] - m["flops"]) / 1e12:+.2f} ({(t["flops_max"] - m["flops_max"]) / 1e12:+.2f})'
      lines.append(
        f'| {name} | {row["what"]} | {_tflop(t)} / {mt["tflop"]} | {row["model_flops"] / 1e12:.2f} '
        f'| {t["executed_over_model"]:.3f} / {mt["ratio"]} '
        f'| {t["bytes"] / 2**30:.1f} / {mt["bytes"]} | {_collective(t):.2f} / {mt["coll"]} | {extra} |'
      )
    lines += _beyond_maxtext(both)
  lines += [
    '',
    "### triax's rows as bench_tpu_compile and bench_gpu_compile compile them",
    '',
    'On XLA:TPU these rows use splash attention, a Pallas kernel that carries no cost',
    'estimate: its calls are *opaque* (counted, their FLOPs not), so those rows hold',
    "the matmuls outside attention against model FLOPs that include attention's (triax's",
    'own venv and compiler); the XLA:GPU rows use XLA attention, every matmul counted.',
    '',
    '| row | what | executed TFLOP | model TFLOP | executed/model | bytes GiB '
    '| collective GiB | opaque kernels | unweighted conds |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  stale = 0
  for name, row in results.items():
    if not isinstance(row, dict) or 'model_flops' not in row or name in both:
      continue
    w = row['triax']
    old = '' if row.get('counting') == COUNTING else ' *'
    stale += bool(old)
    lines.append(
      f'| {name} | {row["what"]} | {_tflop(w)} | {row["model_flops"] / 1e12:.2f} '
      f'| {w["executed_over_model"]:.3f} | {w["bytes"] / 2**30:.1f}{old} | {_collective(w):.2f}{old} '
      f'| {w["opaque_calls"]:.0f} | {w["unweighted_conditionals"]} |'
    )
  if stale:
    lines += [
      '',
      '\\* Counted by an older compiled/hlo_work.py (its dump is not kept): whole buffers for',
      'in-place updates (bytes too high), and on XLA:TPU no fused reduce-scatters.',
    ]
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--rows',
    default=','.join(f'{name}{XLA_ATTN}' for name in tpu.ROWS),
    help="row names: NAME_xla_attn (both sides), NAME (triax, splash), gpu-NAME; '' = none",
  )
  parser.add_argument('--results', default=RESULTS)
  parser.add_argument(
    '--skip_maxtext',
    action='store_true',
    help="compile triax's side only; MaxText's figures stay those --results holds",
  )
  args = parser.parse_args()
  try:
    run(args)
  except BadInput as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


def run(args) -> None:
  table = rows()
  names = list(filter(None, args.rows.split(',')))
  unknown = [n for n in names if n not in table]
  if unknown:
    raise BadInput('--rows', f'unknown row {unknown[0]!r}; choose from {", ".join(table)}')
  if any(table[n].same_compiler for n in names):
    maxtext_python()
  results = {}
  if os.path.exists(args.results):
    with open(args.results) as f:
      results = json.load(f)
  order = {name: k for k, name in enumerate(table)}
  for name in names:
    results[name] = run_row(name, table[name], args.skip_maxtext, results.get(name))
    # In rows()' order: XLA attention on both sides, then triax's own rows.
    results = dict(sorted(results.items(), key=lambda kv: order.get(kv[0], len(order))))
    with open(args.results, 'w') as f:
      json.dump(results, f, indent=1)
      f.write('\n')
    print(name, json.dumps(results[name], default=str)[:400], flush=True)
  print('\n'.join(work_table(results)))


if __name__ == '__main__':
  main()
