"""triax beside MaxText: the same Llama, tokens and layout, timed on XLA:CPU.

  python scripts/bench_peers.py [--layouts=dp8,fsdp8,...] [--pairs=3] [--steps=6] \
      [--out=docs/bench_peers.md]

Each layout of experiments/llama_peers.py runs as `triax train` and as
MaxText 0.2.5's own `train` (synthetic data), each in a process of its own
through scripts/peers_run.py, in the venv this script builds for MaxText
(.bench/maxtext-venv, as scripts/bench_tpu_compile.py does; a reference,
never a dependency): one jax, one XLA and the same flags for both, 8 CPU
devices forced the same way. The two frameworks alternate, layout by layout,
for --pairs rounds; a run's step time is the median of its steps after the
first two (compilation and the first dispatches), each step the wall time
between two steps' completions (triax's metrics; MaxText's log lines, which
it writes as a step's metrics arrive). A layout's ratio is the median of the
pairs' ratios, with their spread.

Every run's figures are kept in docs/bench_peers.json; `--layouts=''`
rewrites the page from it. The executed-work table (loop- and branch-aware
counts from the compiled programs) is scripts/bench_peers_work.py's.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

import bench_tpu_compile as tpu  # the MaxText venv it builds
from bench_harness import ROOT, fail, run_python

BENCH = tpu.BENCH
CONFIG = 'experiments/llama_peers.py'
RUNNER = os.path.join(ROOT, 'scripts', 'peers_run.py')
WARMUP = 2  # steps left out of a run's median

# MaxText 0.2.5's keys for experiments/llama_peers.py's model (its llama2 block is Llama's).
MAXTEXT_MODEL = {
  'hardware': 'cpu',
  'decoder_block': 'llama2',
  'base_emb_dim': 512,
  'base_num_query_heads': 8,
  'base_num_kv_heads': 4,
  'head_dim': 64,
  'base_mlp_dim': 1536,
  'base_num_decoder_layers': 8,
  'vocab_size': 8192,
  'max_target_length': 512,
  'rope_max_timescale': 10000,
  'normalization_layer_epsilon': '1e-5',
  'logits_via_embedding': 'false',
  'per_device_batch_size': 2,  # 16 sequences on 8 devices
  'dtype': 'bfloat16',
  'weight_dtype': 'float32',
  'remat_policy': 'full',
  'attention': 'dot_product',  # triax's model.attention=xla: XLA's own attention on both sides
  'opt_type': 'adamw',
  'enable_checkpointing': 'false',
  'enable_tensorboard': 'false',
  'dataset_type': 'synthetic',
  # No persistent compilation cache (base.yml keeps one in ~/jax_cache), so a
  # run's compile seconds are a compile, as triax's are.
  'jax_cache_dir': '',
}
_PP4 = {
  'ici_fsdp_parallelism': 1,
  'ici_data_parallelism': 2,
  'ici_pipeline_parallelism': 4,
  'num_pipeline_microbatches': 8,
}
# name -> (what, MaxText's keys, MaxText's pipeline); zb_h1's row reuses 1f1b's MaxText runs.
LAYOUTS = {
  'dp8': ('DP 8', {'ici_fsdp_parallelism': 1, 'ici_data_parallelism': 8}, ''),
  'fsdp8': ('FSDP 8', {'ici_fsdp_parallelism': 8}, ''),
  'tp2_fsdp4': ('TP 2 x FSDP 4', {'ici_fsdp_parallelism': 4, 'ici_tensor_parallelism': 2}, ''),
  'tp4_dp2': (
    'TP 4 x DP 2',
    {'ici_fsdp_parallelism': 1, 'ici_data_parallelism': 2, 'ici_tensor_parallelism': 4},
    '',
  ),
  'pp4_dp2_1f1b': (
    'PP 4 x DP 2, m=8: 1f1b',
    {**_PP4, 'num_layers_per_pipeline_stage': 2},
    'its pipeline (GPipe order)',
  ),
  'pp4_dp2_zb_h1': ('PP 4 x DP 2, m=8: zb_h1', None, 'its pipeline (GPipe order)'),
  'pp4_v2_dp2': (
    'PP 4 x DP 2, m=8, v=2: interleaved 1f1b',
    {**_PP4, 'num_layers_per_pipeline_stage': 1, 'num_pipeline_repeats': 2},
    'circular pipeline',
  ),
}
_MAXTEXT_OF = {'pp4_dp2_zb_h1': 'pp4_dp2_1f1b'}
_STEP_LINE = re.compile(r'^I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*completed step: \d+, seconds: ', re.M)


# MaxText's keys for experiments/llama_1b.py as scripts/gpu_bench.sh runs it on one
# GPU: 8 x 2048 tokens, no remat, cuDNN attention through jax (triax's cudnn).
ONE_GPU = {
  **{k: v for k, v in tpu.MAXTEXT_MODELS[tpu.LLAMA_1B].items() if k != 'global_batch'},
  **{k: v for k, v in tpu.MAXTEXT_COMMON.items() if k not in ('remat_policy', 'attention')},
  'hardware': 'gpu',
  'remat_policy': 'none',
  'attention': 'cudnn_flash_jax',
  'per_device_batch_size': 8,
  'steps': 40,
  'enable_tensorboard': 'false',
}
ONE_GPU_SMOKE = {  # the same keys at llama_1b:smoke's size, on one CPU device (a rehearsal)
  **ONE_GPU,
  'hardware': 'cpu',
  'attention': 'dot_product',
  'base_emb_dim': 64,
  'base_num_query_heads': 4,
  'base_num_kv_heads': 2,
  'head_dim': 16,
  'base_mlp_dim': 172,
  'base_num_decoder_layers': 2,
  'vocab_size': 1024,
  'max_target_length': 64,
  'per_device_batch_size': 4,
  'steps': 5,
}


def one_device(smoke: bool) -> list[str]:
  """MaxText's tokens/s and MFU for llama_1b's shape on this machine's one
  device (scripts/bench_gpu.sh's MaxText column beside gpu_bench.sh's triax).
  Its python: TRIAX_MAXTEXT_PYTHON, else the venv this script builds."""
  venv = os.path.join(BENCH, 'maxtext-venv')
  built = os.path.join(venv, 'bin', 'python') if os.path.exists(f'{venv}/.installed') else ''
  # Not built here: a GPU machine may have no network for pip.
  python = os.environ.get('TRIAX_MAXTEXT_PYTHON') or built
  if not python or not os.path.exists(python):
    fail(
      'TRIAX_MAXTEXT_PYTHON',
      f'no MaxText python ({python or "no .bench/maxtext-venv"}); name one with maxtext and '
      'its jax installed, or build .bench/maxtext-venv (python scripts/bench_peers.py)',
    )
  keys = ONE_GPU_SMOKE if smoke else ONE_GPU
  workdir = _workdir('maxtext-one-device')
  args = _maxtext_args(keys, 'one-device', workdir)
  code, text = _spawn(python, workdir, 'maxtext', args, TRIAX_PEERS_DEVICES='1')
  seconds = _maxtext_steps(text)
  if code or len(seconds) < 2:
    raise SystemExit(f'error: MaxText: its run failed:\n{text[-3000:]}')
  step = statistics.median(seconds[1:])
  tokens = keys['per_device_batch_size'] * keys['max_target_length']
  flops = _llama_1b_model_flops(smoke, keys['per_device_batch_size'])
  device, peak = _device(python)
  lines = [
    f'MaxText 0.2.5 on {device}: llama_1b{":smoke" if smoke else ""} keys '
    f'({len(seconds) - 1} steps after the first two)',
    f'tokens/s:    {tokens / step:,.0f}',
    f'step time:   {step * 1e3:.1f} ms',
    f"model FLOPs: {flops:.3g} per step (triax's model/flops.py for the same shape)",
  ]
  lines.append(f'MFU:         {100 * flops / step / peak:.1f}%' if peak else 'MFU:         n/a')
  return lines


def _llama_1b_model_flops(smoke: bool, batch: int) -> float:
  from triax import config as config_lib
  from triax.model import flops as flops_lib
  from triax.model import registry

  cfg = config_lib.from_file(
    os.path.join(ROOT, 'experiments', 'llama_1b.py'), 'smoke' if smoke else None
  )
  model = registry.build(registry.spec_from_config(cfg.model))
  return flops_lib.step_flops(model, batch)['model']


def _device(python: str) -> tuple[str, float | None]:
  from triax.model import flops as flops_lib

  code = 'import jax; print(jax.devices()[0].device_kind)'
  kind = subprocess.run([python, '-c', code], capture_output=True, text=True).stdout.strip()
  return kind, flops_lib.peak_flops(kind)


def maxtext_python() -> str:
  """The MaxText venv's python; a failed build is one line and exit 2."""
  try:
    return tpu.maxtext_python()
  except subprocess.CalledProcessError as e:
    fail('MaxText venv', f'building .bench/maxtext-venv failed ({e}); fix pip and rerun')


