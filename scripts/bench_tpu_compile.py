"""triax against MaxText on XLA:TPU, compiled here for TPU slices that are not here.

  .venv/bin/python scripts/bench_tpu_compile.py [--out=docs/bench_tpu_compile.md] \
      [--rows=fsdp4,tp4,...] [--skip_maxtext] [--skip_triax]

Every figure is kept, in exact bytes with each triax step's largest buffers,
in docs/bench_tpu_compile.json (--results): `--rows=''` writes the doc from
it without compiling anything (the planner's table is priced afresh).

Each row compiles the same model, batch and remat policy both ways for the
same v5p topology and reads XLA:TPU's per-device temporary bytes (what a
step holds beside its arguments; arguments are the same state in both):

  triax    `python -m triax train --compile_only --topology=...` (this venv's
           jax and libtpu, the `tpu` extra);
  MaxText  0.2.5's own `train_compile` in a venv of its own that this
           script builds once in .bench/maxtext-venv (Python 3.12, its `tpu`
           extra: several GB; a reference, never a dependency of triax),
           configured to triax's model (Llama 3.2 1B or Llama 3.1 8B's
           shape, tied or not as triax's, 2048 positions, bf16 compute, fp32
           parameters and Adam state, full remat, splash attention).

MaxText's pipeline is its own (GPipe order, its circular variant for v=2);
triax's rows name their schedule. The two venvs carry different jax and
libtpu releases (both printed in the doc), so a few per cent either way is
the compilers' as much as the frameworks'.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

from bench_harness import ROOT, run_python

from triax.compiled import stats as stats_lib

# Venvs, dumps and runs of the benchmarks (TRIAX_BENCH_DIR elsewhere, e.g. for tests).
BENCH = os.environ.get('TRIAX_BENCH_DIR') or os.path.join(ROOT, '.bench')
MAXTEXT = 'maxtext[tpu]==0.2.5'
# The jax scripts/bench_peers.py's CPU table was measured with (its 0.12.1 wheel
# came later). MaxText's XLA:TPU compiles need a libtpu that reads this jax's
# Mosaic kernels: libtpu 0.0.52 (the newest) refuses them today (a
# debug_locations field, then an unknown attribute), so its column here is the
# one recorded when they compiled.
MAXTEXT_PINS = ('jax==0.12.0.1', 'jaxlib==0.12.0.1')
GiB = 2**30

# name -> (what, topology, triax overrides, MaxText overrides)
LLAMA_1B = 'experiments/llama_1b.py:attention=splash,remat=full'
LLAMA_8B = 'experiments/llama_8b.py:attention=splash,remat=full'
ROWS = {
  'fsdp4': (
    'FSDP 4',
    'v5p:2x2x1',
    (LLAMA_1B, {'mesh.data': 4, 'mesh.fsdp': True}),
    {'ici_fsdp_parallelism': 4},
  ),
  'tp4': (
    'TP 4',
    'v5p:2x2x1',
    (LLAMA_1B, {'mesh.data': 1, 'mesh.tensor': 4}),
    {'ici_fsdp_parallelism': 1, 'ici_tensor_parallelism': 4},
  ),
  'tp2pp2': (
    'TP 2 x PP 2, m=8, 1f1b',
    'v5p:2x2x1',
    (LLAMA_1B, {'mesh.data': 1, 'mesh.tensor': 2, 'mesh.pipe': 2, 'pipeline.microbatches': 8}),
    {
      'ici_fsdp_parallelism': 1,
      'ici_tensor_parallelism': 2,
      'ici_pipeline_parallelism': 2,
      'num_pipeline_microbatches': 8,
      'num_layers_per_pipeline_stage': 8,
    },
  ),
  'pp4': (
    'PP 4, m=8, 1f1b',
    'v5p:2x2x1',
    (LLAMA_1B, {'mesh.data': 1, 'mesh.pipe': 4, 'pipeline.microbatches': 8}),
    {
      'ici_fsdp_parallelism': 1,
      'ici_pipeline_parallelism': 4,
      'num_pipeline_microbatches': 8,
      'num_layers_per_pipeline_stage': 4,
    },
  ),
  'pp4_zb': (
    'PP 4, m=8, zb_h1',
    'v5p:2x2x1',
    (
      LLAMA_1B,
      {'mesh.data': 1, 'mesh.pipe': 4, 'pipeline.microbatches': 8, 'pipeline.schedule': 'zb_h1'},
    ),
    None,  # MaxText has no zero-bubble schedule; compared with its pipeline in the row above
  ),
  'pp4_v2': (
    'PP 4, m=8, v=2, interleaved 1f1b (MaxText: circular)',
    'v5p:2x2x1',
    (
      LLAMA_1B,
      {
        'mesh.data': 1,
        'mesh.pipe': 4,
        'pipeline.microbatches': 8,
        'pipeline.virtual_stages': 2,
        'pipeline.schedule': 'interleaved_1f1b',
      },
    ),
    {
      'ici_fsdp_parallelism': 1,
      'ici_pipeline_parallelism': 4,
      'num_pipeline_microbatches': 8,
      'num_layers_per_pipeline_stage': 2,
      'num_pipeline_repeats': 2,
    },
  ),
  'tp4pp2_8b': (
    '8B shape, TP 4 x PP 2 on 8 chips, m=8, 1f1b',
    'v5p:2x2x2',
    (LLAMA_8B, {'mesh.data': 1, 'mesh.tensor': 4, 'mesh.pipe': 2, 'pipeline.microbatches': 8}),
    {
      'ici_fsdp_parallelism': 1,
      'ici_tensor_parallelism': 4,
      'ici_pipeline_parallelism': 2,
      'num_pipeline_microbatches': 8,
      'num_layers_per_pipeline_stage': 16,
    },
  ),
}

LLAMA_1B_DOTS = 'experiments/llama_1b.py:attention=splash,remat=dots'
# Llama 3.1 70B's shape over llama_8b's file (its keys otherwise).
LLAMA_70B = {
  'model.num_layers': 80,
  'model.d_model': 8192,
  'model.num_heads': 64,
  'model.num_kv_heads': 8,
  'model.d_ff': 28672,
}
PIPE_4 = {'mesh.data': 1, 'mesh.pipe': 4, 'pipeline.microbatches': 8}
# Compiled by triax alone, for the planner's memory model: name -> (what, topology,
# (config, overrides)). The planner section covers these and ROWS.
PLANNER_ROWS = {
  'dp4_zero1': (
    'DP 4, ZeRO-1',
    'v5p:2x2x1',
    (LLAMA_1B, {'mesh.data': 4, 'train.optimizer_sharding': 'data'}),
  ),
  'tp4_dots': (
    'TP 4, dots remat',
    'v5p:2x2x1',
    (LLAMA_1B_DOTS, {'mesh.data': 1, 'mesh.tensor': 4}),
  ),
  'dp2tp2_sp': (
    'DP 2 x TP 2, sequence parallel',
    'v5p:2x2x1',
    (LLAMA_1B, {'mesh.data': 2, 'mesh.tensor': 2, 'mesh.sequence_parallel': True}),
  ),
  'pp4_gpipe': (
    'PP 4, m=8, gpipe',
    'v5p:2x2x1',
    (LLAMA_1B, {**PIPE_4, 'pipeline.schedule': 'gpipe'}),
  ),
  'pp4_bpipe': (
    'PP 4, m=8, bpipe',
    'v5p:2x2x1',
    (LLAMA_1B, {**PIPE_4, 'pipeline.schedule': 'bpipe'}),
  ),
  'pp4_zbv': (
    'PP 4, m=8, zb_v',
    'v5p:2x2x1',
    (LLAMA_1B, {**PIPE_4, 'pipeline.schedule': 'zb_v', 'pipeline.virtual_stages': 2}),
  ),
  'fsdp8_8b': ('8B shape, FSDP 8', 'v5p:2x2x2', (LLAMA_8B, {'mesh.data': 8, 'mesh.fsdp': True})),
  'tp8_8b': ('8B shape, TP 8', 'v5p:2x2x2', (LLAMA_8B, {'mesh.data': 1, 'mesh.tensor': 8})),
  'tp8pp4_70b': (
    '70B shape, TP 8 x PP 4 on 32 chips, m=8, 1f1b',
    'v5p:2x4x4',
    (
      LLAMA_8B,
      {**LLAMA_70B, 'mesh.data': 1, 'mesh.tensor': 8, 'mesh.pipe': 4, 'pipeline.microbatches': 8},
    ),
  ),
  'dp2tp8pp4_70b': (
    '70B shape, DP 2 x TP 8 x PP 4 on 64 chips, m=4, zb_h1, ZeRO-1',
    'v5p:4x4x4',
    (
      LLAMA_8B,
      {
        **LLAMA_70B,
        'mesh.data': 2,
        'mesh.tensor': 8,
        'mesh.pipe': 4,
        'pipeline.microbatches': 4,
        'pipeline.schedule': 'zb_h1',
        'train.optimizer_sharding': 'data',
      },
    ),
  ),
  'fsdp32tp8_70b': (
    '70B shape, FSDP 32 x TP 8 on 256 chips, 32 sequences',
    'v5p:4x8x8',
    (
      LLAMA_8B.replace('remat=full', 'remat=full,batch=32'),
      {**LLAMA_70B, 'mesh.data': 32, 'mesh.fsdp': True, 'mesh.tensor': 8},
    ),
  ),
}

# pipeline.edge_grads=loop on ROWS' pipelined layouts, where the default (auto)
# makes the edges' gradients after the tick loop: name -> (what, topology,
# (config, overrides), the row it repeats).
EDGE_ROWS = {
  f'{name}_loop': (what, topology, (config, {**overrides, 'pipeline.edge_grads': 'loop'}), name)
  for name, (what, topology, (config, overrides), _) in ROWS.items()
  if overrides.get('mesh.pipe', 1) > 1
}

# train.offload_optimizer on three of ROWS' layouts: name -> (what, topology,
# (config, overrides), the row it is compared with).
OFFLOAD = {'train.offload_optimizer': True}
OFFLOAD_ROWS = {
  'fsdp4_offload': (
    'FSDP 4',
    'v5p:2x2x1',
    (LLAMA_1B, {'mesh.data': 4, 'mesh.fsdp': True, **OFFLOAD}),
    'fsdp4',
  ),
  'tp4_offload': (
    'TP 4',
    'v5p:2x2x1',
    (LLAMA_1B, {'mesh.data': 1, 'mesh.tensor': 4, **OFFLOAD}),
    'tp4',
  ),
  'pp4_offload': ('PP 4, m=8, 1f1b', 'v5p:2x2x1', (LLAMA_1B, {**PIPE_4, **OFFLOAD}), 'pp4'),
}

# pipeline.offload_stash: name -> (what, topology, (config, overrides), the row
# it is compared with, the same layout with the stash on the device). Without
# remat a set is every layer's activations; under full remat, each layer's input.
LLAMA_1B_NO_REMAT = 'experiments/llama_1b.py:attention=splash,remat=none'
STASH = {'pipeline.offload_stash': True}
ZB_H1 = {**PIPE_4, 'pipeline.schedule': 'zb_h1'}
STASH_ROWS = {
  'pp4_stash': ('PP 4, m=8, 1f1b, full remat', 'v5p:2x2x1', (LLAMA_1B, {**PIPE_4, **STASH}), 'pp4'),
  'pp4_none': ('PP 4, m=8, 1f1b, no remat', 'v5p:2x2x1', (LLAMA_1B_NO_REMAT, PIPE_4), None),
  'pp4_none_stash': (
    'PP 4, m=8, 1f1b, no remat',
    'v5p:2x2x1',
    (LLAMA_1B_NO_REMAT, {**PIPE_4, **STASH}),
    'pp4_none',
  ),
  'pp4_zb_none': ('PP 4, m=8, zb_h1, no remat', 'v5p:2x2x1', (LLAMA_1B_NO_REMAT, ZB_H1), None),
  'pp4_zb_none_stash': (
    'PP 4, m=8, zb_h1, no remat',
    'v5p:2x2x1',
    (LLAMA_1B_NO_REMAT, {**ZB_H1, **STASH}),
    'pp4_zb_none',
  ),
}

# Issue 24's table (tree 2caa00b: jax 0.10.2, libtpu 0.0.42.1, XLA attention), GiB of
# per-device temp: triax then, and MaxText 0.2.5 as that session measured it.
ISSUE_24 = {
  'fsdp4': (5.22, 3.07),
  'tp4': (7.41, 5.07),
  'tp2pp2': (5.42, 4.29),
  'pp4': (7.52, 3.59),
  'pp4_zb': (11.53, None),
  'pp4_v2': (7.02, 4.52),
  'tp4pp2_8b': (15.12, 8.99),
}

# MaxText's model keys for triax's two shapes (its llama2 decoder block is Llama's).
MAXTEXT_MODELS = {
  LLAMA_1B: {
    'base_emb_dim': 2048,
    'base_num_query_heads': 32,
    'base_num_kv_heads': 8,
    'head_dim': 64,
    'base_mlp_dim': 8192,
    'base_num_decoder_layers': 16,
    'logits_via_embedding': 'true',
    'global_batch': 8,
  },
  LLAMA_8B: {
    'base_emb_dim': 4096,
    'base_num_query_heads': 32,
    'base_num_kv_heads': 8,
    'head_dim': 128,
    'base_mlp_dim': 14336,
    'base_num_decoder_layers': 32,
    'logits_via_embedding': 'false',
    'global_batch': 8,
  },
}
MAXTEXT_COMMON = {
  'decoder_block': 'llama2',
  'vocab_size': 128256,
  'normalization_layer_epsilon': '1e-5',
  'rope_max_timescale': 500000,
  'max_target_length': 2048,
  'dtype': 'bfloat16',
  'weight_dtype': 'float32',
  'remat_policy': 'full',
  'attention': 'flash',
  'enable_checkpointing': 'false',
  'dataset_type': 'synthetic',
}


# compile_stats.json's figures of the step and of the programs beside it: a
# checkpoint save's and restore's conversions and the evaluation.
PROGRAM_KEYS = (
  'temp_bytes',
  'argument_bytes',
  'output_bytes',
  'alias_bytes',
  'param_bytes',
  'optimizer_bytes',
  'offloaded_bytes',
  'checkpoint_save_bytes',
  'checkpoint_restore_bytes',
  'eval_bytes',
)


# What MaxText's venv needs to load libtpu here (no TPU, no metadata server).
MAXTEXT_ENV = {'ALLOW_MULTIPLE_LIBTPU_LOAD': '1', 'TPU_SKIP_MDS_QUERY': '1'}


def triax_row(
  name: str, topology: str, config: str, overrides: dict, python: str, env: dict | None = None
) -> dict:
  """triax's compile_stats.json for the row, compiled by `python` (this venv's,
  or MaxText's with `env`: the same jax and libtpu as MaxText's column)."""
  name = name if env is None else f'{name}-maxtext-venv'
  workdir = os.path.join(BENCH, 'triax', name)
  shutil.rmtree(workdir, ignore_errors=True)
  dump = dump_dir(name)
  shutil.rmtree(dump, ignore_errors=True)
  args = [
    '-m',
    'triax',
    'train',
    f'--config={config}',
    '--compile_only',
    f'--topology={topology}',
    f'--workdir={workdir}',
  ] + [f'--config.{k}={v}' for k, v in overrides.items()]
  # XLA's HLO and buffer assignment of the train step, kept (compiled/aot.py).
  done = run_python(args, python=python, env={**(env or {}), 'TRIAX_XLA_DUMP': dump})
  if done.returncode not in (0, 3):
    raise RuntimeError(f'{name}: triax failed:\n{done.stderr[-3000:]}')
  with open(os.path.join(workdir, 'compile_stats.json')) as f:
    return json.load(f)


def dump_dir(name: str) -> str:
  return os.path.join(BENCH, 'triax', f'{name}-xla-dump')


def maxtext_python() -> str:
  """The MaxText venv's python, built on first use."""
  venv = os.path.join(BENCH, 'maxtext-venv')
  python = os.path.join(venv, 'bin', 'python')
  if not os.path.exists(os.path.join(venv, '.installed')):
    base = _python312()
    subprocess.run([base, '-m', 'venv', venv], check=True)
    subprocess.run([python, '-m', 'pip', 'install', '-q', MAXTEXT, *MAXTEXT_PINS], check=True)
    open(os.path.join(venv, '.installed'), 'w').close()
  return python


