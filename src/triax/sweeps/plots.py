"""A sweep's plots as PNG: loss curves overlaid, throughput and memory per point.

Figures are built with matplotlib's object API (`Figure`, rendered by Agg
when saved), never pyplot, so no global backend or figure state is touched
in the process that imports this.
"""

from __future__ import annotations

import os

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from triax.sweeps.results import Row


def loss_curves(rows: list[Row], path: str, title: str = '') -> None:
  """Train loss (solid) and eval loss (dots, same colour) of every point, by step."""
  fig = Figure(figsize=(9, 5), layout='constrained')
  ax = fig.add_subplot()
  for i, row in enumerate(rows):
    color = f'C{i % 10}'
    style = '-' if i < 10 else '--'  # ten colours, then the cycle repeats dashed
    if row.run.train_curve:
      steps, losses = zip(*row.run.train_curve)
      ax.plot(steps, losses, style, color=color, label=row.name, linewidth=1.2)
    if row.run.eval_curve:
      steps, losses = zip(*row.run.eval_curve)
      ax.plot(steps, losses, 'o', color=color, markersize=4)
  ax.set_xlabel('step')
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_ylabel('loss (nats/token): train solid, eval dots')
  ax.set_title(f'{title}: loss' if title else 'loss')
  ax.grid(alpha=0.3)
  if any(row.run.train_curve for row in rows):
    ax.legend(fontsize='small', loc='upper left', bbox_to_anchor=(1.01, 1.0))
  fig.savefig(path, dpi=110)


def bars(
  rows: list[Row], values: list[float | None], path: str, xlabel: str, title: str = ''
) -> None:
  """One horizontal bar per point (labels are long); points without a value say why."""
  height = max(2.5, 0.35 * len(rows) + 1.2)
  fig = Figure(figsize=(9, height), layout='constrained')
  ax = fig.add_subplot()
  positions = range(len(rows))
  ax.barh(positions, [v or 0.0 for v in values], color='C0')
  top = max([v for v in values if v] or [1.0])
  for y, (row, value) in enumerate(zip(rows, values)):
    text = f'{value:,.4g}' if value else row.status
    ax.text((value or 0.0) + 0.01 * top, y, text, va='center', fontsize='small')
  ax.set_yticks(list(positions), [row.name for row in rows], fontsize='small')
  ax.invert_yaxis()  # first point on top, as in the tables
  ax.set_xlim(0, top * 1.15)
  ax.set_xlabel(xlabel)
  ax.set_title(title)
  ax.grid(axis='x', alpha=0.3)
  fig.savefig(path, dpi=110)


def write_plots(rows: list[Row], workdir: str, title: str = '') -> dict:
  """loss.png, throughput.png and memory.png in `workdir`; returns their paths."""
  paths = {name: os.path.join(workdir, f'{name}.png') for name in ('loss', 'throughput', 'memory')}
  loss_curves(rows, paths['loss'], title)
  bars(
    rows,
    [r.run.tokens_per_sec for r in rows],
    paths['throughput'],
    'tokens/s (median after the first logged step)',
    f'{title}: throughput',
  )
  bars(
    rows,
    [None if r.run.peak_bytes is None else r.run.peak_bytes / 2**20 for r in rows],
    paths['memory'],
    'MiB per device (XLA temp + args + outputs - aliased)',
    f'{title}: peak memory of the train step',
  )
  return {f'{name}_png': p for name, p in paths.items()}
