"""Schedules read from and written to files: torch's CSV and triax's JSON.

`load(path, stages, microbatches, virtual_stages)` reads `.csv` (torch.distributed.
pipelining's compute-only CSV, as its `_dump_csv(path, 'compute_only')` writes it) or
`.json` (triax's: a Schedule field for field, orders as Action strings such as `F3.1`,
`EVICT3.1`); `write_csv` and `write_json` write them. JSON round-trips any schedule exactly
(BPipe's copies and partners, DualPipeV's overlapped pairs included); CSV holds what
torch's cells can say.

A CSV has no header; row r is stage r's order, one cell `{chunk}{kind}{microbatch}` per
time step (`5F2`: global chunk 5's forward of micro-batch 2), kinds F, B, I, W; blank
cells are idle and only the order counts. With I and W, I reads as our B and a B as our B
with its W right after it (`Schedule.full_backwards`); `(0F3;7B1)OVERLAP_F_B` is an
overlapped pair (`Schedule.overlaps`). torch's UNSHARD, RESHARD and REDUCE_GRAD markers
are skipped; R / RECOMPUTE cells are refused. The placement is read off the rows.

Errors are ConfigErrors that name the file, row and cell (both from 0; in JSON, orders[r][c])
and say what to do. A deadlocking order is caught by lowering it, the rest by
`validate.validate`. Plain Python. The format's details: docs/design/schedules.md."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
from collections.abc import Callable, Sequence

from triax.errors import ConfigError
from triax.pipeline import lower as lower_lib
from triax.pipeline import validate as validate_lib
from triax.pipeline.ir import (
  BACKWARD,
  COPY_KINDS,
  EVICT,
  FORWARD,
  KINDS,
  LOAD,
  WEIGHT,
  Action,
  Schedule,
  ScheduleDeadlock,
)

KEY = 'pipeline.schedule_file'
# The config keys the file's sizes are checked against; the CLI names its flags instead.
SIZE_KEYS = ('mesh.pipe', 'pipeline.microbatches', 'pipeline.virtual_stages')

_TORCH_KIND = {'F': FORWARD, 'B': BACKWARD, 'I': BACKWARD, 'W': WEIGHT}
_TORCH_SKIPPED = ('UNSHARD', 'RESHARD', 'REDUCE_GRAD')
_TORCH_COMMS = ('SEND_F', 'RECV_F', 'SEND_B', 'RECV_B')
_TORCH_CELL = re.compile(r'(\d+)([A-Za-z_]+)(\d*)')
_OUR_CELL = re.compile(r'([A-Z]+)(\d+)\.(\d+)')
_NEIGHBOUR = {FORWARD: BACKWARD, BACKWARD: FORWARD, WEIGHT: BACKWARD}
_JSON_KEYS = (
  'name',
  'stages',
  'microbatches',
  'virtual_stages',
  'placement',
  'partner',
  'stash_cap',
  'overlaps',
  'full_backwards',
  'orders',
)
_OVERLAP_CELL = re.compile(r'\((.*)\)OVERLAP_F_B')


def load(
  path: str,
  stages: int | None = None,
  microbatches: int | None = None,
  virtual_stages: int | None = None,
  *,
  size_keys: Sequence[str] = SIZE_KEYS,
) -> Schedule:
  """Reads a schedule (.csv: torch's compute-only CSV, .json: triax's).

  Args:
    path: the file.
    stages, microbatches, virtual_stages: the configured p, m, v the file
      must match; None takes the file's own.
    size_keys: what to call those three in messages.

  Raises:
    ConfigError: keyed `pipeline.schedule_file`, one line naming the file,
      row and cell at fault, for a file that is missing, malformed, does not
      match the sizes or cannot run.
  """
  ext = os.path.splitext(path)[1].lower()
  if ext not in ('.csv', '.json'):
    raise _error(
      path,
      f'unknown file type {ext or "(no extension)"}; name a .csv file '
      "(torch's compute-only CSV) or a .json file (triax's)",
    )
  try:
    with open(path, encoding='utf-8', newline='') as f:
      text = f.read()
  except FileNotFoundError:
    raise _error(
      path, 'no such file; check the path (relative paths start at the working directory)'
    ) from None
  except (OSError, UnicodeDecodeError) as e:
    raise _error(path, f'cannot read it ({type(e).__name__}: {e}); check the file') from None
  parse = _parse_csv if ext == '.csv' else _parse_json
  schedule, cells = parse(path, text, dict(zip(size_keys, (stages, microbatches, virtual_stages))))
  cells.check_complete(schedule)
  _check_runs(schedule, cells)
  return schedule


def write_csv(schedule: Schedule, path: str) -> None:
  """Writes torch's compute-only CSV: B for a fused backward, I and W for a split one.

  Each action sits at its lockstep tick with every action costing one
  tick (`lower.compute_ticks` of the schedule as built), so the file reads
  as a timeline, as torch's own do. A schedule with overlapped pairs or
  full backwards in a split one (DualPipeV) has cells of two or three of
  our actions, which sit at no one tick: its rows list their cells in order
  with no idle cells, as torch's ScheduleDualPipeV writes them, so a file
  torch wrote is written back byte for byte.

  Raises:
    ValueError: for a schedule that moves residuals (BPipe's EVICT/LOAD),
      which the compute-only CSV cannot hold (write JSON instead), or whose
      pair marks disagree with its orders.
    ScheduleDeadlock: for orders that cannot run.
  """
  copies = [a for order in schedule.orders for a in order if a.kind in COPY_KINDS]
  if copies:
    raise ValueError(
      f'{schedule.name} moves residuals between stages ({copies[0]}, ...), '
      "which torch's compute-only CSV cannot hold; write triax's JSON "
      '(write_json) instead'
    )
  if schedule.overlaps or schedule.full_backwards:
    rows = [[_torch_spell(schedule, cell) for cell in row] for row in torch_cells(schedule)]
  else:
    rows = [[] for _ in range(schedule.stages)]
    for a, tick in sorted(lower_lib.compute_ticks(schedule).items(), key=lambda x: x[1]):
      row = rows[schedule.stage_of(a.chunk)]
      row.extend([''] * (tick - len(row)))
      row.append(_torch_spell(schedule, (a,)))
  # The csv module's default dialect is what torch writes: commas, CRLF.
  with open(path, 'w', newline='', encoding='utf-8') as f:
    csv.writer(f).writerows(rows)


def torch_cells(schedule: Schedule) -> list[list[tuple[Action, ...]]]:
  """Each stage's order cut into torch's cells.

  A cell is an overlapped pair (F, B, and B's W if B is a full backward),
  a full backward (B, W) or one action.

  Raises:
    ValueError: where `schedule.overlaps` or `full_backwards` disagree
      with the orders (a pair apart, a full backward's W not right after it).
  """
  pairs = dict(schedule.overlaps)
  if len(pairs) != len(schedule.overlaps):
    raise ValueError('a forward overlaps two backwards; each forward is in one pair at most')
  for f, b in schedule.overlaps:
    if (f.kind, b.kind) != (FORWARD, BACKWARD):
      raise ValueError(f'overlap ({f}, {b}) must pair a forward with a backward')
  if any(b.kind != BACKWARD for b in schedule.full_backwards):
    raise ValueError('full_backwards must hold backward (B) actions only')
  if schedule.full_backwards and not schedule.split_backward:
    raise ValueError('full backwards are marked in a schedule without W actions')
  rows, used = [], 0
  for order in schedule.orders:
    row, i = [], 0
    while i < len(order):
      n = 1
      if order[i] in pairs:
        if order[i + 1 : i + 2] != (pairs[order[i]],):
          raise ValueError(f'{order[i]} overlaps {pairs[order[i]]}, which must come right after it')
        n, used = 2, used + 1
      b = order[i + n - 1]
      if b in schedule.full_backwards:
        w = Action(WEIGHT, b.microbatch, b.chunk)
        if order[i + n : i + n + 1] != (w,):
          raise ValueError(f'{b} is a full backward: its {w} must come right after it')
        n += 1
      row.append(order[i : i + n])
      i += n
    rows.append(row)
  marked_b = {b for order in schedule.orders for b in order} & schedule.full_backwards
  if used != len(pairs) or marked_b != schedule.full_backwards:
    raise ValueError('an overlap or full backward names an action that is in no order')
  return rows


def _torch_spell(schedule: Schedule, cell: tuple[Action, ...]) -> str:
  """One of `torch_cells`' cells as torch writes it (5F2, 5I2, 5B2, (0F3;7B1)OVERLAP_F_B)."""

  def one(a: Action) -> str:
    if a.kind == BACKWARD:
      fused = not schedule.split_backward or a in schedule.full_backwards
      return f'{a.chunk}{"B" if fused else "I"}{a.microbatch}'
    return f'{a.chunk}{a.kind}{a.microbatch}'

  if len(cell) > 1 and cell[0].kind == FORWARD:
    return f'({one(cell[0])};{one(cell[1])})OVERLAP_F_B'
  return one(cell[0])


def write_json(schedule: Schedule, path: str) -> None:
  """Writes triax's JSON, one line per stage's order."""
  head = {
    'name': schedule.name,
    'stages': schedule.stages,
    'microbatches': schedule.microbatches,
    'virtual_stages': schedule.virtual_stages,
    'placement': list(schedule.placement),
    'partner': None if schedule.partner is None else list(schedule.partner),
    'stash_cap': schedule.stash_cap,
    'overlaps': [[str(f), str(b)] for f, b in sorted(schedule.overlaps)],
    'full_backwards': [str(b) for b in sorted(schedule.full_backwards)],
  }
  lines = ['{'] + [f'  {json.dumps(k)}: {json.dumps(v)},' for k, v in head.items()]
  orders = [json.dumps([str(a) for a in order]) for order in schedule.orders]
  lines += ['  "orders": [', ',\n'.join(f'    {o}' for o in orders), '  ]', '}']
  with open(path, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines) + '\n')


# ---------------------------------------------------------------- shared checks


def _error(path: str, message: str) -> ConfigError:
  return ConfigError(KEY, f'{path}: {message}')


@dataclasses.dataclass
class _Cells:
  """Where each action of a file was written, for messages.

  Attributes:
    path: the file.
    where: action -> (row, cell).
    spell: an action as the file writes it (torch's `1I3`, our `B3.1`).
  """

  path: str
  spell: Callable[[Action], str]
  where: dict[Action, tuple[int, int]] = dataclasses.field(default_factory=dict)

  def error(self, row: int, cell: int | None, message: str) -> ConfigError:
    at = f'row {row}' if cell is None else f'row {row}, cell {cell}'
    return _error(self.path, f'{at}: {message}')

  def add(self, action: Action, row: int, cell: int) -> None:
    if action in self.where:
      r, c = self.where[action]
      raise self.error(
        row,
        cell,
        f'{self.spell(action)} appears twice (first at row {r}, '
        f'cell {c}); each action runs once, delete one',
      )
    self.where[action] = (row, cell)

  def check_complete(self, schedule: Schedule) -> None:
    """Every (micro-batch, chunk) runs F and a backward (and W if split),
    and an EVICT comes with its LOAD (rows were checked while parsing)."""
    wanted = (FORWARD, BACKWARD) + ((WEIGHT,) if schedule.split_backward else ())
    pairs = [(j, c) for c in range(schedule.num_chunks) for j in range(schedule.microbatches)]
    runs = {(a.microbatch, a.chunk) for a in self.where}
    # A pair with some of its actions points at a cell; report those first,
    # since a mistyped micro-batch leaves one such pair and one absent one.
    for j, c in sorted(pairs, key=lambda x: x not in runs):
      row = schedule.stage_of(c)
      have = [a for a in (Action(k, j, c) for k in KINDS) if a in self.where]
      if not have:
        raise self.error(
          row,
          None,
          f'never runs micro-batch {j} of chunk {c} (torch stage '
          f'{c}); every micro-batch runs F and a backward of every chunk',
        )
      for kind in wanted:
        if Action(kind, j, c) not in self.where:
          # Point at the action next to the missing one: W's B, B's F, F's B.
          near = Action(_NEIGHBOUR[kind], j, c)
          cite = near if near in self.where else have[0]
          raise self.error(
            *self.where[cite],
            f'{self.spell(cite)} has no '
            f'{self.spell(Action(kind, j, c))} anywhere; add it to row {row}',
          )
      evict, back = Action(EVICT, j, c), Action(LOAD, j, c)
      if (evict in self.where) != (back in self.where):
        there = evict if evict in self.where else back
        raise self.error(
          *self.where[there],
          f'{self.spell(there)} has no '
          f'{self.spell(back if there == evict else evict)}; each set moved '
          'is evicted once and loaded back once',
        )


def _check_sizes(cells: _Cells, schedule: Schedule, config: dict[str, int | None]) -> None:
  """The file's p, m, v against the configured ones (None: anything goes)."""
  (pipe_key, p), (mb_key, m), (v_key, v) = config.items()
  if p is not None and schedule.stages != p:
    raise _error(
      cells.path,
      f'{schedule.stages} rows (pipeline stages), but {pipe_key} is '
      f'{p}; set {pipe_key}={schedule.stages} or use a file for {p} stages',
    )
  if v is not None and schedule.virtual_stages != v:
    raise _error(
      cells.path,
      f'each row runs {schedule.virtual_stages} chunk(s) (torch stages), '
      f'but {v_key} is {v}; set {v_key}={schedule.virtual_stages} or use a file '
      f'for {v} chunks per stage',
    )
  if m is not None and schedule.microbatches > m:
    a, (r, c) = next((a, rc) for a, rc in cells.where.items() if a.microbatch >= m)
    raise cells.error(
      r,
      c,
      f'{cells.spell(a)} is micro-batch {a.microbatch}, but {mb_key} is '
      f'{m} (micro-batches 0..{m - 1}); set {mb_key}={schedule.microbatches} '
      f'or use a file for {m}',
    )
  if m is not None and schedule.microbatches < m:
    raise _error(
      cells.path,
      f'runs micro-batches 0..{schedule.microbatches - 1} only, but '
      f'{mb_key} is {m}; set {mb_key}={schedule.microbatches} or use a file for {m}',
    )


def _check_runs(schedule: Schedule, cells: _Cells) -> None:
  """Lowers the schedule (a deadlock names the action that never runs),
  then holds it to the validator."""
  try:
    lower_lib.lower(schedule)
  except ScheduleDeadlock as e:
    # lower ends its message with 'stage s waits on X' per stage; the
    # grid in between is many lines, and our error is one.
    waits = re.findall(r'^stage (\d+) waits on ((?!nothing)\S+)$', str(e), re.MULTILINE)
    first = str(e).splitlines()[0]
    if not waits:
      raise _error(cells.path, f'the orders deadlock ({first})') from None
    tick = re.search(r'at tick (\d+)', first)
    stuck = [_parse_ours(x) for _, x in waits]
    # The first stuck action the file itself holds (not a W that lowering
    # added after a fused B), to point at its cell.
    head = next((a for a in stuck if a in cells.where), None)
    r, c = cells.where[head] if head else (int(waits[0][0]), None)
    raise cells.error(
      r,
      c,
      f'{cells.spell(head) if head else waits[0][1]} and the other '
      f"stages' next actions wait on each other (deadlock at lockstep tick "
      f'{tick[1] if tick else "?"}: '
      + ', '.join(
        f'stage {s} waits on {cells.spell(a) if a else x}' for (s, x), a in zip(waits, stuck)
      )
      + '); reorder the rows so each action comes after what it needs',
    ) from None
  except ValueError as e:  # residual copies the lockstep table cannot place
    raise _error(cells.path, f'{e}; move the EVICT/LOAD actions') from None
  problems = validate_lib.validate(schedule)
  if problems:
    more = f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''
    raise _error(cells.path, f'{problems[0]}{more}')


def _parse_ours(text: str) -> Action | None:
  m = _OUR_CELL.fullmatch(text)
  return Action(m[1], int(m[2]), int(m[3])) if m and m[1] in KINDS else None


# ---------------------------------------------------------------- torch's CSV


def _parse_csv(path: str, text: str, config: dict[str, int | None]) -> tuple[Schedule, _Cells]:
  try:
    rows = list(csv.reader(io.StringIO(text, newline='')))
  except csv.Error as e:
    raise _error(path, f'not a CSV file ({e}); write one row of cells like 0F0 per rank') from None
  while rows and not rows[-1]:  # blank lines at the end
    rows.pop()
  letters: dict[Action, str] = {}  # an action -> the letter its cell gave it
  split = False  # any I or W: B is then a full backward, our B and W

  def spell(a: Action) -> str:
    letter = letters.get(a) or {FORWARD: 'F', WEIGHT: 'W'}.get(a.kind, 'I' if split else 'B')
    return f'{a.chunk}{letter}{a.microbatch}'

  cells = _Cells(path, spell)
  read = [(r, c, raw.strip()) for r, row in enumerate(rows) for c, raw in enumerate(row)]
  read = [(r, c, token, _torch_cell(cells, r, c, token)) for r, c, token in read]
  read = [x for x in read if x[3]]
  split = any(letter in 'IW' for *_, subs in read for _, letter in subs)
  orders, home, full = _place_cells(cells, read, split, letters, len(rows))
  overlaps = [(subs[0][0], subs[1][0]) for *_, subs in read if len(subs) == 2]
  if not home:
    raise _error(
      path,
      'no actions; want one row per rank of cells like 0F0 (torch stage 0, forward, micro-batch 0)',
    )
  n = len(home)
  missing = next((k for k in range(n) if k not in home), None)
  if missing is not None:
    top = max(home)
    raise cells.error(
      *home[top],
      f'torch stage {top} is here but no row runs stage {missing}; '
      f'stages (chunks) count 0..{n - 1} without gaps',
    )
  per_row = [sorted(k for k, (r, _) in home.items() if r == row) for row in range(len(rows))]
  for r, chunks in enumerate(per_row):
    if len(chunks) != len(per_row[0]):
      raise cells.error(
        r,
        None,
        f'runs torch stages {chunks} but row 0 runs {per_row[0]}; '
        'every rank holds the same number of stages (chunks)',
      )
  p = len(rows)
  m = 1 + max(a.microbatch for a in cells.where)
  schedule = Schedule(
    os.path.splitext(os.path.basename(path))[0],
    p,
    m,
    n // p,
    tuple(tuple(o) for o in orders),
    placement=tuple(home[k][0] for k in range(n)),
    overlaps=overlaps,
    full_backwards=full,
  )
  _check_sizes(cells, schedule, config)
  return schedule, cells


def _place_cells(cells: _Cells, read: list, split: bool, letters: dict, p: int):
  """The rows' actions as (orders, chunk -> (row, cell) first seen, full backwards).

  In a split file a B is our B and its W, which the file must not hold
  again: older torch wrote B where it now writes I.
  """
  explicit_w = {a: (r, c) for r, c, _, subs in read for a, letter in subs if letter == 'W'}
  home: dict[int, tuple[int, int]] = {}
  orders, full = [[] for _ in range(p)], []
  for r, c, token, subs in read:
    for a, letter in subs:
      if a.chunk in home and home[a.chunk][0] != r:
        r0, c0 = home[a.chunk]
        raise cells.error(
          r,
          c,
          f'{token}: torch stage {a.chunk} is already on row {r0} '
          f'(cell {c0}); each stage (chunk) runs on one rank only',
        )
      home.setdefault(a.chunk, (r, c))
      letters[a] = letter
      cells.add(a, r, c)
      orders[r].append(a)
      if letter == 'B' and split:
        w = Action(WEIGHT, a.microbatch, a.chunk)
        if w in explicit_w:
          raise cells.error(
            *explicit_w[w],
            f'{cells.spell(w)}: {token} at row {r}, cell {c} is a full backward, which '
            'computes the weight gradient too; write I there for the input gradient only '
            '(older torch wrote B where it now writes I) or delete this W',
          )
        cells.add(w, r, c)
        orders[r].append(w)
        full.append(a)
  return orders, home, full


def _torch_cell(cells: _Cells, r: int, c: int, token: str) -> list[tuple[Action, str]]:
  """One cell as its (action, torch letter)s: none for idle and skipped
  cells, two for an overlapped pair (F then B or I)."""
  if not token:
    return []
  if token.startswith('('):
    m = _OVERLAP_CELL.fullmatch(token)
    subs = [_torch_action(cells, r, c, x.strip()) for x in m[1].split(';')] if m else []
    if [letter for _, letter in subs] not in (['F', 'B'], ['F', 'I']):
      raise cells.error(
        r,
        c,
        f'bad cell {token!r}; an overlapped pair is a forward then a backward, '
        'like (0F3;7B1)OVERLAP_F_B',
      )
    return subs
  a = _torch_action(cells, r, c, token)
  return [a] if a[0] is not None else []


def _torch_action(cells: _Cells, r: int, c: int, token: str) -> tuple[Action | None, str]:
  """One action as (action, torch letter); (None, '') for skipped ones."""
  m = _TORCH_CELL.fullmatch(token)
  if not m:
    raise cells.error(
      r,
      c,
      f'bad cell {token!r}; want stage, kind, micro-batch like 5F2 '
      '(torch stage 5, forward, micro-batch 2) or an empty cell',
    )
  stage, kind, microbatch = m.groups()
  if kind in _TORCH_SKIPPED:
    return None, ''
  if kind in _TORCH_COMMS:
    raise cells.error(
      r,
      c,
      f"{token} is a communication action of torch's compute+comms "
      "format; write the compute-only CSV (_dump_csv(path, 'compute_only'))",
    )
  if kind == 'R' or kind.startswith('RECOMPUTE'):
    raise cells.error(
      r,
      c,
      f'{token}: torch has no recompute action; B reruns the forward under '
      'model.remat=full and pipeline.tick_packing packs the ticks for it: drop the cell',
    )
  if kind not in _TORCH_KIND:
    raise cells.error(
      r,
      c,
      f'{token}: unknown kind {kind!r}; want F (forward), B (full '
      'backward), I (input-gradient backward) or W (weight gradient)',
    )
  if not microbatch:
    raise cells.error(
      r, c, f'{token} names no micro-batch; write it after the kind, like {stage}{kind}0'
    )
  return Action(_TORCH_KIND[kind], int(microbatch), int(stage)), kind


# ---------------------------------------------------------------- triax's JSON


def _parse_json(path: str, text: str, config: dict[str, int | None]) -> tuple[Schedule, _Cells]:
  try:
    doc = json.loads(text)
  except json.JSONDecodeError as e:
    raise _error(
      path, f'not JSON (line {e.lineno}, column {e.colno}: {e.msg}); fix the syntax'
    ) from None
  if not isinstance(doc, dict):
    raise _error(path, 'want a JSON object with keys ' + ', '.join(_JSON_KEYS))
  unknown = sorted(set(doc) - set(_JSON_KEYS))
  if unknown:
    raise _error(path, f'unknown key {unknown[0]!r}; the keys are {", ".join(_JSON_KEYS)}')
  for key in ('stages', 'microbatches', 'virtual_stages', 'orders'):
    if key not in doc:
      raise _error(path, f'no {key!r}; a schedule file has ' + ', '.join(_JSON_KEYS))
  for key in ('stages', 'microbatches', 'virtual_stages'):
    if not _is_int(doc[key]) or doc[key] < 1:
      raise _error(path, f'{key} must be an integer >= 1; got {doc[key]!r}')
  p, m, v = doc['stages'], doc['microbatches'], doc['virtual_stages']
  placement = _int_list(path, doc, 'placement', p * v, p)
  partner = _int_list(path, doc, 'partner', p, p)
  if placement is not None and any(placement.count(s) != v for s in range(p)):
    raise _error(path, f'placement {placement} must put {v} chunks on each of the {p} stages')
  if partner is not None and any(partner[x] != s for s, x in enumerate(partner)):
    raise _error(path, f'partner {partner} must pair stages up (partner[partner[s]] == s)')
  if doc.get('stash_cap') is not None and not _is_int(doc['stash_cap']):
    raise _error(path, f'stash_cap must be an integer or null; got {doc["stash_cap"]!r}')
  orders = doc['orders']
  if (
    not isinstance(orders, list) or len(orders) != p or not all(isinstance(o, list) for o in orders)
  ):
    raise _error(path, f'orders must be {p} lists (one per stage) of actions like "F0.0"')
  cells = _Cells(path, str)
  shape = Schedule(
    str(doc.get('name') or os.path.splitext(os.path.basename(path))[0]),
    p,
    m,
    v,
    (),
    partner=tuple(partner) if partner else None,
    stash_cap=doc.get('stash_cap'),
    placement=placement,
  )
  parsed = [
    [_json_action(cells, shape, r, c, x) for c, x in enumerate(o)] for r, o in enumerate(orders)
  ]
  schedule = dataclasses.replace(
    shape,
    orders=tuple(tuple(o) for o in parsed),
    overlaps=_json_marks(path, doc, 'overlaps', 2),
    full_backwards=_json_marks(path, doc, 'full_backwards', None),
  )
  try:
    torch_cells(schedule)
  except ValueError as e:
    raise _error(path, f'{e}; fix overlaps or full_backwards') from None
  _check_sizes(cells, schedule, config)
  return schedule, cells


def _json_marks(path: str, doc: dict, key: str, pair: int | None) -> list:
  """doc[key] (absent or null: none) as Actions, or as `pair`-tuples of them."""
  x = doc.get(key) or []

  def actions(items) -> list[Action] | None:
    out = [_parse_ours(a) if isinstance(a, str) else None for a in items]
    return None if None in out else out

  if isinstance(x, list) and pair is None and actions(x) is not None:
    return actions(x)
  if isinstance(x, list) and pair and all(isinstance(y, list) and len(y) == pair for y in x):
    out = [actions(y) for y in x]
    if None not in out:
      return [tuple(y) for y in out]
  want = 'pairs like ["F3.0", "B1.7"]' if pair else 'actions like "B1.7"'
  raise _error(path, f'{key} must be null or a list of {want}; got {x!r}')


def _json_action(cells: _Cells, shape: Schedule, r: int, c: int, text) -> Action:
  a = _parse_ours(text) if isinstance(text, str) else None
  if a is None:
    raise cells.error(
      r,
      c,
      f'bad action {text!r}; want kind, micro-batch.chunk like "F3.1" (kinds {", ".join(KINDS)})',
    )
  if not 0 <= a.microbatch < shape.microbatches or not 0 <= a.chunk < shape.num_chunks:
    raise cells.error(
      r,
      c,
      f'{a} is outside micro-batches 0..{shape.microbatches - 1} or '
      f'chunks 0..{shape.num_chunks - 1}',
    )
  if a.kind in COPY_KINDS and shape.partner is None:
    raise cells.error(r, c, f'{a} moves residuals but the file gives no partner list')
  if shape.stage_of_action(a) != r:
    raise cells.error(
      r,
      c,
      f'{a} runs on stage {shape.stage_of_action(a)} (chunk {a.chunk} is '
      f'on stage {shape.stage_of(a.chunk)}); move it to row '
      f'{shape.stage_of_action(a)}',
    )
  cells.add(a, r, c)
  return a


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _int_list(path: str, doc: dict, key: str, length: int, below: int) -> list[int] | None:
  """doc[key] as a list of `length` ints in 0..below-1, or None if absent or null."""
  x = doc.get(key)
  if x is None:
    return None
  if (
    not isinstance(x, list) or len(x) != length or not all(_is_int(i) and 0 <= i < below for i in x)
  ):
    raise _error(path, f'{key} must be null or {length} stage numbers in 0..{below - 1}; got {x!r}')
  return x
