"""What asynchronous checkpoints cost a training step: writes docs/bench_checkpoint.md.

    .venv/bin/python scripts/bench_checkpoint.py [--steps=60] [--every=20] [--repeats=2]

Trains experiments/gpt_tiny.py (data 2 x tensor 2 x pipe 2, interleaved
1F1B, 8 forced CPU devices) for --steps steps, in fresh workdirs, alternately
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
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'src'))

import jax  # noqa: E402

from triax import config as config_lib  # noqa: E402
from triax.training import checkpoint as ckpt_lib  # noqa: E402
from triax.training import loop  # noqa: E402
from triax.training.metrics import read_metrics  # noqa: E402

CONFIG = 'experiments/gpt_tiny.py'


def experiment(steps: int, every: int):
  cfg = config_lib.from_file(CONFIG, f'steps={steps}')
  cfg.train.log_every = 1
  cfg.train.eval_every = steps  # one evaluation, at the end, in both runs
  cfg.checkpoint.every_steps = every
  cfg.checkpoint.keep = 2
  return cfg


class SaveClock:
  """Wraps Checkpointer.save and _write_manifest to add up the time they take."""

  def __init__(self):
    self.blocking, self.manifest, self.saves = 0.0, 0.0, 0
    self._save, self._manifest = ckpt_lib.Checkpointer.save, ckpt_lib.Checkpointer._write_manifest
    clock = self

    def save(ckpt, *args, **kwargs):
      started = time.perf_counter()
      clock._save(ckpt, *args, **kwargs)
      clock.blocking += time.perf_counter() - started
      clock.saves += 1

    def write_manifest(ckpt):
      started = time.perf_counter()
      clock._manifest(ckpt)
      clock.manifest += time.perf_counter() - started

    ckpt_lib.Checkpointer.save, ckpt_lib.Checkpointer._write_manifest = save, write_manifest


def run_once(steps: int, every: int, root: str, clock: SaveClock) -> dict:
  workdir = tempfile.mkdtemp(dir=root)
  before = (clock.blocking, clock.manifest, clock.saves)
  started = time.perf_counter()
  loop.train_and_evaluate(experiment(steps, every), workdir, progress=False)
  wall = time.perf_counter() - started
  times = [r['step_time_s'] for r in read_metrics(workdir) if 'step_time_s' in r]
  stats = json.load(open(os.path.join(workdir, 'compile_stats.json')))
  size = sum(
    os.path.getsize(os.path.join(d, n))
    for d, _, names in os.walk(os.path.join(workdir, 'checkpoints', str(steps)))
    for n in names
  )
  return {
    'wall_s': wall - stats['compile_seconds'],
    'step_s': statistics.median(times),
    'saves': clock.saves - before[2],
    'blocking_s': clock.blocking - before[0],
    'manifest_s': clock.manifest - before[1],
    'checkpoint_bytes': size,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--every', type=int, default=20)
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--out', default='docs/bench_checkpoint.md')
  args = parser.parse_args()
  jax.config.update('jax_compilation_cache_dir', tempfile.mkdtemp())  # later runs skip compiles
  clock = SaveClock()
  runs = {0: [], args.every: []}
  load = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as root:
    run_once(args.steps, 0, root, clock)  # warm-up: fills the compilation cache
    for _ in range(args.repeats):
      for every in runs:
        runs[every].append(run_once(args.steps, every, root, clock))
  write_doc(args, runs, load, os.getloadavg()[0])


def write_doc(args, runs: dict, load_before: float, load_after: float) -> None:
  plain, saving = runs[0], runs[args.every]
  step = statistics.median(r['step_s'] for r in plain)
  # Per pair (a saving run and the plain run beside it): the wall time the extra saves add.
  pairs = [(s['wall_s'] - p['wall_s']) / args.steps / step for s, p in zip(saving, plain)]
  extra_saves = saving[0]['saves'] - plain[0]['saves']
  blocking = statistics.median(r['blocking_s'] / r['saves'] for r in saving)
  manifest = statistics.median(r['manifest_s'] / r['saves'] for r in saving)
  size = saving[0]['checkpoint_bytes']
  figures = {
    'steps': args.steps,
    'every': args.every,
    'extra_saves': extra_saves,
    'step_s': step,
    'overhead_per_step_ratio_pairs': pairs,
    'overhead_per_step_ratio_median': statistics.median(pairs),
    'blocking_per_save_in_steps': blocking / step,
    'blocking_per_step_ratio': blocking / step / args.every,
    'manifest_per_save_in_steps': manifest / step,
    'checkpoint_bytes': size,
    'load_before': load_before,
    'load_after': load_after,
    'runs': runs,
  }
  each = ', '.join(f'{x:.1%}' for x in pairs)
  text = f"""# Cost of asynchronous checkpoints

`scripts/bench_checkpoint.py --steps={args.steps} --every={args.every} --repeats={args.repeats}`:
`{CONFIG}` (data 2 x tensor 2 x pipe 2, interleaved 1F1B, v=2) on 8 forced CPU
devices of this 2-CPU machine, {args.steps} steps with a save every {args.every} steps
({extra_saves} more saves) against the same run with the final save only.
Checkpoint: {size / 2**20:.1f} MiB (parameters and Adam state, canonical layout).
The machine was shared with other work (load average {load_before:.1f} before,
{load_after:.1f} after, on 2 CPUs): figures are ratios to the step time measured
in the same runs, and the wall-time ones are noisy (see each pair).

| what | ratio |
|---|---|
| wall time the saves add per training step, median of pairs (each pair: {each}) | {statistics.median(pairs):.1%} |
| host time one save blocks the loop (`Checkpointer.save`), in step times | {blocking / step:.2f} |
| the same, spread over the {args.every} steps between saves | {blocking / step / args.every:.2%} |
| CRC-32 manifest of one save (orbax's background thread), in step times | {manifest / step:.2f} |

A save blocks the loop only for the wait on the previous save, the
conversion to the checkpoint's layout and orbax's dispatch; the files are
written while the next steps run. The blocking row is the floor of what a
save costs; the wall-time row adds what the background write and the
checksums take from the step by sharing the host's cores: on CPU "devices"
the step itself runs on those 2 cores, so it overstates what an accelerator
(whose step does not use them) would pay. Issue 28 asks for at most 3% per
step on the benchmark config; here the blocking part is below that, and the
wall-time figure is within the noise of this shared machine. Run it alone
(and on an accelerator) before quoting it as a bound.

```
{json.dumps(figures)}
```
"""
  with open(args.out, 'w') as f:
    f.write(text)
  print(text)


if __name__ == '__main__':
  main()
