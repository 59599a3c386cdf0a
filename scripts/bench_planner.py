"""How well does the planner's simulator predict real step times here?

Runs a dozen-plus plans for real on this machine's forced CPU devices
(pipe, micro-batches, schedule, tensor, remat, uneven splits), each as
`python -m triax train --config=PLAN --workdir=DIR --cpu_devices=8` in a
subprocess (the plan file is what `python -m triax plan --out` writes), and
compares the trainer's measured `step_time_s` (median over the steps after
the first) with the simulator's prediction (lockstep model, the executor's,
with the profile measured in this process):

  MAPE, Spearman rank correlation, and the regret of the predicted-best plan
  (its measured time over the measured-best plan's); beside them the noise
  floor: how well the rounds' measurements rank alike (no predictor can
  rank-correlate with a measurement better than the machine repeats it).

  .venv/bin/python scripts/bench_planner.py [--out=runs/bench_planner.md]
      [--config=experiments/gpt_tiny.py] [--steps=6] [--repeats=3] [--only=0,3,5]
      [--predict_only] [--clusters_only]

Then, for every shipped cluster spec (experiments/clusters/*.yaml), the
strategy maker's best plan and its SIMULATED speedup over the baselines
(even split, data parallel only, planned as if all devices were the
slowest type), with the same profile (--clusters_only: just this part).

Uneven layer splits need the trainer's `pipeline.layers_per_stage`; without
it they are predicted but not run (the table says so). A plan the trainer
rejects or that crashes is reported with its error and left out of the
statistics. Takes ~30-90 s per plan on 2 cores.

Other processes on the machine distort both the profile and the runs (two
busy cores halve everything, unevenly): by default each measurement first
waits (up to --quiet_wait_s) until the CPUs are less than --quiet_busy busy
over 3 s, and the table records how busy they were just before each run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

from bench_harness import ROOT, force_cpu_devices, run_python

DEVICES = 8
force_cpu_devices(DEVICES)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# (data, tensor, pipe, schedule, microbatches, virtual_stages, remat, layers per stage or None)
PLANS = (
  (8, 1, 1, '1f1b', 1, 1, 'none', None),
  (4, 2, 1, '1f1b', 1, 1, 'none', None),
  (2, 4, 1, '1f1b', 1, 1, 'none', None),
  (1, 1, 8, '1f1b', 8, 1, 'none', None),
  (1, 1, 8, 'gpipe', 8, 1, 'none', None),
  (2, 1, 4, '1f1b', 4, 1, 'none', None),
  (2, 1, 4, '1f1b', 16, 1, 'none', None),
  (2, 1, 4, 'gpipe', 8, 1, 'none', None),
  (2, 1, 4, 'interleaved_1f1b', 8, 2, 'none', None),
  (2, 2, 2, '1f1b', 4, 1, 'none', None),
  (4, 1, 2, 'zb_h1', 4, 1, 'none', None),
  (2, 1, 4, 'bpipe', 8, 1, 'none', None),
  (2, 1, 4, '1f1b', 8, 1, 'full', None),
  (2, 1, 4, '1f1b', 8, 1, 'none', (3, 2, 2, 1)),
  (4, 1, 2, '1f1b', 4, 1, 'none', (5, 3)),
  (8, 1, 1, '1f1b', 1, 1, 'full', None),
  (2, 1, 4, '1f1b', 8, 1, 'dots', None),
  (2, 2, 2, 'interleaved_1f1b', 4, 2, 'full', None),
  # The search's pick on cpu_forced_8 (the table below; without its ZeRO-1):
  # 1-layer chunks under full remat, both priced by executor ratios.
  (4, 1, 2, 'interleaved_1f1b', 4, 4, 'full', None),
)
# What every benchmark run sets besides the plan: 8 layers so that pipe=8
# and uneven splits exist, few steps, no evaluation or checkpoints between.
BENCH_OVERRIDES = {
  'model.num_layers': 8,
  'train.global_batch_size': 32,
  'train.eval_every': 10_000,
  'train.eval_batches': 1,
  'train.log_every': 1,
  'train.warmup_steps': 1,
  'checkpoint.every_steps': 0,
}


def spearman(xs, ys) -> float:
  def ranks(v):
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(v):
      j = i
      while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
        j += 1
      for k in range(i, j + 1):
        r[order[k]] = (i + j) / 2
      i = j + 1
    return r

  rx, ry = ranks(xs), ranks(ys)
  mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
  cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
  sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
  sy = math.sqrt(sum((b - my) ** 2 for b in ry))
  return cov / (sx * sy) if sx and sy else float('nan')


def cpu_busy(window_s: float = 3.0) -> float:
  """Fraction of the machine's CPU time spent busy over the next window_s."""

  def read():
    with open('/proc/stat') as f:
      values = [int(x) for x in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values), idle

  total0, idle0 = read()
  time.sleep(window_s)
  total1, idle1 = read()
  return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_for_quiet(threshold: float, limit_s: float) -> float:
  """Waits until other processes leave the CPUs mostly idle (or limit_s);
  returns the busy fraction measured last."""
  deadline = time.time() + limit_s
  busy = cpu_busy()
  while busy > threshold and time.time() < deadline:
    busy = cpu_busy()
  return busy


