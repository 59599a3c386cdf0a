"""What `python -m triax schedule` does: build or load, lower, check, time, show.

The entry point only parses flags into a `Request` and calls `main`; this
module is importable and tested without subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import TextIO

from triax.errors import ConfigError
from triax.pipeline import files, render, rounds, simulate, validate
from triax.pipeline import schedule as sched

# Builder errors name config keys; on the command line we name the flag.
_FLAG_OF_KEY = {
  'pipeline.schedule': '--schedule',
  'pipeline.schedule_file': '--schedule_file',
  'mesh.pipe': '--stages',
  'pipeline.microbatches': '--microbatches',
  'pipeline.virtual_stages': '--virtual_stages',
  'synthesis.memory_limit': '--memory_limit',
  'synthesis.time_limit_s': '--time_limit_s',
  'synthesis.t_forward': '--t_forward',
  'synthesis.t_backward': '--t_backward',
  'pipeline.fuse_overlaps': '--fuse_overlaps',
}


@dataclasses.dataclass(frozen=True)
class Request:
  """One CLI invocation.

  Attributes:
    schedule: schedule name, a key of `schedule.SCHEDULES`.
    stages: pipeline stages p; with `schedule_file`, None takes the file's.
    microbatches: micro-batches m; likewise.
    virtual_stages: model chunks per stage v; likewise.
    t_forward: forward time of one micro-batch through one stage.
    t_backward: backward time likewise (the input-gradient part only for
      schedules that split the backward, see `simulate.Costs`); None: 2 for
      a fused backward (twice the forward), 1 for a split one.
    t_transfer: time to send one activation or gradient to a neighbour.
    t_weight: weight-gradient (W) time, for schedules that split the
      backward (zb_h1), or the part of a fused backward the lowering's W
      takes; None: 1 when split (ZB-H1's t_F = t_B = t_W), half the
      backward when fused.
    t_evict: time to move one residual set to or from the partner (bpipe).
    plot: PNG path for the Gantt chart, or None.
    schedule_file: a schedule file (see `files.load`) to analyse instead of
      the named schedule, or None.
    write_csv: path to write the schedule to as torch's compute-only CSV, or
      None.
    memory_limit: synthesise the schedule (`synthesis.run`) with at most
      this many residual sets per stage instead of building by name; None
      builds by name.
    time_limit_s: the synthesiser's time limit.
    write_json: path to write the schedule to as triax's JSON, or None.
    t_exchange: expert parallelism's all-to-alls in one micro-batch's
      forward through one stage, and in its backward (`simulate.Costs`).
    fuse_overlaps: lower each overlapped pair into one tick (pipeline.
      fuse_overlaps), where the exchanges run beside the other's compute.
    full_remat: lower for a model whose B reruns the forward (model.remat=
      full): ticks packed into rounds (pipeline/rounds.py), and the
      default costs B 2, W 1.
  """

  schedule: str = '1f1b'
  stages: int | None = 4
  microbatches: int | None = 8
  virtual_stages: int | None = 1
  t_forward: float = 1.0
  t_backward: float | None = None
  t_transfer: float = 0.0
  plot: str | None = None
  t_weight: float | None = None
  t_evict: float = 0.0
  schedule_file: str | None = None
  write_csv: str | None = None
  memory_limit: int | None = None
  time_limit_s: float = 10.0
  write_json: str | None = None
  t_exchange: float = 0.0
  fuse_overlaps: bool = False
  full_remat: bool = False


@dataclasses.dataclass(frozen=True)
class Analysis:
  """Everything computed for one request."""

  request: Request
  costs: simulate.Costs
  schedule: sched.Schedule
  program: sched.Program
  problems: tuple[str, ...]
  lockstep: simulate.Result
  asynchronous: simulate.Result
  synthesis: object | None = None  # synthesis.Synthesis when synthesised


def analyse(request: Request) -> Analysis:
  """Builds or loads, lowers, validates and times the requested schedule.

  Raises:
    ConfigError: for invalid flags or a bad schedule file, keyed by the flag
      name.
  """
  _costs(request, split=False)  # bad numbers fail before any file is read
  synthesised = None
  try:
    if request.memory_limit is not None:
      from triax.pipeline import synthesis  # only synthesis needs the solver

      synthesised = synthesis.run(
        request.stages,
        request.microbatches,
        request.virtual_stages,
        request.memory_limit,
        _costs(request, split=True),
        request.time_limit_s,
      )
      schedule = synthesised.schedule
    elif request.schedule_file:
      schedule = files.load(
        request.schedule_file,
        request.stages,
        request.microbatches,
        request.virtual_stages,
        size_keys=[_FLAG_OF_KEY[k] for k in files.SIZE_KEYS],
      )
    else:
      schedule = sched.build(
        request.schedule, request.stages, request.microbatches, request.virtual_stages
      )
    if request.fuse_overlaps:
      sched.check_fusable(schedule)
  except ConfigError as e:
    raise ConfigError(_FLAG_OF_KEY.get(e.key, e.key), e.message) from None
  program = sched.lower(schedule, request.fuse_overlaps, _units(request))
  costs = _costs(request, schedule.split_backward)
  return Analysis(
    request=request,
    costs=costs,
    schedule=schedule,
    program=program,
    problems=tuple(validate.validate(schedule, program)),
    lockstep=simulate.simulate_lockstep(program, costs),
    asynchronous=simulate.simulate_async(schedule, costs),
    synthesis=synthesised,
  )


def _units(request: Request) -> rounds.TickUnits | None:
  return rounds.units_for('full' if request.full_remat else 'none')


def _costs(request: Request, split: bool) -> simulate.Costs:
  default = simulate.Costs.design_point(split, _units(request))
  request = dataclasses.replace(
    request,
    t_backward=default.t_backward if request.t_backward is None else request.t_backward,
    t_weight=default.t_weight if request.t_weight is None else request.t_weight,
  )
  for name in ('t_forward', 't_backward', 't_transfer', 't_weight', 't_evict', 't_exchange'):
    value = getattr(request, name)
    if not value >= 0 or value == float('inf'):
      raise ConfigError(f'--{name}', f'must be a finite number >= 0; got {value}')
  return simulate.Costs(
    t_forward=request.t_forward,
    t_backward=request.t_backward,
    t_weight=request.t_weight,
    t_transfer=request.t_transfer,
    t_evict=request.t_evict,
    t_exchange=request.t_exchange,
  )


def summary(analysis: Analysis) -> dict:
  """The JSON-able report; top-level timing is the lockstep (executor) one.

  `models` has both time models (total time, bubble, peak in-flight per
  stage, and the lockstep ticks). `slots` are the buffer entries every
  device allocates (messages, stashed residual sets, B-to-W cuts), `peaks`
  each stage's own most in use. `fused_ticks` counts (tick, stage) cells
  that run an overlapped pair with its W. `residual_sets_moved` counts EVICTs and
  LOADs per step; schedules that move residuals (bpipe) add their
  `partner` and the per-stage `transfers_per_step`.
  """
  s, program = analysis.schedule, analysis.program
  moved = sched.transfers_per_step(program)
  out = {
    'schedule': s.name,
    'stages': s.stages,
    'microbatches': s.microbatches,
    'virtual_stages': s.virtual_stages,
    'placement': list(s.placement),
    'ticks': program.ticks,
    # A packed program's rounds (pipeline/rounds.py); 0: one action a tick.
    'rounds': len(program.rounds),
    'bubble_fraction': analysis.lockstep.bubble_fraction,
    'peak_inflight': list(analysis.lockstep.peak_inflight),
    'valid': not analysis.problems,
    'problems': list(analysis.problems),
    'models': {
      'lockstep': _model(analysis.lockstep),
      'async': _model(analysis.asynchronous),
    },
    'slots': dict(program.slots),
    'peaks': {buf: list(peaks) for buf, peaks in program.peaks.items()},
    'stash_cap': s.stash_cap,
    'split_backward': program.split_backward,
    'fused_ticks': program.fused_cells,
    'residual_sets_moved': moved['total'],
  }
  if analysis.request.schedule_file:
    out['schedule_file'] = analysis.request.schedule_file
  if analysis.synthesis is not None:
    found = analysis.synthesis
    out['synthesis'] = {
      'memory_limit': s.stash_cap,
      'method': found.method,
      'optimal': found.optimal,
      'lower_bound': found.lower_bound,
      'warning': found.warning,
    }
  if s.partner is not None:
    out['partner'] = list(s.partner)
    out['transfers_per_step'] = {
      'evictions': list(moved['evictions']),
      'loads': list(moved['loads']),
      'total': moved['total'],
    }
  return out


def _model(result: simulate.Result) -> dict:
  out = {
    'total_time': result.total_time,
    'bubble_fraction': result.bubble_fraction,
    'peak_inflight': list(result.peak_inflight),
  }
  if result.ticks is not None:
    out['ticks'] = result.ticks
  return out


def text(analysis: Analysis, grid: bool = True) -> str:
  """The grid (unless `grid` is False) and a few summary lines, for people."""
  lock, asy = analysis.lockstep, analysis.asynchronous
  program = analysis.program
  lines = [render.text_grid(program), ''] if grid else []
  lines += [
    f'lockstep (the executor): {program.ticks} ticks, time '
    f'{lock.total_time:g}, bubble {lock.bubble_fraction:.2%}, peak '
    f'in-flight per stage {list(lock.peak_inflight)}',
    f'asynchronous (the papers): time {asy.total_time:g}, bubble '
    f'{asy.bubble_fraction:.2%}, peak in-flight per stage '
    f'{list(asy.peak_inflight)}',
    'buffer slots per stage: '
    + ', '.join(f'{buf} {n}' for buf, n in program.slots.items())
    + ' (in-flight counts micro-batch-chunks, each 1/v of a stage)',
  ]
  if program.split_backward:
    costs = analysis.costs
    lines.append(
      f'backward split into B (t_backward={costs.t_backward:g}) and W (t_weight={costs.t_weight:g})'
    )
  if program.fused:
    lines.append(
      f'{program.fused_cells} fused ticks (a B and its W, then another '
      f"micro-batch's F); t_exchange={analysis.costs.t_exchange:g} runs beside their compute"
    )
  if analysis.synthesis is not None:
    found = analysis.synthesis
    limit = analysis.request.memory_limit
    if found.method == 'built-in':
      lines.append(
        f'under {limit} residual sets per stage the named {analysis.schedule.name} is '
        f'fastest: asynchronous time {found.async_time:g}, where the synthesiser found '
        f'{found.beaten:g} (proved lower bound {found.lower_bound:g} for schedules that '
        'move no residual sets)'
      )
    else:
      lines.append(
        f'synthesised under {limit} residual sets per stage by {found.method}: asynchronous '
        f'time {found.async_time:g}, '
        + ('optimal' if found.optimal else f'proved lower bound {found.lower_bound:g}')
      )
    if found.warning:
      lines.append(f'warning: {found.warning}')
  if analysis.schedule.partner is not None:
    moved = sched.transfers_per_step(program)
    lines.append(
      f'stash cap {analysis.schedule.stash_cap}; residual sets '
      f'moved per step {moved["total"]} (evictions per stage '
      f'{list(moved["evictions"])}, loads per stage '
      f'{list(moved["loads"])}); bytes = sets x one stash slot'
    )
  lines.append(
    'valid' if not analysis.problems else 'INVALID:\n  ' + '\n  '.join(analysis.problems)
  )
  return '\n'.join(lines)


def run(request: Request, as_json: bool = False, out: TextIO | None = None) -> dict:
  """Analyses, writes the plot if asked, prints text or one JSON object.

  Returns:
    The summary dict (also what --json prints).

  Raises:
    ConfigError: for invalid flags.
  """
  out = out or sys.stdout
  if request.plot is not None:
    _check_out_path('--plot', request.plot, '.png')
  if request.write_csv is not None:
    _check_out_path('--write_csv', request.write_csv, '.csv')
  if request.write_json is not None:
    _check_out_path('--write_json', request.write_json, '.json')
  analysis = analyse(request)
  report = summary(analysis)
  if request.write_csv is not None:
    try:
      files.write_csv(analysis.schedule, request.write_csv)
    except (ValueError, OSError) as e:  # BPipe's copies have no CSV form
      raise ConfigError('--write_csv', str(e)) from None
    report['csv'] = request.write_csv
  if request.write_json is not None:
    files.write_json(analysis.schedule, request.write_json)
    report['json'] = request.write_json
  if request.plot is not None:
    render.gantt_png(analysis.schedule, analysis.program, analysis.costs, request.plot)
    report['plot'] = request.plot
  if as_json:
    print(json.dumps(report), file=out)
  else:
    # With a picture asked for, the grid (one column per tick: hundreds wide) would repeat it.
    print(text(analysis, grid=request.plot is None), file=out)
    for flag in ('write_csv', 'write_json', 'plot'):
      if getattr(request, flag) is not None:
        print(f'wrote {getattr(request, flag)}', file=out)
  return report


def _check_out_path(flag: str, path: str, ext: str) -> None:
  """Before any work: the file to write has the right extension and folder."""
  if not path.endswith(ext):
    raise ConfigError(flag, f'must name a {ext} file; got {path}')
  folder = os.path.dirname(path) or '.'
  if not os.path.isdir(folder):
    raise ConfigError(flag, f'folder {folder} does not exist')


def main(request: Request, as_json: bool = False) -> int:
  """Runs the request; returns the exit status (2 for bad input)."""
  try:
    report = run(request, as_json=as_json)
  except ConfigError as e:
    print(f'error: {e.key}: {e.message}', file=sys.stderr)
    return 2
  return 0 if report['valid'] else 1
