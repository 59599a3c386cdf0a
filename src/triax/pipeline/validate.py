"""Checks that a schedule, and the lockstep program lowered from it, are sound.

A schedule is sound when every (micro-batch, chunk) is run forward and
backward exactly once on the stage that holds the chunk and the per-stage
orders can all run to completion. A program is sound when the lockstep table
respects the dependencies and every buffer write and read the executor will
do finds the tensor it expects: the validator replays the table phase by
phase against per-stage slot contents, so a slot conflict, a dropped message
or a read of an empty slot shows up with its tick, stage and action.

Plain Python and numpy, like the IR.
"""

from __future__ import annotations

import collections

from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Action, Program, Schedule


def validate(schedule: Schedule, program: Program | None = None) -> list[str]:
  """Returns every problem found; an empty list means valid.

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
    raise ValueError(f'{schedule.name}: {len(problems)} problem(s):\n  ' +
                     '\n  '.join(problems))


# ---------------------------------------------------------------- schedule


def _check_layout(schedule: Schedule) -> list[str]:
  """Sizes, kinds, ranges and placement of every action."""
  p, m, n = schedule.stages, schedule.microbatches, schedule.num_chunks
  if min(p, m, schedule.virtual_stages) < 1:
    return [f'sizes must be >= 1: stages={p} microbatches={m} '
            f'virtual_stages={schedule.virtual_stages}']
  if len(schedule.orders) != p:
    return [f'{len(schedule.orders)} orders for {p} stages']
  problems = []
  for s, order in enumerate(schedule.orders):
    for i, a in enumerate(order):
      where = f'stage {s} position {i}: {a}'
      if a.kind not in sched.KINDS:
        problems.append(f'{where}: unknown kind {a.kind!r}')
      elif not 0 <= a.microbatch < m:
        problems.append(f'{where}: micro-batch outside 0..{m - 1}')
      elif not 0 <= a.chunk < n:
        problems.append(f'{where}: chunk outside 0..{n - 1}')
      elif schedule.stage_of(a.chunk) != s:
        problems.append(f'{where}: chunk {a.chunk} lives on stage '
                        f'{schedule.stage_of(a.chunk)}')
  return problems


def _check_counts(schedule: Schedule) -> list[str]:
  """Exactly one F and one B per (micro-batch, chunk); at most one W."""
  counts = collections.Counter(a for order in schedule.orders for a in order)
  problems = []
  for j in range(schedule.microbatches):
    for c in range(schedule.num_chunks):
      for kind in (sched.FORWARD, sched.BACKWARD):
        n = counts[Action(kind, j, c)]
        if n != 1:
          problems.append(f'stage {schedule.stage_of(c)}: {kind}{j}.{c} runs '
                          f'{n} times (want exactly 1)')
      n = counts[Action(sched.WEIGHT, j, c)]
      if n > 1:
        problems.append(f'stage {schedule.stage_of(c)}: W{j}.{c} runs {n} '
                        'times (want at most 1)')
  return problems


def _check_stage_order(schedule: Schedule) -> list[str]:
  """On one stage, B follows its F and W follows its B."""
  problems = []
  for s, order in enumerate(schedule.orders):
    position = {a: i for i, a in enumerate(order)}
    for i, a in enumerate(order):
      before = {sched.BACKWARD: sched.FORWARD,
                sched.WEIGHT: sched.BACKWARD}.get(a.kind)
      if before is None:
        continue
      k = position.get(Action(before, a.microbatch, a.chunk), -1)
      if k > i:
        problems.append(f'stage {s} position {i}: {a} runs before its '
                        f'{before}{a.microbatch}.{a.chunk} (position {k})')
  return problems


def _check_runs_to_completion(schedule: Schedule) -> list[str]:
  """The per-stage orders, run asynchronously, never deadlock."""
  done: set[Action] = set()
  cursor = [0] * schedule.stages
  progress = True
  while progress:
    progress = False
    for s, order in enumerate(schedule.orders):
      while cursor[s] < len(order):
        a = order[cursor[s]]
        if not all(d in done for d in _dependencies(a, schedule)):
          break
        done.add(a)
        cursor[s] += 1
        progress = True
  problems = []
  for s, order in enumerate(schedule.orders):
    if cursor[s] < len(order):
      a = order[cursor[s]]
      missing = [str(d) for d in _dependencies(a, schedule) if d not in done]
      problems.append(f'deadlock: stage {s} position {cursor[s]}: {a} waits '
                      f'for {", ".join(missing)}')
  return problems


def _dependencies(a: Action, schedule: Schedule) -> tuple[Action, ...]:
  # EVICT/LOAD (BPipe) do not have data dependencies of their own yet.
  if a.kind in (sched.EVICT, sched.LOAD):
    return ()
  return sched.dependencies(a, schedule)


# ---------------------------------------------------------------- program


def _check_program(schedule: Schedule, program: Program) -> list[str]:
  p, t = schedule.stages, program.ticks
  shapes = {'fwd': (t, p, 6), 'bwd': (t, p, 5), 'recv': (t, p, 2)}
  problems = [f'program.{name} has shape {getattr(program, name).shape}; '
              f'want {shape}' for name, shape in shapes.items()
              if getattr(program, name).shape != shape]
  if len(program.grid) != t or any(len(row) != p for row in program.grid):
    problems.append(f'program.grid is not {t} ticks x {p} stages')
  if problems:
    return problems
  problems += _check_grid(schedule, program)
  problems += _check_lockstep_dependencies(schedule, program)
  problems += _check_slot_counts(program)
  if not problems:
    problems += _replay_buffers(schedule, program)
  return problems


def _decode(program: Program, t: int, s: int) -> tuple[Action, ...]:
  """The actions the fwd/bwd tables say stage s runs at tick t."""
  actions = []
  f, b = program.fwd[t, s], program.bwd[t, s]
  if f[sched.F_VALID]:
    actions.append(Action(sched.FORWARD, int(f[sched.F_MB]),
                          int(f[sched.F_CHUNK])))
  if b[sched.B_VALID]:
    actions.append(Action(sched.BACKWARD, int(b[sched.B_MB]),
                          int(b[sched.B_CHUNK])))
  return tuple(actions)


def _check_grid(schedule: Schedule, program: Program) -> list[str]:
  """One F and one B per cell at most, tables agree, each action once."""
  problems = []
  seen = collections.Counter()
  for t, row in enumerate(program.grid):
    for s, cell in enumerate(row):
      where = f'tick {t} stage {s}'
      kinds = collections.Counter(a.kind for a in cell)
      for kind, n in kinds.items():
        if kind not in (sched.FORWARD, sched.BACKWARD):
          problems.append(f'{where}: lockstep cannot run {kind} actions')
        elif n > 1:
          problems.append(f'{where}: runs {n} {kind} actions '
                          f'({", ".join(map(str, cell))})')
      if (tuple(sorted(cell, key=lambda a: a.kind != sched.FORWARD)) !=
          tuple(cell)):
        problems.append(f'{where}: B listed before F in {cell}')
      decoded = _decode(program, t, s)
      if decoded != tuple(cell):
        problems.append(f'{where}: grid says {list(map(str, cell))} but the '
                        f'tables say {list(map(str, decoded))}')
      for a in cell:
        seen[a] += 1
        if schedule.stage_of(a.chunk) != s:
          problems.append(f'{where}: {a} belongs on stage '
                          f'{schedule.stage_of(a.chunk)}')
  wanted = collections.Counter(a for o in schedule.orders for a in o)
  for a in sorted(set(seen) | set(wanted), key=str):
    if seen[a] != wanted[a]:
      problems.append(f'{a} runs {seen[a]} times in the program, '
                      f'{wanted[a]} in the schedule')
  return problems


def _check_lockstep_dependencies(schedule: Schedule,
                                 program: Program) -> list[str]:
  """F(j,c-1) in an earlier tick, F(j,c) no later, B(j,c+1) earlier."""
  tick = {a: t for t, row in enumerate(program.grid)
          for cell in row for a in cell}
  problems = []
  for a, t in sorted(tick.items(), key=lambda x: x[1]):
    for d in _dependencies(a, schedule):
      td = tick.get(d)
      # Within a tick F (phase 0) precedes B (phase 1) on one stage; every
      # other dependency crosses a receive, which ends the tick.
      same_tick_ok = (d.kind == sched.FORWARD and a.kind == sched.BACKWARD)
      if td is None or td > t or (td == t and not same_tick_ok):
        problems.append(f'tick {t} stage {schedule.stage_of(a.chunk)}: {a} '
                        f'runs before its input from {d} '
                        f'(tick {"never" if td is None else td})')
  return problems


def _check_slot_counts(program: Program) -> list[str]:
  problems = []
  columns = (('act', program.fwd[..., sched.F_ACT], program.num_act_slots),
             ('stash', program.fwd[..., sched.F_STASH],
              program.num_stash_slots),
             ('grad', program.fwd[..., sched.F_GRAD], program.num_grad_slots),
             ('stash', program.bwd[..., sched.B_STASH],
              program.num_stash_slots),
             ('grad', program.bwd[..., sched.B_GRAD], program.num_grad_slots),
             ('act', program.recv[..., sched.R_ACT], program.num_act_slots),
             ('grad', program.recv[..., sched.R_GRAD], program.num_grad_slots))
  for buf, values, count in columns:
    if count < 1:
      problems.append(f'num_{buf}_slots is {count}; want >= 1')
    for t, s in zip(*((values >= count) | (values < -1)).nonzero()):
      problems.append(f'tick {t} stage {s}: {buf} slot {values[t, s]} '
                      f'outside 0..{count - 1}')
  return problems


class _Buffers:
  """What each slot of one stage's act, grad and stash buffers holds.

  Entries are tagged Action('', micro-batch, chunk), printed as 'j.c': a
  buffer entry belongs to a (micro-batch, chunk), not to an action kind.
  """

  def __init__(self):
    self.held = {'act': {}, 'grad': {}, 'stash': {}}

  def write(self, buf: str, slot: int, value: Action, where: str,
            problems: list[str]) -> None:
    if slot < 0:
      problems.append(f'{where}: no {buf} slot to write {value} to')
      return
    old = self.held[buf].get(slot)
    if old is not None:
      problems.append(f'{where}: {buf} slot {slot} still holds {old} '
                      '(slot conflict)')
    self.held[buf][slot] = value

  def read(self, buf: str, slot: int, want: Action, where: str,
           problems: list[str]) -> None:
    if slot < 0:
      problems.append(f'{where}: no {buf} slot to read {want} from')
      return
    got = self.held[buf].pop(slot, None)
    if got is None:
      problems.append(f'{where}: {buf} slot {slot} is empty (no producer '
                      f'for {want})')
    elif got != want:
      problems.append(f'{where}: {buf} slot {slot} holds {got}, not {want} '
                      '(slot conflict)')


def _replay_buffers(schedule: Schedule, program: Program) -> list[str]:
  """Replays every buffer write and read in executor order."""
  p, last = schedule.stages, schedule.num_chunks - 1
  buffers = [_Buffers() for _ in range(p)]
  problems: list[str] = []
  for t in range(program.ticks):
    for s in range(p):
      f = program.fwd[t, s]
      if f[sched.F_VALID]:
        _replay_forward(f, buffers[s], last, f'tick {t} stage {s}', problems)
    for s in range(p):
      b = program.bwd[t, s]
      if b[sched.B_VALID]:
        a = Action(sched.BACKWARD, int(b[sched.B_MB]), int(b[sched.B_CHUNK]))
        where = f'tick {t} stage {s}: {a}'
        key = Action('', a.microbatch, a.chunk)
        buffers[s].read('stash', int(b[sched.B_STASH]), key, where, problems)
        buffers[s].read('grad', int(b[sched.B_GRAD]), key, where, problems)
    for s in range(p):
      _replay_receive(program, t, s, buffers[s], last, problems)
  for s, buf in enumerate(buffers):
    for name, held in buf.held.items():
      for slot, value in sorted(held.items()):
        problems.append(f'stage {s}: {name} slot {slot} still holds {value} '
                        'after the last tick (sent but never consumed)')
  return problems


def _replay_forward(f, buffers: _Buffers, last: int, where: str,
                    problems: list[str]) -> None:
  j, c = int(f[sched.F_MB]), int(f[sched.F_CHUNK])
  where = f'{where}: F{j}.{c}'
  key = Action('', j, c)
  if c > 0:
    buffers.read('act', int(f[sched.F_ACT]), key, where, problems)
  elif f[sched.F_ACT] != -1:
    problems.append(f'{where}: chunk 0 reads act slot {f[sched.F_ACT]}')
  buffers.write('stash', int(f[sched.F_STASH]), key, where, problems)
  if c == last:
    buffers.write('grad', int(f[sched.F_GRAD]), key, where, problems)
  elif f[sched.F_GRAD] != -1:
    problems.append(f'{where}: not the last chunk but writes loss-gradient '
                    f'slot {f[sched.F_GRAD]}')


def _replay_receive(program: Program, t: int, s: int, buffers: _Buffers,
                    last: int, problems: list[str]) -> None:
  """Phase 2: what stage s must store from its neighbours at tick t."""
  p = program.fwd.shape[1]
  f = program.fwd[t, (s - 1) % p]
  arriving = None
  if f[sched.F_VALID] and f[sched.F_CHUNK] != last:
    arriving = Action('', int(f[sched.F_MB]), int(f[sched.F_CHUNK]) + 1)
  _store(buffers, 'act', int(program.recv[t, s, sched.R_ACT]), arriving,
         f'tick {t} stage {s}', (s - 1) % p, problems)
  b = program.bwd[t, (s + 1) % p]
  arriving = None
  if b[sched.B_VALID] and b[sched.B_CHUNK] > 0:
    arriving = Action('', int(b[sched.B_MB]), int(b[sched.B_CHUNK]) - 1)
  _store(buffers, 'grad', int(program.recv[t, s, sched.R_GRAD]), arriving,
         f'tick {t} stage {s}', (s + 1) % p, problems)


def _store(buffers: _Buffers, buf: str, slot: int, arriving: Action | None,
           where: str, source: int, problems: list[str]) -> None:
  if arriving is None:
    if slot != -1:
      problems.append(f'{where}: stores into {buf} slot {slot} but stage '
                      f'{source} sends nothing (no producer)')
    return
  if slot == -1:
    problems.append(f'{where}: drops {buf} {arriving} from stage {source} '
                    '(no consumer slot)')
    return
  buffers.write(buf, slot, arriving,
                f'{where}: receiving {buf} {arriving} from stage {source}',
                problems)
