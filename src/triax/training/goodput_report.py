"""`triax goodput`'s library: a workdir's time split (training/goodput.py) as a table and a
figure. matplotlib is imported by `plot` only."""

from __future__ import annotations

from triax.training import goodput

_WHAT = {
  'productive': 'steps whose results the run kept',
  'compile': 'compiling the train and eval steps',
  'data': 'building batches on the host',
  'checkpoint': 'saves blocking the loop (and the last save)',
  'eval': 'evaluations',
  'lost': 'steps, saves and evals computed again after a kill or rollback',
  'restart': 'relaunch, start-up and restore of later attempts; rollback restores',
  'startup': "the first attempt's start-up (imports, data, restore)",
}
_COLOURS = {
  'productive': '#2ca02c',
  'compile': '#1f77b4',
  'data': '#17becf',
  'checkpoint': '#9467bd',
  'eval': '#bcbd22',
  'lost': '#d62728',
  'restart': '#ff7f0e',
  'startup': '#7f7f7f',
}


def table(ledger: goodput.Ledger) -> str:
  """The parts of the wall time, one row each, with their share, and the totals."""
  wall = ledger.wall
  lines = [
    '| part | seconds | share | what |',
    '|---|---:|---:|---|',
  ]
  for part in goodput.PARTS:
    seconds = ledger.totals[part]
    share = seconds / wall if wall > 0 else 0.0
    lines.append(f'| {part} | {seconds:.2f} | {share:.1%} | {_WHAT[part]} |')
  lines.append(f'| **wall** | {wall:.2f} | 100.0% | {ledger.attempts} attempt(s) |')
  return '\n'.join(lines) + (
    f'\n\ngoodput {ledger.metrics()["goodput"]:.1%}; {ledger.lost_steps} steps lost; '
    f'{ledger.attempts} attempt(s)'
  )


def plot(records: list[dict], ledger: goodput.Ledger, path: str) -> None:
  """A PNG: the step each record reached against wall time (a drop is a resume or a
  rollback), and the wall time's parts as one stacked bar."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(9, 4.5))
  FigureCanvasAgg(fig)
  line, bar = fig.subplots(2, 1, height_ratios=(3, 1))
  start = ledger.first_start
  attempts: dict[str, list[tuple[float, int]]] = {}
  for record in records:
    attempts.setdefault(record['attempt'], []).append((record['time'] - start, record['step']))
  for number, points in enumerate(attempts.values(), 1):
    times, steps = zip(*points)
    line.plot(times, steps, drawstyle='steps-post', label=f'attempt {number}')
  line.set_xlim(0, ledger.wall)
  line.set_ylabel('step reached')
  line.legend(loc='upper left', fontsize='small')
  left = 0.0
  for part in goodput.PARTS:
    seconds = ledger.totals[part]
    bar.barh(0, seconds, left=left, color=_COLOURS[part], label=f'{part} {seconds:.1f}s')
    left += seconds
  bar.set_xlim(0, ledger.wall)
  bar.set_yticks([])
  bar.set_xlabel('wall time (s)')
  bar.legend(ncol=4, fontsize='small', loc='upper center', bbox_to_anchor=(0.5, -0.6))
  fig.suptitle(
    f'goodput {ledger.metrics()["goodput"]:.0%}, {ledger.lost_steps} steps lost, '
    f'{ledger.attempts} attempts'
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