def speed_index() -> float:
  """Seconds of a fixed small matmul loop on one device: how fast the machine
  is right now, given whatever else runs on it."""
  import jax
  import jax.numpy as jnp

  loop = jax.jit(lambda m: jax.lax.fori_loop(0, 40, lambda _, m: jnp.tanh(m @ m), m))
  m = jnp.full((384, 384), 0.01, jnp.float32)
  jax.block_until_ready(loop(m))
  times = []
  for _ in range(7):
    start = time.perf_counter()
    jax.block_until_ready(loop(m))
    times.append(time.perf_counter() - start)
  return sorted(times)[3]


def measure(plan_file: str, workdir: str, steps: int) -> tuple[float | None, str]:
  """Runs the trainer; returns (median step_time_s after the first step, error)."""
  args = [
    '-m',
    'triax.cli.train',
    f'--config={plan_file}',
    f'--workdir={workdir}',
    f'--cpu_devices={DEVICES}',
    '--noprogress',
    f'--config.train.steps={steps}',
  ]
  # The trainer's --cpu_devices sets the count.
  proc = run_python(args, drop_device_count=True)
  if proc.returncode:
    tail = (proc.stderr.strip().splitlines() or ['?'])[-1]
    return None, f'exit {proc.returncode}: {tail[:200]}'
  path = os.path.join(workdir, 'metrics.jsonl')
  times = []
  with open(path) as f:
    for line in f:
      record = json.loads(line)
      if 'step_time_s' in record and record['step'] > 1:
        times.append(record['step_time_s'])
  if not times:
    return None, 'no step_time_s in metrics.jsonl'
  times.sort()
  return times[len(times) // 2], ''


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='experiments/gpt_tiny.py')
  parser.add_argument('--cluster', default='experiments/clusters/cpu_forced_8.yaml')
  parser.add_argument('--out', default='runs/bench_planner.md')
  parser.add_argument('--steps', type=int, default=6)
  parser.add_argument('--only', default='', help='comma-separated plan indices')
  parser.add_argument('--predict_only', action='store_true')
  parser.add_argument(
    '--clusters_only',
    action='store_true',
    help='only the per-cluster search table (simulated speedups)',
  )
  parser.add_argument(
    '--quiet_busy',
    type=float,
    default=0.25,
    help='wait until the CPUs are less busy than this before measuring',
  )
  parser.add_argument('--quiet_wait_s', type=float, default=300)
  parser.add_argument(
    '--repeats',
    type=int,
    default=3,
    help='rounds over all plans; each plan keeps its fastest round '
    '(other processes only ever slow a run down)',
  )
  args = parser.parse_args()

  import importlib.util

  from triax import config as config_lib
  from triax.layout import Layout
  from triax.plan import cluster as cluster_lib
  from triax.plan.cost import profile, simulator
  from triax.plan.search import emit

  spec = importlib.util.spec_from_file_location('bench_base', os.path.join(ROOT, args.config))
  base = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(base)
  cfg = emit.apply(base.get_config(), dict(BENCH_OVERRIDES))
  cluster = cluster_lib.load(os.path.join(ROOT, args.cluster))
  uneven_ok = 'layers_per_stage' in config_lib.defaults().pipeline
  chosen = [int(i) for i in args.only.split(',')] if args.only else range(len(PLANS))
  plans = []
  for i in chosen:
    d, t, p, name, m, v, remat, split = PLANS[i]
    layers = split or (cfg.model.num_layers // p,) * p
    devices = list(range(DEVICES))
    stages = tuple(tuple(devices[s + p * k] for k in range(d * t)) for s in range(p))
    plans.append(
      (
        i,
        simulator.Plan(
          layout=Layout(data=d, tensor=t, pipe=p, schedule=name, microbatches=m, virtual_stages=v),
          remat=remat,
          layers=layers,
          stages=stages,
          global_batch=cfg.train.global_batch_size,
        ),
      )
    )
  if args.clusters_only:
    plans, args.predict_only = [], True
  wait_for_quiet(args.quiet_busy, args.quiet_wait_s)
  started = time.perf_counter()
  # The tensor degrees and micro-batch sizes of the plans (of the cluster
  # search too: every shipped cluster has 8 devices, as the plans do).
  prof = profile.measure(
    cfg.model,
    sorted({p.tensor for _, p in plans} | {1, 2, 4}),
    sorted({p.microbatch_size for _, p in plans} | {1, 2, 4, 8, 16}),
  )
  print(f'profiled in {time.perf_counter() - started:.1f} s', flush=True)
  speed_at_profile = speed_index()
  rows = []
  estimates = {i: simulator.simulate_plan(plan, prof, cluster) for i, plan in plans}
  for i, plan in plans:
    est = estimates[i]
    rows.append(
      dict(
        index=i,
        plan=plan.describe(),
        predicted=est.step_time,
        predicted_async=est.async_time,
        measured=None,
        note='',
        load='',
        corrected=None,
        rounds=[],
      )
    )
    if not plan.even and not uneven_ok:
      rows[-1]['note'] = 'not run: trainer has no pipeline.layers_per_stage'
  with tempfile.TemporaryDirectory() as tmp:
    for round_ in range(0 if args.predict_only else args.repeats):
      for row, (i, plan) in zip(rows, plans):
        if row['note'].startswith('not run'):
          continue
        plan_file = os.path.join(tmp, f'plan{i}.py')
        emit.write(
          plan_file,
          estimates[i],
          os.path.join(ROOT, args.config),
          None,
          dict(BENCH_OVERRIDES),
          cluster.name,
        )
        before = wait_for_quiet(args.quiet_busy, args.quiet_wait_s)
        # The machine's speed now relative to when it was profiled (others' load).
        slowdown = speed_index() / speed_at_profile
        measured, note = measure(plan_file, os.path.join(tmp, f'run{i}_{round_}'), args.steps)
        row['rounds'].append(measured)
        if measured is not None and (row['measured'] is None or measured < row['measured']):
          row.update(
            measured=measured,
            corrected=row['predicted'] * slowdown,
            load=f'{before:.0%}',
            note=note,
          )
        elif measured is None and row['measured'] is None:
          row['note'] = note
        shown = f'{measured * 1e3:8.1f}' if measured else '       -'
        print(
          f'round {round_} {i:2d} {plan.describe():55s} predicted '
          f'{row["predicted"] * 1e3:8.1f} ms (x{slowdown:.2f} load) measured {shown} ms '
          f'{note}',
          flush=True,
        )
  clusters = _clusters_report(cfg, prof)
  if args.clusters_only:
    path = os.path.join(ROOT, args.out).rsplit('.', 1)[0] + '_clusters.md'
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    with open(path, 'w') as f:
      f.write(clusters)
    print(clusters)
    return 0
  report = _report(rows, prof, args) + '\n' + clusters
  os.makedirs(os.path.dirname(os.path.join(ROOT, args.out)) or '.', exist_ok=True)
  with open(os.path.join(ROOT, args.out), 'w') as f:
    f.write(report)
  with open(os.path.join(ROOT, args.out).rsplit('.', 1)[0] + '.json', 'w') as f:
    json.dump({'rows': rows, 'profile_wall_s': prof.wall_s}, f, indent=1)
  print(report)
  return 0


def _clusters_report(cfg, prof) -> str:
  """The strategy maker on every shipped cluster, with this profile."""
  import glob

  from triax.plan import cluster as cluster_lib
  from triax.plan.search import exhaustive

  lines = [
    '## Strategy maker on the shipped clusters (SIMULATED)',
    '',
    f'Model: the benchmark config ({BENCH_OVERRIDES}); the profile above '
    '(tensor degrees 1, 2, 4), other device types by the roofline. Speedup = the '
    "baseline's predicted step time over the best plan's.",
    '',
    '| cluster | best plan | predicted ms | vs even split | vs data parallel '
    '| vs planned-as-slowest | plans | search s |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for path in sorted(glob.glob(os.path.join(ROOT, 'experiments', 'clusters', '*.yaml'))):
    cluster = cluster_lib.load(path)
    result = exhaustive.search(cfg, cluster, top_k=1, profile=prof)
    if not result.top:
      lines.append(
        f'| {cluster.name} | no plan fits | | | | | {result.evaluated} | {result.search_s:.1f} |'
      )
      continue
    best = result.top[0]
    speed = lambda k, r=result: f'{r.speedup(k):.2f}x' if r.speedup(k) else '-'
    lines.append(
      f'| {cluster.name} | {best.plan.describe()} | {best.step_time * 1e3:.2f} | '
      f'{speed("even_split")} | {speed("data_parallel")} | '
      f'{speed("homogeneous_slowest")} | {result.evaluated} | '
      f'{result.search_s:.1f} |'
    )
  lines += [
    '',
    "This model is tiny: for transformers where the layout matters (BERT-large's size up "
    'to the largest each mixed cluster holds, analytic profile, also simulated) see '
    '[bench_heterog.md](bench_heterog.md) (`scripts/bench_heterog.py`).',
  ]
  return '\n'.join(lines) + '\n'


def _report(rows, prof, args) -> str:
  done = [r for r in rows if r['measured']]
  lines = [
    f'# Planner validation on {prof.machine.num_devices} forced CPU devices '
    f'({prof.machine.effective_cores:.2f} effective cores measured)',
    '',
    f'Config {args.config} with {BENCH_OVERRIDES}; {args.steps} steps per run, '
    f'median step_time_s after step 1, fastest of {args.repeats} rounds. Predicted: '
    "lockstep model (the executor's), profile measured in "
    f'{prof.wall_s:.1f} s.',
    '',
    'Busy: share of the 2 cores other processes used in the 3 s before a run. '
    "Load-corrected: the prediction times the ratio of a fixed matmul loop's time "
    "just before the run to its time at profiling (other processes' load).",
    '',
    '| # | plan | predicted ms | load-corrected ms | async ms | measured ms | error '
    '| error (corrected) | busy | note |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]

  def err(key, r):
    return f'{(r[key] - r["measured"]) / r["measured"]:+.1%}' if r['measured'] and r[key] else '-'

  for r in rows:
    measured = f'{r["measured"] * 1e3:.1f}' if r['measured'] else '-'
    corrected = f'{r["corrected"] * 1e3:.1f}' if r['corrected'] else '-'
    lines.append(
      f'| {r["index"]} | {r["plan"]} | {r["predicted"] * 1e3:.1f} | {corrected} | '
      f'{r["predicted_async"] * 1e3:.1f} | {measured} | {err("predicted", r)} | '
      f'{err("corrected", r)} | {r["load"]} | {r["note"]} |'
    )
  lines.append('')
  if len(done) >= 2:
    meas = [r['measured'] for r in done]
    lines.append(f'- plans measured: {len(done)} of {len(rows)}')
    for key, name in (('predicted', 'prediction'), ('corrected', 'load-corrected prediction')):
      pred = [r[key] for r in done]
      mape = sum(abs(p - m) / m for p, m in zip(pred, meas)) / len(done)
      rho = spearman(pred, meas)
      best = min(done, key=lambda r: r[key])
      regret = best['measured'] / min(meas)
      lines.append(
        f'- {name}: MAPE {mape:.1%} (target <= 15%), Spearman {rho:.3f} '
        f'(target >= 0.9), regret of its best plan (#{best["index"]}) '
        f'{regret:.3f}x the measured best'
      )
    lines.append(repeatability([r['rounds'] for r in done]))
  else:
    lines.append('- too few plans measured for statistics')
  return '\n'.join(lines) + '\n'


def repeatability(rounds) -> str:
  """How well the machine agrees with itself: the Spearman correlation of
  one round's measurements with another's (the ceiling for any predictor's
  rank correlation against them) and each plan's spread over its rounds."""
  n = min(len(r) for r in rounds)
  full = [r[:n] for r in rounds if all(x is not None for x in r[:n])]
  if n < 2 or len(full) < 2:
    return '- repeatability: needs two rounds that measured every plan'
  pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
  rhos = [spearman([r[a] for r in full], [r[b] for r in full]) for a, b in pairs]
  spread = sorted(max(r) / min(r) - 1 for r in full)
  return (
    f'- repeatability (the noise floor): Spearman between rounds '
    f"{min(rhos):.3f}-{max(rhos):.3f} over {len(pairs)} pairs of rounds; a plan's "
    f'slowest round over its fastest: median +{spread[len(spread) // 2]:.0%}, '
    f'worst +{spread[-1]:.0%}'
  )


if __name__ == '__main__':
  sys.exit(main())
