"""Checks that a schedule, and the lockstep program lowered from it, are sound.

A schedule is sound when its placement gives every stage v chunks, every
(micro-batch, chunk) is run forward and backward exactly once on the stage
that holds the chunk (and, if the schedule splits the backward, its weight
gradient W exactly once, after its B), every EVICT has one LOAD, partners
are consistent, and the per-stage orders can all run to completion.

A program (lower.py) is sound when its tables say what its grid says, each
stage runs at most one compute action a tick (or a fused tick's overlapped
pair with its W) and in its order, every input
was produced in an earlier tick, and every buffer write and read the
executor does finds the value it expects. The validator replays the tables
tick by tick in the executor's phases (land, compute, send, receive)
against per-stage slot contents, so a slot conflict, a dropped message or a
read of an empty slot shows up with its tick, stage and action. That
includes residuals moving between partners: the replay follows each set to
the partner and back, and holds the stash pool to the schedule's cap.

Plain Python and numpy, like the IR.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from triax.pipeline import lower as lower_lib
from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Action, Program, Schedule


def validate(schedule: Schedule, program: Program | None = None) -> list[str]:
  """Returns every problem found; an empty list means valid.

  `schedule` is the schedule as built (or as run: the program's own
  `schedule`); its `stash_cap` is the promise the program is held to.
  Program checks run only once the schedule itself is valid, because they
  compare the program against the schedule's actions.
  """
  problems = _check_layout(schedule)
  if problems:
    return problems
  problems = _check_counts(schedule) + _check_stage_order(schedule)
  if problems:
    return problems
  problems = _check_runs_to_completion(schedule)
  if problems or program is None:
    return problems
  return _check_program(schedule, program)


def check(schedule: Schedule, program: Program | None = None) -> None:
  """Raises ValueError listing every problem, if there is any."""
  problems = validate(schedule, program)
  if problems:
    raise ValueError(f'{schedule.name}: {len(problems)} problem(s):\n  ' + '\n  '.join(problems))


# ---------------------------------------------------------------- schedule


def _check_layout(schedule: Schedule) -> list[str]:
  """Sizes, placement, kinds, ranges and stage of every action."""
  p, m, n = schedule.stages, schedule.microbatches, schedule.num_chunks
  if min(p, m, schedule.virtual_stages) < 1:
    return [
      f'sizes must be >= 1: stages={p} microbatches={m} virtual_stages={schedule.virtual_stages}'
    ]
  if len(schedule.orders) != p:
    return [f'{len(schedule.orders)} orders for {p} stages']
  problems = _check_placement(schedule) or _check_partner(schedule)
  if problems:
    return problems
  for s, order in enumerate(schedule.orders):
    for i, a in enumerate(order):
      where = f'stage {s} position {i}: {a}'
      if a.kind not in sched.KINDS:
        problems.append(f'{where}: unknown kind {a.kind!r}')
      elif not 0 <= a.microbatch < m:
        problems.append(f'{where}: micro-batch outside 0..{m - 1}')
      elif not 0 <= a.chunk < n:
        problems.append(f'{where}: chunk outside 0..{n - 1}')
      elif a.kind in sched.COPY_KINDS and schedule.partner is None:
        problems.append(f'{where}: moves residuals but the schedule has no partner pairing')
      elif a.kind in sched.COPY_KINDS and schedule.partner[
        schedule.stage_of(a.chunk)
      ] == schedule.stage_of(a.chunk):
        problems.append(
          f'{where}: stage {schedule.stage_of(a.chunk)} is '
          'its own partner; there is nowhere to evict to'
        )
      elif schedule.stage_of_action(a) != s:
        problems.append(
          f'{where}: runs on stage '
          f'{schedule.stage_of_action(a)} (chunk {a.chunk} '
          f'lives on stage {schedule.stage_of(a.chunk)})'
        )
  return problems


def _check_placement(schedule: Schedule) -> list[str]:
  """One stage per chunk, and v chunks on every stage."""
  p, v, placement = schedule.stages, schedule.virtual_stages, schedule.placement
  if len(placement) != p * v:
    return [f'placement {placement} has {len(placement)} entries for p*v = {p * v} chunks']
  problems = [
    f'placement puts chunk {c} on stage {s}, outside 0..{p - 1}'
    for c, s in enumerate(placement)
    if not 0 <= s < p
  ]
  if problems:
    return problems
  held = collections.Counter(placement)
  return [
    f'placement puts {held[s]} chunks on stage {s} '
    f'({list(schedule.chunks_of(s))}); every stage holds v = {v}'
    for s in range(p)
    if held[s] != v
  ]


def _check_partner(schedule: Schedule) -> list[str]:
  """A partner pairing, if any, maps every stage to a stage and back."""
  partner, p = schedule.partner, schedule.stages
  if partner is None:
    return []
  if len(partner) != p or not all(isinstance(x, (int, np.integer)) and 0 <= x < p for x in partner):
    return [f'partner {partner} is not one stage in 0..{p - 1} per stage']
  return [
    f'partner of stage {s} is {x}, whose partner is {partner[x]} (partners must pair up)'
    for s, x in enumerate(partner)
    if partner[x] != s
  ]


def _check_counts(schedule: Schedule) -> list[str]:
  """Exactly one F and one B per (micro-batch, chunk); exactly one W each if
  the schedule splits the backward; at most one EVICT, and one LOAD per
  EVICT."""
  counts = collections.Counter(a for order in schedule.orders for a in order)
  once = (sched.FORWARD, sched.BACKWARD) + ((sched.WEIGHT,) if schedule.split_backward else ())
  problems = []
  for j in range(schedule.microbatches):
    for c in range(schedule.num_chunks):
      for kind in once:
        n = counts[Action(kind, j, c)]
        if n != 1:
          problems.append(
            f'stage {schedule.stage_of(c)}: {kind}{j}.{c} runs {n} times (want exactly 1)'
          )
      evictions = counts[Action(sched.EVICT, j, c)]
      loads = counts[Action(sched.LOAD, j, c)]
      if evictions > 1:
        problems.append(
          f'stage {schedule.stage_of(c)}: EVICT{j}.{c} runs {evictions} times (want at most 1)'
        )
      if loads != evictions:
        problems.append(f'{j}.{c} is evicted {evictions} times but loaded {loads} times')
  return problems


def _check_stage_order(schedule: Schedule) -> list[str]:
  """On one stage, B follows its F, W its B and EVICT its F."""
  problems = []
  for s, order in enumerate(schedule.orders):
    position = {a: i for i, a in enumerate(order)}
    for i, a in enumerate(order):
      before = {
        sched.BACKWARD: sched.FORWARD,
        sched.WEIGHT: sched.BACKWARD,
        sched.EVICT: sched.FORWARD,
      }.get(a.kind)
      if before is None:
        continue
      k = position.get(Action(before, a.microbatch, a.chunk), -1)
      if k > i:
        problems.append(
          f'stage {s} position {i}: {a} runs before its '
          f'{before}{a.microbatch}.{a.chunk} (position {k})'
        )
  return problems


def _check_runs_to_completion(schedule: Schedule) -> list[str]:
  """The per-stage orders, run asynchronously (`sched.walk_async`), never deadlock."""
  done: set[Action] = set()

  def run(stage: int, a: Action, issued: int | None) -> bool:
    del stage, issued
    if not all(d in done for d in sched.dependencies(a, schedule)):
      return False
    done.add(a)
    return True

  problems = []
  for s, a in sched.walk_async(schedule, run):
    missing = [str(d) for d in sched.dependencies(a, schedule) if d not in done]
    problems.append(
      f'deadlock: stage {s} position {schedule.orders[s].index(a)}: {a} '
      f'waits for {", ".join(missing) or "its stage"}'
    )
  return problems


# ---------------------------------------------------------------- program

# The buffer each slot-valued table indexes.
_BUFFER_OF = {
  'src': 'msg',
  'loss': 'msg',
  'stash': 'stash',
  'cut': 'cut',
  'move_send': 'stash',
  'move_recv': 'stash',
}
_BUFFERS = ('msg', 'stash', 'cut')
_KIND_OF_CODE = {code: kind for kind, code in lower_lib.KIND_CODE.items()}
# The per-action tables each compute kind uses; the others must be -1.
_USES = {
  sched.FORWARD: {'src', 'loss', 'stash'},
  sched.BACKWARD: {'src', 'stash', 'cut'},
  sched.WEIGHT: {'stash', 'cut'},
}
_PER_ACTION = ('mb', 'chunk', 'local', 'src', 'loss', 'stash', 'cut')


def _check_program(schedule: Schedule, program: Program) -> list[str]:
  run = sched.with_split_backward(schedule)
  problems = _check_shapes(run, program)
  if problems:
    return problems
  problems = _check_slot_ranges(program)
  if problems:
    return problems
  problems = _check_grid(run, program)
  problems += _check_lockstep_dependencies(run, program)
  if not problems:
    problems += _replay_buffers(schedule, program)
  return problems


def _check_shapes(run: Schedule, program: Program) -> list[str]:
  """The program runs this schedule, and its tables have [T, p] int shape."""
  p, t = run.stages, program.ticks
  ran = program.schedule
  if (ran.stages, ran.microbatches, ran.virtual_stages, ran.placement, ran.orders, ran.partner) != (
    run.stages,
    run.microbatches,
    run.virtual_stages,
    run.placement,
    run.orders,
    run.partner,
  ):
    return [
      f'program.schedule ({ran.name}) is not the schedule validated '
      f'with every fused B split into B then W ({run.name})'
    ]
  problems = []
  if sched.with_split_backward(program.source).orders != ran.orders:
    problems.append(f'program.source ({program.source.name}) does not split into program.schedule')
  lanes = (('table', program.table, lower_lib.TABLES), ('lane2', program.lane2, lower_lib.LANE2))
  for field, tables, names in lanes:
    for name in names:
      table = tables.get(name)
      if table is None:
        problems.append(f'program.{field} has no {name!r} table')
      elif table.shape != (t, p) or not np.issubdtype(table.dtype, np.integer):
        problems.append(
          f'program.{field}[{name!r}] is {table.dtype} {table.shape}; want int {(t, p)}'
        )
  for name, recv in (('recv', program.recv), ('recv2', program.recv2)):
    for o, table in recv.items():
      if not 0 <= o < p:
        problems.append(f'program.{name} has offset {o}, outside 0..{p - 1}')
      if table.shape != (t, p) or not np.issubdtype(table.dtype, np.integer):
        problems.append(f'program.{name}[{o}] is {table.dtype} {table.shape}; want int {(t, p)}')
  if len(program.grid) != t or any(len(row) != p for row in program.grid):
    problems.append(f'program.grid is not {t} ticks x {p} stages')
  for buf in _BUFFERS:
    if program.slots.get(buf, 0) < 1:
      problems.append(
        f'program.slots[{buf!r}] is {program.slots.get(buf)}; '
        'want >= 1 (the executor allocates at least one)'
      )
    if len(program.peaks.get(buf, ())) != p:
      problems.append(f'program.peaks[{buf!r}] is not one count per stage')
  moves = any(a.kind in sched.COPY_KINDS for row in program.grid for cell in row for a in cell)
  if moves and program.partner != run.partner:
    problems.append(f"program.partner {program.partner} differs from the schedule's {run.partner}")
  return problems


def _check_slot_ranges(program: Program) -> list[str]:
  """Kinds are known codes and every slot index is -1 or within `slots`."""
  problems = []
  kind = program.table['kind']
  for t, s in zip(*(~np.isin(kind, list(_KIND_OF_CODE) + [lower_lib.IDLE])).nonzero()):
    problems.append(f'tick {t} stage {s}: kind {kind[t, s]} is not IDLE, RUN_F, RUN_B or RUN_W')
  columns = [(name, program.table[name], _BUFFER_OF[name]) for name in _BUFFER_OF]
  columns += [(f'lane2 {name}', program.lane2[name], _BUFFER_OF[name]) for name in ('src', 'stash')]
  columns += [(f'recv[{o}]', program.recv[o], 'msg') for o in sorted(program.recv)]
  columns += [(f'recv2[{o}]', program.recv2[o], 'msg') for o in sorted(program.recv2)]
  for name, values, buf in columns:
    count = program.slots[buf]
    for t, s in zip(*((values >= count) | (values < -1)).nonzero()):
      problems.append(
        f'tick {t} stage {s}: {name} names {buf} slot {values[t, s]}, outside 0..{count - 1}'
      )
  return problems


def _decode(
  schedule: Schedule, program: Program, t: int, s: int, problems: list[str] | None = None
) -> Action | None:
  """The compute action the tables say stage s runs at tick t, or None.

  With `problems`, also reports per-action entries that do not fit it: a
  chunk held elsewhere, a wrong local index, or a slot the kind never uses.
  """
  table = program.table
  code = int(table['kind'][t, s])
  where = f'tick {t} stage {s}'
  if code == lower_lib.IDLE:
    if problems is not None:
      for name in _PER_ACTION:
        if table[name][t, s] != -1:
          problems.append(f'{where}: idle, but {name} is {table[name][t, s]}')
    return None
  a = Action(_KIND_OF_CODE[code], int(table['mb'][t, s]), int(table['chunk'][t, s]))
  if problems is None:
    return a
  if not (0 <= a.microbatch < schedule.microbatches and 0 <= a.chunk < schedule.num_chunks):
    problems.append(f'{where}: the tables run {a}, outside the schedule')
    return a
  if schedule.stage_of(a.chunk) != s:
    problems.append(
      f'{where}: the tables run {a}, whose chunk lives on stage {schedule.stage_of(a.chunk)}'
    )
  if table['local'][t, s] != schedule.local_of(a.chunk):
    problems.append(
      f'{where}: {a} names local chunk {table["local"][t, s]}; '
      f'chunk {a.chunk} is local {schedule.local_of(a.chunk)}'
    )
  for name in ('src', 'loss', 'stash', 'cut'):
    if name not in _USES[a.kind] and table[name][t, s] != -1:
      problems.append(f'{where}: {a} does not use {name}, but it is {table[name][t, s]}')
  return a


def _decode2(
  schedule: Schedule, program: Program, t: int, s: int, problems: list[str] | None = None
) -> tuple[Action, ...]:
  """The B and W the second lane's tables say stage s runs beside its F at
  tick t (a fused tick), or () where they name none."""
  table, lane2 = program.table, program.lane2
  where = f'tick {t} stage {s}'
  if lane2['mb'][t, s] < 0:
    if problems is not None:
      for name in lower_lib.LANE2:
        if lane2[name][t, s] != -1:
          problems.append(f'{where}: no second lane, but its {name} is {lane2[name][t, s]}')
    return ()
  j, c = int(lane2['mb'][t, s]), int(lane2['chunk'][t, s])
  pair = (Action(sched.BACKWARD, j, c), Action(sched.WEIGHT, j, c))
  if problems is None:
    return pair
  if not (0 <= j < schedule.microbatches and 0 <= c < schedule.num_chunks):
    problems.append(f'{where}: the second lane runs {pair[0]}, outside the schedule')
  elif schedule.stage_of(c) != s or lane2['local'][t, s] != schedule.local_of(c):
    problems.append(
      f'{where}: the second lane runs {pair[0]} as local chunk {lane2["local"][t, s]}; '
      f'chunk {c} is local {schedule.local_of(c)} on stage {schedule.stage_of(c)}'
    )
  if table['kind'][t, s] != lower_lib.RUN_F:
    problems.append(f'{where}: the second lane runs {pair[0]} beside no forward')
  return pair


def _fused_cell(schedule: Schedule, compute: Sequence[Action]) -> bool:
  """An overlapped pair with its B's W: what one fused tick runs."""
  if [a.kind for a in compute] != [sched.FORWARD, sched.BACKWARD, sched.WEIGHT]:
    return False
  f, b, w = compute
  return (f, b) in schedule.overlaps and (w.microbatch, w.chunk) == (b.microbatch, b.chunk)


