"""A run's outcome read back from its workdir, and a sweep's outcomes as CSV and Markdown.

Everything here reads what `triax train` wrote (metrics.jsonl,
compile_stats.json) and what the sweep runner wrote (sweep_status.json),
so tables can be rebuilt from a workdir at any time and README numbers are
produced by the tool, never typed.

Conventions of the columns:
  tokens/s, step time  medians over the logged train lines after the first
                       (the first window holds the first step's dispatch and
                       any lazy work; with one line that line is used)
  peak memory          per device, of the compiled train step, from XLA:
                       temp + argument + output - alias bytes
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import statistics

from triax.errors import ConfigError
from triax.training import workdir as workdir_lib
from triax.training.metrics import read_metrics

# Written by the sweep runner into a point's directory once its process has ended.
STATUS_FILE = 'sweep_status.json'


@dataclasses.dataclass
class RunSummary:
  """What one training workdir says about its run (None where it says nothing)."""

  final_step: int | None = None  # last logged train step
  final_eval_step: int | None = None  # last evaluated step
  final_loss: float | None = None
  final_eval_loss: float | None = None
  tokens_per_sec: float | None = None
  step_time_s: float | None = None
  mfu: float | None = None
  peak_bytes: int | None = None  # per device, compiled train step
  train_curve: list = dataclasses.field(default_factory=list)  # [(step, loss)]
  eval_curve: list = dataclasses.field(default_factory=list)  # [(step, eval_loss)]


def peak_bytes_per_device(stats: dict) -> int:
  """XLA's per-device footprint of the step: live temporaries plus buffers in and out.

  Donated state buffers are counted once: outputs that alias an argument are
  subtracted.
  """
  return (
    stats['temp_bytes']
    + stats['argument_bytes']
    + stats['output_bytes']
    - stats.get('alias_bytes', 0)
  )


def _median_after_first(records: list[dict], key: str) -> float | None:
  values = [r[key] for r in records if key in r]
  if len(values) > 1:
    values = values[1:]
  return statistics.median(values) if values else None


def summarize_run(workdir: str) -> RunSummary:
  """Reads a training workdir; a missing or empty one gives an all-None summary."""
  records = read_metrics(workdir) if os.path.isdir(workdir) else []
  train = [r for r in records if 'loss' in r]
  evals = [r for r in records if 'eval_loss' in r]
  run = RunSummary(
    train_curve=[(r['step'], r['loss']) for r in train],
    eval_curve=[(r['step'], r['eval_loss']) for r in evals],
  )
  if train:
    run.final_step, run.final_loss = train[-1]['step'], train[-1]['loss']
    run.tokens_per_sec = _median_after_first(train, 'tokens_per_sec')
    run.step_time_s = _median_after_first(train, 'step_time_s')
    run.mfu = _median_after_first(train, 'mfu')
  if evals:
    run.final_eval_step, run.final_eval_loss = evals[-1]['step'], evals[-1]['eval_loss']
  stats_path = workdir_lib.path(workdir, workdir_lib.COMPILE_STATS)
  if os.path.exists(stats_path):
    with open(stats_path) as f:
      run.peak_bytes = peak_bytes_per_device(json.load(f))
  return run


def is_complete(run: RunSummary, final_step: int) -> bool:
  """Whether a run logged its final train step and the evaluation that follows it."""
  return run.final_step == final_step and run.final_eval_step == final_step


@dataclasses.dataclass
class Row:
  """One point of a sweep: its overrides, how its run ended and what it measured."""

  name: str
  overrides: dict
  status: str  # ok | failed | not run
  returncode: int | None
  error: str | None  # last stderr line of a failed run
  run: RunSummary


def read_point(directory: str, name: str, overrides: dict, final_step: int) -> Row:
  """The row of a point whose run should end at `final_step`."""
  run = summarize_run(directory)
  status_path = os.path.join(directory, STATUS_FILE)
  recorded = {}
  if os.path.exists(status_path):
    with open(status_path) as f:
      recorded = json.load(f)
  if is_complete(run, final_step):
    status = 'ok'
  elif recorded:
    status = 'failed'
  else:
    status = 'not run'
  returncode = recorded.get('returncode')
  error = recorded.get('error') if status == 'failed' else None
  if status == 'failed' and not returncode:
    error = error or f'stopped at step {run.final_step} of {final_step}'
  return Row(
    name=name, overrides=overrides, status=status, returncode=returncode, error=error, run=run
  )


def _override_keys(rows: list[Row]) -> list[str]:
  keys: list[str] = []
  for row in rows:
    keys += [k for k in row.overrides if k not in keys]
  return keys


def _labels(keys: list[str]) -> dict[str, str]:
  """Column titles: a key's last component, unless two keys share it."""
  leaves = [k.rsplit('.', 1)[-1] for k in keys]
  return {k: (leaf if leaves.count(leaf) == 1 else k) for k, leaf in zip(keys, leaves)}


CSV_METRICS = (
  'final_loss',
  'final_eval_loss',
  'tokens_per_sec',
  'step_time_s',
  'mfu',
  'peak_bytes',
)