def _python312() -> str:
  for candidate in (os.environ.get('TRIAX_PYTHON312'), shutil.which('python3.12')):
    if candidate and subprocess.run([candidate, '-c', 'pass'], capture_output=True).returncode == 0:
      return candidate
  found = sorted(glob.glob(os.path.expanduser('~/.pyenv/versions/3.12*/bin/python3.12')))
  if found:
    return found[-1]
  raise SystemExit(
    'error: MaxText 0.2.5 needs Python 3.12: set TRIAX_PYTHON312=/path/to/python3.12'
  )


def maxtext_row(name: str, topology: str, config: str, overrides: dict, python: str) -> dict:
  model = dict(MAXTEXT_MODELS[config])
  chips = _chips(topology)
  per_device = model.pop('global_batch') / chips
  settings = {
    **MAXTEXT_COMMON,
    **model,
    **overrides,
    'per_device_batch_size': per_device,
    'compile_topology': f'v5p-{2 * chips}',  # MaxText names v5p slices by TensorCores
    'compile_topology_num_slices': 1,
    'run_name': name,
    'base_output_directory': os.path.join(BENCH, 'maxtext-out'),
  }
  base = subprocess.run(
    [python, '-c', 'import maxtext, os; print(os.path.dirname(maxtext.__file__))'],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  # MaxText's own compiler, not bench_harness.run_python: no triax on its path.
  cmd = [python, '-m', 'maxtext.trainers.pre_train.train_compile', f'{base}/configs/base.yml']
  cmd += [f'{k}={v}' for k, v in settings.items()]
  # Its buffer assignment, for the heap its temporaries take (as triax's).
  dump = os.path.join(BENCH, 'maxtext-out', f'{name}-xla-dump')
  shutil.rmtree(dump, ignore_errors=True)
  env = dict(os.environ, **MAXTEXT_ENV, XLA_FLAGS=f'--xla_dump_to={dump}')
  done = subprocess.run(cmd, env=env, capture_output=True, text=True)
  text = done.stdout + done.stderr
  found = re.search(r'Memory analysis: CompiledMemoryStats\(([^)]*)\)', text)
  if done.returncode or not found:
    raise RuntimeError(f'{name}: MaxText failed:\n{text[-3000:]}')
  stats = {k: int(v) for k, v in re.findall(r'(\w+)=(\d+)', found.group(1))}
  from triax.compiled import buffers

  return dict(stats, heap=buffers.temp_heap(dump))


def row_config(config: str, overrides: dict, chips: int):
  """A row's validated config, as `triax train --config=PATH:ARG --config.k=v` loads it."""
  from triax import config as config_lib

  path, _, arg = config.partition(':')
  cfg = config_lib.from_file(os.path.join(ROOT, path), arg or None)
  for key, value in overrides.items():
    config_lib.set_dotted(cfg, key, value)
  return config_lib.validate(cfg, chips)


def _chips(topology: str) -> int:
  n = 1
  for d in topology.split(':')[1].split('x'):
    n *= int(d)
  return n


def versions(python: str) -> str:
  code = (
    'import importlib.metadata as m; '
    "print(', '.join(f'{p} {m.version(p)}' for p in ('jax', 'libtpu') ))"
  )
  return subprocess.run([python, '-c', code], capture_output=True, text=True).stdout.strip()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.path.join(ROOT, 'docs', 'bench_tpu_compile.md'))
  parser.add_argument(
    '--rows',
    default=','.join([*ROWS, *PLANNER_ROWS, *OFFLOAD_ROWS, *EDGE_ROWS, *STASH_ROWS]),
    help="names of ROWS, PLANNER_ROWS, OFFLOAD_ROWS, EDGE_ROWS and STASH_ROWS to compile; '' = "
    'none: the doc from the cache',
  )
  parser.add_argument('--skip_maxtext', action='store_true')
  parser.add_argument(
    '--skip_triax',
    action='store_true',
    help="compile only MaxText's side of --rows; triax's figures from --results",
  )
  # Tracked beside the doc, exact byte counts: the doc regenerates from it
  # (--rows='') without compiling, MaxText's columns included.
  parser.add_argument('--results', default=os.path.join(ROOT, 'docs', 'bench_tpu_compile.json'))
  args = parser.parse_args()
  os.makedirs(BENCH, exist_ok=True)
  results = {}
  if os.path.exists(args.results):
    with open(args.results) as f:
      results = json.load(f)
  mt_python = None if args.skip_maxtext else maxtext_python()
  for name in filter(None, args.rows.split(',')):
    if name in PLANNER_ROWS:
      (what, topology, (config, overrides)), mt = PLANNER_ROWS[name], None
    elif name in OFFLOAD_ROWS or name in EDGE_ROWS or name in STASH_ROWS:
      others = {**OFFLOAD_ROWS, **EDGE_ROWS, **STASH_ROWS}
      (what, topology, (config, overrides), _), mt = others[name], None
    else:
      what, topology, (config, overrides), mt = ROWS[name]
    started = time.time()
    row = {}
    if not args.skip_triax:
      stats = triax_row(name, topology, config, overrides, sys.executable)
      row = {
        'triax_temp': stats['temp_bytes'],
        'triax_argument': stats['argument_bytes'],
        'triax_heap': stats['temp_heap_bytes'],
        'triax_largest': stats['largest_buffers'],
        'triax_offloaded': stats['offloaded_bytes'],
        'triax_host_temp': stats['host_temp_bytes'],
        'triax_stash_slots': (stats['schedule'] or {}).get('stash_slots'),
        'triax_set_bytes': (stats['schedule'] or {}).get('residual_bytes_per_slot'),
        # The run's programs beside the step (stats_lib.program_peaks reads these).
        'triax_programs': {k: stats[k] for k in PROGRAM_KEYS},
      }
    if mt is not None and mt_python:
      results['versions'] = {'triax': versions(sys.executable), 'maxtext': versions(mt_python)}
      m = maxtext_row(name, topology, config, mt, mt_python)
      row.update(
        maxtext_temp=m['temp_size_in_bytes'],
        maxtext_argument=m['argument_size_in_bytes'],
        maxtext_heap=m['heap'],
      )
      if not args.skip_triax:
        same = triax_row(name, topology, config, overrides, mt_python, MAXTEXT_ENV)
        row.update(triax_same_temp=same['temp_bytes'], triax_same_heap=same['temp_heap_bytes'])
    results[name] = {**results.get(name, {}), **row}
    print(
      f'{name}: {json.dumps({k: v for k, v in row.items() if k != "triax_largest"})} '
      f'({time.time() - started:.0f} s)',
      flush=True,
    )
    with open(args.results, 'w') as f:
      json.dump(results, f, indent=1)
      f.write('\n')
  write_doc(args.out, results, sys.executable, mt_python)


