"""Pictures of a schedule: a text grid, a Gantt chart and a Chrome trace.

matplotlib is imported inside `gantt_png` only: the planner and the CLI
without --plot never pay for it, and we draw on an Agg canvas of our own
instead of pyplot so no global backend state changes under other callers.
"""

from __future__ import annotations

from triax.pipeline import schedule as sched
from triax.pipeline import simulate
from triax.pipeline.schedule import Program, Schedule

# Colour per action kind; darker shades mark later local chunks.
_COLOURS = {
  sched.FORWARD: (0.30, 0.45, 0.69),
  sched.BACKWARD: (0.33, 0.66, 0.41),
  sched.WEIGHT: (0.87, 0.52, 0.32),
  sched.EVICT: (0.51, 0.38, 0.70),
  sched.LOAD: (0.80, 0.33, 0.47),
}


def text_grid(program: Program) -> str:
  """Stages as bands of F and B rows (and W, X rows where used), ticks as
  columns.

  A cell like `F3.1` is micro-batch 3 through global chunk 1 (on the stage
  `placement` gives it); `.` is idle.
  In X rows `E3.0`/`L3.0` send an EVICT/LOAD of that residual set to the
  partner at the end of the tick and `e3.0`/`l3.0` receive one.
  """
  s = program.schedule
  rounds = ''
  if program.packed:
    rounds = f' in {len(program.rounds)} rounds, sending after the marked ticks'
  head = (
    f'{s.name}: stages={s.stages} microbatches={s.microbatches} '
    f'virtual_stages={s.virtual_stages}, {program.ticks} lockstep ticks{rounds} '
    '(cell = kind micro-batch.chunk)'
  )
  grid = sched.format_grid(
    program.grid, s.stages, program.partner, program.rounds, sorted(program.sends)
  )
  return head + '\n' + grid