def write_csv(rows: list[Row], path: str) -> None:
  """Raw numbers, one row per point, one column per override key."""
  keys = _override_keys(rows)
  with open(path, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(['point', *keys, *CSV_METRICS, 'status', 'returncode', 'error'])
    for row in rows:
      metrics = [getattr(row.run, m) for m in CSV_METRICS]
      writer.writerow(
        [
          row.name,
          *(row.overrides.get(k, '') for k in keys),
          *('' if v is None else v for v in metrics),
          row.status,
          '' if row.returncode is None else row.returncode,
          row.error or '',
        ]
      )


def _fmt(value, spec: str) -> str:
  return '' if value is None else format(value, spec)


def _cell(text) -> str:
  return str(text).replace('|', '\\|').replace('\n', ' ')


def markdown(rows: list[Row], caption: str = '') -> str:
  """A Markdown table of the points (plus `caption` under it)."""
  keys = _override_keys(rows)
  labels = _labels(keys)
  with_mfu = any(r.run.mfu is not None for r in rows)
  header = [labels[k] for k in keys] + [
    'train loss',
    'eval loss',
    'tokens/s',
    'step (ms)',
    'peak MiB/device',
  ]
  align = ['---'] * len(keys) + ['---:'] * 5
  if with_mfu:
    header.append('MFU')
    align.append('---:')
  header.append('status')
  align.append('---')
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '|'.join(align) + '|']
  for row in rows:
    r = row.run
    cells = [_cell(row.overrides.get(k, '')) for k in keys]
    cells += [
      _fmt(r.final_loss, '.3f'),
      _fmt(r.final_eval_loss, '.3f'),
      _fmt(r.tokens_per_sec, ',.0f'),
      _fmt(None if r.step_time_s is None else 1e3 * r.step_time_s, '.1f'),
      _fmt(None if r.peak_bytes is None else r.peak_bytes / 2**20, '.2f'),
    ]
    if with_mfu:
      cells.append(_fmt(None if r.mfu is None else 100 * r.mfu, '.1f') + ('%' if r.mfu else ''))
    status = row.status
    if row.status == 'failed':
      detail = row.error or ''
      detail = detail if len(detail) <= 100 else detail[:97] + '...'
      status = f'failed (exit {row.returncode}): {_cell(detail)}'
    cells.append(status)
    lines.append('| ' + ' | '.join(cells) + ' |')
  text = '\n'.join(lines) + '\n'
  if caption:
    text += '\n' + caption + '\n'
  return text


def caption(command: str, cpu_devices: int) -> str:
  where = (
    f'{cpu_devices} forced CPU devices on a {os.cpu_count()}-core host'
    if cpu_devices
    else 'the default devices'
  )
  made = f'Generated by `{command}` ' if command else 'Generated by triax sweep '
  return (
    made + f'({where}). Tokens/s and step time: medians over logged steps after the '
    'first; peak memory: XLA temp + argument + output - aliased bytes of the compiled '
    'train step, per device.'
  )


def write_tables(rows: list[Row], workdir: str, caption_text: str = '') -> dict:
  paths = {
    'results_csv': os.path.join(workdir, 'results.csv'),
    'results_md': os.path.join(workdir, 'results.md'),
  }
  write_csv(rows, paths['results_csv'])
  with open(paths['results_md'], 'w') as f:
    f.write(markdown(rows, caption_text))
  return paths


def _markers(name: str) -> tuple[str, str]:
  return f'<!-- results:{name}:begin -->', f'<!-- results:{name}:end -->'


def _block_span(text: str, name: str, path: str) -> tuple[int, int]:
  begin, end = _markers(name)
  starts = [m.start() for m in re.finditer(re.escape(begin), text)]
  ends = [m.start() for m in re.finditer(re.escape(end), text)]
  if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
    raise ConfigError(
      '--readme',
      f'{path} needs exactly one {begin} followed by one {end} '
      f'(found {len(starts)} and {len(ends)}); add them where the table goes',
    )
  return starts[0] + len(begin), ends[0]


def check_readme_block(path: str, name: str) -> None:
  """Raises ConfigError unless `path` holds the begin/end markers of `name` once, in order."""
  if not os.path.isfile(path):
    raise ConfigError('--readme', f'{path}: no such file')
  with open(path) as f:
    _block_span(f.read(), name, path)


def replace_readme_block(path: str, name: str, table: str) -> None:
  """Puts `table` between the markers of `name`, keeping the markers and all else."""
  with open(path) as f:
    text = f.read()
  start, stop = _block_span(text, name, path)
  text = text[:start] + '\n' + table.rstrip('\n') + '\n' + text[stop:]
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.write(text)
  os.replace(tmp, path)


def benchmark_report(workdir: str) -> str:
  """A benchmark run's headline numbers (scripts/gpu_bench.sh prints this)."""
  run = summarize_run(workdir)
  if run.tokens_per_sec is None:
    raise ConfigError('--workdir', f'{workdir} has no logged train steps')
  stats_path = workdir_lib.path(workdir, workdir_lib.COMPILE_STATS)
  with open(stats_path) as f:
    stats = json.load(f)
  n = len(run.train_curve)
  lines = [
    f'tokens/s:    {run.tokens_per_sec:,.0f}  (median of {max(n - 1, 1)} logged windows '
    'after the first)',
    f'step time:   {run.step_time_s * 1e3:.1f} ms',
    f"model FLOPs: {stats['model_flops_per_step']:.3g} per step (from the model family's "
    'shapes, recomputation not counted)',
  ]
  if 'hardware_flops_per_step' in stats:  # runs before model families logged only the model's
    lines.append(
      f'hardware FLOPs: {stats["hardware_flops_per_step"]:.3g} per step (with recomputation)'
    )
  if run.mfu is not None:
    lines.append(f'MFU:         {100 * run.mfu:.1f}%')
  else:
    lines.append(
      'MFU:         n/a (no peak FLOP/s known for this device kind; set '
      '--config.hardware.peak_flops_per_device)'
    )
  lines.append(f'peak memory: {run.peak_bytes / 2**30:.2f} GiB per device (XLA estimate)')
  lines.append(f'final loss:  {run.final_loss:.3f} at step {run.final_step}')
  return '\n'.join(lines)