def _check_grid(schedule: Schedule, program: Program) -> list[str]:
  """At most one compute action per cell (or a fused pair with its W) and
  one copy action, each on its stage; the tables say what the grid says;
  every action runs once, and each stage's compute actions run in its order."""
  problems = []
  seen = collections.Counter()
  ran = [[] for _ in range(schedule.stages)]
  for t, row in enumerate(program.grid):
    for s, cell in enumerate(row):
      where = f'tick {t} stage {s}'
      unknown = [a for a in cell if a.kind not in sched.KINDS]
      if unknown:
        problems.append(f'{where}: lockstep cannot run {list(map(str, unknown))}')
        continue
      compute = [a for a in cell if a.kind in sched.COMPUTE_KINDS]
      copies = [a for a in cell if a.kind in sched.COPY_KINDS]
      if len(compute) > 1 and not _fused_cell(schedule, compute):
        problems.append(
          f'{where}: runs {len(compute)} compute actions '
          f'({", ".join(map(str, compute))}); a tick runs one, or an overlapped '
          'pair with its W'
        )
      if len(copies) > 1:
        problems.append(
          f'{where}: sends {len(copies)} residual sets '
          f'({", ".join(map(str, copies))}); a tick sends one'
        )
      decoded = _decode(schedule, program, t, s, problems)
      tables = ((decoded,) if decoded else ()) + _decode2(schedule, program, t, s, problems)
      if tables != tuple(compute) and (len(compute) < 2 or _fused_cell(schedule, compute)):
        problems.append(
          f'{where}: grid says {list(map(str, compute))} but '
          f'the tables say {list(map(str, tables))}'
        )
      sends = program.table['move_send'][t, s] >= 0
      if sends != bool(copies):
        problems.append(
          f'{where}: grid {"has no" if sends else "has"} '
          f'residual move but move_send is '
          f'{program.table["move_send"][t, s]}'
        )
      for a in cell:
        seen[a] += 1
        if schedule.stage_of_action(a) != s:
          problems.append(f'{where}: {a} belongs on stage {schedule.stage_of_action(a)}')
      ran[s] += compute
  wanted = collections.Counter(a for o in schedule.orders for a in o)
  for a in sorted(set(seen) | set(wanted), key=str):
    if seen[a] != wanted[a]:
      problems.append(f'{a} runs {seen[a]} times in the program, {wanted[a]} in the schedule')
  if problems:
    return problems
  for s, order in enumerate(schedule.orders):
    want = [a for a in order if a.kind in sched.COMPUTE_KINDS]
    if ran[s] != want:
      k = next(i for i, (x, y) in enumerate(zip(ran[s], want)) if x != y)
      problems.append(
        f'stage {s}: its compute action {k} is {ran[s][k]} in '
        f'the program but {want[k]} in its order'
      )
  return problems