def planner_peak(
  topology: str, config: str, overrides: dict, cluster: str = 'tpu_v5p', programs: bool = False
) -> float:
  """The planner's per-device peak of the train step (analytic profile, the
  cluster file: the v5p one unless named), for the layout the row compiles:
  the most of any stage. `programs`: of a save, restore or evaluation beside
  the resident state instead (memory.state_programs)."""
  from triax.plan import candidate
  from triax.plan import cluster as cluster_lib
  from triax.plan.cost import analytic, memory

  cfg = row_config(config, overrides, _chips(topology))
  cluster = cluster_lib.load(os.path.join(ROOT, 'experiments', 'clusters', f'{cluster}.yaml'))
  profile = analytic.build(cfg.model, (cfg.mesh.tensor,))
  options = candidate.Options(
    state_programs=False,
    offload_stash=bool(cfg.pipeline.offload_stash),
    offload_optimizer=bool(cfg.train.offload_optimizer),
  )
  plan = candidate.from_config(cfg)
  program = None
  if plan.uses_executor:
    program = plan.lowered
  # Memory only: no step time (an offloading row's would need the cluster's host link).
  return max(memory.memory(plan, profile, cluster, options, program)[4 if programs else 3])


def _maxtext_versions(results: dict, mt_python: str | None) -> str:
  """The MaxText venv's jax and libtpu: asked now, or as recorded when its rows ran."""
  if mt_python:
    return versions(mt_python)
  return results.get('versions', {}).get('maxtext', 'not run')


