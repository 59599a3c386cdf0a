"""Schedule comparison (issue 4): gpipe, 1f1b, interleaved_1f1b v=2, bpipe, zb_h1 at p = 4.

  PYTHONPATH=src .venv/bin/python scripts/bench_schedules.py [--out=docs/bench_schedules.md]

Per schedule and m in {4, 8, 16, 32}: simulated bubble in both time models
(t_B = 2 t_F; zb_h1 splits it into B = W = t_F), lockstep ticks, compiled
per-device temp bytes (every device compiles the same buffers in SPMD), the
residual bytes live at each stage's peak (max and min over stages: peak
stash sets x bytes per set per device), residual bytes moved between stages
per step (BPipe's evictions and loads), and the step time relative to 1f1b
measured in the same run on 8 forced CPU devices (ratios only: the devices
share this machine's cores).
"""

import os
import sys

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'src'))

from absl import app, flags  # noqa: E402

from triax import config  # noqa: E402
from triax.pipeline import schedule as sched  # noqa: E402
from triax.pipeline import simulate  # noqa: E402
from triax.training.measure import measure, write_report  # noqa: E402

_OUT = flags.DEFINE_string('out', 'docs/bench_schedules.md', 'Markdown table to write.')
_MICROBATCHES = flags.DEFINE_list('microbatches', ['4', '8', '16', '32'], 'm values.')
_STEPS = flags.DEFINE_integer('steps', 4, 'Timed steps per point (after 2 warm-up steps).')

P, DATA = 4, 2
SCHEDULES = (('gpipe', 1), ('1f1b', 1), ('interleaved_1f1b', 2), ('bpipe', 1), ('zb_h1', 1))


def bench_config(m, name, v):
  c = config.defaults()
  # Activation-heavy on purpose (long sequences, narrow model): where BPipe matters.
  c.model.num_layers, c.model.d_model, c.model.num_heads = 8, 64, 4
  c.model.d_ff, c.model.seq_len = 256, 128
  c.mesh.data, c.mesh.pipe = DATA, P
  c.pipeline.schedule, c.pipeline.virtual_stages, c.pipeline.microbatches = name, v, m
  c.train.global_batch_size = 4 * DATA * m   # fixed micro-batch of 4 sequences per data shard
  return c


def simulated(name, m, v):
  program = sched.lower(sched.build(name, P, m, v))
  if program.split_backward:
    costs = simulate.Costs(t_forward=1.0, t_backward=1.0, t_weight=1.0)
  else:
    costs = simulate.Costs(t_forward=1.0, t_backward=2.0)
  return (program, simulate.simulate_lockstep(program, costs).bubble_fraction,
          simulate.simulate_async(program.schedule, costs).bubble_fraction)


def main(argv):
  del argv
  rows = []
  for m in map(int, _MICROBATCHES.value):
    times = {}
    for name, v in SCHEDULES:
      result = measure(bench_config(m, name, v), steps=_STEPS.value)
      program, lock, asyn = simulated(name, m, v)
      per_set = result.stats['schedule']['residual_bytes_per_slot'] / DATA  # per device
      live = [n * per_set for n in program.peak_stash]
      moved = result.stats['schedule']['residual_bytes_moved_per_step']
      times[name] = result.step_time_s
      rows.append([name + (f' v={v}' if v > 1 else ''), m, program.ticks, lock, asyn,
                   result.stats['temp_bytes'], max(live), min(live), moved, name])
      print(rows[-1], flush=True)
    for row in rows[-len(SCHEDULES):]:
      row[-1] = times[row[-1]] / times['1f1b']
  lines = [
      f'Schedules at p={P}, data={DATA}: 8 layers of width 64, 128 tokens x 4 sequences per '
      'micro-batch per data shard, fp32, 8 forced CPU devices on '
      f'{os.cpu_count()} cores. Bubbles simulated with t_B = 2 t_F (zb_h1: B = W = t_F).',
      '',
      '| schedule | m | ticks | bubble lockstep | bubble async | temp MiB/device '
      '| live stash MiB max / min over stages | MiB moved/step | step time / 1f1b |',
      '|---|---|---|---|---|---|---|---|---|']
  for name, m, ticks, lock, asyn, temp, hi, lo, moved, rel in rows:
    lines.append(f'| {name} | {m} | {ticks} | {lock:.3f} | {asyn:.3f} | {temp / 2**20:.1f} '
                 f'| {hi / 2**20:.1f} / {lo / 2**20:.1f} | {moved / 2**20:.1f} | {rel:.2f} |')
  write_report(_OUT.value, lines)


if __name__ == '__main__':
  app.run(main)
