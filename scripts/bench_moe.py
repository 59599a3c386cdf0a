"""Mixture of experts: what expert parallelism and the dispatch cost and save.

Writes docs/bench_moe.md:
  1. mixtral_tiny's model (8 experts, top-2) on the 8 CPU devices, data=8,
     by expert degree (1, 2, 4) and dispatch (dropless, capacity at 1.25):
     per-device parameter and optimizer bytes and compiled temp bytes
     (XLA's memory analysis: deterministic) and the step time (ratios to
     expert 1 dropless within this one run; this machine's cores are shared
     by the 8 devices, so the all-to-all costs no link time here).
  2. 1f1b against DualPipeV at pipe=4, unfused and with its overlapped
     pairs fused into one tick (pipeline.fuse_overlaps), experts whole and
     split over 2 devices: compiled temp bytes, step time, and what the
     all-to-all adds to each schedule's step.
  3. The fused tick in the lockstep time model (pipeline/simulate.py):
     DualPipeV's step unfused and fused, by all-to-all time per action
     against its compute (t_exchange), where fusing starts to pay.
  4. The fused tick on XLA:GPU's compiler (h100:8, compile only, through
     jax's CUDA plugin): the kernels its schedule runs inside the fused
     branch's all-to-all windows, and how many are the other micro-batch's
     (compiled/hlo_schedule.py), with XLA's passes as they are and with
     its multi-output fusion off.
  5-7. deepseek_tiny (scripts/bench_deepseek.py): the max/mean expert load
     with the balancing bias's update on and off; compiled temp bytes and
     step time by layout and schedule; MLA's decoding cache against
     multi-head attention's.

  python scripts/bench_moe.py [--sections=1,...,7] [--steps=5]

Sections not run keep what the report held.
"""

from __future__ import annotations

import os
import sys

import bench_deepseek
from absl import app, flags
from bench_harness import ROOT, doc_sections, force_cpu_devices, run_python

force_cpu_devices()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

_SECTIONS = flags.DEFINE_list(
  'sections', ['1', '2', '3', '4', '5', '6', '7'], 'Which sections to run.'
)
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
  from triax.compiled import measure

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
  from triax.compiled import measure
  from triax.errors import ConfigError

  rows = [
    'The same model with 8 layers, data=2 x pipe=4, m=8, the aux loss per micro-batch (model.router_aux_loss_scope='
    'microbatch, what the executor computes); DualPipeV with its v=2 chunks, and fused: each '
    "overlapped pair in one tick (pipeline.fuse_overlaps), one micro-batch's B and W, then "
    "another's F. The all-to-all "
    'cost of a schedule is its step time at expert 2 less its step time at expert 1 (no '
    'all-to-all); a schedule that hides it under compute would show none. On CPU no '
    'collective runs beside compute, so none can hide here (section 3 models it).',
    '',
    '| schedule | expert | temp MiB | step s (CPU) | vs 1f1b at expert 1 |',
    '|---|---|---|---|---|',
  ]
  base, times = None, {}
  for schedule in SCHEDULES:
    for expert in (1, 2):
      # 8 layers: DualPipeV's 2 chunks per stage at pipe 4.
      cfg = _config(expert, 'dropless', **{'mesh.data': 2, 'mesh.pipe': 4, 'model.num_layers': 8})
      cfg.pipeline.schedule, cfg.pipeline.microbatches = schedule.split('+')[0], 8
      cfg.pipeline.virtual_stages = 1 if schedule == '1f1b' else 2
      cfg.pipeline.fuse_overlaps = schedule.endswith('+fused')
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
  for schedule in SCHEDULES:
    cost = times[schedule, 2] - times[schedule, 1]
    rows.append(
      f'- {schedule}: the all-to-all costs {cost:+.3f} s a step '
      f'({cost / times[schedule, 1]:+.0%} of its step at expert 1).'
    )
  return rows


def _model_rows() -> list[str]:
  from triax.pipeline import schedule as sched
  from triax.pipeline import simulate

  rows = [
    'DualPipeV at pipe=4 in the lockstep time model (`simulate.simulate_lockstep`, what '
    '`triax schedule --t_exchange=X [--fuse_overlaps]` prints): each chunk action costs 1, '
    'and an F or a B also waits for its all-to-alls, X of its compute. A fused tick lasts the '
    "longer of its three actions' compute and its two exchanges (the exchanges run beside the "
    "other micro-batch's compute, DualPipe's overlap at best); a stage beside it running "
    'one action waits for it.',
    '',
    '| m | all-to-all / compute | ticks unfused | ticks fused | time unfused | time fused | fused / unfused |',
    '|---|---|---|---|---|---|---|',
  ]
  p = 4
  for m in (2 * p, 4 * p):
    s = sched.build('dualpipe_v', p, m, 2)
    plain, fused = sched.lower(s), sched.lower(s, fuse_overlaps=True)
    for x in EXCHANGES:
      costs = simulate.Costs(2.0, 2.0, 2.0, t_exchange=2.0 * x)  # a stage's: 1 a chunk action
      a = simulate.simulate_lockstep(plain, costs).total_time
      b = simulate.simulate_lockstep(fused, costs).total_time
      rows.append(f'| {m} | {x:g} | {plain.ticks} | {fused.ticks} | {a:g} | {b:g} | {b / a:.2f}x |')
  return rows


