"""How well does the planner's simulator predict real step times here?

Runs a dozen-plus plans for real on this machine's forced CPU devices
(pipe, micro-batches, schedule, tensor, remat, uneven splits), each as
`python -m triax.train --config=PLAN --workdir=DIR --cpu_devices=8` in a
subprocess (the plan file is what `python -m triax.plan --out` writes), and
compares the trainer's measured `step_time_s` (median over the steps after
the first) with the simulator's prediction (lockstep model, the executor's,
with the profile measured in this process):

  MAPE, Spearman rank correlation, and the regret of the predicted-best plan
  (its measured time over the measured-best plan's).

  .venv/bin/python scripts/bench_planner.py [--out=runs/bench_planner.md]
      [--config=experiments/gpt_tiny.py] [--steps=8] [--only=0,3,5] [--predict_only]

Uneven layer splits need the trainer's `pipeline.layers_per_stage`; without
it they are predicted but not run (the table says so). A plan the trainer
rejects or that crashes is reported with its error and left out of the
statistics. Takes ~30 s per plan on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'src'))
DEVICES = 8
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           f' --xla_force_host_platform_device_count={DEVICES}').strip()
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


def measure(plan_file: str, workdir: str, steps: int) -> tuple[float | None, str]:
  """Runs the trainer; returns (median step_time_s after the first step, error)."""
  cmd = [sys.executable, '-m', 'triax.train', f'--config={plan_file}',
         f'--workdir={workdir}', f'--cpu_devices={DEVICES}', '--noprogress',
         f'--config.train.steps={steps}']
  env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, 'src'))
  env.pop('XLA_FLAGS', None)   # the trainer's --cpu_devices sets the count
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
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
  parser.add_argument('--steps', type=int, default=8)
  parser.add_argument('--only', default='', help='comma-separated plan indices')
  parser.add_argument('--predict_only', action='store_true')
  args = parser.parse_args()

  import importlib.util
  from triax import config as config_lib
  from triax.plan import cluster as cluster_lib, emit, profile, simulator

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
    plans.append((i, simulator.Plan(data=d, tensor=t, pipe=p, schedule=name, microbatches=m,
                                    virtual_stages=v, remat=remat, layers=layers,
                                    stages=stages,
                                    global_batch=cfg.train.global_batch_size)))
  started = time.perf_counter()
  prof = profile.measure(cfg.model, sorted({p.tensor for _, p in plans}),
                         sorted({p.microbatch_size for _, p in plans}))
  print(f'profiled in {time.perf_counter() - started:.1f} s', flush=True)
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for i, plan in plans:
      est = simulator.simulate_plan(plan, prof, cluster)
      row = dict(index=i, plan=plan.describe(), predicted=est.step_time,
                 predicted_async=est.async_time, measured=None, note='')
      if not plan.even and not uneven_ok:
        row['note'] = 'not run: trainer has no pipeline.layers_per_stage'
      elif not args.predict_only:
        plan_file = os.path.join(tmp, f'plan{i}.py')
        emit.write(plan_file, est, os.path.join(ROOT, args.config), None,
                   dict(BENCH_OVERRIDES), cluster.name)
        row['measured'], row['note'] = measure(plan_file, os.path.join(tmp, f'run{i}'),
                                               args.steps)
      rows.append(row)
      shown = f'{row["measured"] * 1e3:8.1f}' if row['measured'] else '       -'
      print(f'{i:2d} {plan.describe():55s} predicted {est.step_time * 1e3:8.1f} ms '
            f'measured {shown} ms {row["note"]}', flush=True)
  report = _report(rows, prof, args)
  os.makedirs(os.path.dirname(os.path.join(ROOT, args.out)) or '.', exist_ok=True)
  with open(os.path.join(ROOT, args.out), 'w') as f:
    f.write(report)
  with open(os.path.join(ROOT, args.out).rsplit('.', 1)[0] + '.json', 'w') as f:
    json.dump({'rows': rows, 'profile_wall_s': prof.wall_s}, f, indent=1)
  print(report)
  return 0


def _report(rows, prof, args) -> str:
  done = [r for r in rows if r['measured']]
  lines = [f'# Planner validation on {prof.machine.num_devices} forced CPU devices '
           f'({prof.machine.effective_cores:.2f} effective cores measured)', '',
           f'Config {args.config} with {BENCH_OVERRIDES}; {args.steps} steps per run, '
           'median step_time_s after step 1. Predicted: lockstep model (the executor\'s), '
           f'profile measured in {prof.wall_s:.1f} s.', '',
           '| # | plan | predicted ms | async ms | measured ms | error | note |',
           '|---|---|---|---|---|---|---|']
  for r in rows:
    measured = f'{r["measured"] * 1e3:.1f}' if r['measured'] else '-'
    error = (f'{(r["predicted"] - r["measured"]) / r["measured"]:+.1%}'
             if r['measured'] else '-')
    lines.append(f'| {r["index"]} | {r["plan"]} | {r["predicted"] * 1e3:.1f} | '
                 f'{r["predicted_async"] * 1e3:.1f} | {measured} | {error} | {r["note"]} |')
  lines.append('')
  if len(done) >= 2:
    pred = [r['predicted'] for r in done]
    meas = [r['measured'] for r in done]
    mape = sum(abs(p - m) / m for p, m in zip(pred, meas)) / len(done)
    rho = spearman(pred, meas)
    best_pred = min(done, key=lambda r: r['predicted'])
    regret = best_pred['measured'] / min(meas)
    lines += [f'- plans measured: {len(done)} of {len(rows)}',
              f'- MAPE: {mape:.1%} (target <= 15%)',
              f'- Spearman rank correlation: {rho:.3f} (target >= 0.9)',
              f'- regret of the predicted-best plan (#{best_pred["index"]}): '
              f'{regret:.3f}x the measured best']
  else:
    lines.append('- too few plans measured for statistics')
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  sys.exit(main())
