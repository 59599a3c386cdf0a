"""Mixture of experts: what expert parallelism and the dispatch cost and save.

Writes docs/bench_moe.md:
  1. mixtral_tiny's model (8 experts, top-2) on the 8 CPU devices, data=8,
     by expert degree (1, 2, 4) and dispatch (dropless, capacity at 1.25):
     per-device parameter and optimizer bytes and compiled temp bytes
     (XLA's memory analysis: deterministic) and the step time (ratios to
     expert 1 dropless within this one run; this machine's cores are shared
     by the 8 devices, so the all-to-all costs no link time here).
  2. 1f1b against DualPipeV at pipe=4, experts whole and split over 2
     devices: compiled temp bytes, step time, and what the all-to-all adds
     to each schedule's step.

  python scripts/bench_moe.py [--sections=1,2] [--steps=5]
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'src'))
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

_SECTIONS = flags.DEFINE_list('sections', ['1', '2'], 'Which sections to run.')
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps per configuration (after 2 warm-up).')
_OUT = flags.DEFINE_string('out', os.path.join(ROOT, 'docs', 'bench_moe.md'), 'Report.')

MIXTRAL_TINY = os.path.join(ROOT, 'experiments', 'mixtral_tiny.py')
MiB = 2**20
DEGREES = (1, 2, 4)
DISPATCHES = ('dropless', 'capacity')


def _config(expert: int, dispatch: str, **mesh):
  from triax import config

  c = config.from_file(MIXTRAL_TINY)
  c.mesh.data, c.mesh.tensor, c.mesh.pipe, c.mesh.expert = 8, 1, 1, expert
  c.model.moe_dispatch = dispatch
  c.model.capacity_factor = 1.25
  for key, value in mesh.items():
    group, name = key.split('.')
    c[group][name] = value
  return c


def _degree_rows() -> list[str]:
  from triax.training import measure

  c = _config(1, 'dropless')
  m = c.model
  rows = [
    f"mixtral_tiny's model: {m.num_layers} layers, d_model {m.d_model}, {m.num_experts} experts "
    f'of d_ff {m.d_ff}, top-{m.experts_per_token}, {m.seq_len} positions, global batch '
    f'{c.train.global_batch_size}, fp32; data=8 (the expert axis carved from it), '
    f'{_STEPS.value} timed steps after 2.',
    '',
    '| expert | dispatch | params MiB | Adam MiB | temp MiB | step s (CPU) | vs expert 1 dropless |',
    '|---|---|---|---|---|---|---|',
  ]
  base = None
  for expert in DEGREES:
    for dispatch in DISPATCHES:
      run = measure.measure(_config(expert, dispatch), steps=_STEPS.value, warmup=2)
      s, step = run.stats, run.step_time_s
      base = step if base is None else base
      rows.append(
        f'| {expert} | {dispatch} | {s["param_bytes"] / MiB:.2f} | '
        f'{s["optimizer_bytes"] / MiB:.2f} | {s["temp_bytes"] / MiB:.2f} | {step:.3f} | '
        f'{step / base:.2f}x |'
      )
      print(rows[-1], flush=True)
  return rows


def _schedule_rows() -> list[str]:
  from triax import config
  from triax.errors import ConfigError
  from triax.training import measure

  rows = [
    'The same model with 8 layers, data=2 x pipe=4, m=8, the aux loss per micro-batch (model.router_aux_loss_scope='
    'microbatch, what the executor computes); DualPipeV with its v=2 chunks. The all-to-all '
    'cost of a schedule is its step time at expert 2 less its step time at expert 1 (no '
    'all-to-all); a schedule that hides it under compute would show none.',
    '',
    '| schedule | expert | temp MiB | step s (CPU) | vs 1f1b at expert 1 |',
    '|---|---|---|---|---|',
  ]
  base, times = None, {}
  for schedule in ('1f1b', 'dualpipe_v'):
    for expert in (1, 2):
      # 8 layers: DualPipeV's 2 chunks per stage at pipe 4.
      cfg = _config(expert, 'dropless', **{'mesh.data': 2, 'mesh.pipe': 4, 'model.num_layers': 8})
      cfg.pipeline.schedule, cfg.pipeline.microbatches = schedule, 8
      cfg.pipeline.virtual_stages = 2 if schedule == 'dualpipe_v' else 1
      cfg.model.router_aux_loss_scope = 'microbatch'
      try:
        config.validate(cfg, 8)
      except ConfigError as e:
        return rows + ['', f'Not measured: `{schedule}` at pipe=4 is refused: `error: {e}`.']
      run = measure.measure(cfg, steps=_STEPS.value, warmup=2)
      base = run.step_time_s if base is None else base
      times[schedule, expert] = run.step_time_s
      rows.append(
        f'| {schedule} | {expert} | {run.stats["temp_bytes"] / MiB:.2f} | '
        f'{run.step_time_s:.3f} | {run.step_time_s / base:.2f}x |'
      )
      print(rows[-1], flush=True)
  rows.append('')
  for schedule in ('1f1b', 'dualpipe_v'):
    cost = times[schedule, 2] - times[schedule, 1]
    rows.append(
      f'- {schedule}: the all-to-all costs {cost:+.3f} s a step '
      f'({cost / times[schedule, 1]:+.0%} of its step at expert 1).'
    )
  return rows


SECTIONS = {
  '1': ('Expert degree and dispatch on 8 CPU devices', _degree_rows),
  '2': ('1f1b against DualPipeV at pipe=4', _schedule_rows),
}


def main(argv):
  del argv
  lines = ['# Mixture of experts: expert parallelism and dispatch', '']
  lines += ['Written by `scripts/bench_moe.py`.', '']
  for key, (title, rows) in SECTIONS.items():
    if key in _SECTIONS.value:
      lines += [f'## {title}', '', *rows(), '']
  from triax.training import measure

  measure.write_report(_OUT.value, lines)


if __name__ == '__main__':
  app.run(main)