def run(python: str, framework: str, layout: str, steps: int) -> dict:
  """One run in a process of its own: its steps' seconds and compile seconds."""
  name = f'{framework}-{layout}'
  workdir = _workdir(name)
  if framework == 'triax':
    args = [
      f'--config={CONFIG}:layout={layout},steps={steps}',
      f'--workdir={os.path.join(workdir, "run")}',
      '--cpu_devices=8',
      '--noprogress',
    ]
  else:
    args = _maxtext_args({**MAXTEXT_MODEL, **LAYOUTS[layout][1], 'steps': steps}, name, workdir)
  metrics = os.path.join(workdir, 'run', 'metrics.jsonl')
  watch = {'TRIAX_PEERS_WATCH': metrics} if framework == 'triax' else {}
  code, text = _spawn(python, workdir, framework, args, **watch)
  if code:
    raise RuntimeError(f'{name} failed:\n{text[-3000:]}')
  with open(os.path.join(workdir, 'compiles.json')) as f:
    record = json.load(f)
  seconds = _triax_steps(workdir) if framework == 'triax' else _maxtext_steps(text)
  if len(seconds) != steps - 1:
    raise RuntimeError(f'{name}: {len(seconds)} step times for {steps} steps:\n{text[-3000:]}')
  ends = _triax_ends(metrics, record['cpu_samples']) if watch else _maxtext_ends(text)
  cpu = _cpu_between(ends, record['cpu_samples'])
  # `fresh`: compiled, not read from a persistent cache (MaxText's runs before
  # MAXTEXT_MODEL turned its cache off have no such key, nor `cpu`).
  return {'steps': seconds, 'cpu': cpu, 'compile': max(record['compile_seconds']), 'fresh': True}