def _check_lockstep_dependencies(schedule: Schedule, program: Program) -> list[str]:
  """Every input is produced in an earlier tick: compute outputs cross a
  send phase, which ends the tick. Copies move in the partner ppermute
  that opens a tick, before its compute: a LOAD at tick t is back for a B
  in tick t, an EVICT sends its F's residuals in a later tick than the F's,
  and a LOAD sends them back in a later tick than they arrived in. A fused
  tick's W runs after its own B, in the same tick."""
  tick = {a: t for t, row in enumerate(program.grid) for cell in row for a in cell}
  # A fused tick's W reads its own B's cut, made earlier in the tick.
  fused_w = {
    cell[-1]
    for row in program.grid
    for cell in row
    if _fused_cell(schedule, [a for a in cell if a.kind in sched.COMPUTE_KINDS])
  }
  problems = []
  for a, t in sorted(tick.items(), key=lambda x: (x[1], str(x[0]))):
    for d in sched.dependencies(a, schedule):
      # (In a packed program an input from another stage must also have been
      # sent; the replay finds the read of a slot nothing landed in.)
      td = tick.get(d)
      landed_first = (d.kind in sched.COPY_KINDS and a.kind in sched.COMPUTE_KINDS) or a in fused_w
      late = td is None or (td > t if landed_first else td >= t)
      if late:
        problems.append(
          f'tick {t} stage {schedule.stage_of_action(a)}: {a} '
          f'runs before its input from {d} '
          f'(tick {"never" if td is None else td})'
        )
  return problems


