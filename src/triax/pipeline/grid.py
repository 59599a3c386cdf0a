"""The text grid of a lockstep program: a band of rows per stage, a column per tick."""

from __future__ import annotations

from collections.abc import Sequence

from triax.pipeline.ir import BACKWARD, COPY_KINDS, EVICT, FORWARD, LOAD, WEIGHT, Action

_SHORT = {EVICT: 'E', LOAD: 'L'}


def format_grid(
  grid: Sequence[Sequence[Sequence[Action]]],
  stages: int,
  partner: Sequence[int] | None = None,
  rounds: Sequence[int] = (),
  sends: Sequence[int] = (),
) -> str:
  """An aligned table: a band of rows per stage, a column per tick.

  Each stage gets an F and a B row, a W row if any stage runs W, and an X
  row if residuals move: 'E3.0'/'L3.0' where the stage sends EVICT/LOAD of
  micro-batch 3, chunk 0, and 'e3.0'/'l3.0' where it receives them (shown
  only when `partner` is given). A packed program's `rounds` (their first
  ticks) and `sends` (ticks that send) get a row each under the ticks.
  """
  kinds = {a.kind for row in grid for cell in row for a in cell}
  bands = [FORWARD, BACKWARD] + [WEIGHT] * (WEIGHT in kinds)
  copies = bool(kinds & set(COPY_KINDS))
  arriving = [[[] for _ in range(stages)] for _ in grid]
  if copies and partner is not None:
    for t, row in enumerate(grid):
      for s, cell in enumerate(row):
        for a in cell:
          if a.kind in COPY_KINDS:
            arriving[t][partner[s]].append(f'{_SHORT[a.kind].lower()}{a.microbatch}.{a.chunk}')
  rows = []  # (stage label, band, cell labels)
  for s in range(stages):
    for kind in bands:
      cells = [
        ','.join(str(a) for a in grid[t][s] if a.kind == kind) or '.' for t in range(len(grid))
      ]
      rows.append((f's{s}' if kind == FORWARD else '', kind, cells))
    if copies:
      cells = [
        ','.join(
          [f'{_SHORT[a.kind]}{a.microbatch}.{a.chunk}' for a in grid[t][s] if a.kind in COPY_KINDS]
          + arriving[t][s]
        )
        or '.'
        for t in range(len(grid))
      ]
      rows.append(('', 'X', cells))
  width = max([len(x) for _, _, cells in rows for x in cells] + [len(str(len(grid) - 1))])
  label_width = len(f's{stages - 1}')
  lines = [f'{"tick":<{label_width + 4}}' + ' '.join(str(t).rjust(width) for t in range(len(grid)))]
  if rounds:
    first = {t: str(r) for r, t in enumerate(rounds)}
    for name, marks in (('round', first), ('send', {t: 'S' for t in sends})):
      cells = [marks.get(t, '.') for t in range(len(grid))]
      lines.append(f'{name:<{label_width + 4}}' + ' '.join(x.rjust(width) for x in cells))
  for label, kind, cells in rows:
    lines.append(f'{label:<{label_width}} {kind}  ' + ' '.join(x.rjust(width) for x in cells))
  return '\n'.join(lines)