def planner_rows() -> dict:
  """name -> (what, topology, (config, overrides)) of every row the planner is held against."""
  rows = {k: v[:3] for k, v in ROWS.items()}
  for name, (what, topology, (config, overrides), _) in {**OFFLOAD_ROWS, **STASH_ROWS}.items():
    # Named apart from the row they repeat on the device.
    for key, part in (
      ('train.offload_optimizer', 'optimizer'),
      ('pipeline.offload_stash', 'stash'),
    ):
      what += f', {part} in host memory' if overrides.get(key) else ''
    rows[name] = (what, topology, (config, overrides))
  return {**rows, **PLANNER_ROWS}


def planner_section(results: dict) -> list[str]:
  lines = [
    '',
    '## The planner against XLA:TPU',
    '',
    "The planner's predicted per-device peak of the train step (`plan/cost/memory.py`,",
    'analytic profile, experiments/clusters/tpu_v5p.yaml) for the layout of each row,',
    "against XLA:TPU's compiled peak (arguments + temporaries; the step donates its",
    "state, so outputs take the arguments' buffers), GiB. `XLA:TPU` takes the",
    'temporaries from memory_analysis(), `program` from the buffer assignment: the',
    'heap the program allocates (holes included). memory_analysis() adds the',
    "heap's fragmentation to it a second time (XLA:TPU's backend log at PP 4 1F1B:",
    '"Program hbm requirement 3.68G: HLO temp 3.65G (... fragmentation (615.84M))",',
    '"Total hbm usage >= 9.59G: reserved 263.00M, program 3.68G, arguments 5.65G",',
    'where temp_size_in_bytes is 3.65G + 615.84M); `fragmentation` is that excess.',
    '',
    '| layout | planner | XLA:TPU | planner / XLA | program | planner / program | fragmentation |',
    '|---|---|---|---|---|---|---|',
  ]
  rows = planner_rows()
  within, within_program, priced = 0, 0, 0
  for name, (what, topology, (config, overrides)) in rows.items():
    if name not in results:
      continue
    r = results[name]
    compiled = (r['triax_argument'] + r['triax_temp']) / GiB
    predicted = planner_peak(topology, config, overrides) / GiB
    priced += 1
    within += 0.9 <= predicted / compiled <= 1.1
    heap = r.get('triax_heap')
    if heap is None:
      program_text = '- | - | -'
    else:
      program = (r['triax_argument'] + heap) / GiB
      within_program += 0.9 <= predicted / program <= 1.1
      extra = (r['triax_temp'] - heap) / GiB
      program_text = f'{program:.2f} | {predicted / program:.3f} | {extra:.2f}'
    lines.append(
      f'| {what} | {predicted:.2f} | {compiled:.2f} | {predicted / compiled:.3f} | {program_text} |'
    )
  lines += [
    '',
    f'Within 10%: {within} of {priced} against XLA:TPU, {within_program} against the program.',
  ]
  return lines