class _Buffers:
  """What each slot of one stage's msg, stash and cut buffers holds.

  Values are named by what they are: 'act j.c' (chunk c's input activation),
  'grad j.c' (chunk c's output gradient), 'set j.c' (residuals) and
  'cut j.c'.
  """

  def __init__(self):
    self.held = {buf: {} for buf in _BUFFERS}
    self.peak = {buf: 0 for buf in _BUFFERS}

  def write(self, buf: str, slot: int, value: str, where: str, problems: list[str]) -> None:
    if slot < 0:
      problems.append(f'{where}: no {buf} slot to write {value} to')
      return
    old = self.held[buf].get(slot)
    if old is not None:
      problems.append(f'{where}: {buf} slot {slot} still holds {old} (overwritten by {value})')
    self.held[buf][slot] = value
    self.peak[buf] = max(self.peak[buf], len(self.held[buf]))

  def read(
    self, buf: str, slot: int, want: str, where: str, problems: list[str], free: bool = True
  ) -> None:
    """Checks that `slot` holds `want`; frees it unless `free` is False."""
    if slot < 0:
      problems.append(f'{where}: no {buf} slot to read {want} from')
      return
    got = (self.held[buf].pop if free else self.held[buf].get)(slot, None)
    if got is None:
      problems.append(f'{where}: {buf} slot {slot} is empty (no producer for {want})')
    elif got != want:
      problems.append(f'{where}: {buf} slot {slot} holds {got}, not {want}')


