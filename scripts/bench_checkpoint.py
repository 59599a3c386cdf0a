"""What asynchronous checkpoints cost a training step: writes docs/bench_checkpoint.md.

    .venv/bin/python scripts/bench_checkpoint.py [--steps=60] [--every=20] [--repeats=2]
    python scripts/bench_checkpoint.py --config=experiments/gpt_1b.py --steps=40 --every=20 \
        --repeats=1 --no-warmup --out=docs/bench_checkpoint_gpu.md     # on one GPU

Trains --config (default experiments/gpt_tiny.py: data 2 x tensor 2 x pipe 2,
interleaved 1F1B, 8 forced CPU devices; on a GPU, experiments/gpt_1b.py, the
benchmark config of scripts/gpu_bench.sh) for --steps steps, in fresh workdirs, alternately
with a save every --every steps and with only the final save (both runs end
with one), --repeats times each. The per-step cost of saving is the extra wall
time of the saving runs over their number of steps, set against the step time
of the runs without (metrics.jsonl's median step_time_s). Also reported: the
host time each save blocks the loop (Checkpointer.save: the wait for the
previous save, the conversion to the checkpoint's layout, orbax's dispatch),
and the CRC-32 pass of the manifest, which runs after the write in orbax's
background thread. A benchmark, not a test: every figure in the doc is a ratio
or comes with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_harness import force_cpu_devices

force_cpu_devices()

import jax  # noqa: E402

from triax import config as config_lib  # noqa: E402
from triax.training import checkpoint as ckpt_lib  # noqa: E402
from triax.training import loop  # noqa: E402
from triax.training.metrics import read_metrics  # noqa: E402


def experiment(config: str, steps: int, every: int):
  path, _, arg = config.partition(':')
  cfg = config_lib.from_file(path, ','.join(a for a in (arg, f'steps={steps}') if a))
  cfg.train.log_every = 1
  cfg.train.eval_every = steps  # one evaluation, at the end, in both runs
  cfg.checkpoint.every_steps = every
  cfg.checkpoint.keep = 2
  return cfg


class SaveClock:
  """Wraps Checkpointer.save and _write_manifest to time them: each save's
  blocking, in order, and the manifests' total."""

  def __init__(self):
    self.blocking, self.manifest = [], 0.0
    self._save, self._manifest = ckpt_lib.Checkpointer.save, ckpt_lib.Checkpointer._write_manifest
    clock = self

    def save(ckpt, *args, **kwargs):
      started = time.perf_counter()
      clock._save(ckpt, *args, **kwargs)
      clock.blocking.append(time.perf_counter() - started)

    def write_manifest(ckpt):
      started = time.perf_counter()
      clock._manifest(ckpt)
      clock.manifest += time.perf_counter() - started

    ckpt_lib.Checkpointer.save, ckpt_lib.Checkpointer._write_manifest = save, write_manifest


def run_once(config: str, steps: int, every: int, root: str) -> dict:
  """One run's figures, in this process (`run_apart` gives it one of its own)."""
  clock = SaveClock()
  workdir = tempfile.mkdtemp(dir=root)
  cfg = experiment(config, steps, every)
  started = time.perf_counter()
  loop.train_and_evaluate(cfg, workdir, progress=False)
  wall = time.perf_counter() - started
  # One record per step (log_every=1). A step's time excludes a save's blocking,
  # which SaveClock counts; the first step's, the one-off costs of a process's first run.
  times = [
    r['step_time_s'] for r in read_metrics(workdir) if r.get('step', 0) > 1 and 'step_time_s' in r
  ]
  stats = json.load(open(os.path.join(workdir, 'compile_stats.json')))
  size = sum(
    os.path.getsize(os.path.join(d, n))
    for d, _, names in os.walk(os.path.join(workdir, 'checkpoints', str(cfg.train.steps)))
    for n in names
  )
  return {
    'wall_s': wall - stats['compile_seconds'],
    'step_s': statistics.median(times),
    # Each step over the run's own median: what saving adds to some steps,
    # whatever the speed of the machine during this run.
    'excess_s': sum(times) - len(times) * statistics.median(times),
    'timed_steps': len(times),
    'saves': len(clock.blocking),
    'blocking_s': sum(clock.blocking),
    # A run's first save also traces and compiles the conversion to the
    # checkpoint's layout, once: the others are what one more save costs.
    'later_saves_s': clock.blocking[1:],
    'manifest_s': clock.manifest,
    'checkpoint_bytes': size,
    # What it ran on, for the doc (the parent process never starts JAX).
    'platform': jax.devices()[0].platform,
    'device_kind': jax.devices()[0].device_kind,
    'devices': jax.device_count(),
  }