def programs_section(results: dict) -> list[str]:
  """Each row's train step against the programs a run holds beside it."""

  lines = [
    '',
    "## The run's peak: the step against a save, a restore and an evaluation",
    '',
    "Per device, GiB, XLA:TPU's memory_analysis() (temporaries as the `triax` column",
    "counts them): the train step's peak, and beside the resident state (parameters and",
    "the optimizer state on the device) a checkpoint save's and a restore's conversion",
    "(leaf by leaf, the checkpoint's copy in host memory: training/relayout.py) and the",
    'evaluation (its forward a micro-batch at a time, the rows over the data and pipe',
    "ranks: training/step.py's `_eval_loss`); `stats_lib.program_peaks`. The run's peak is",
    "the largest; `step` marks a row whose peak is its train step's. The planner's",
    'figure is `memory.state_programs` for the layout (as the section above), against',
    'the largest of the three compiled.',
    '',
    '| layout | step | save | restore | evaluation | run | planner: the largest of the three |',
    '|---|---|---|---|---|---|---|',
  ]
  named = {**planner_rows(), **{k: v[:3] for k, v in EDGE_ROWS.items()}}
  tops = []
  for name, (what, topology, (config, overrides)) in named.items():
    stats = results.get(name, {}).get('triax_programs')
    if stats is None:
      continue
    what += ', edge gradients in the loop' if name in EDGE_ROWS else ''
    peaks = stats_lib.program_peaks(stats)
    tops.append(max(peaks, key=lambda k: (peaks[k], k == 'step')))
    cells = ' | '.join(f'{peaks[k] / GiB:.2f}' for k in ('step', 'save', 'restore', 'eval'))
    predicted = planner_peak(topology, config, overrides, programs=True)
    ratio = predicted / max(peaks['save'], peaks['restore'], peaks['eval'])
    lines.append(f'| {what} | {cells} | {tops[-1]} | {predicted / GiB:.2f} ({ratio:.2f}x) |')
  lines += ['', f"The train step is the run's peak on {tops.count('step')} of {len(tops)} rows."]
  return lines


