"""Long sequences: what context parallelism and sequence parallelism cost and save.

Writes docs/bench_long_context.md:
  1. llama_long (llama_tiny's width, 2 layers, full remat, one row) at 2k, 8k
     and 32k positions on 1, 2, 4 and 8 CPU devices of `context`, both kinds
     of attention: per-device temp bytes from XLA's compiled memory analysis
     (deterministic) and the step time (2k and 8k only; ratios within one
     run, this machine's 2 cores are shared by every device).
  2. Megatron's sequence parallelism at t = 2 and 4, compiled by XLA:TPU for
     v5p chips (libtpu on this host): per-device temp bytes with and without,
     against Korthikanti et al.'s per-layer activation formula.
  3. A 32k run that `triax budget` finds no way to fit under a limit with
     context=1, and that trains with context=8 and ring attention (its
     losses, step times and per-device peak bytes).
  4. Sliding windows at 32k (4k window) and 8k (1k, timed) positions over
     8 context ranks, ring and all-gather: executed matmul FLOPs and bytes
     moved per device from the compiled programs, ring steps run, temp bytes.

  python scripts/bench_long_context.py [--sections=1,2,3,4]
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags
from bench_harness import ROOT, doc_sections, force_cpu_devices, run_python

from triax.compiled import stats as stats_lib

force_cpu_devices()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

_SECTIONS = flags.DEFINE_list('sections', ['1', '2', '3', '4'], 'Which sections to run.')
_OUT = flags.DEFINE_string('out', os.path.join(ROOT, 'docs', 'bench_long_context.md'), 'Report.')

LONG = os.path.join(ROOT, 'experiments', 'llama_long.py')
MiB = 2**20
SEQS = (2048, 8192, 32768)
TIMED_UP_TO = 8192
# Section 3's limit: what a context=8 device needs fits, context=1's does not.
LIMIT_MIB = 2048
# Section 3's run: 32k positions, one layer, three steps (a few minutes here;
# before the ring scored its blocks in key tiles, 8 devices' whole-block
# scores held 18 GB of this host's 24 and no step ended in 12 minutes).
SEQ3 = 32768
RUN = f'seq={SEQ3},layers=1,steps=3'


def _context_rows() -> list[str]:
  import jax

  from triax import config
  from triax.compiled import measure

  rows = [
    '| positions | context | attention | temp MiB per device (XLA:CPU) | temp MiB (XLA:TPU, v5p) '
    '| step s (CPU) | vs context 1 |',
    '|---|---|---|---|---|---|---|',
  ]
  for seq in SEQS:
    base_time = None
    for c in (1, 2, 4, 8):
      for kind in ('allgather', 'ring') if c > 1 else ('allgather',):
        cfg = config.from_file(LONG, f'seq={seq},context={c},kind={kind}')
        cfg.mesh.data, cfg.train.global_batch_size = 1, 1
        devices = jax.devices()[:c]
        if seq <= TIMED_UP_TO:
          m = measure.measure(cfg, steps=2, warmup=1, devices=devices)
          stats, step = m.stats, m.step_time_s
        else:
          stats, step = _compile_only(cfg, devices), None
        base_time = step if c == 1 else base_time
        ratio = f'{step / base_time:.2f}x' if step and base_time else '—'
        shown = f'{step:.2f}' if step else 'compiled only'
        label = kind if c > 1 else '—'
        tpu = _tpu_stats(f'seq={seq},context={c},kind={kind}', _CHIPS[c])['temp_bytes']
        rows.append(
          f'| {seq} | {c} | {label} | {stats["temp_bytes"] / MiB:.1f} | {tpu / MiB:.1f} '
          f'| {shown} | {ratio} |'
        )
        print(rows[-1], flush=True)
  return rows


# A v5p slice of c chips: one row on the c context ranks, nothing else.
_CHIPS = {1: 'v5p:1x1x1', 2: 'v5p:2x1x1', 4: 'v5p:2x2x1', 8: 'v5p:2x2x2'}


def _tpu_stats(arg: str, topology: str, config: str = LONG, flags_=()) -> dict:
  """compile_stats.json of `triax train --compile_only --topology` (XLA:TPU)."""
  with tempfile.TemporaryDirectory() as workdir:
    _run(
      [
        'triax.cli.train',
        f'--config={config}:{arg}' if arg else f'--config={config}',
        f'--workdir={workdir}/w',
        '--compile_only',
        f'--topology={topology}',
        '--config.train.global_batch_size=1',
        '--config.mesh.data=1',
        *flags_,
      ]
    )
    with open(os.path.join(workdir, 'w', 'compile_stats.json')) as f:
      return json.load(f)


def _compile_only(cfg, devices) -> dict:
  import jax

  from triax import config
  from triax.mesh import build_mesh
  from triax.training.step import build_trainer

  cfg = config.validate(cfg, len(devices))
  trainer = build_trainer(cfg, build_mesh(cfg.mesh, devices))
  with jax.set_mesh(trainer.mesh):
    return stats_lib.compile_stats(trainer)[1]


# Korthikanti et al. 2022, bytes per layer with 2-byte activations (their
# Table 2): tensor parallelism alone and with sequence parallelism. Their
# count includes dropout (masks of 1 byte, the dropped attention
# probabilities); triax has none, which removes sbh(2) and 3as^2b: the
# second pair of columns.
def _paper(s, b, h, a, t, sp):
  return s * b * h * ((34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t))


def _no_dropout(s, b, h, a, t, sp):
  return s * b * h * ((32 / t if sp else 8 + 24 / t) + 2 * a * s / (h * t))


# bf16, as the paper counts: under fp32, XLA:TPU's default-precision matmuls keep
# bf16 copies of their operands beside the fp32 values, which no formula has.
# a*s/h small: the s^2 term, which sequence parallelism splits no further than
# tensor parallelism does, would hide the saving (the formula's own ratio is
# 0.59 here, 0.62 at 8 heads and 512 positions). A batch of 128 rows: the
# per-layer slope also holds the layer's weight gradients and optimizer
# temporaries, a small share beside this many activations.
SP_SHAPE = dict(s=256, b=128, h=1024, a=4)
# The per-layer figure is the slope between these depths: what one more layer
# adds to the step's temporaries (its activations; its share of the optimizer's
# temporaries is a few per cent), not the embedding, head and update around them.
SP_DEPTHS = (2, 4)


def _sp_rows() -> list[str]:
  s, b, h, a = (SP_SHAPE[k] for k in ('s', 'b', 'h', 'a'))
  low, high = SP_DEPTHS
  rows = [
    f'gpt, d={h}, {a} heads, d_ff={4 * h}, {s} positions, batch {b}, bf16 activations, no '
    f'remat; XLA:TPU for v5p chips (compile only). Per layer: (bytes at {high} layers - bytes '
    f'at {low}) / {high - low}, of memory_analysis() temp and of the heap XLA:TPU allocates '
    "for the program's temporaries (its buffer assignment; temp counts the heap's "
    'fragmentation a second time, compile_stats.json `temp_heap_bytes`); activations: the '
    "heap less the layer's fp32 weight gradient (a temporary too, which no formula counts). "
    'Formula: Korthikanti et al. per layer (2-byte activations).',
    '',
    '| t | SP | temp MiB per layer | SP / no SP | heap MiB per layer | SP / no SP (heap) | '
    'activations MiB per layer | SP / no SP (activations) | paper formula | without dropout '
    '| formula SP / no SP | activations / without dropout |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for t, topology in ((2, 'v5p:2x1x1'), (4, 'v5p:2x2x1')):
    plain = None
    for sp in (False, True):
      stats = [_sp_stats(topology, t, sp, layers) for layers in SP_DEPTHS]
      layer = {k: (stats[1][k] - stats[0][k]) / (high - low) for k in stats[0]}
      plain = layer if not sp else plain
      paper, ours = _paper(s, b, h, a, t, sp), _no_dropout(s, b, h, a, t, sp)
      ratio = {k: f'{layer[k] / plain[k]:.2f}' if sp else '—' for k in layer}
      expected = _no_dropout(s, b, h, a, t, True) / _no_dropout(s, b, h, a, t, False)
      rows.append(
        f'| {t} | {"on" if sp else "off"} | {layer["temp"] / MiB:.1f} | {ratio["temp"]} '
        f'| {layer["heap"] / MiB:.1f} | {ratio["heap"]} | {layer["act"] / MiB:.1f} '
        f'| {ratio["act"]} | {paper / MiB:.1f} | {ours / MiB:.1f} '
        f'| {expected:.2f} | {layer["act"] / ours:.2f} |'
      )
      print(rows[-1], flush=True)
  return rows


def _sp_stats(topology: str, t: int, sp: bool, layers: int) -> dict[str, int]:
  s, b, h, a = (SP_SHAPE[k] for k in ('s', 'b', 'h', 'a'))
  flags_ = [
    f'--config.mesh.tensor={t}',
    '--config.mesh.pipe=1',
    '--config.pipeline.microbatches=1',
    '--config.pipeline.virtual_stages=1',
    '--config.pipeline.schedule=1f1b',
    f'--config.mesh.sequence_parallel={str(sp).lower()}',
    f'--config.model.num_layers={layers}',
    f'--config.model.d_model={h}',
    f'--config.model.num_heads={a}',
    f'--config.model.d_ff={4 * h}',
    f'--config.model.seq_len={s}',
    f'--config.train.global_batch_size={b}',
    '--config.model.dtype=bfloat16',
  ]
  gpt = os.path.join(ROOT, 'experiments', 'gpt_tiny.py')
  stats = _tpu_stats('', topology, config=gpt, flags_=flags_)
  # The layer's weights' fp32 gradient is a temporary of the step too (the
  # parameter bytes' slope is exactly its bytes): no activation, no formula's.
  return {
    'temp': stats['temp_bytes'],
    'heap': stats['temp_heap_bytes'],
    'act': stats['temp_heap_bytes'] - stats['param_bytes'],
  }


def _run(args: list[str]) -> str:
  """`python -m ARGS...` on its own --cpu_devices or --topology: its stdout."""
  result = run_python(['-m', *args], drop_device_count=True)
  if result.returncode not in (0, 3):
    raise RuntimeError(f'{" ".join(args)} failed:\n{result.stderr[-3000:]}')
  return result.stdout


def _budget_and_training_rows() -> list[str]:
  budget = _run(
    [
      'triax.cli.budget',
      f'--config={LONG}:context=1,{RUN}',
      f'--memory_limit_mib={LIMIT_MIB}',
      '--cpu_devices=8',
      '--steps=1',
    ]
  )
  with tempfile.TemporaryDirectory() as workdir:
    _run(
      [
        'triax.cli.train',
        f'--config={LONG}:{RUN}',
        f'--workdir={workdir}/w',
        '--cpu_devices=8',
        '--progress=false',
      ]
    )
    with open(os.path.join(workdir, 'w', 'metrics.jsonl')) as f:
      losses = [json.loads(line) for line in f]
    with open(os.path.join(workdir, 'w', 'compile_stats.json')) as f:
      peak = json.load(f)['peak_bytes']
  losses = [(r['step'], r['loss'], r['step_time_s']) for r in losses if 'loss' in r]
  verdict = [line for line in budget.splitlines() if line.strip()]
  return [
    f'`triax budget --config=experiments/llama_long.py:context=1,{RUN} '
    f'--memory_limit_mib={LIMIT_MIB}` ({SEQ3:,} positions, 8 rows over data=8):',
    '',
    '```',
    *verdict,
    '```',
    '',
    f'`triax train --config=experiments/llama_long.py:{RUN}` (context=8, ring): per-device peak '
    f'{peak / MiB:.0f} MiB (under the {LIMIT_MIB} MiB limit); losses by step:',
    '',
    '| step | loss | step s (CPU) |',
    '|---|---|---|',
    *(f'| {step} | {loss:.3f} | {seconds:.1f} |' for step, loss, seconds in losses),
  ]


# Each section's lines, kept after it runs: the report is assembled from all
# of them, so one section can be rerun alone (each takes many minutes here).
CACHE = os.path.join(ROOT, '.bench', 'long_context')
# Section 4: a 4k window at 32k positions over 8 ranks (compiled), and a 1k
# window at 8k (timed: 32k steps take minutes on this host).
WINDOWED = ((SEQ3, 4096, False), (TIMED_UP_TO, 1024, True))


def _window_rows() -> list[str]:
  """Sliding windows over 8 context ranks: what a window leaves the ring and
  the all-gather to do, from the compiled programs (and one timed pair)."""
  import jax

  from triax import config
  from triax.compiled import hlo_work, measure
  from triax.model import window as window_lib

  rows = [
    'llama_long (2 layers, full remat) on 8 CPU devices of `context`, every layer local '
    '(model.sliding_window, model.sliding_window_pattern=0). Per device, from the compiled '
    'train step (compiled/hlo_work.py: loops by their trips): matmul FLOPs, bytes moved by '
    'collective-permutes and all-gathers, and XLA:CPU temp bytes. Ring steps: those some '
    "rank's queries reach (model/window.py), of 8. Step s: the median of two steps at 8k "
    'positions, each pair timed back to back on a machine other runs shared, so only the '
    "pair's ratio says anything.",
    '',
    '| positions | window | attention | ring steps | matmul GFLOP | vs no window | '
    'moved MiB | vs no window | temp MiB | step s (CPU) | vs no window |',
    '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  devices = jax.devices()[:8]
  for seq, window, timed in WINDOWED:
    for kind in ('ring', 'allgather'):
      base = None
      for w in (0, window):
        cfg = config.from_file(LONG, f'seq={seq},context=8,kind={kind}')
        cfg.mesh.data, cfg.train.global_batch_size = 1, 1
        cfg.model.sliding_window = w
        compiled = measure.compile_config(cfg, devices)
        step = measure.time_steps(compiled, steps=2, warmup=1) if timed else None
        work = hlo_work.work(compiled.step.as_text())
        moved = sum(work.collective_bytes.get(k, 0.0) for k in ('collective-permute', 'all-gather'))
        figures = (work.flops, moved, step)
        base = figures if not w else base
        ratio = [f'{a / b:.2f}x' if a and b else '—' for a, b in zip(figures, base)]
        steps = len(window_lib.ring_steps(8, seq // 8, w)) if kind == 'ring' else '—'
        rows.append(
          f'| {seq} | {w or "—"} | {kind} | {steps} | {work.flops / 1e9:.1f} | {ratio[0]} '
          f'| {moved / MiB:.1f} | {ratio[1]} | {compiled.stats["temp_bytes"] / MiB:.1f} '
          f'| {f"{step:.2f}" if step else "compiled only"} | {ratio[2]} |'
        )
        print(rows[-1], flush=True)
  return rows


SECTIONS = {
  '1': ('Context parallelism on 8 CPU devices', _context_rows),
  '2': ('Sequence parallelism against the formula', _sp_rows),
  '3': ('32k positions under a memory limit', _budget_and_training_rows),
  '4': ('Sliding windows over the ring and the all-gather', _window_rows),
}


def main(argv):
  del argv
  os.makedirs(CACHE, exist_ok=True)
  for key in _SECTIONS.value:
    rows = SECTIONS[key][1]()
    with open(os.path.join(CACHE, f'{key}.json'), 'w') as f:
      json.dump(rows, f)
  lines = ['# Long sequences: context and sequence parallelism', '']
  lines += ['Written by `scripts/bench_long_context.py`.', '']
  written = doc_sections(_OUT.value)
  for key, (title, _) in SECTIONS.items():
    path = os.path.join(CACHE, f'{key}.json')
    if os.path.exists(path):
      with open(path) as f:
        lines += [f'## {title}', '', *json.load(f), '']
    elif title in written:  # not run on this machine yet: the doc's own lines stay
      lines += [f'## {title}', '', *written[title], '']
  from triax.compiled import measure

  measure.write_report(_OUT.value, lines)


if __name__ == '__main__':
  app.run(main)
