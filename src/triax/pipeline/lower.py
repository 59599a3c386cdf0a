"""Lowers a schedule to the lockstep program the executor runs: `lower` -> `Program`.

In one tick each stage runs at most one compute action of its order, in the order's
sequence, in four phases: land (BPipe: a residual set that arrived last tick is written
into its stash slot), compute (one F, B or W; a fused backward is run split, B then W:
`ir.with_split_backward`), send (the output goes to the stage holding the neighbouring
chunk: one ppermute per stage offset the placement uses, plus BPipe's partner ppermute)
and receive (arrivals are written into their assigned slots). With `fuse_overlaps` an
overlapped pair runs in one tick with its B's W; with unequal `units` (full
recomputation) ticks are packed into rounds (rounds.py).

Invariants: an action runs in the first tick after everything it needs has arrived, so
the lockstep program is the asynchronous schedule with unit costs (its ticks, peak
in-flight micro-batches and bubble are the papers'); every value that waits (activation,
gradient, loss gradient, residual set, cut) gets a buffer slot by interval colouring, so
buffers are as small as the schedule allows; activations and gradients share one message
pool. A deadlocking order raises a ConfigError that shows the grid.
Plain Python and numpy: no devices needed. Design: docs/design/executor.md."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from triax.errors import ConfigError
from triax.pipeline import grid as grid_lib
from triax.pipeline import rounds as rounds_lib
from triax.pipeline.ir import (
  BACKWARD,
  COMPUTE_KINDS,
  COPY_KINDS,
  EVICT,
  FORWARD,
  KINDS,
  LOAD,
  WEIGHT,
  Action,
  Schedule,
  ScheduleDeadlock,
  dependencies,
  with_split_backward,
)

# Values of the `kind` table.
IDLE, RUN_F, RUN_B, RUN_W = range(4)
KIND_CODE = {FORWARD: RUN_F, BACKWARD: RUN_B, WEIGHT: RUN_W}

# Event times inside a tick; a buffer event at tick t happens at
# _PHASES * t + phase. A slot read at x is free for a write at any y > x.
# A tick opens with the partner ppermute (residual sets sent, then landed),
# computes, and ends with the neighbour ppermutes (messages received).
_SEND, _LAND, _COMPUTE, _RECV = range(4)
_PHASES = 4

# The per-tick tables every program has, [ticks, stages] int32 each; -1 = none.
TABLES = (
  'kind',
  'mb',
  'chunk',
  'local',
  'src',
  'loss',
  'stash',
  'cut',
  'move_send',
  'move_recv',
  'pend',
)
# The second lane of a fused tick (`lower`'s fuse_overlaps): the B that runs
# beside the tick's F, its W at once after it. Its tables (Program.lane2)
# mean what the first lane's of the same names do.
LANE2 = ('mb', 'chunk', 'local', 'src', 'stash')


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """A schedule lowered to lockstep ticks, with buffer slots assigned (`eq=False`: arrays).

  Attributes:
    schedule: the schedule as run: the built one with every fused B split
      into B then W (see `ir.with_split_backward`).
    source: the schedule as built.
    ticks: T, the number of lockstep ticks.
    grid: [tick][stage] -> the actions the stage runs (at most one compute
      action, or a fused tick's F, B and W; then the copies it sends at the
      tick's start).
    table: name -> int32 [T, p]: `kind` (IDLE, RUN_F, RUN_B, RUN_W), `mb`,
      `chunk` (global), `local` (its index on the stage), `src` (message
      slot read; -1 for chunk 0's F, which embeds), `loss` (slot the last
      chunk's F writes its loss gradient to), `stash` (F writes, B and W
      read, W frees), `cut` (B writes, W reads), `move_send` / `move_recv`
      (BPipe's stash slots sent and landed at the tick's start).
    lane2: name -> int32 [T, p]: a fused tick's B, in the `LANE2` tables
      (all -1 without fused ticks).
    recv: stage offset o -> int32 [T, p]: message slot where the output
      sent by stage (s - o) mod p this tick lands on stage s; -1 none
      (offset 0: a stage's own output, no collective).
    slots: buffer -> entries the executor allocates (max over stages, >= 1):
      'msg' (activations and gradients), 'stash', 'cut'.
    peaks: buffer -> per stage, the most slots in use at once.
    partner: the partner pairing for residual moves, or None.
    recv2: like `recv`, for the input gradient a fused tick's B sends
      (empty without fused ticks).
    rounds: a packed program's rounds (rounds.py), the first tick of each;
      () for the papers' lowering (every tick a round that sends at its end).
    sends: a packed program's ticks that end with a send phase.
    outbox: a packed program's stage offset o -> int32 [T, p]: the message
      slot (written at the tick in the `pend` table) whose output stage s
      sends over offset o at tick t; -1 none.
    units: what the packing took each action to cost (None: not packed).
    packing: while the lowering compares packings, the one a program's
      grid came from (None in every program it returns).
  """

  schedule: Schedule
  source: Schedule
  ticks: int
  grid: tuple[tuple[tuple[Action, ...], ...], ...]
  table: dict[str, np.ndarray]
  recv: dict[int, np.ndarray]
  slots: dict[str, int]
  peaks: dict[str, tuple[int, ...]]
  partner: tuple[int, ...] | None
  lane2: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  recv2: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
  rounds: tuple[int, ...] = ()
  sends: frozenset[int] = frozenset()
  outbox: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
  units: rounds_lib.TickUnits | None = None
  packing: rounds_lib.Packing | None = None

  @property
  def packed(self) -> bool:
    """True iff ticks are grouped into rounds (rounds.py)."""
    return bool(self.rounds)

  @property
  def fused_cells(self) -> int:
    """(tick, stage) cells that run an overlapped pair with its W."""
    return int((self.lane2['mb'] >= 0).sum()) if self.lane2 else 0

  @property
  def fused(self) -> bool:
    """True iff some tick runs an overlapped pair (F with a B and its W)."""
    return self.fused_cells > 0

  @property
  def num_stash_slots(self) -> int:
    return self.slots['stash']

  @property
  def peak_stash(self) -> tuple[int, ...]:
    return self.peaks['stash']

  @property
  def offsets(self) -> tuple[int, ...]:
    return tuple(sorted(self.recv))

  @property
  def split_backward(self) -> bool:
    """True iff the built schedule itself splits its backward (zero-bubble)."""
    return self.source.split_backward


def lower(
  schedule: Schedule, fuse_overlaps: bool = False, units: rounds_lib.TickUnits | None = None
) -> Program:
  """Lowers a schedule to lockstep ticks and assigns buffer slots.

  The schedule must be valid (see validate.py): one F and one B per
  (micro-batch, chunk), at most one W and one EVICT/LOAD pair.

  With `fuse_overlaps`, each overlapped pair the schedule marks
  (`Schedule.overlaps`, DualPipeV's `(F;B)`) whose B has its W right after
  it runs in one tick: the B, its W, then the F (`fused_units`). The tick
  then costs the three, and a stage beside it that runs one action waits
  for it; what it buys is one computation holding two micro-batches'
  work, in which an expert-parallel all-to-all of one can run under the
  other's compute.

  With `units` that are not all equal (`rounds.units_for`: a model that
  recomputes its forward in B), ticks are packed into rounds (rounds.py),
  unless pairs fuse or residual sets move (BPipe), which run one action a
  tick as before.

  Raises:
    ScheduleDeadlock: if no stage can run its next action while actions
      remain (an order that waits on itself).
    ValueError: for copies the table cannot hold (an F and its B less than
      two ticks apart, an eviction to a stage's own self, more than one
      copy a tick from one stage).
  """
  run = with_split_backward(schedule)
  if units is not None and not units.uniform and not fuse_overlaps and not run.evicted:
    return _lower_packed(run, schedule, units)
  at = compute_ticks(run, fuse_overlaps)
  at.update(_copy_ticks(run, at))
  ticks = max(at.values(), default=-1) + 1
  grid = [[[] for _ in range(run.stages)] for _ in range(ticks)]
  for a, t in at.items():
    grid[t][run.stage_of_action(a)].append(a)
  grid = tuple(
    tuple(tuple(sorted(cell, key=lambda a: KINDS.index(a.kind))) for cell in row) for row in grid
  )
  fused = _fused(run, at) if fuse_overlaps else {}
  lands = {a: _time(t, _RECV) for a, t in at.items()}
  slots, counts = _assign_slots(run, at, fused, lands, {})
  return _tabulate(run, schedule, grid, at, slots, counts, fused, at, {})


def _lower_packed(run: Schedule, source: Schedule, units: rounds_lib.TickUnits) -> Program:
  """The packed program (rounds.py) that the lockstep time model times
  fastest at the design costs, of each rule's (timed from their grids; only
  the one kept gets its slots and tables)."""
  from triax.pipeline import simulate  # simulate imports this module

  design = simulate.Costs.design_point(source.split_backward, units)
  design = dataclasses.replace(design, t_transfer=rounds_lib.MESSAGE_UNITS)
  best = None
  for rule in rounds_lib.RULES:
    untabled = _packed_grid(run, source, rounds_lib.pack(run, units, rule), units)
    took = simulate.simulate_lockstep(untabled, design).total_time
    if best is None or took < best[0]:
      best = (took, untabled)
  return _tabulate_packing(best[1])


def _packed_grid(
  run: Schedule, source: Schedule, packing: rounds_lib.Packing, units: rounds_lib.TickUnits
) -> Program:
  """A packed program's grid and rounds, without slots and tables yet: all
  the time model reads of it (`_tabulate_packing` adds the rest)."""
  grid = [[[] for _ in range(run.stages)] for _ in range(packing.ticks)]
  for a, t in packing.at.items():
    grid[t][run.stage_of(a.chunk)].append(a)
  return Program(
    schedule=run,
    source=source,
    ticks=packing.ticks,
    grid=tuple(tuple(tuple(cell) for cell in row) for row in grid),
    table={},
    recv={},
    slots={},
    peaks={'stash': (0,) * run.stages},
    partner=None,
    rounds=packing.rounds,
    sends=packing.sends,
    units=units,
    packing=packing,
  )


def _tabulate_packing(untabled: Program) -> Program:
  run, packing = untabled.schedule, untabled.packing
  at = packing.at
  land = rounds_lib.land_ticks(packing, run)
  sent = {a: t for a, t in land.items() if rounds_lib.cross_offset(run, a) is not None}
  # In a tick: compute; an output for another stage kept in a slot of its
  # sender's pool (_KEPT), one for a chunk of its own stage landed (_LOCAL);
  # a send after the round reads what waits (_READ); arrivals land (_RECV).
  pending = {a: _time(t, _RECV) + _READ for a, t in sent.items()}
  lands = {a: _time(t, _RECV) + (0 if a in sent else _LOCAL) for a, t in land.items()}
  slots, counts = _assign_slots(run, at, {}, lands, pending)
  program = _tabulate(run, untabled.source, untabled.grid, at, slots, counts, {}, land, sent)
  return dataclasses.replace(
    program,
    rounds=packing.rounds,
    sends=packing.sends,
    units=untabled.units,
  )


def fused_units(order: Sequence[Action], schedule: Schedule) -> list[tuple[Action, ...]]:
  """A stage's compute actions cut into what each tick runs when pairs fuse:
  (F, B, W) for an overlapped pair whose B's W follows it at once, else one
  action. A pair whose W comes later runs in consecutive ticks."""
  pairs = dict(schedule.overlaps)
  acts = [a for a in order if a.kind in COMPUTE_KINDS]
  units, i = [], 0
  while i < len(acts):
    f = acts[i]
    b = pairs.get(f)
    w = None if b is None else Action(WEIGHT, b.microbatch, b.chunk)
    if acts[i + 1 : i + 3] == [b, w]:
      units.append((f, b, w))
      i += 3
    else:
      units.append((f,))
      i += 1
  return units


def check_fusable(schedule: Schedule) -> None:
  """That `lower(schedule, fuse_overlaps=True)` fuses every overlapped pair.

  Raises:
    ConfigError: for a schedule with no pairs, or one whose pair has its
      B's W later (a file's `(F;I)` cell), which would run apart.
  """
  if not schedule.overlaps:
    raise ConfigError(
      'pipeline.fuse_overlaps',
      f'{schedule.name} marks no overlapped pairs to fuse; dualpipe_v does, and a schedule '
      'file with OVERLAP_F_B cells',
    )
  run = with_split_backward(schedule)
  fused = {u[:2] for o in run.orders for u in fused_units(o, run) if len(u) == 3}
  apart = sorted(set(run.overlaps) - fused)
  if apart:
    f, b = apart[0]
    raise ConfigError(
      'pipeline.fuse_overlaps',
      f'{schedule.name}: the pair ({f};{b}) has its W later, not at once after its B, so it '
      f'cannot run as one tick ({len(apart)} such pair(s)); make its backward whole',
    )


def compute_ticks(schedule: Schedule, fuse_overlaps: bool = False) -> dict[Action, int]:
  """Each stage's compute actions in order, one per tick (or one fused
  pair, see `lower`), each in the first tick after its inputs were produced
  (an evicted set leaves at the start of the tick after its F and can be
  back at the start of its B's tick, so the B must be two ticks after the
  F, see `_copy_ticks`)."""
  p = schedule.stages
  if fuse_overlaps:
    streams = [fused_units(o, schedule) for o in schedule.orders]
  else:
    streams = [[(a,) for a in o if a.kind in COMPUTE_KINDS] for o in schedule.orders]
  nxt = [0] * p
  at: dict[Action, int] = {}
  remaining = sum(len(x) for x in streams)
  t = 0
  while remaining:
    ran = []
    for s in range(p):
      if nxt[s] == len(streams[s]):
        continue
      unit = streams[s][nxt[s]]
      # Within a fused unit the W reads its own B's cut, made earlier in the tick.
      if all(d in unit or _done_before(d, at, t) for a in unit for d in dependencies(a, schedule)):
        ran.append((s, unit))
    if not ran:
      heads = [streams[s][nxt[s]][0] for s in range(p) if nxt[s] < len(streams[s])]
      if any(_waits_only_for_a_copy(a, schedule, at) for a in heads):
        t += 1  # an idle tick: an evicted set comes back in the next one
        continue
      heads = [list(streams[s][nxt[s]]) if nxt[s] < len(streams[s]) else [] for s in range(p)]
      raise _deadlock(schedule, at, t, heads)
    for s, unit in ran:
      for a in unit:
        at[a] = t
      nxt[s] += 1
    remaining -= len(ran)
    t += 1
  return at


def _fused(schedule: Schedule, at: dict[Action, int]) -> dict[Action, Action]:
  """The F -> B pairs that share a tick."""
  return {f: b for f, b in schedule.overlaps if at.get(f) is not None and at[f] == at.get(b)}


def _waits_only_for_a_copy(a: Action, schedule: Schedule, at: dict[Action, int]) -> bool:
  """True if `a`'s only missing input is residuals that are on their way back."""
  deps = dependencies(a, schedule)
  return any(d.kind in COPY_KINDS for d in deps) and all(
    d in at for d in deps if d.kind not in COPY_KINDS
  )