def _gpu_rows() -> list[str]:
  import glob
  import tempfile

  from triax.compiled import hlo_schedule

  plugin = os.environ.get('TRIAX_XLA_CUDA_PLUGIN') or GPU_PLUGIN
  if not os.path.isfile(plugin):
    return [f'Not measured: no CUDA plugin at {plugin} (`source scripts/env.sh test` installs it).']
  rows = [
    "mixtral_tiny's model with 8 layers at data=2 x pipe=4 x expert 2, DualPipeV fused "
    '(pipeline.fuse_overlaps), its layers unrolled (model.scan_layers=false: a chunk is '
    "loop-free code), compiled for h100:8 (`--compile_only`). In the fused branch's scheduled "
    'HLO: its async all-to-all pairs, their chains (all-to-alls linked by data flow: one '
    "micro-batch's dispatch and combine), the kernels scheduled inside their windows, and "
    "those of another chain only (the other micro-batch's work, what hides an all-to-all).",
    '',
    '| XLA passes | all-to-all pairs | chains | kernels in windows | of another chain |',
    '|---|---|---|---|---|',
  ]
  for label, xla_flags in GPU_PASSES:
    with tempfile.TemporaryDirectory() as tmp:
      env = {
        'XLA_FLAGS': xla_flags,
        'TRIAX_XLA_CUDA_PLUGIN': plugin,
        'TRIAX_XLA_DUMP': os.path.join(tmp, 'dump'),
      }
      flags_ = [f'--config.{k}={v}' for k, v in GPU_CONFIG.items()]
      run_python(
        ['-m', 'triax', 'train', f'--config={MIXTRAL_TINY}', '--compile_only']
        + ['--topology=h100:8', f'--workdir={os.path.join(tmp, "w")}', *flags_],
        env=env,
        check=True,
      )
      (path,) = glob.glob(os.path.join(tmp, 'dump', '*gpu_after_optimizations.txt'))
      with open(path) as f:
        w = hlo_schedule.windows(f.read())
    rows.append(
      f'| {label} | {w.pairs} | {" + ".join(map(str, w.chains))} | {w.kernels} | {w.other_chain} |'
    )
    print(rows[-1], flush=True)
  return rows


# jax's CUDA plugin where scripts/env.sh installs it for the test extra.
GPU_PLUGIN = os.path.join(sys.prefix, 'xla-cuda', 'jax_plugins', 'xla_cuda12', 'xla_cuda_plugin.so')
# Section 4's layout (flags of `triax train`).
GPU_CONFIG = {
  'mesh.data': 2,
  'mesh.tensor': 1,
  'mesh.pipe': 4,
  'mesh.expert': 2,
  'model.num_layers': 8,
  'model.router_aux_loss_scope': 'microbatch',
  'model.scan_layers': 'false',
  'pipeline.schedule': 'dualpipe_v',
  'pipeline.virtual_stages': 2,
  'pipeline.microbatches': 8,
  'pipeline.fuse_overlaps': 'true',
}
# XLA as it is, and without its multi-output fusion (which merged kernels of
# both micro-batches into one while jnp's gathers shared a zeros array; moe._rows).
GPU_PASSES = (
  ('as they are', ''),
  ('multi_output_fusion off', '--xla_disable_hlo_passes=multi_output_fusion'),
)
# 1f1b, DualPipeV, and DualPipeV with its overlapped pairs fused into one tick.
SCHEDULES = ('1f1b', 'dualpipe_v', 'dualpipe_v+fused')
# All-to-all time of an F or a B against its compute, in section 3.
EXCHANGES = (0.0, 0.1, 0.25, 0.5, 1.0)

SECTIONS = {
  '1': ('Expert degree and dispatch on 8 CPU devices', _degree_rows),
  '2': ('1f1b against DualPipeV at pipe=4', _schedule_rows),
  '3': ("DualPipeV's fused tick in the time model", _model_rows),
  '4': ("DualPipeV's fused tick on XLA:GPU's compiler", _gpu_rows),
  '5': ('DeepSeek: loss-free balancing', bench_deepseek.balance_rows),
  '6': ('DeepSeek: layouts and schedules on 8 CPU devices', bench_deepseek.layout_rows),
  '7': ("DeepSeek: MLA's decoding cache", bench_deepseek.cache_rows),
}


def main(argv):
  del argv
  lines = ['# Mixture of experts: expert parallelism and dispatch', '']
  lines += ['Written by `scripts/bench_moe.py`.', '']
  # Sections not run this time keep what the report held.
  kept = doc_sections(_OUT.value)
  for key, (title, rows) in SECTIONS.items():
    if key in _SECTIONS.value:
      lines += [f'## {title}', '', *rows(), '']
    elif title in kept:
      lines += [f'## {title}', '', *kept[title], '']
  from triax.compiled import measure

  measure.write_report(_OUT.value, lines)


if __name__ == '__main__':
  app.run(main)