def _replay_buffers(schedule: Schedule, program: Program) -> list[str]:
  """Replays every buffer write and read in the executor's phases."""
  run = program.schedule
  p = run.stages
  buffers = [_Buffers() for _ in range(p)]
  problems: list[str] = []
  for t in range(program.ticks):
    # The partner ppermute opens the tick: every set is sent, then each
    # arriving one lands, so a slot sent from may be landed into.
    for s, (slot, value) in enumerate(_replay_moves(program, t, buffers, problems)):
      if slot is not None:
        buffers[s].write('stash', slot, value, f'tick {t} stage {s}: landing {value}', problems)
    actions = [_decode(run, program, t, s) for s in range(p)]
    if program.packed:
      _replay_packed_tick(run, program, t, actions, buffers, problems)
      continue
    # A fused tick runs its B and W first, then its F (executor order).
    lane2 = [_decode2(run, program, t, s) for s in range(p)]
    for s, a in enumerate(actions):
      for b in lane2[s]:
        _replay_compute(run, program, t, s, b, buffers[s], problems, lane2=True)
      if a is not None:
        _replay_compute(run, program, t, s, a, buffers[s], problems)
    _replay_messages(run, t, actions, program.recv, buffers, problems)
    backwards = [x[0] if x else None for x in lane2]
    _replay_messages(run, t, backwards, program.recv2, buffers, problems, 'recv2')
  for s, buf in enumerate(buffers):
    for name, held in buf.held.items():
      for slot, value in sorted(held.items()):
        problems.append(
          f'stage {s}: {name} slot {slot} still holds {value} after the last tick (never consumed)'
        )
  if problems:
    return problems
  for name in _BUFFERS:
    peaks = tuple(b.peak[name] for b in buffers)
    if peaks != tuple(program.peaks[name]):
      problems.append(
        f'program.peaks[{name!r}] is {tuple(program.peaks[name])} '
        f'but the tables hold at most {peaks}'
      )
  cap = schedule.stash_cap
  peaks = tuple(b.peak['stash'] for b in buffers)
  if cap is not None and max(peaks, default=0) > cap:
    problems.append(
      f'stash pools need {max(peaks)} slots (per stage '
      f"{peaks}), more than the schedule's cap of {cap}"
    )
  if cap is not None and program.slots['stash'] > max(cap, 1):
    problems.append(
      f"program.slots['stash'] is {program.slots['stash']}, more than the schedule's cap of {cap}"
    )
  return problems