def _done_before(dep: Action, at: dict[Action, int], t: int) -> bool:
  if dep.kind in COPY_KINDS:
    # The residuals come back in time if their F is at least two ticks
    # before the B (checked when copies are placed).
    return (
      Action(FORWARD, dep.microbatch, dep.chunk) in at
      and at[Action(FORWARD, dep.microbatch, dep.chunk)] < t - 1
    )
  return dep in at and at[dep] < t


def _deadlock(
  schedule: Schedule, at: dict[Action, int], t: int, heads: Sequence[Sequence[Action]]
) -> ScheduleDeadlock:
  rows = [[[] for _ in range(schedule.stages)] for _ in range(t)]
  for a, tick in at.items():
    rows[tick][schedule.stage_of(a.chunk)].append(a)
  waiting = [
    f'stage {s} waits on {" and ".join(map(str, h)) or "nothing"}' for s, h in enumerate(heads)
  ]
  return ScheduleDeadlock(
    f'{schedule.name}: lockstep lowering makes no progress at tick {t}; grid so far:\n'
    f'{grid_lib.format_grid(rows, schedule.stages)}\n' + '\n'.join(waiting)
  )


def _copy_ticks(schedule: Schedule, at: dict[Action, int]) -> dict[Action, int]:
  """EVICT in the tick after its F; LOAD as late as its B's own tick.

  Copies move at the start of a tick, before its compute, and land in that
  tick: the executor then never slices the stash for a send after reading
  it in the same step, which would make XLA copy the whole pool. So the
  residuals leave at the start of the tick after their F and are back in
  time for the B of the tick they return in, as early and as late as the
  table allows (the orders' positions of copies matter to the asynchronous
  model only). A stage sends at most one set a tick (one ppermute over the
  partner pairs), so a LOAD that would share its tick moves earlier.
  """
  placed: dict[Action, int] = {}
  busy: set[tuple[int, int]] = set()
  evicts = [a for o in schedule.orders for a in o if a.kind == EVICT]
  for a in sorted(evicts, key=lambda a: at[Action(FORWARD, a.microbatch, a.chunk)]):
    j, c = a.microbatch, a.chunk
    s = schedule.stage_of(c)
    if schedule.partner is None or schedule.partner[s] == s:
      raise ValueError(f'{schedule.name}: {a}: stage {s} has no partner to move residuals to')
    t = at[Action(FORWARD, j, c)] + 1
    if (s, t) in busy:
      raise ValueError(f'{schedule.name}: stage {s} would send two sets at tick {t}')
    placed[a] = t
    busy.add((s, t))
  for a in sorted(evicts, key=lambda a: -at[Action(BACKWARD, a.microbatch, a.chunk)]):
    j, c = a.microbatch, a.chunk
    tf, tb = at[Action(FORWARD, j, c)], at[Action(BACKWARD, j, c)]
    sender = schedule.partner[schedule.stage_of(c)]
    for t in range(tb, tf + 1, -1):
      if (sender, t) not in busy:
        break
    else:
      raise ValueError(
        f'{schedule.name}: cannot evict {j}.{c}: its F (tick {tf}) and B (tick {tb}) '
        'leave no tick for the residuals to come back'
      )
    placed[Action(LOAD, j, c)] = t
    busy.add((sender, t))
  return placed