def run_apart(args, every: int, root: str) -> dict:
  """`run_once` in a process of its own: one process's runs slow down one after
  another (step times up 20% over eight runs here), which pairs of runs in one
  process would count as the cost of saving."""
  # This script again, not bench_harness.run_python: in the caller's
  # directory, which --config and --root are relative to.
  command = [sys.executable, os.path.abspath(__file__), f'--config={args.config}']
  command += [f'--steps={args.steps}', f'--child={every}', f'--root={root}']
  done = subprocess.run(command, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f'a run with a save every {every} steps failed:\n{done.stderr[-3000:]}')
  return json.loads(done.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--every', type=int, default=20)
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--out', default='docs/bench_checkpoint.md')
  parser.add_argument('--config', default='experiments/gpt_tiny.py', help='FILE[:ARG]')
  parser.add_argument(
    '--warmup',
    action=argparse.BooleanOptionalAction,
    default=True,
    help='a first run that fills the compilation cache (compile time is subtracted anyway; '
    '--no-warmup saves an accelerator that run)',
  )
  parser.add_argument('--child', type=int, help=argparse.SUPPRESS)  # one run, its figures
  parser.add_argument('--root', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child is not None:
    print(json.dumps(run_once(args.config, args.steps, args.child, args.root)))
    return
  # One compilation cache for every run's process: later runs skip compiles.
  os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', tempfile.mkdtemp())
  runs = {0: [], args.every: []}
  load = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as root:
    if args.warmup:
      run_apart(args, 0, root)  # fills the compilation cache
    for repeat in range(args.repeats):
      # Which run goes first alternates, so that a drift in the machine's
      # speed counts for and against saving alike.
      for every in list(runs)[:: 1 if repeat % 2 == 0 else -1]:
        runs[every].append(run_apart(args, every, root))
  write_doc(args, runs, load, os.getloadavg()[0])


def write_doc(args, runs: dict, load_before: float, load_after: float) -> None:
  plain, saving = runs[0], runs[args.every]
  step = statistics.median(r['step_s'] for r in plain)
  # Per pair (a saving run and the plain run beside it): the wall time the extra saves add.
  pairs = [(s['wall_s'] - p['wall_s']) / args.steps / step for s, p in zip(saving, plain)]
  extra_saves = saving[0]['saves'] - plain[0]['saves']
  blocking = statistics.median(t for r in saving for t in r['later_saves_s'])
  # The same from the steps' times over their run's median and the extra
  # saves' blocking: without the start-up, compile, evaluation and final save
  # the wall includes, and without a run's speed against its pair's.
  stepwise = [
    (s['excess_s'] - p['excess_s'] + extra_saves * blocking) / p['timed_steps'] / step
    for s, p in zip(saving, plain)
  ]
  manifest = statistics.median(r['manifest_s'] / r['saves'] for r in saving)
  size = saving[0]['checkpoint_bytes']
  figures = {
    'steps': args.steps,
    'every': args.every,
    'extra_saves': extra_saves,
    'step_s': step,
    'overhead_per_step_ratio_pairs': pairs,
    'overhead_per_step_ratio_median': statistics.median(pairs),
    'stepwise_overhead_ratio_pairs': stepwise,
    'stepwise_overhead_ratio_median': statistics.median(stepwise),
    'blocking_per_save_in_steps': blocking / step,
    'blocking_per_step_ratio': blocking / step / args.every,
    'manifest_per_save_in_steps': manifest / step,
    # The save interval whose blocking part alone is 3% of the steps between saves.
    'every_for_3pct_blocking': math.ceil(blocking / step / 0.03),
    'checkpoint_bytes': size,
    'load_before': load_before,
    'load_after': load_after,
    'runs': runs,
  }
  each = ', '.join(f'{x:.1%}' for x in pairs)
  each_stepwise = ', '.join(f'{x:.1%}' for x in stepwise)
  ran = plain[0]
  on_cpu = ran['platform'] == 'cpu'
  flags = f'--steps={args.steps} --every={args.every} --repeats={args.repeats}'
  if args.config != 'experiments/gpt_tiny.py':
    flags = f'--config={args.config} {flags}'
  if not args.warmup:
    flags += ' --no-warmup'
  where = (
    f'{ran["devices"]} forced CPU devices of this {os.cpu_count()}-CPU machine'
    if on_cpu
    else f'{ran["devices"]} x {ran["device_kind"]} (host: {os.cpu_count()} CPUs)'
  )
  verdict = (
    f'Issue 28 asks for at most 3% per step: the blocking part is '
    f'{blocking / step / args.every:.2%} at a save every {args.every} steps, and the time '
    f'the saves add, median of pairs, {statistics.median(stepwise):.1%}.'
  )
  if on_cpu:
    why = f"""the step-time row adds what the background write and the
checksums take from the steps by sharing the host's cores: on CPU "devices"
the step itself runs on those cores, so it overstates what an accelerator
(whose step does not use them) would pay. The pairs alternate which run goes
first, each in a process of its own; their spread is this machine's noise. {verdict}"""
  else:
    why = f"""on an accelerator the step does not use the host's cores, so
the background write costs the step only what it takes of the host's memory
bandwidth and the device's copies. {verdict} The blocking part alone stays
under 3% from a save every {figures['every_for_3pct_blocking']} steps on."""
  text = f"""# Cost of asynchronous checkpoints

`scripts/bench_checkpoint.py {flags}`:
`{args.config}` on {where}, {args.steps} steps with a save every {args.every} steps
({extra_saves} more saves) against the same run with the final save only.
Checkpoint: {size / 2**20:.1f} MiB (parameters and Adam state, canonical layout).
Load average {load_before:.1f} before, {load_after:.1f} after: figures are ratios
to the step time measured in the same runs ({step * 1e3:.1f} ms), and the
wall-time ones are noisy (see each pair).

| what | ratio |
|---|---|
| time the saves add per training step: the steps over their run's median, and the blocking, median of pairs (each pair: {each_stepwise}) | {statistics.median(stepwise):.1%} |
| wall time the saves add per training step, median of pairs (each pair: {each}) | {statistics.median(pairs):.1%} |
| host time one more save blocks the loop (`Checkpointer.save`), in step times | {blocking / step:.2f} |
| the same, spread over the {args.every} steps between saves | {blocking / step / args.every:.2%} |
| CRC-32 manifest of one save (orbax's background thread), in step times | {manifest / step:.2f} |

A save blocks the loop only for the wait on the previous save, the
conversion to the checkpoint's layout and orbax's dispatch; the files are
written while the next steps run. The blocking row is the floor of what a
save costs; {why}

```
{json.dumps(figures)}
```
"""
  with open(args.out, 'w') as f:
    f.write(text)
  print(text)


if __name__ == '__main__':
  main()
