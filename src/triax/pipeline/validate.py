"""Checks that a schedule, and the lockstep program lowered from it, are sound.

A schedule is sound when every (micro-batch, chunk) is run forward and
backward exactly once on the stage that holds the chunk (and, if the
schedule splits the backward, its weight gradient W exactly once, after its
B), every EVICT has one LOAD, partners are consistent, and the per-stage
orders can all run to completion. A program is sound when the lockstep table
respects the dependencies and every buffer write and read the executor will
do finds the tensor it expects: the validator replays the table phase by
phase against per-stage slot contents, so a slot conflict, a dropped message
or a read of an empty slot shows up with its tick, stage and action. That
includes residuals moving between partners: the replay follows each set to
the partner and back, and holds the stash pool to the schedule's cap.

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
  problems = _check_partner(schedule)
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
        problems.append(f'{where}: moves residuals but the schedule has no '
                        'partner pairing')
      elif (a.kind in sched.COPY_KINDS and
            schedule.partner[schedule.stage_of(a.chunk)] ==
            schedule.stage_of(a.chunk)):
        problems.append(f'{where}: stage {schedule.stage_of(a.chunk)} is '
                        'its own partner; there is nowhere to evict to')
      elif schedule.stage_of_action(a) != s:
        problems.append(f'{where}: runs on stage '
                        f'{schedule.stage_of_action(a)} (chunk {a.chunk} '
                        f'lives on stage {schedule.stage_of(a.chunk)})')
  return problems


def _check_partner(schedule: Schedule) -> list[str]:
  """A partner pairing, if any, maps every stage to a stage and back."""
  partner, p = schedule.partner, schedule.stages
  if partner is None:
    return []
  if len(partner) != p or not all(
      isinstance(x, int) and 0 <= x < p for x in partner):
    return [f'partner {partner} is not one stage in 0..{p - 1} per stage']
  return [f'partner of stage {s} is {x}, whose partner is {partner[x]} '
          '(partners must pair up)'
          for s, x in enumerate(partner) if partner[x] != s]


def _check_counts(schedule: Schedule) -> list[str]:
  """Exactly one F and one B per (micro-batch, chunk); exactly one W each if
  the schedule splits the backward; at most one EVICT, and one LOAD per
  EVICT."""
  counts = collections.Counter(a for order in schedule.orders for a in order)
  once = (sched.FORWARD, sched.BACKWARD) + (
      (sched.WEIGHT,) if schedule.split_backward else ())
  problems = []
  for j in range(schedule.microbatches):
    for c in range(schedule.num_chunks):
      for kind in once:
        n = counts[Action(kind, j, c)]
        if n != 1:
          problems.append(f'stage {schedule.stage_of(c)}: {kind}{j}.{c} runs '
                          f'{n} times (want exactly 1)')
      evictions = counts[Action(sched.EVICT, j, c)]
      loads = counts[Action(sched.LOAD, j, c)]
      if evictions > 1:
        problems.append(f'stage {schedule.stage_of(c)}: EVICT{j}.{c} runs '
                        f'{evictions} times (want at most 1)')
      if loads != evictions:
        problems.append(f'{j}.{c} is evicted {evictions} times but loaded '
                        f'{loads} times')
  return problems


def _check_stage_order(schedule: Schedule) -> list[str]:
  """On one stage, B follows its F, W its B and EVICT its F."""
  problems = []
  for s, order in enumerate(schedule.orders):
    position = {a: i for i, a in enumerate(order)}
    for i, a in enumerate(order):
      before = {sched.BACKWARD: sched.FORWARD,
                sched.WEIGHT: sched.BACKWARD,
                sched.EVICT: sched.FORWARD}.get(a.kind)
      if before is None:
        continue
      k = position.get(Action(before, a.microbatch, a.chunk), -1)
      if k > i:
        problems.append(f'stage {s} position {i}: {a} runs before its '
                        f'{before}{a.microbatch}.{a.chunk} (position {k})')
  return problems


def _check_runs_to_completion(schedule: Schedule) -> list[str]:
  """The per-stage orders, run asynchronously, never deadlock.

  Compute actions run in order; copies (EVICT, LOAD) run in order on a copy
  stream, each once the compute actions before it in the order are done.
  """
  done: set[Action] = set()
  compute = [[a for a in o if a.kind not in sched.COPY_KINDS]
             for o in schedule.orders]
  copies = [[a for a in o if a.kind in sched.COPY_KINDS]
            for o in schedule.orders]
  issue = [sched.copy_issue_points(o) for o in schedule.orders]
  at = [0] * schedule.stages     # compute cursor
  at_copy = [0] * schedule.stages
  progress = True
  while progress:
    progress = False
    for s in range(schedule.stages):
      moved = True
      while moved:
        moved = False
        if at[s] < len(compute[s]) and _ready(compute[s][at[s]], schedule,
                                              done):
          done.add(compute[s][at[s]])
          at[s] += 1
          moved = True
        if (at_copy[s] < len(copies[s]) and at[s] >= issue[s][at_copy[s]]
            and _ready(copies[s][at_copy[s]], schedule, done)):
          done.add(copies[s][at_copy[s]])
          at_copy[s] += 1
          moved = True
        progress |= moved
  problems = []
  for s, order in enumerate(schedule.orders):
    for stream, cursor in ((compute[s], at[s]), (copies[s], at_copy[s])):
      if cursor < len(stream):
        a = stream[cursor]
        missing = [str(d) for d in sched.dependencies(a, schedule)
                   if d not in done]
        problems.append(f'deadlock: stage {s} position {order.index(a)}: {a} '
                        f'waits for {", ".join(missing) or "its stage"}')
  return problems


def _ready(a: Action, schedule: Schedule, done: set[Action]) -> bool:
  return all(d in done for d in sched.dependencies(a, schedule))


# ---------------------------------------------------------------- program


_SHAPES = {'fwd': 6, 'bwd': 5, 'recv': 2, 'wgt': 5, 'evict': 2, 'load': 2}


def _check_program(schedule: Schedule, program: Program) -> list[str]:
  p, t = schedule.stages, program.ticks
  problems = [f'program.{name} has shape {getattr(program, name).shape}; '
              f'want {(t, p, width)}' for name, width in _SHAPES.items()
              if getattr(program, name).shape != (t, p, width)]
  if len(program.grid) != t or any(len(row) != p for row in program.grid):
    problems.append(f'program.grid is not {t} ticks x {p} stages')
  if program.split_backward != schedule.split_backward:
    has = 'has' if schedule.split_backward else 'has no'
    problems.append(f'program.split_backward is {program.split_backward} but '
                    f'the schedule {has} W actions')
  moves = bool((program.evict >= 0).any() or (program.load >= 0).any())
  if moves and program.partner != schedule.partner:
    problems.append(f'program.partner {program.partner} differs from the '
                    f'schedule\'s {schedule.partner}')
  if problems:
    return problems
  problems += _check_grid(schedule, program)
  problems += _check_lockstep_dependencies(schedule, program)
  problems += _check_slot_counts(program)
  if not problems:
    problems += _replay_buffers(schedule, program)
  return problems


def _decode(program: Program, t: int, s: int) -> tuple[Action, ...]:
  """The compute actions the fwd/bwd/wgt tables say stage s runs at tick t."""
  actions = []
  for kind, table, valid, mb, chunk in (
      (sched.FORWARD, program.fwd, sched.F_VALID, sched.F_MB, sched.F_CHUNK),
      (sched.BACKWARD, program.bwd, sched.B_VALID, sched.B_MB, sched.B_CHUNK),
      (sched.WEIGHT, program.wgt, sched.W_VALID, sched.W_MB, sched.W_CHUNK)):
    row = table[t, s]
    if row[valid]:
      actions.append(Action(kind, int(row[mb]), int(row[chunk])))
  return tuple(actions)


def _check_grid(schedule: Schedule, program: Program) -> list[str]:
  """One action of each kind per cell at most, in phase order, tables
  agree, each action once."""
  problems = []
  seen = collections.Counter()
  for t, row in enumerate(program.grid):
    for s, cell in enumerate(row):
      where = f'tick {t} stage {s}'
      kinds = collections.Counter(a.kind for a in cell)
      for kind, n in kinds.items():
        if kind not in sched.KINDS:
          problems.append(f'{where}: lockstep cannot run {kind} actions')
        elif n > 1:
          problems.append(f'{where}: runs {n} {kind} actions '
                          f'({", ".join(map(str, cell))})')
      if any(kind not in sched.KINDS for kind in kinds):
        continue
      ranks = [sched.KINDS.index(a.kind) for a in cell]
      if ranks != sorted(ranks):
        problems.append(f'{where}: actions out of phase order in '
                        f'{list(map(str, cell))}')
      compute = tuple(sorted((a for a in cell
                              if a.kind in sched.COMPUTE_KINDS),
                             key=lambda a: sched.KINDS.index(a.kind)))
      decoded = _decode(program, t, s)
      if decoded != compute:
        problems.append(f'{where}: grid says {list(map(str, compute))} but '
                        f'the tables say {list(map(str, decoded))}')
      for kind, table in ((sched.EVICT, program.evict),
                          (sched.LOAD, program.load)):
        sends = table[t, s, sched.X_SEND] >= 0
        if sends != (kind in kinds):
          problems.append(f'{where}: grid {"has no" if sends else "has"} '
                          f'{kind} but the {kind.lower()} table '
                          f'{"sends" if sends else "sends nothing"}')
      for a in cell:
        seen[a] += 1
        if schedule.stage_of_action(a) != s:
          problems.append(f'{where}: {a} belongs on stage '
                          f'{schedule.stage_of_action(a)}')
  wanted = collections.Counter(a for o in schedule.orders for a in o)
  for a in sorted(set(seen) | set(wanted), key=str):
    if seen[a] != wanted[a]:
      problems.append(f'{a} runs {seen[a]} times in the program, '
                      f'{wanted[a]} in the schedule')
  return problems


def _check_lockstep_dependencies(schedule: Schedule,
                                 program: Program) -> list[str]:
  """Every input is produced in an earlier tick, or earlier in the same
  tick when it never leaves the stage (F -> B, B -> W, F -> EVICT of one
  micro-batch-chunk); everything else crosses a transfer phase, which ends
  the tick."""
  tick = {a: t for t, row in enumerate(program.grid)
          for cell in row for a in cell}
  problems = []
  for a, t in sorted(tick.items(), key=lambda x: x[1]):
    for d in sched.dependencies(a, schedule):
      td = tick.get(d)
      same_tick_ok = ((d.microbatch, d.chunk) == (a.microbatch, a.chunk) and
                      d.kind in sched.COMPUTE_KINDS and
                      sched.PHASE_OF_KIND[d.kind] < sched.PHASE_OF_KIND[a.kind])
      if td is None or td > t or (td == t and not same_tick_ok):
        problems.append(f'tick {t} stage {schedule.stage_of_action(a)}: {a} '
                        f'runs before its input from {d} '
                        f'(tick {"never" if td is None else td})')
  return problems


def _check_slot_counts(program: Program) -> list[str]:
  problems = []
  act, grad, stash = (program.num_act_slots, program.num_grad_slots,
                      program.num_stash_slots)
  columns = (('act', program.fwd[..., sched.F_ACT], act),
             ('stash', program.fwd[..., sched.F_STASH], stash),
             ('grad', program.fwd[..., sched.F_GRAD], grad),
             ('stash', program.bwd[..., sched.B_STASH], stash),
             ('grad', program.bwd[..., sched.B_GRAD], grad),
             ('stash', program.wgt[..., sched.W_STASH], stash),
             ('grad', program.wgt[..., sched.W_GRAD], grad),
             ('act', program.recv[..., sched.R_ACT], act),
             ('grad', program.recv[..., sched.R_GRAD], grad),
             ('stash', program.evict[..., sched.X_SEND], stash),
             ('stash', program.evict[..., sched.X_RECV], stash),
             ('stash', program.load[..., sched.X_SEND], stash),
             ('stash', program.load[..., sched.X_RECV], stash))
  for buf, count in (('act', act), ('grad', grad), ('stash', stash)):
    if count < 1:
      problems.append(f'num_{buf}_slots is {count}; want >= 1')
  for buf, values, count in columns:
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
    self.peak_stash = 0

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
    self.peak_stash = max(self.peak_stash, len(self.held['stash']))

  def read(self, buf: str, slot: int, want: Action, where: str,
           problems: list[str], free: bool = True) -> Action | None:
    """Checks that `slot` holds `want`; frees it unless `free` is False."""
    if slot < 0:
      problems.append(f'{where}: no {buf} slot to read {want} from')
      return None
    got = (self.held[buf].pop if free else self.held[buf].get)(slot, None)
    if got is None:
      problems.append(f'{where}: {buf} slot {slot} is empty (no producer '
                      f'for {want})')
    elif got != want:
      problems.append(f'{where}: {buf} slot {slot} holds {got}, not {want} '
                      '(slot conflict)')
    return got


def _replay_buffers(schedule: Schedule, program: Program) -> list[str]:
  """Replays every buffer write and read in executor order."""
  p, last = schedule.stages, schedule.num_chunks - 1
  buffers = [_Buffers() for _ in range(p)]
  problems: list[str] = []
  split = program.split_backward
  for t in range(program.ticks):
    for s in range(p):
      f = program.fwd[t, s]
      if f[sched.F_VALID]:
        _replay_forward(f, buffers[s], last, f'tick {t} stage {s}', problems)
    # Phase 1 B reads its slots; without W it frees them. Phase 2 W frees.
    for kind, table, cols, frees in (
        (sched.BACKWARD, program.bwd,
         (sched.B_VALID, sched.B_MB, sched.B_CHUNK, sched.B_STASH,
          sched.B_GRAD), not split),
        (sched.WEIGHT, program.wgt,
         (sched.W_VALID, sched.W_MB, sched.W_CHUNK, sched.W_STASH,
          sched.W_GRAD), True)):
      valid, mb, chunk, stash, grad = cols
      for s in range(p):
        row = table[t, s]
        if row[valid]:
          a = Action(kind, int(row[mb]), int(row[chunk]))
          where = f'tick {t} stage {s}: {a}'
          key = Action('', a.microbatch, a.chunk)
          buffers[s].read('stash', int(row[stash]), key, where, problems,
                          free=frees)
          buffers[s].read('grad', int(row[grad]), key, where, problems,
                          free=frees)
    _replay_copies(schedule, program, t, buffers, problems)
    for s in range(p):
      _replay_receive(program, t, s, buffers[s], last, problems)
  for s, buf in enumerate(buffers):
    for name, held in buf.held.items():
      for slot, value in sorted(held.items()):
        problems.append(f'stage {s}: {name} slot {slot} still holds {value} '
                        'after the last tick (sent but never consumed)')
  peaks = tuple(b.peak_stash for b in buffers)
  if not problems and peaks != tuple(program.peak_stash):
    problems.append(f'program.peak_stash is {tuple(program.peak_stash)} but '
                    f'the tables hold at most {peaks}')
  cap = schedule.stash_cap
  if cap is not None and max(peaks, default=0) > cap:
    problems.append(f'stash pools need {max(peaks)} slots (per stage '
                    f'{peaks}), more than the schedule\'s cap of {cap}')
  if cap is not None and program.num_stash_slots > max(cap, 1):
    problems.append(f'num_stash_slots is {program.num_stash_slots}, more '
                    f'than the schedule\'s cap of {cap}')
  return problems


def _replay_copies(schedule: Schedule, program: Program, t: int,
                   buffers: list[_Buffers], problems: list[str]) -> None:
  """The transfer phase's evict and load ppermutes: every send slot is read
  (and freed) before any receive slot is written."""
  p = schedule.stages
  sent = {}  # (kind, sender) -> the set sent
  for kind, table in ((sched.EVICT, program.evict),
                      (sched.LOAD, program.load)):
    for s in range(p):
      slot = int(table[t, s, sched.X_SEND])
      if slot < 0:
        continue
      actions = [a for a in program.grid[t][s] if a.kind == kind]
      where = f'tick {t} stage {s}: {kind} send'
      if not actions:
        continue  # _check_grid reported the table/grid mismatch
      key = Action('', actions[0].microbatch, actions[0].chunk)
      buffers[s].read('stash', slot, key, f'{where} of {key}', problems)
      sent[(kind, s)] = key
  for kind, table in ((sched.EVICT, program.evict),
                      (sched.LOAD, program.load)):
    for s in range(p):
      slot = int(table[t, s, sched.X_RECV])
      source = program.partner[s] if program.partner is not None else None
      arriving = sent.get((kind, source)) if source is not None else None
      where = f'tick {t} stage {s}'
      if source is None and slot != -1:
        problems.append(f'{where}: stores a {kind} into stash slot {slot} '
                        'but the program has no partner pairing')
        continue
      _store(buffers[s], 'stash', slot, arriving, f'{where}: {kind}', source,
             problems)


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
  """Transfer phase: what stage s must store from its neighbours at tick t."""
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