def _triax_ends(metrics: str, samples: list) -> list[float]:
  """Wall times at which triax's steps ended: the first CPU sample that saw
  each step's line in metrics.jsonl (samples hold its line count)."""
  with open(metrics) as f:
    lines = [i for i, line in enumerate(f) if '"step_time_s"' in line]
  return [next(wall for wall, _, seen in samples if seen > i) for i in lines]


def _maxtext_ends(log: str) -> list[float]:
  """Wall times of MaxText's step lines (its log's local time, this year)."""
  year = datetime.datetime.now().year
  return [
    datetime.datetime.strptime(f'{year}{day} {clock}', '%Y%m%d %H:%M:%S.%f').timestamp()
    for day, clock in _STEP_LINE.findall(log)
  ]


def _cpu_between(ends: list[float], samples: list) -> list[float]:
  """The process's CPU seconds between consecutive step ends, read off the
  samples by linear interpolation."""
  walls = [s[0] for s in samples]
  cpus = [s[1] for s in samples]

  def at(t: float) -> float:
    k = min(max(bisect.bisect_left(walls, t), 1), len(walls) - 1)
    w0, w1 = walls[k - 1], walls[k]
    share = 0.0 if w1 == w0 else min(max((t - w0) / (w1 - w0), 0.0), 1.0)
    return cpus[k - 1] + share * (cpus[k] - cpus[k - 1])

  marks = [at(t) for t in ends]
  return [b - a for a, b in zip(marks, marks[1:])]


def _workdir(name: str) -> str:
  """A run's directory under .bench/peers, emptied."""
  workdir = os.path.join(BENCH, 'peers', name)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  return workdir


