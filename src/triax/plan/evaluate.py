"""`triax plan --evaluate`: one layout priced instead of a search.

The layout is the config's own (as `candidate.from_config` reads it), or the config with
`--layout` applied, written in the words `Plan.describe` prints:

  dN eN cN tN pN   mesh.data, mesh.expert, mesh.context, mesh.tensor, mesh.pipe
  mN vN            pipeline.microbatches, pipeline.virtual_stages
  mbN              sequences per micro-batch per data replica: sets
                   pipeline.microbatches to global batch / (data * N)
  SCHEDULE         pipeline.schedule (1f1b, zb_h1, interleaved_1f1b, ...)
  remat=POLICY     model.remat (none, attention, dots, full)
  sp, nosp         mesh.sequence_parallel on, off
  replicated, zero1, fsdp   the state sharding (train.optimizer_sharding, mesh.fsdp)
  allgather, ring  model.context_attention
  layers=A/B/...   layers per pipeline stage (pipeline.layers_per_stage per chunk)

Tokens are separated by commas or spaces; a number may follow its letters with or without
'=' (d8, m=16). `configure` turns them into `--config.*` keys (others keep the config's
values) and `config.validate` judges the result, so a layout that cannot run fails with
the key at fault. `summary` turns the simulator's estimate into the report; `text` prints it."""

from __future__ import annotations

import re
from typing import Any

import ml_collections

from triax import config as config_lib
from triax.errors import ConfigError
from triax.layout import CONTEXT_ATTENTION
from triax.pipeline import schedule as sched
from triax.plan import candidate
from triax.plan.candidate import Estimate
from triax.plan.cluster import Cluster
from triax.plan.cost import memory as memory_lib
from triax.plan.search import emit

# A degree's letter -> its config key (mbN, the micro-batch size, is resolved in `configure`).
_DEGREES = {
  'd': 'mesh.data',
  'e': 'mesh.expert',
  'c': 'mesh.context',
  't': 'mesh.tensor',
  'p': 'mesh.pipe',
  'm': 'pipeline.microbatches',
  'v': 'pipeline.virtual_stages',
}
_DEGREE = re.compile(r'(mb|[decptmv])=?(-?\d+)')
_WORDS = {
  'sp': {'mesh.sequence_parallel': True},
  'nosp': {'mesh.sequence_parallel': False},
  **{
    kind: {'train.optimizer_sharding': optimizer, 'mesh.fsdp': fsdp}
    for kind, (optimizer, fsdp) in emit.STATE_KEYS.items()
  },
  **{kind: {'model.context_attention': kind} for kind in CONTEXT_ATTENTION},
}
TOKENS = (
  'dN eN cN tN pN mN vN mbN, a schedule name, remat=none|attention|dots|full, sp, nosp, '
  'replicated, zero1, fsdp, allgather, ring, layers=A/B/...'
)
GIB = 2**30


def parse(layout: str) -> tuple[dict[str, Any], int | None, tuple[int, ...] | None]:
  """--layout's tokens as (config keys, micro-batch size or None, layers per
  stage or None).

  Raises:
    ConfigError('--layout', ...): a token it does not know, or two for one key.
  """
  values: dict[str, Any] = {}
  size, layers = None, None
  tokens = [t for t in re.split(r'[,\s]+', layout.strip()) if t]
  if not tokens:
    raise ConfigError('--layout', f'is empty; give tokens such as d2,t4,p2,m8 ({TOKENS})')
  for token in tokens:
    degree = _DEGREE.fullmatch(token)
    if degree:
      letters, number = degree.group(1), int(degree.group(2))
      if letters == 'mb':
        size = _once(token, size, number)
        continue
      found = {_DEGREES[letters]: number}
    elif token in _WORDS:
      found = _WORDS[token]
    elif token in sched.SCHEDULES:
      found = {'pipeline.schedule': token}
    elif token.startswith('remat='):
      found = {'model.remat': token.partition('=')[2]}
    elif token.startswith('layers='):
      layers = _once(token, layers, _counts(token))
      continue
    else:
      raise ConfigError('--layout', f'{token!r} is not a layout token; tokens are {TOKENS}')
    for key, value in found.items():
      if key in values:
        raise ConfigError('--layout', f'{token!r} sets {key} a second time')
      values[key] = value
  return values, size, layers