def _replay_compute(
  run: Schedule,
  program: Program,
  t: int,
  s: int,
  a: Action,
  buffers: _Buffers,
  problems: list[str],
  lane2: bool = False,
) -> None:
  """One F, B or W: the reads and writes of its branch in the executor.

  `lane2`: a fused tick's B or W, read from the second lane's tables; its
  B hands its cut straight to its W, through no slot.
  """
  if lane2:
    lane = program.lane2
    row = dict(src=int(lane['src'][t, s]), stash=int(lane['stash'][t, s]))
    where, mine = f'tick {t} stage {s}: {a} (second lane)', f'{a.microbatch}.{a.chunk}'
    free = a.kind == sched.WEIGHT
    buffers.read('stash', row['stash'], f'set {mine}', where, problems, free=free)
    if not free:
      buffers.read('msg', row['src'], f'grad {mine}', where, problems)
    return
  row = {name: int(program.table[name][t, s]) for name in ('src', 'loss', 'stash', 'cut')}
  j, c = a.microbatch, a.chunk
  where = f'tick {t} stage {s}: {a}'
  mine = f'{j}.{c}'
  if a.kind == sched.FORWARD:
    if c > 0:
      buffers.read('msg', row['src'], f'act {mine}', where, problems)
    elif row['src'] != -1:
      problems.append(f'{where}: chunk 0 embeds, but src is {row["src"]}')
    buffers.write('stash', row['stash'], f'set {mine}', where, problems)
    if c == run.num_chunks - 1:
      # Written after the input is read: the executor computes the loss
      # gradient from the chunk's output.
      buffers.write('msg', row['loss'], f'grad {mine}', where, problems)
    elif row['loss'] != -1:
      problems.append(f'{where}: not the last chunk, but loss is {row["loss"]}')
  elif a.kind == sched.BACKWARD:
    buffers.read('stash', row['stash'], f'set {mine}', where, problems, free=False)
    buffers.read('msg', row['src'], f'grad {mine}', where, problems)
    buffers.write('cut', row['cut'], f'cut {mine}', where, problems)
  else:
    buffers.read('stash', row['stash'], f'set {mine}', where, problems)
    buffers.read('cut', row['cut'], f'cut {mine}', where, problems)