# A packed tick's receive phase, in order (offsets from _RECV): outputs kept
# to send, outputs landed on their own stage, a send after the round's read.
_KEPT, _LOCAL, _READ = -0.5, -0.4, -0.25


def _time(tick: int, phase: int) -> int:
  return _PHASES * tick + phase


def _intervals(
  schedule: Schedule,
  at: dict[Action, int],
  fused: dict[Action, Action],
  land: dict[Action, float],
  pending: dict[Action, float],
) -> dict:
  """Per stage and buffer, the [write, read] event times of each entry.

  Stash keys are (micro-batch, chunk, segment): segment 0 from the F until
  the set is freed or evicted, 1 on the partner while evicted, 2 back home
  from the LOAD until W frees it. Message keys are ('x', j, c) for chunk
  c's input activation and ('g', j, c) for its output gradient; cut keys
  (j, c).

  A fused tick (`fused`, F -> B) runs its B and W before its F, so the F's
  set is written after the W freed its own (half a phase later) and the
  B's cut goes straight to its W, with no slot.

  `land`: the event time each action's output lands where it is read;
  `pending`: a packed program's outputs for other stages, by the event
  time their send reads them, each waiting in a slot of its sender's pool
  from its tick's compute (key ('out', j, c) of the chunk it goes to, or
  ('back', j, c)).
  """
  p, last = schedule.stages, schedule.num_chunks - 1
  out = {(s, buf): [] for s in range(p) for buf in ('msg', 'stash', 'cut')}
  fused_backwards = set(fused.values())
  for a, tf in at.items():
    if a.kind != FORWARD:
      continue
    j, c = a.microbatch, a.chunk
    s = schedule.stage_of(c)
    tb, tw = at[Action(BACKWARD, j, c)], at[Action(WEIGHT, j, c)]
    freed = _time(tw, _COMPUTE)
    stashed = _time(tf, _COMPUTE) + 0.5 * (a in fused)
    evict = Action(EVICT, j, c)
    if evict in at:
      te, tl = at[evict], at[Action(LOAD, j, c)]
      guest = schedule.partner[s]
      out[(s, 'stash')].append((stashed, _time(te, _SEND), (j, c, 0)))
      out[(guest, 'stash')].append((_time(te, _LAND), _time(tl, _SEND), (j, c, 1)))
      out[(s, 'stash')].append((_time(tl, _LAND), freed, (j, c, 2)))
    else:
      out[(s, 'stash')].append((stashed, freed, (j, c, 0)))
    if Action(BACKWARD, j, c) not in fused_backwards:
      out[(s, 'cut')].append((_time(tb, _COMPUTE), freed, (j, c)))
    if c > 0:
      out[(s, 'msg')].append((land[Action(FORWARD, j, c - 1)], _time(tf, _COMPUTE), ('x', j, c)))
    # The last chunk's F writes its loss gradient while it computes; it must
    # not take the slot its own input is read from, so it counts from just
    # after the read.
    written = _time(tf, _COMPUTE) + 0.5 if c == last else land[Action(BACKWARD, j, c + 1)]
    out[(s, 'msg')].append((written, _time(tb, _COMPUTE), ('g', j, c)))
  for a, read in pending.items():
    kept = _time(at[a], _RECV) + _KEPT
    out[(schedule.stage_of(a.chunk), 'msg')].append((kept, read, _pending_key(a)))
  return out