def _once(token: str, before, value):
  if before is not None:
    raise ConfigError('--layout', f'{token!r}: given a second time')
  return value


def _counts(token: str) -> tuple[int, ...]:
  text = token.partition('=')[2]
  if not re.fullmatch(r'\d+(/\d+)*', text):
    raise ConfigError('--layout', f'{token!r}: want layers=A/B/... (layers per pipeline stage)')
  return tuple(int(n) for n in text.split('/'))


def configure(cfg, layout: str | None, num_devices: int):
  """The config with `layout` applied (cfg's own without one), validated
  for `num_devices`; its Plan; the config keys the layout set.

  Raises:
    ConfigError: a bad --layout token, or config.validate's error (the key
      it names, its message, and where the layout came from).
  """
  given = ml_collections.ConfigDict(cfg.to_dict())
  values, size, layers = parse(layout) if layout is not None else ({}, None, None)
  if 'pipeline.schedule' in values and given.pipeline.get('schedule_file'):
    values[emit.SCHEDULE_FILE_KEY] = ''  # the named schedule, not the file's (as emit does)
  values.update(_stale(given, values, layers is not None))
  try:
    emit.apply(given, values)
    if size is not None:
      values['pipeline.microbatches'] = _microbatches(given, size, num_devices, values)
    if layers is not None:
      values[emit.LAYERS_KEY] = _chunk_layers(given, layers, num_devices)
    validated = config_lib.validate(emit.apply(given, values), num_devices)
  except ConfigError as e:
    if e.key == '--layout':
      raise
    raise ConfigError(e.key, f'{e.message} ({_where(layout, values, num_devices)})') from None
  return validated, candidate.from_config(validated), values


def _stale(cfg, values: dict, layers_given: bool) -> dict[str, Any]:
  """The placement keys cfg wrote for a layout `values` changes, reset (as
  elastic/replan.py's overrides reset them): mesh.device_order when a mesh
  degree changes, an uneven pipeline.layers_per_stage (per chunk, in the
  schedule's chunk order) when the stages, chunks or schedule change."""

  def changed(*keys):  # each a group.key
    return any(k in values and values[k] != cfg[k.split('.')[0]][k.split('.')[1]] for k in keys)

  out = {}
  if tuple(cfg.mesh.device_order) and changed(*(f'mesh.{a}' for a in config_lib.MESH_AXES)):
    out['mesh.device_order'] = ()
  chunks = ('mesh.pipe', 'pipeline.virtual_stages', 'pipeline.schedule')
  if tuple(cfg.pipeline.layers_per_stage) and not layers_given and changed(*chunks):
    out[emit.LAYERS_KEY] = ()
  return out


def _where(layout: str | None, values: dict, num_devices: int) -> str:
  """What an error in the evaluated config came from."""
  if layout is None:
    return f"the config's own layout on the cluster's {num_devices} devices; --layout gives another"
  keys = ', '.join(f'{k}={v}' for k, v in values.items())
  return f'--layout={layout} sets {keys}'


def _microbatches(cfg, size: int, num_devices: int, values: dict) -> int:
  """pipeline.microbatches for micro-batches of `size` sequences per data replica."""
  data = config_lib.resolve_mesh_shape(cfg.mesh, num_devices)[0]
  batch = cfg.train.global_batch_size
  if size < 1 or batch % (data * size):
    raise ConfigError(
      '--layout',
      f'mb{size}: train.global_batch_size={batch} over {data} data replicas does not make '
      f'micro-batches of {size} sequences; data * mb must divide the batch',
    )
  m = batch // (data * size)
  if values.get('pipeline.microbatches', m) != m:
    raise ConfigError(
      '--layout',
      f'm{values["pipeline.microbatches"]} and mb{size} disagree: {batch} sequences over '
      f'{data} replicas in micro-batches of {size} make m={m}; give one of them',
    )
  return m


