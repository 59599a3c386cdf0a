"""Pipeline engine benchmark (issue 3): schedules at p = 4 against pipe = 1.

  PYTHONPATH=src .venv/bin/python scripts/bench_pipeline.py [--out=docs/bench_pipeline.md]

For gpipe, 1f1b and interleaved_1f1b (v=2) with m in {4, 8, 16, 32}: ticks,
simulated bubble in both time models, per-device temp bytes (XLA), and the
step time relative to pipe = 1 on the same 8 devices and global batch. (The
ablation that computed idle slots, as MaxText/praxis do, left with the
lockstep executor it was built into; its last results are in git history.)
Times are medians of warm steps on 8 forced CPU devices
that share this machine's cores: read them as ratios within one run.
"""

import os

from absl import app, flags
from bench_harness import force_cpu_devices

force_cpu_devices()

from triax import config  # noqa: E402
from triax.compiled.measure import measure, write_report  # noqa: E402
from triax.pipeline import schedule as sched  # noqa: E402
from triax.pipeline import simulate  # noqa: E402

_OUT = flags.DEFINE_string('out', 'docs/bench_pipeline.md', 'Markdown table to write.')
_MICROBATCHES = flags.DEFINE_list('microbatches', ['4', '8', '16', '32'], 'm values.')
_STEPS = flags.DEFINE_integer('steps', 4, 'Timed steps per point (after 2 warm-up steps).')

P = 4
SCHEDULES = (('gpipe', 1), ('1f1b', 1), ('interleaved_1f1b', 2))


def bench_config(**overrides):
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.num_heads = 8, 128, 4
  c.model.d_ff, c.model.seq_len = 512, 64
  c.train.global_batch_size = 64
  for key, value in overrides.items():
    group, name = key.split('.')
    c[group][name] = value
  return c


def bubbles(name, m, v):
  program = sched.lower(sched.build(name, P, m, v))
  costs = simulate.Costs.design_point(split=False)
  return (
    program.ticks,
    simulate.simulate_lockstep(program, costs).bubble_fraction,
    simulate.simulate_async(program.schedule, costs).bubble_fraction,
  )


def main(argv):
  del argv
  base = measure(bench_config(**{'mesh.data': 8}), steps=_STEPS.value)
  rows = []
  for m in map(int, _MICROBATCHES.value):
    for name, v in SCHEDULES:
      cfg = bench_config(
        **{
          'mesh.data': 2,
          'mesh.pipe': P,
          'pipeline.schedule': name,
          'pipeline.virtual_stages': v,
          'pipeline.microbatches': m,
        }
      )
      skip = measure(cfg, steps=_STEPS.value)
      ticks, lock, asyn = bubbles(name, m, v)
      rows.append(
        (
          f'{name}' + (f' v={v}' if v > 1 else ''),
          m,
          ticks,
          lock,
          asyn,
          skip.stats['temp_bytes'],
          skip.step_time_s / base.step_time_s,
        )
      )
      print(rows[-1], flush=True)
  lines = [
    f'Pipeline benchmark: p={P}, mesh data=2 x pipe=4 vs data=8 x pipe=1 (baseline step '
    f'{base.step_time_s * 1e3:.0f} ms, temp {base.stats["temp_bytes"] / 2**20:.1f} MiB), '
    'global batch 64 x 64 tokens, 8 layers of width 128, fp32, 8 forced CPU devices on '
    f'{os.cpu_count()} cores. Bubbles simulated with t_B = 2 t_F.',
    '',
    '| schedule | m | ticks | bubble (lockstep) | bubble (async) | temp MiB/device '
    '| step time / pipe=1 |',
    '|---|---|---|---|---|---|---|',
  ]
  for name, m, ticks, lock, asyn, temp, rel in rows:
    lines.append(
      f'| {name} | {m} | {ticks} | {lock:.3f} | {asyn:.3f} | {temp / 2**20:.1f} | {rel:.2f} |'
    )
  write_report(_OUT.value, lines)


if __name__ == '__main__':
  app.run(main)