def _replay_moves(
  program: Program, t: int, buffers: Sequence[_Buffers], problems: list[str]
) -> list[tuple[int | None, str | None]]:
  """The tick's residual ppermute over partner pairs, which opens it.

  Returns, per stage, the (slot, set) that lands in this tick, (None, None)
  where nothing does. Every sent slot is read (and freed) here; the caller
  writes the arriving sets after all sends.
  """
  p = len(buffers)
  send, recv = program.table['move_send'], program.table['move_recv']
  partner = program.partner
  landing: list[tuple[int | None, str | None]] = [(None, None)] * p
  arriving: dict[int, tuple[int, str]] = {}
  for s in range(p):
    slot = int(send[t, s])
    copies = [a for a in program.grid[t][s] if a.kind in sched.COPY_KINDS]
    if slot < 0 or not copies:
      continue  # a table/grid mismatch is _check_grid's to report
    a = copies[0]
    value = f'set {a.microbatch}.{a.chunk}'
    where = f'tick {t} stage {s}: {a}'
    buffers[s].read('stash', slot, value, where, problems)
    if partner is None:
      problems.append(f'{where}: sends a residual set, but the program has no partner pairing')
      continue
    arriving[partner[s]] = (s, value)
  for r in range(p):
    slot = int(recv[t, r])
    where = f'tick {t} stage {r}'
    if r not in arriving:
      if slot != -1:
        source = 'no partner' if partner is None else f'stage {partner[r]}'
        problems.append(
          f'{where}: lands a residual set in stash slot {slot}, '
          f'but {source} sends nothing (no producer)'
        )
      continue
    source, value = arriving[r]
    if slot == -1:
      problems.append(
        f'{where}: drops {value} from stage {source} (move_recv is -1: no consumer slot)'
      )
      continue
    landing[r] = (slot, value)
  return landing


def _replay_messages(
  run: Schedule,
  t: int,
  actions: Sequence[Action | None],
  recv: dict[int, np.ndarray],
  buffers: Sequence[_Buffers],
  problems: list[str],
  name: str = 'recv',
) -> None:
  """The receive phase: each F's activation and B's input gradient lands in
  the slot its receiver's `recv` table (program.`name`) names, for the
  offset it travels."""
  sent = {}  # (offset, receiver) -> (value, sender)
  for s, a in enumerate(actions):
    out = _output(run, s, a)
    if out is not None:
      o, to, value = out
      sent[(o, to)] = (value, s)
  _land(run, t, sent, recv, buffers, problems, name)