def gantt_png(schedule: Schedule, program: Program, costs: simulate.CostsLike, path: str) -> None:
  """Writes a two-panel Gantt chart: lockstep (executor) and asynchronous.

  Boxes are coloured by kind, shaded by local chunk, and labelled with the
  micro-batch; EVICT/LOAD run on the sender's copy stream and are drawn as
  a thin bar under its compute row. Both panels share the time axis so
  their lengths compare.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.patches import Patch

  results = (simulate.simulate_lockstep(program, costs), simulate.simulate_async(schedule, costs))
  longest = max(r.total_time for r in results)
  n = sum(len(o) for o in schedule.orders) / schedule.stages
  fig = Figure(figsize=(min(40.0, max(8.0, 0.3 * n)), 1.2 + 0.9 * schedule.stages))
  FigureCanvasAgg(fig)
  axes = fig.subplots(2, 1, sharex=True)
  for ax, result in zip(axes, results):
    _draw(ax, result)
    ax.set_xlim(0, longest * 1.01 if longest > 0 else 1)
  axes[-1].set_xlabel('time')
  # The lockstep panel may show W where the schedule has none (the executor splits every backward).
  kinds = {span.action.kind for r in results for span in r.timeline}
  legend = _legend(kinds, schedule.virtual_stages, Patch)
  rows = schedule.virtual_stages  # a row of kinds per local chunk
  fig.legend(handles=legend, loc='lower center', fontsize=8, ncol=len(legend) // rows)
  fig.suptitle(
    f'{schedule.name}: p={schedule.stages} m={schedule.microbatches} v={schedule.virtual_stages}'
  )
  # Room for the legend's rows under the time axis, clear of the panels' titles.
  fig.tight_layout(rect=(0, 0.05 * rows * 4.8 / fig.get_figheight(), 1, 1))
  fig.savefig(path, dpi=100)


def _draw(ax, result: simulate.Result) -> None:
  s = result.schedule
  for span in result.timeline:
    a = span.action
    width = span.end - span.start
    copy = a.kind in sched.COPY_KINDS
    # Copies share the row with compute they overlap: a band below it.
    low, height = (span.stage + 0.2, 0.25) if copy else (span.stage - 0.4, 0.6)
    ax.broken_barh(
      [(span.start, width)],
      (low, height),
      facecolors=_shade(a.kind, s.local_of(a.chunk), s.virtual_stages),
      edgecolors='white',
      linewidth=0.5,
    )
    if not copy:
      ax.text(
        span.start + width / 2,
        low + height / 2,
        str(a.microbatch),
        ha='center',
        va='center',
        fontsize=7,
        color='white',
      )
  title = {
    'lockstep': 'lockstep (what the executor runs)',
    'async': "asynchronous (the papers' model)",
  }[result.model]
  ticks = f', {result.ticks} ticks' if result.ticks is not None else ''
  ax.set_title(
    f'{title}: time {result.total_time:g}{ticks}, bubble '
    f'{result.bubble_fraction:.1%}, peak in-flight '
    f'{list(result.peak_inflight)}',
    fontsize=9,
  )
  ax.set_yticks(range(s.stages), [f'stage {i}' for i in range(s.stages)])
  ax.set_ylim(s.stages - 0.5, -0.5)


def _legend(kinds: set[str], v: int, patch) -> list:
  """One entry per kind drawn, and per local chunk when a stage holds v > 1 (its shade)."""
  return [
    patch(color=_shade(k, c, v), label=k if v == 1 else f'{k}, local chunk {c}')
    for k in _COLOURS  # matplotlib fills columns first: a column per kind, a row per chunk
    if k in kinds
    for c in range(v)
  ]


def _shade(kind: str, local_chunk: int, virtual_stages: int) -> tuple[float, float, float]:
  r, g, b = _COLOURS.get(kind, (0.5, 0.5, 0.5))
  darken = 1.0 - 0.45 * local_chunk / max(1, virtual_stages - 1)
  return (r * darken, g * darken, b * darken)


def chrome_trace(result: simulate.Result, time_scale: float = 1e6) -> dict:
  """The timeline in Chrome's trace event format (chrome://tracing,
  Perfetto): one thread per stage, one complete event per action.

  EVICT/LOAD go to a second thread per sending stage ('stage s copy',
  tid p+s), present only if the schedule moves residuals.

  Args:
    result: a simulation result.
    time_scale: trace microseconds per cost unit; the default reads costs as
      seconds.
  """
  s = result.schedule
  copies = any(x.action.kind in sched.COPY_KINDS for x in result.timeline)
  events: list[dict] = [
    {'name': 'process_name', 'ph': 'M', 'pid': 0, 'args': {'name': f'{s.name} ({result.model})'}}
  ]
  events += [
    {'name': 'thread_name', 'ph': 'M', 'pid': 0, 'tid': stage, 'args': {'name': f'stage {stage}'}}
    for stage in range(s.stages)
  ]
  if copies:
    events += [
      {
        'name': 'thread_name',
        'ph': 'M',
        'pid': 0,
        'tid': s.stages + stage,
        'args': {'name': f'stage {stage} copy'},
      }
      for stage in range(s.stages)
    ]
  for span in result.timeline:
    a = span.action
    tid = span.stage + (s.stages if a.kind in sched.COPY_KINDS else 0)
    events.append(
      {
        'name': str(a),
        'cat': a.kind,
        'ph': 'X',
        'pid': 0,
        'tid': tid,
        'ts': span.start * time_scale,
        'dur': (span.end - span.start) * time_scale,
        'args': {'microbatch': a.microbatch, 'chunk': a.chunk, 'local_chunk': s.local_of(a.chunk)},
      }
    )
  return {'traceEvents': events, 'displayTimeUnit': 'ms', 'otherData': _summary(result)}


def _summary(result: simulate.Result) -> dict:
  return {
    'model': result.model,
    'total_time': result.total_time,
    'bubble_fraction': result.bubble_fraction,
    'peak_inflight': list(result.peak_inflight),
  }