def _pending_key(a: Action) -> tuple:
  """The slot key of an F's or B's output waiting on its own stage."""
  if a.kind == FORWARD:
    return ('out', a.microbatch, a.chunk + 1)
  return ('back', a.microbatch, a.chunk - 1)


def _colour_intervals(intervals: Sequence[tuple[float, float, tuple]]) -> tuple[dict, int]:
  """Greedy interval colouring by write time, lowest free slot first.

  Returns key -> slot and the number of slots used (the maximum overlap,
  optimal for interval graphs).
  """
  slot_of = {}
  busy: list[tuple[float, int]] = []  # (read time, slot)
  free: list[int] = []
  used = 0
  for write, read, key in sorted(intervals, key=lambda x: (x[0], x[1])):
    while busy and busy[0][0] < write:
      heapq.heappush(free, heapq.heappop(busy)[1])
    if free:
      slot = heapq.heappop(free)
    else:
      slot, used = used, used + 1
    slot_of[key] = slot
    heapq.heappush(busy, (read, slot))
  return slot_of, used


def _assign_slots(
  schedule: Schedule,
  at: dict[Action, int],
  fused: dict[Action, Action],
  land: dict[Action, float],
  pending: dict[Action, float],
) -> tuple[dict, dict]:
  slots, counts = {}, {}
  for where, xs in _intervals(schedule, at, fused, land, pending).items():
    slots[where], counts[where] = _colour_intervals(xs)
  return slots, counts