def _chunk_layers(cfg, layers: tuple[int, ...], num_devices: int) -> tuple[int, ...]:
  """pipeline.layers_per_stage (per model chunk, in chunk order) for `layers`
  per pipeline stage: a stage's chunks are equal, and the schedule's
  placement says which stage holds each chunk."""
  p = config_lib.resolve_mesh_shape(cfg.mesh, num_devices)[3]
  pipe = cfg.pipeline
  v = pipe.virtual_stages
  if len(layers) != p or any(n < v or n % v for n in layers):
    raise ConfigError(
      '--layout',
      f'layers={"/".join(map(str, layers))}: want one count per pipeline stage (mesh.pipe={p}), '
      f'each a positive multiple of pipeline.virtual_stages={v}',
    )
  if pipe.get('schedule_file'):
    raise ConfigError(
      '--layout', 'layers= with a pipeline.schedule_file: set pipeline.layers_per_stage instead'
    )
  placement = candidate.program(pipe.schedule, p, pipe.microbatches, v).schedule.placement
  return tuple(layers[s] // v for s in placement)


def summary(
  estimate: Estimate, cfg, cluster: Cluster, memory_fraction: float, flops: float | None
) -> dict:
  """What --evaluate reports of `estimate` (its plan on `cluster`), as JSON:
  throughput, TFLOP/s and MFU per device under both time models (from the
  family's model FLOPs a step, `flops`, None where it has no count; MFU
  over the devices' data-sheet peaks, their mean `peak_flops_per_device`), each
  stage's memory by part (memory.parts) with its peak, usable bytes and
  what is left, and whether the plan fits."""
  plan = estimate.plan
  times = {'lockstep': estimate.lockstep_time, 'async': estimate.async_time}
  tokens = plan.global_batch * cfg.model.seq_len
  peak = _peak_flops(cluster, plan, cfg.model.dtype)
  stages = []
  for s, parts in enumerate(estimate.memory_parts):
    used, usable = estimate.memory[s], estimate.capacity[s]
    stages.append(
      {
        **parts,
        'peak': used,
        'device_memory': usable / memory_fraction,
        'spare': usable - used,
      }
    )
  tightest = min(range(len(stages)), key=lambda s: stages[s]['spare'] / stages[s]['capacity'])
  worst = stages[tightest]
  n = len(plan.devices)
  rate, mfu = None, None
  if flops is not None:
    rate = {k: flops / (t * n) / 1e12 for k, t in times.items()}
    if peak is not None:
      mfu = {k: flops / (t * peak) for k, t in times.items()}
  return {
    'time_model': estimate.model,
    'tokens_per_s': {k: tokens / t for k, t in times.items()},
    'model_flops_per_step': flops,
    'tflops_per_device': rate,
    'peak_flops_per_device': None if peak is None else peak / n,
    'mfu': mfu,
    'memory_fraction': memory_fraction,
    'stages': stages,
    'fits': not estimate.oom,
    'tightest_stage': tightest,
    'spare_bytes': worst['spare'],
    'spare_fraction': worst['spare'] / worst['capacity'],
  }


def _peak_flops(cluster: Cluster, plan: candidate.Plan, dtype: str) -> float | None:
  """The plan's devices' dense peak FLOP/s at the compute dtype, summed
  (the spec's data sheets); None where a group states none."""
  total = 0.0
  for d in plan.devices:
    try:
      peak = cluster.groups[cluster.devices[d].group].peak(dtype)
    except KeyError:
      return None
    if not peak:
      return None
    total += peak
  return total


# The text table's memory columns: (heading, part).
_COLUMNS = (
  ('params', 'params'),
  ('grads', 'grads'),
  ('moments', 'moments'),
  ('gathered', 'gathered'),
  ('stash', 'stash'),
  ('cuts', 'cut'),
  ('messages', 'msg'),
  ('work', 'workspace'),
  ('step', 'step'),
  ('save', 'save'),
  ('restore', 'restore'),
  ('eval', 'eval'),
  ('peak', 'peak'),
  ('usable', 'capacity'),
  ('spare', 'spare'),
)
# Stages the text shows all of; beyond, the first, the tightest and the last.
_STAGES_SHOWN = 8


def text(report: dict, context: list[str]) -> str:
  """The human report of a `summary` (with the plan's row, report._row, as
  report['plan']) after the `context` lines (cluster, model, profile)."""
  row = report['plan']
  times = {'lockstep': row['lockstep_time_s'], 'async': row['async_time_s']}
  lines = [*context, f'layout: {row["plan"]}  ({_source(report["layout"])})']
  lines.append(
    "times are SIMULATED predictions (lockstep = what triax's executor runs; async = the "
    "papers' model)"
  )
  lines += ['', f'{"":14s}{"lockstep":>12s}{"async":>12s}']
  lines.append(f'{"step time ms":14s}' + ''.join(f'{t * 1e3:12.2f}' for t in times.values()))
  lines.append(
    f'{"tokens/s":14s}' + ''.join(f'{x:12,.0f}' for x in report['tokens_per_s'].values())
  )
  if report['tflops_per_device'] is not None:
    rates = report['tflops_per_device'].values()
    # A tiny model's rate still reads.
    lines.append(
      f'{"TFLOP/s/dev":14s}' + ''.join(f'{x:12.2f}' if x >= 1 else f'{x:12.2g}' for x in rates)
    )
  if report['mfu'] is not None:
    lines.append(f'{"MFU":14s}' + ''.join(f'{x:12.1%}' for x in report['mfu'].values()))
  flops, peak = report['model_flops_per_step'], report['peak_flops_per_device']
  if flops is not None:
    line = f'  model FLOPs {flops:.3g} a step (no recompute: what MFU counts)'
    dtype = report['model']['dtype']
    if peak:
      line += (
        f"; MFU of the devices' data-sheet {dtype} peak, {peak / 1e12:.0f} TFLOP/s each on average"
      )
    lines.append(line)
    if peak and report['model']['fp8'] != 'none':
      # FP8 and bf16 runs of one model compare on one scale (docs/design/planner_costs.md).
      lines.append(
        f'  (model.fp8: MFU keeps the {dtype} peak as its denominator; the FP8 matmuls run at '
        "the spec's float8 peak, 2x it on an H100)"
      )
  lines.append(f'bubble: {percent(row["bubble_fraction"])} ({report["time_model"]} model)')
  lines += ['', *_memory_lines(report)]
  return '\n'.join(lines)


def _source(layout: dict) -> str:
  return "the config's own" if layout['given'] is None else '--layout applied to the config'


def percent(x: float) -> str:
  """A share as a percentage; never '-0.0%' (float noise below 0.05%)."""
  return f'{0.0 if abs(x) < 5e-4 else x:.1%}'


def _memory_lines(report: dict) -> list[str]:
  stages = report['stages']
  share = report['memory_fraction']
  # GiB, or MiB where a small model's figures would all read 0.00.
  unit, scale = ('GiB', GIB) if max(p['peak'] for p in stages) >= GIB else ('MiB', 2**20)
  lines = [
    f'memory per device, {unit} (usable: {share:.0%} of the device; step = the train step, '
    'save / restore / eval beside the resident state; peak = the largest):',
    f'{"stage":>5s}' + ''.join(f'{head:>9s}' for head, _ in _COLUMNS),
  ]
  shown = range(len(stages))
  if len(stages) > _STAGES_SHOWN:
    shown = sorted({0, report['tightest_stage'], len(stages) - 1})
  for s in shown:
    lines.append(f'{s:5d}' + ''.join(f'{stages[s][part] / scale:9.2f}' for _, part in _COLUMNS))
  if len(stages) > _STAGES_SHOWN:
    lines.append(f'  ({len(stages) - len(shown)} more stages in --json)')
  tight = stages[report['tightest_stage']]
  where = f'stage {report["tightest_stage"]}, the fullest, ' if len(stages) > 1 else ''
  spare, fraction = report['spare_bytes'] / scale, report['spare_fraction']
  if report['fits']:
    verdict = f'fits: {spare:.2f} {unit} ({fraction:.1%}) to spare'
  else:
    verdict = f'does NOT fit: {-spare:.2f} {unit} ({-fraction:.1%}) over'
  lines.append(
    f'{verdict} ({where}peak {tight["peak"] / scale:.2f} of {tight["capacity"] / scale:.2f} '
    f'{unit} usable, {tight["device_memory"] / scale:.2f} {unit} a device)'
  )
  if any(p['step'] < sum(p[k] for k in memory_lib.STEP_PARTS) * (1 - 1e-9) for p in stages):
    lines.append(
      '  (the moments wait in host memory (train.offload_optimizer) but for the update: '
      'step is the larger phase, not the sum)'
    )
  return lines