def _against_base(rows: dict, results: dict):
  """(what, the row's results, its base row's) for each of `rows` measured with its base."""
  for name, (what, _, _, base) in rows.items():
    if name in results and base in results:
      yield what, results[name], results[base]


def offload_section(results: dict) -> list[str]:
  """train.offload_optimizer against the same layout without it."""
  lines = [
    '',
    '## The optimizer state in host memory',
    '',
    "`train.offload_optimizer=true`: Adam's moments (and its count) live in pinned host",
    'memory between steps and come to the device for the update, after the backward.',
    "Per device, GiB: XLA:TPU's arguments in device memory and the program's heap",
    '(the buffer assignment), without and with; HBM = the two together.',
    '',
    '| layout | offloaded | device arguments | heap | HBM | HBM saved |',
    '|---|---|---|---|---|---|',
  ]
  for what, r, b in _against_base(OFFLOAD_ROWS, results):
    hbm = [x['triax_argument'] + x['triax_heap'] for x in (b, r)]
    lines.append(
      f'| {what} | {r["triax_offloaded"] / GiB:.2f} '
      f'| {b["triax_argument"] / GiB:.2f} -> {r["triax_argument"] / GiB:.2f} '
      f'| {b["triax_heap"] / GiB:.2f} -> {r["triax_heap"] / GiB:.2f} '
      f'| {hbm[0] / GiB:.2f} -> {hbm[1] / GiB:.2f} | {(hbm[0] - hbm[1]) / GiB:.2f} |'
    )
  return lines