def _tabulate(
  run: Schedule,
  source: Schedule,
  grid: tuple,
  at: dict[Action, int],
  slot: dict,
  counts: dict,
  fused: dict[Action, Action],
  land: dict[Action, int],
  sent: dict[Action, int],
) -> Program:
  p, last, ticks = run.stages, run.num_chunks - 1, len(grid)
  table = {name: np.full((ticks, p), -1, np.int32) for name in TABLES}
  table['kind'][:] = IDLE
  second = {name: np.full((ticks, p), -1, np.int32) for name in LANE2}
  recv: dict[int, np.ndarray] = {}
  recv2: dict[int, np.ndarray] = {}
  outbox: dict[int, np.ndarray] = {}
  lane2 = set(fused.values())
  lane2 |= {Action(WEIGHT, b.microbatch, b.chunk) for b in lane2}

  def arrive(a: Action, src: int, dst: int, key: tuple, into: dict = recv) -> None:
    """a's output, sent by stage src, lands on dst: where and when."""
    o = (dst - src) % p
    if o not in into:
      into[o] = np.full((ticks, p), -1, np.int32)
    into[o][land[a], dst] = slot[(dst, 'msg')][key]
    if a in sent:  # waits in a slot of its sender until a send carries it
      kept = slot[(src, 'msg')][_pending_key(a)]
      table['pend'][at[a], src] = kept
      if o not in outbox:
        outbox[o] = np.full((ticks, p), -1, np.int32)
      outbox[o][sent[a], src] = kept

  def home(j: int, c: int) -> int:
    """The stash slot B and W read: back from the partner if evicted."""
    return slot[(run.stage_of(c), 'stash')][(j, c, 2 if (j, c) in run.evicted else 0)]

  for a, t in at.items():
    j, c = a.microbatch, a.chunk
    s = run.stage_of(c)
    if a in lane2:
      # A fused tick's B (its W implied): the second lane's tables.
      if a.kind == BACKWARD:
        second['mb'][t, s], second['chunk'][t, s] = j, c
        second['local'][t, s] = run.local_of(c)
        second['stash'][t, s] = home(j, c)
        second['src'][t, s] = slot[(s, 'msg')][('g', j, c)]
        if c > 0:
          arrive(a, s, run.stage_of(c - 1), ('g', j, c - 1), recv2)
      continue
    if a.kind in KIND_CODE:
      table['kind'][t, s] = KIND_CODE[a.kind]
      table['mb'][t, s], table['chunk'][t, s] = j, c
      table['local'][t, s] = run.local_of(c)
    if a.kind == FORWARD:
      table['stash'][t, s] = slot[(s, 'stash')][(j, c, 0)]
      if c > 0:
        table['src'][t, s] = slot[(s, 'msg')][('x', j, c)]
      if c == last:
        table['loss'][t, s] = slot[(s, 'msg')][('g', j, c)]
      else:
        arrive(a, s, run.stage_of(c + 1), ('x', j, c + 1))
    elif a.kind == BACKWARD:
      table['stash'][t, s] = home(j, c)
      table['src'][t, s] = slot[(s, 'msg')][('g', j, c)]
      table['cut'][t, s] = slot[(s, 'cut')][(j, c)]
      if c > 0:
        arrive(a, s, run.stage_of(c - 1), ('g', j, c - 1))
    elif a.kind == WEIGHT:
      table['stash'][t, s] = home(j, c)
      table['cut'][t, s] = slot[(s, 'cut')][(j, c)]
    elif a.kind == EVICT:
      guest = run.partner[s]
      table['move_send'][t, s] = slot[(s, 'stash')][(j, c, 0)]
      table['move_recv'][t, guest] = slot[(guest, 'stash')][(j, c, 1)]
    elif a.kind == LOAD:
      guest = run.partner[s]
      table['move_send'][t, guest] = slot[(guest, 'stash')][(j, c, 1)]
      table['move_recv'][t, s] = slot[(s, 'stash')][(j, c, 2)]

  def most(buf: str) -> int:
    return max([1] + [counts[(s, buf)] for s in range(p)])

  return Program(
    schedule=run,
    source=source,
    ticks=ticks,
    grid=grid,
    table=table,
    recv=recv,
    slots={buf: most(buf) for buf in ('msg', 'stash', 'cut')},
    peaks={buf: tuple(counts[(s, buf)] for s in range(p)) for buf in ('msg', 'stash', 'cut')},
    partner=run.partner if run.evicted else None,
    lane2=second,
    recv2=recv2,
    outbox=outbox,
  )


def transfers_per_step(program: Program) -> dict:
  """Residual sets moved between partner stages in one step.

  Returns {'evictions': per stage, EVICTs it sends; 'loads': per stage,
  LOADs it sends; 'total': all sets moved}. Bytes per step = total x the
  bytes of one stash slot, which the executor knows.
  """
  p = program.schedule.stages
  sent = {EVICT: [0] * p, LOAD: [0] * p}
  for row in program.grid:
    for s, cell in enumerate(row):
      for a in cell:
        if a.kind in sent:
          sent[a.kind][s] += 1
  return {
    'evictions': tuple(sent[EVICT]),
    'loads': tuple(sent[LOAD]),
    'total': sum(sent[EVICT]) + sum(sent[LOAD]),
  }