def _maxtext_args(keys: dict, name: str, workdir: str) -> list[str]:
  return [
    f'{k}={v}' for k, v in {**keys, 'run_name': name, 'base_output_directory': workdir}.items()
  ]


def _spawn(python: str, workdir: str, framework: str, args: list[str], **env) -> tuple[int, str]:
  """scripts/peers_run.py in a process of its own (its compiles in WORKDIR/compiles.json):
  its exit status and its output. No XLA_FLAGS on either side: the runner
  sets the device count."""
  done = run_python(
    [RUNNER, os.path.join(workdir, 'compiles.json'), framework, *args],
    python=python,
    env=env,
    drop_device_count=True,
  )
  return done.returncode, done.stdout + done.stderr


def _triax_steps(workdir: str) -> list[float]:
  """Seconds between consecutive steps' completions, from step 2 on (metrics.jsonl)."""
  with open(os.path.join(workdir, 'run', 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return [r['step_time_s'] for r in records if 'step_time_s' in r][1:]


def _maxtext_steps(log: str) -> list[float]:
  """Seconds between the log lines of consecutive steps (MaxText writes a
  step's line when its metrics arrive; its own `seconds` count from one
  dispatch to the next)."""
  ends = _maxtext_ends(log)
  return [b - a for a, b in zip(ends, ends[1:])]


def measure(layouts: list[str], pairs: int, steps: int, results: dict) -> None:
  """Alternating runs, both in MaxText's venv (one jax, one XLA)."""
  python = maxtext_python()
  results['versions'] = _jax(python)
  # MaxText's runs of a layout that has none of its own (zb_h1) are another's.
  theirs = list(dict.fromkeys(_MAXTEXT_OF.get(layout, layout) for layout in layouts))
  rerun = {*(f'triax {name}' for name in layouts), *(f'maxtext {name}' for name in theirs)}
  # A rerun row's failures go with the runs it replaces.
  results['failed'] = [f for f in results.get('failed', []) if f['run'] not in rerun]
  for name in {*layouts, *theirs}:
    row = results['rows'].setdefault(name, {'triax': [], 'maxtext': []})
    row['triax'] = [] if name in layouts else row['triax']
    row['maxtext'] = [] if name in theirs else row['maxtext']
  for pair in range(pairs):
    done = set()  # MaxText layouts run (or failed) in this pair
    for layout in layouts:
      ours = _attempt(results, python, 'triax', layout, steps, pair)
      if ours:
        results['rows'][layout]['triax'].append(ours)
        print(f'pair {pair}: triax {layout}: {_median(ours):.2f} s', flush=True)
      mt = _MAXTEXT_OF.get(layout, layout)
      if mt not in done:
        done.add(mt)
        m = _attempt(results, python, 'maxtext', mt, steps, pair)
        if m:
          results['rows'][mt]['maxtext'].append(m)
          print(f'pair {pair}: MaxText {mt}: {_median(m):.2f} s', flush=True)


def _attempt(
  results: dict, python: str, framework: str, layout: str, steps: int, pair: int
) -> dict | None:
  """One run (tried twice: XLA:CPU's collectives have crashed a run once in a
  while), or None; each failure is kept in results['failed'] for the page."""
  for _ in range(2):
    try:
      return dict(run(python, framework, layout, steps), pair=pair)
    except RuntimeError as e:
      results.setdefault('failed', []).append(
        {'run': f'{framework} {layout}', 'pair': pair, 'tail': str(e)[-1500:]}
      )
      print(f'{framework} {layout} failed: {str(e)[-600:]}', flush=True)
  return None


def _jax(python: str) -> str:
  code = 'import jax; print(jax.__version__)'
  return subprocess.run([python, '-c', code], capture_output=True, text=True).stdout.strip()


def _median(r: dict, figure: str = 'steps') -> float:
  return statistics.median(r[figure][WARMUP - 1 :])


def bubbles(layout: str) -> tuple[float, float] | None:
  """(triax's lockstep bubble at the papers' unit costs, MaxText's share of
  iterations that compute no micro-batch's work) for a pipelined layout."""
  from triax.pipeline import rounds, simulate
  from triax.pipeline import schedule as sched

  keys = _triax_keys(layout)
  if keys.get('mesh.pipe', 1) == 1:
    return None
  p, m, v = keys['mesh.pipe'], keys['pipeline.microbatches'], keys.get('pipeline.virtual_stages', 1)
  schedule = sched.build(keys['pipeline.schedule'], p, m, v)
  units = rounds.units_for('full')
  program = sched.lower(schedule, units=units)
  costs = simulate.Costs.design_point(schedule.split_backward, units)
  ours = simulate.simulate_lockstep(program, costs).bubble_fraction
  # MaxText runs m*v + p - 1 iterations in each direction, every stage computing in each.
  return ours, (p - 1) / (m * v + p - 1)


def _triax_keys(layout: str) -> dict:
  sys.path.insert(0, os.path.join(ROOT, 'experiments'))
  import llama_peers

  return llama_peers.LAYOUTS[layout]


def table(results: dict) -> list[str]:
  lines = [
    '| layout | MaxText | triax step (s) | MaxText step (s) | triax / MaxText [spread] | pairs | '
    'tokens/s triax / MaxText | compile s triax / MaxText | CPU s a step triax / MaxText |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  tokens = 8 * MAXTEXT_MODEL['per_device_batch_size'] * MAXTEXT_MODEL['max_target_length']
  for layout, (what, _keys, pipeline) in LAYOUTS.items():
    row = results['rows'].get(layout)
    mt_row = results['rows'].get(_MAXTEXT_OF.get(layout, layout), {})
    if not row or not row['triax'] or not mt_row.get('maxtext'):
      continue
    a, b, ratios = _paired(row['triax'], mt_row['maxtext'], 'steps')
    compile_a = statistics.median(r['compile'] for r in row['triax'])
    compile_b = statistics.median(r['compile'] for r in mt_row['maxtext'])
    cached = '' if all(r.get('fresh') for r in mt_row['maxtext']) else ' (cached)'
    lines.append(
      f'| {what} | {pipeline or "-"} | {a:.2f} | {b:.2f} | '
      f'**{statistics.median(ratios):.2f}** [{min(ratios):.2f}, {max(ratios):.2f}] | '
      f'{len(ratios)} | '
      f'{tokens / a:.0f} / {tokens / b:.0f} | {compile_a:.1f} / {compile_b:.1f}{cached} | '
      f'{_cpu_cell(row["triax"], mt_row["maxtext"])} |'
    )
  return lines


def _cpu_cell(ours: list[dict], theirs: list[dict]) -> str:
  """Median CPU seconds a step on each side and their pairs' median ratio
  (runs made before the CPU was sampled have none: '-')."""
  if not all('cpu' in r for r in ours + theirs):
    return '-'
  a, b, ratios = _paired(ours, theirs, 'cpu')
  return f'{a:.1f} / {b:.1f} ({statistics.median(ratios):.2f})'


def _paired(ours: list[dict], theirs: list[dict], figure: str) -> tuple[float, float, list]:
  """(triax's median of its runs' `figure`, MaxText's, and each pair's ratio)."""
  by_pair = {r['pair']: _median(r, figure) for r in theirs}
  ratios = [_median(r, figure) / by_pair[r['pair']] for r in ours if r['pair'] in by_pair]
  a = statistics.median(_median(r, figure) for r in ours)
  return a, statistics.median(by_pair.values()), ratios


def bubble_lines(results: dict) -> list[str]:
  lines = [
    '| layout | triax bubble (lockstep, unit costs) | MaxText: iterations with no work |',
    '|---|---|---|',
  ]
  for layout, (what, _k, _p) in LAYOUTS.items():
    if layout not in results['rows']:
      continue
    found = bubbles(layout)
    if found:
      lines.append(f'| {what} | {found[0]:.3f} | {found[1]:.3f} |')
  return lines


def write(path: str, results: dict) -> None:
  with open(os.path.splitext(path)[0] + '.json', 'w') as f:
    json.dump(results, f, indent=1)
  lines = [
    '# triax beside MaxText on XLA:CPU',
    '',
    'Written by `scripts/bench_peers.py`; every run is kept in `docs/bench_peers.json`.',
    '',
    f"One venv for both, MaxText's: MaxText 0.2.5 (`maxtext[tpu]`), jax {results.get('versions')};",
    'triax from this tree.',
    'The model is experiments/llama_peers.py on both: Llama, d_model 512, 8 layers, 8 heads of 64',
    'with 4 K/V heads, SwiGLU 1536, vocabulary 8192, 16 sequences x 512 tokens a step, bf16',
    'compute with fp32 parameters and AdamW state, full recomputation, XLA attention,',
    '8 forced CPU devices on 2 cores, no XLA flags on either side.',
    '',
    *table(results),
    '',
    *_method_lines(results),
    *_failed_lines(results),
    '',
    '## What XLA:CPU hides',
    '',
    *bubble_lines(results),
    '',
    *HIDES,
    '',
    *work_section(),
    '',
    '## What the tables showed, and what changed',
    '',
    *FINDINGS,
  ]
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')


def _failed_lines(results: dict) -> list[str]:
  """Runs that failed (each tried once more; a row's pairs are those both sides finished)."""
  lines = []
  for f in results.get('failed', []):
    cause = next((x for x in f['tail'].splitlines() if x.startswith(('F1', 'E1', 'Error'))), '')
    lines.append(
      f'- {f["run"]}, pair {f["pair"]}: failed{": `" + cause[:120] + "`" if cause else ""}'
    )
  return ['', 'Failed runs (each run once more):', *lines] if lines else []


def _method_lines(results: dict) -> list[str]:
  pairs = max((len(r['triax']) for r in results['rows'].values()), default=0)
  return [
    f'Medians of {pairs} pairs of runs, each run a process of its own, the two frameworks',
    "alternating; a run's step is the median of its steps after the first two. The spread is",
    "the smallest and largest of the pairs' ratios. Compile seconds: the longest",
    '`Lowered.compile` of the run (its train step), timed alike on both sides',
    "(scripts/peers_run.py). MaxText's runs compile with its persistent compilation cache",
    "off (jax_cache_dir ''); a figure marked (cached) is from runs made before that, mostly",
    'reads of its cache (~/jax_cache, kept between runs), and compares nothing.',
    "CPU seconds a step: the process's CPU time (all its threads) between two step ends,",
    "sampled every 0.1 s (scripts/peers_run.py), with the pairs' median ratio. Work on the",
    'machine besides the run stretches its wall time but not its CPU time, so where the two',
    'ratios differ, the CPU column is the one other load did not move.',
  ]


HIDES = [
  'Eight devices share two cores, so a device with nothing to do frees its core for the',
  "others: a pipeline's idle ticks cost no time here, where on accelerators each one is a",
  "chip waiting. The CPU column therefore prices a schedule's work, not its bubble. The",
  "bubble is priced above from the schedule instead: triax's lockstep program at the",
  "papers' unit costs (simulate.py), and the share of MaxText's pipeline iterations in",
  'which a stage has no micro-batch. MaxText computes in those iterations (every stage runs',
  "every iteration, on zeros), so its bubble costs it work even here; triax's idle ticks",
  'run no branch.',
]


def work_section() -> list[str]:
  """scripts/bench_peers_work.py's table, from docs/bench_peers_work.json."""
  import bench_peers_work as work

  if not os.path.exists(work.RESULTS):
    return []
  with open(work.RESULTS) as f:
    results = json.load(f)
  return ['## The work each compiled step executes', '', *work.work_table(results)]


FINDINGS = [
  '- **triax could not compile a bf16 pipeline on XLA:CPU** (any jax from 0.10.2 to 0.12.1):',
  "  the pools of the after-loop edge gradients are reduce-scattered over `pipe`, and XLA:CPU's",
  '  pass that widens bf16 reductions to f32 aborts the process on them ("Invalid binary',
  '  instruction opcode copy": the reducer it clones ends in a copy). On CPU the pools now go',
  "  through f32 (exact: each row is one stage's, the others add zeros); XLA:TPU and XLA:GPU",
  '  programs are unchanged. tests/test_pipeline_memory.py compiles such a step.',
  "- **Where triax's pipelined steps lost on XLA:CPU, and the fix.** The first table",
  '  (commit 055e937) had the pipelined rows at 1.46 (1f1b), 1.38 (zb_h1) and 1.53 (v=2) of',
  "  MaxText's step. A profile of one PP 4 x DP 2 1f1b step had XLA:CPU running the split",
  "  backward's MLP weight gradients (W) and the after-loop head's weight gradient as Eigen",
  '  `dot` thunks outside its YNNPACK fusions: 296 device-thread seconds in 800 calls, against',
  '  270 in all 10,768 fusion calls. The folding of a transpose into the dot that reads it',
  "  (x^T g over a one-sequence micro-batch's tokens) leaves a dot whose left operand is",
  "  contracted over its first dimension, which jax 0.12's XLA:CPU gives to Eigen and YNNPACK",
  "  does not take (the DP 8 step's weight gradients, two sequences a device, were fused).",
  "  On CPU meshes the executor's re-evaluated backward now lays both operands of such a",
  '  dot out as [batch, rows, contracted] behind an optimization barrier',
  '  (pipeline/cpu_dots.py): no dot of the step runs outside a fusion (tests/test_cpu_dots.py,',
  "  which finds 3 without it); the row's CPU seconds a step went from 45-46 to 22-24, the",
  '  two measured alternately in one session on a loaded machine. XLA:TPU and XLA:GPU',
  '  programs are unchanged: their compilers choose dot layouts themselves.',
  "- **Found and fixed: the edge rows' third matmul.** With the edges' gradients made after",
  "  the loop (edge_grads=auto's choice here), the edge rows ran the head's forward again and",
  "  its input gradient, which only the final norm's scale gradient needed: three of the",
  "  head's vocabulary-sized matmuls a micro-batch where two make the matrix's gradient. The",
  "  norm's scale now takes its gradient in the loop, beside the input gradient the last",
  "  stage makes anyway (model/loss.py's partial_vjp; pipeline/executor.py's _split_by_rank),",
  "  and the rows make the matrix's alone: 2.15 TFLOP a device less on every pipelined",
  '  XLA:TPU row with XLA attention (the TP 2 x PP 2 row went from 0.04 TFLOP over MaxText',
  '  to 2.11 under; tests/test_hlo_work.py counts one head forward beyond the model where it',
  "  counted two). What is left on the busiest stage is the head's in-loop work, which",
  '  MaxText splits over its devices.',
  '- **The table above** is after both fixes, every row measured with nothing else running',
  '  on the machine: there the wall and CPU ratios agree. The pipelined rows measured',
  '  between the two fixes, beside other work, had wall ratios of 0.59, 0.96 and 0.90 with',
  "  spreads from 0.35 to 1.16 (MaxText's pipeline step took 36 s under that load, 13 s",
  '  without it).',
]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layouts', default=','.join(LAYOUTS))
  parser.add_argument('--pairs', type=int, default=3)
  parser.add_argument('--steps', type=int, default=6)
  parser.add_argument('--out', default=os.path.join(ROOT, 'docs', 'bench_peers.md'))
  parser.add_argument(
    '--one_device',
    action='store_true',
    help="only MaxText's llama_1b on this machine's one device: tokens/s and MFU "
    '(scripts/bench_gpu.sh)',
  )
  parser.add_argument('--smoke', action='store_true', help='with --one_device: a tiny model on CPU')
  args = parser.parse_args()
  if args.one_device:
    print('\n'.join(one_device(args.smoke)))
    return
  layouts = [x for x in args.layouts.split(',') if x]
  unknown = [x for x in layouts if x not in LAYOUTS]
  if unknown:
    fail('--layouts', f'unknown layout {unknown[0]!r}; choose from {", ".join(LAYOUTS)}')
  if args.pairs < 1 or args.steps <= WARMUP:
    fail('--pairs/--steps', f'need --pairs >= 1 and --steps > {WARMUP}')
  saved = os.path.splitext(args.out)[0] + '.json'
  results = {'rows': {}}
  if os.path.exists(saved):
    with open(saved) as f:
      results = json.load(f)
  if layouts:
    measure(layouts, args.pairs, args.steps, results)
  write(args.out, results)
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