def stash_section(results: dict) -> list[str]:
  """pipeline.offload_stash against the same layout with the stash on the device."""
  lines = [
    '',
    '## The stash in host memory',
    '',
    "`pipeline.offload_stash=true`: each micro-batch's residual set waits in pinned host",
    'memory between its F and its B and W, copied out after the F and back before',
    "each of them. Per device, GiB: the pool's sets (slots x one set's bytes, the",
    "lowering's), the program's heap without and with, and what XLA:TPU places in host",
    'memory (host temp; the pool and its spare slot are slots + 1 sets of it).',
    '',
    '| layout | slots x set | heap | heap saved | host temp |',
    '|---|---|---|---|---|',
  ]
  # The rows without a base (None) are other rows' bases: _against_base skips them.
  for what, r, b in _against_base(STASH_ROWS, results):
    pool = r['triax_stash_slots'] * r['triax_set_bytes']
    lines.append(
      f'| {what} | {r["triax_stash_slots"]} x {r["triax_set_bytes"] / GiB:.2f} = {pool / GiB:.2f} '
      f'| {b["triax_heap"] / GiB:.2f} -> {r["triax_heap"] / GiB:.2f} '
      f'| {(b["triax_heap"] - r["triax_heap"]) / GiB:.2f} | {r["triax_host_temp"] / GiB:.2f} |'
    )
  return lines


def edge_section(results: dict) -> list[str]:
  """pipeline.edge_grads: in the tick loop against after it (auto's choice here)."""
  lines = [
    '',
    "## The edges' weight gradients after the tick loop",
    '',
    "`pipeline.edge_grads`: the embedding's and head's weight gradients made in the",
    'tick loop (`loop`, an fp32 accumulator of the vocabulary tables carried through it)',
    'or after it (`auto` here: the loop keeps one activation per micro-batch instead,',
    "and each stage makes 1/p of the micro-batches' edge gradients once it ends).",
    "triax's own jax and libtpu; per device, GiB: memory_analysis()'s temp and the",
    "program's heap (the buffer assignment).",
    '',
    '| layout | temp, loop -> after | heap, loop -> after | heap saved |',
    '|---|---|---|---|',
  ]
  for what, r, b in _against_base(EDGE_ROWS, results):
    lines.append(
      f'| {what} | {r["triax_temp"] / GiB:.2f} -> {b["triax_temp"] / GiB:.2f} '
      f'| {r["triax_heap"] / GiB:.2f} -> {b["triax_heap"] / GiB:.2f} '
      f'| {(r["triax_heap"] - b["triax_heap"]) / GiB:.2f} |'
    )
  return lines