def _output(run: Schedule, s: int, a: Action | None) -> tuple[int, int, str] | None:
  """(offset, receiving stage, value) of the message `a` makes on stage s, if any."""
  if a is None:
    return None
  j, c = a.microbatch, a.chunk
  if a.kind == sched.FORWARD and c < run.num_chunks - 1:
    to, value = run.stage_of(c + 1), f'act {j}.{c + 1}'
  elif a.kind == sched.BACKWARD and c > 0:
    to, value = run.stage_of(c - 1), f'grad {j}.{c - 1}'
  else:
    return None
  return (to - s) % run.stages, to, value


def _land(
  run: Schedule,
  t: int,
  sent: dict,
  recv: dict[int, np.ndarray],
  buffers: Sequence[_Buffers],
  problems: list[str],
  name: str = 'recv',
) -> None:
  """The receive phase: each message in `sent` ((offset, receiver) ->
  (value, sender)) lands in the slot its receiver's `recv` table names."""
  p = run.stages
  for o in sorted(recv):
    for r in range(p):
      slot = int(recv[o][t, r])
      where = f'tick {t} stage {r}'
      if (o, r) not in sent:
        if slot != -1:
          problems.append(
            f'{where}: stores into msg slot {slot} from offset {o}, '
            f'but stage {(r - o) % p} sends nothing there (no producer)'
          )
        continue
      value, source = sent.pop((o, r))
      if slot == -1:
        problems.append(f'{where}: drops {value} from stage {source} (no consumer slot)')
        continue
      buffers[r].write(
        'msg', slot, value, f'{where}: receiving {value} from stage {source}', problems
      )
  for (o, r), (value, source) in sorted(sent.items()):
    problems.append(
      f'tick {t} stage {r}: drops {value} from stage {source} '
      f'(the program has no {name} table for offset {o})'
    )


def _replay_packed_tick(
  run: Schedule,
  program: Program,
  t: int,
  actions: Sequence[Action | None],
  buffers: Sequence[_Buffers],
  problems: list[str],
) -> None:
  """One tick of a packed program (rounds.py), in the executor's order: the
  compute; each output for another stage kept in its own stage's pool
  (`pend`), one for a chunk of the same stage landed; the send after a
  round's last tick reads what waits (`outbox`) and lands it."""
  for s, a in enumerate(actions):
    if a is not None:
      _replay_compute(run, program, t, s, a, buffers[s], problems)
  local = {}
  for s, a in enumerate(actions):
    out = _output(run, s, a)
    slot = int(program.table['pend'][t, s])
    where = f'tick {t} stage {s}'
    if out is None or out[0] == 0:
      if slot != -1:
        problems.append(f'{where}: pend is {slot}, but its output stays on its stage')
      if out is not None:
        local[(0, s)] = (out[2], s)
      continue
    buffers[s].write('msg', slot, out[2], f'{where}: {a} keeps {out[2]} to send', problems)
  _land(run, t, local, {o: r for o, r in program.recv.items() if o == 0}, buffers, problems)
  sent = _replay_sends(program, t, buffers, problems) if t in program.sends else {}
  _land(run, t, sent, {o: r for o, r in program.recv.items() if o}, buffers, problems)


def _replay_sends(
  program: Program, t: int, buffers: Sequence[_Buffers], problems: list[str]
) -> dict:
  """A packed program's send at tick t: each `outbox` slot read (and freed)
  on its stage. Returns (offset, receiver) -> (value, sender)."""
  p, sent = program.schedule.stages, {}
  for o, box in sorted(program.outbox.items()):
    for s in range(p):
      slot = int(box[t, s])
      if slot < 0:
        continue
      held = buffers[s].held['msg'].get(slot)
      where = f'tick {t} stage {s}: sending over offset {o}'
      if held is None:
        problems.append(f'{where}: msg slot {slot} is empty (nothing waits there)')
        continue
      buffers[s].read('msg', slot, held, where, problems)
      sent[(o, (s + o) % p)] = (held, s)
  return sent