def _heap_note(measured) -> list[str]:
  """What the newer libtpu's temp_size_in_bytes is: the heap, for both sides."""
  gaps = [
    abs(r[temp] - r[heap])
    for _, _, r in measured
    for temp, heap in (('maxtext_temp', 'maxtext_heap'), ('triax_same_temp', 'triax_same_heap'))
    if r.get(temp) is not None and r.get(heap) is not None
  ]
  if not gaps:
    return []
  own = [r['triax_temp'] - r['triax_heap'] for _, _, r in measured if r.get('triax_heap')]
  return [
    '',
    "With MaxText's libtpu, `temp_size_in_bytes` is the heap the buffer assignment",
    f'allocates, for both frameworks (within {max(gaps) / 2**10:.0f} KiB on every row); with',
    "triax's own (libtpu 0.0.42) it is the heap plus its fragmentation a second time",
    f'(up to {max(own) / GiB:.2f} GiB here; the planner section below), so the `triax`',
    'column overstates what its program holds.',
  ]


def write_doc(path: str, results: dict, python: str, mt_python: str | None) -> None:
  lines = [
    '# triax against MaxText on XLA:TPU (compiled here, no TPU)',
    '',
    'Written by `scripts/bench_tpu_compile.py` from docs/bench_tpu_compile.json (every',
    "figure in exact bytes; `--rows=''` rewrites this page from it, compiling nothing).",
    'Per-device temporary bytes of the train step as XLA:TPU compiles it for the',
    'topology (its `memory_analysis()`), GiB; the',
    'arguments (parameters, Adam state, batch) are the same state in both. Every row:',
    "the 1B shape is Llama 3.2 1B's (tied embeddings), the 8B one Llama 3.1 8B's; 8",
    'sequences x 2048 tokens, bf16 compute, fp32 parameters and Adam, full remat, splash',
    'attention on both sides.',
    '',
    f'triax: {versions(python)}. MaxText 0.2.5: {_maxtext_versions(results, mt_python)}.',
    "`same compiler`: triax compiled by the MaxText venv's python (its jax, libtpu,",
    'flax and optax; triax from src/), so that both columns come from one XLA:TPU.',
    '',
    '| layout | topology | triax | triax, same compiler | MaxText | '
    'triax / MaxText, same compiler | triax / MaxText | arguments triax / MaxText | '
    'issue 24: triax / MaxText then |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  measured = [(name, ROWS[name], results[name]) for name in ROWS if name in results]
  gib = lambda x: '-' if x is None else f'{x / GiB:.2f}'  # noqa: E731
  for name, (what, topology, _, _), r in measured:
    mt, same = r.get('maxtext_temp'), r.get('triax_same_temp')
    ratio = f'{r["triax_temp"] / mt:.2f}' if mt else '-'
    same_ratio = f'{same / mt:.2f}' if mt and same else '-'
    args = f'{gib(r["triax_argument"])} / {gib(r.get("maxtext_argument"))}'
    then = ISSUE_24.get(name, (None, None))
    then_text = ' / '.join('-' if x is None else f'{x:.2f}' for x in then)
    lines.append(
      f'| {what} | {topology} | {gib(r["triax_temp"])} | {gib(same)} | {gib(mt)} | '
      f'{same_ratio} | {ratio} | {args} | {then_text} |'
    )
  lines += [
    '',
    "Issue 24's columns are that session's measurements (XLA attention on triax's side,",
    "splash on MaxText's but for its 4.91 GiB FSDP row with materialised scores); the",
    "other columns are this script's, MaxText in its own venv with its own jax and libtpu.",
  ]
  lines += _heap_note(measured)
  lines += planner_section(results)
  lines += programs_section(results)
  lines += edge_section(results)
  lines += offload_section(results)
  lines += stash_section(results)
  lines += [
    '',
    '## The largest buffers of each triax step',
    '',
    "From XLA:TPU's buffer assignment (compile_stats.json's `largest_buffers`; all ten",
    'of each in docs/bench_tpu_compile.json). Values that share bytes at different',
    "times each appear: the pipelines' three fp32 tables are one buffer (offset and",
    "size the same), the tied table's gradient accumulator, made after the tick loop",
    "(`pipeline.edge_grads`), which the head's dot_general and the embedding's",
    'scatter-add update in place.',
    '',
  ]
  for _, (what, _, _, _), r in measured:
    lines.append(
      f'- {what}: '
      + '; '.join(
        f'{b["shape"]} {b["bytes"] / GiB:.2f} GiB ({b["op_name"].split("/")[-1] or "-"})'
        for b in r['triax_largest'][:3]
      )
    )
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))


if __name__ == '__main__':
  main()
