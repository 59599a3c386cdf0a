"""Pipeline schedules as data: the IR, its builders and the lockstep lowering.

A `Schedule` lists, per pipeline stage, the order in which that stage runs its
actions: the asynchronous view of the papers, which `simulate.simulate_async`
times. The SPMD executor cannot run that directly: every stage advances in
lockstep ticks, and in one tick each stage runs

  phase 0: at most one forward (F),
  phase 1: at most one backward (B),
  phase 2: receives, via one ppermute each way, the activation its
           predecessor produced in this tick's F and the gradient its
           successor produced in this tick's B.

`lower` turns a schedule into that lockstep `Program` and assigns every
in-flight tensor (received activation, received or loss gradient, stashed
forward residuals) a buffer slot, so the executor can allocate fixed ring
buffers of `num_*_slots` entries.

Model chunks are numbered globally, 0..p*v-1 in layer order; chunk c lives on
stage c % p as that stage's local chunk c // p.

Plain Python and numpy: the planner and the CLI use this without devices.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence

import numpy as np

from triax.errors import ConfigError

# Action kinds. W, EVICT and LOAD are reserved for zero-bubble and BPipe
# schedules: the validator and the asynchronous simulator know W, the lowering
# does not yet.
FORWARD = 'F'
BACKWARD = 'B'
WEIGHT = 'W'
EVICT = 'EVICT'
LOAD = 'LOAD'
KINDS = (FORWARD, BACKWARD, WEIGHT, EVICT, LOAD)

# Columns of Program.fwd.
F_VALID, F_MB, F_CHUNK, F_ACT, F_STASH, F_GRAD = range(6)
# Columns of Program.bwd.
B_VALID, B_MB, B_CHUNK, B_STASH, B_GRAD = range(5)
# Columns of Program.recv.
R_ACT, R_GRAD = range(2)

# (micro-batch, chunk) -> the tick its F (or B) runs in.
_Ticks = dict[tuple[int, int], int]

# Phase offsets inside a tick; a buffer event at tick t happens at 3*t+phase.
_PHASE_F, _PHASE_B, _PHASE_RECV = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Action:
  """One unit of pipeline work.

  Attributes:
    kind: 'F' forward, 'B' backward (input and weight gradient), 'W' weight
      gradient only (zero-bubble, reserved), 'EVICT'/'LOAD' (BPipe, reserved).
    microbatch: micro-batch index, 0..m-1.
    chunk: global model chunk, 0..p*v-1 in layer order.
  """
  kind: str
  microbatch: int
  chunk: int

  def __str__(self) -> str:
    return f'{self.kind}{self.microbatch}.{self.chunk}'


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per-stage execution orders of one pipeline-parallel training step.

  Attributes:
    name: builder name, e.g. '1f1b'.
    stages: p, the number of pipeline stages (devices along `pipe`).
    microbatches: m, micro-batches per step.
    virtual_stages: v, model chunks per stage.
    orders: per stage, its actions in the order the papers run them.
  """
  name: str
  stages: int
  microbatches: int
  virtual_stages: int
  orders: tuple[tuple[Action, ...], ...]

  @property
  def num_chunks(self) -> int:
    return self.stages * self.virtual_stages

  def stage_of(self, chunk: int) -> int:
    return chunk % self.stages


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """A schedule lowered to lockstep ticks, with buffer slots assigned.

  `eq=False` because numpy arrays have no single truth value; compare fields.

  Attributes:
    schedule: the schedule this was lowered from.
    ticks: T, the number of lockstep ticks.
    grid: [tick][stage] -> the actions run (F before B), for render/simulate.
    fwd: int32 [T, p, 6], columns F_*: VALID, MB, CHUNK, ACT (slot holding
      the input activation; -1 for chunk 0), STASH (slot the residuals go
      to), GRAD (slot the executor writes the loss gradient to, for the last
      chunk; else -1). Idle entries are VALID=0 and -1 elsewhere.
    bwd: int32 [T, p, 5], columns B_*: VALID, MB, CHUNK, STASH, GRAD (slot
      holding the output gradient).
    recv: int32 [T, p, 2], columns R_*: act slot that stores the activation
      arriving at the end of this tick, grad slot likewise; -1 for none.
    num_act_slots: act buffer entries the executor allocates (max over
      stages, >= 1).
    num_grad_slots: grad buffer entries, likewise.
    num_stash_slots: stash buffer entries, likewise.
    peak_stash: per stage, the most stash slots in use at once: the lockstep
      peak of in-flight micro-batch-chunks.
  """
  schedule: Schedule
  ticks: int
  grid: tuple[tuple[tuple[Action, ...], ...], ...]
  fwd: np.ndarray
  bwd: np.ndarray
  recv: np.ndarray
  num_act_slots: int
  num_grad_slots: int
  num_stash_slots: int
  peak_stash: tuple[int, ...]


class ScheduleDeadlock(RuntimeError):
  """A schedule cannot make progress (lockstep lowering or async timing)."""


# ---------------------------------------------------------------- builders


def _check_sizes(stages: int, microbatches: int,
                 virtual_stages: int) -> tuple[int, int, int]:
  """Returns the sizes as plain ints, or raises ConfigError naming the key."""
  for key, value, what in (
      ('mesh.pipe', stages, 'pipeline stages'),
      ('pipeline.microbatches', microbatches, 'micro-batches'),
      ('pipeline.virtual_stages', virtual_stages, 'model chunks per stage')):
    # bool is an int subclass; True stages is a config mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ConfigError(key, f'{what} must be an integer; got {value!r}')
    if value < 1:
      raise ConfigError(key, f'{what} must be at least 1; got {value}')
  return int(stages), int(microbatches), int(virtual_stages)


def _schedule(name: str, stages: int, microbatches: int, virtual_stages: int,
              orders: Sequence[Sequence[Action]]) -> Schedule:
  return Schedule(name, stages, microbatches, virtual_stages,
                  tuple(tuple(order) for order in orders))


def gpipe(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """GPipe fill-drain: each stage runs all its forwards, then all backwards.

  With v > 1 this is circular GPipe: forwards chunk-major (every micro-batch
  through local chunk 0, then local chunk 1, ...), backwards in reverse chunk
  order.
  """
  p, m, v = _check_sizes(stages, microbatches, virtual_stages)
  orders = []
  for s in range(p):
    forwards = [Action(FORWARD, j, local * p + s)
                for local in range(v) for j in range(m)]
    backwards = [Action(BACKWARD, j, local * p + s)
                 for local in reversed(range(v)) for j in range(m)]
    orders.append(forwards + backwards)
  return _schedule('gpipe', p, m, v, orders)


def one_f_one_b(stages: int, microbatches: int,
                virtual_stages: int = 1) -> Schedule:
  """PipeDream-Flush 1F1B: warm-up forwards, then F/B pairs, then cool-down.

  Stage s warms up with min(p-1-s, m) forwards, so it never holds more than
  p-s micro-batches in the asynchronous model.
  """
  p, m, v = _check_sizes(stages, microbatches, virtual_stages)
  if v != 1:
    raise ConfigError(
        'pipeline.virtual_stages',
        f'1f1b runs one model chunk per stage; got {v} '
        '(use interleaved_1f1b for virtual stages)')
  orders = []
  for s in range(p):
    warmup = min(p - 1 - s, m)
    order = [Action(FORWARD, j, s) for j in range(warmup)]
    for i in range(m - warmup):
      order += [Action(FORWARD, warmup + i, s), Action(BACKWARD, i, s)]
    order += [Action(BACKWARD, j, s) for j in range(m - warmup, m)]
    orders.append(order)
  return _schedule('1f1b', p, m, 1, orders)


def interleaved_1f1b(stages: int, microbatches: int,
                     virtual_stages: int = 1) -> Schedule:
  """Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21).

  Device d holds chunks d, d+p, .... Its k-th forward is local chunk
  (k // p) % v of micro-batch (k // (p*v))*p + k % p, its k-th backward the
  same micro-batch in local chunk v-1-((k // p) % v). It warms up with
  (p-d-1)*2 + (v-1)*p forwards (capped at m*v), alternates F and B, then
  drains the remaining backwards.

  With v = 1 Megatron's warm-up formula would give 2(p-d-1) forwards, which
  is bubble-optimal too but stashes more; we use PipeDream-Flush's p-d-1
  instead, so v = 1 is exactly 1f1b.

  Raises:
    ConfigError: if v > 1 and m is not a multiple of p (the micro-batch
      formula above walks micro-batches in groups of p).
  """
  p, m, v = _check_sizes(stages, microbatches, virtual_stages)
  if v == 1:
    return dataclasses.replace(one_f_one_b(p, m), name='interleaved_1f1b')
  if m % p:
    raise ConfigError(
        'pipeline.microbatches',
        f'interleaved_1f1b needs a multiple of mesh.pipe (={p}) '
        f'micro-batches; got {m}')
  total = m * v

  def microbatch(k: int) -> int:
    return (k // (p * v)) * p + k % p

  orders = []
  for d in range(p):
    def forward(k: int) -> Action:
      return Action(FORWARD, microbatch(k), ((k // p) % v) * p + d)

    def backward(k: int) -> Action:
      return Action(BACKWARD, microbatch(k), (v - 1 - (k // p) % v) * p + d)

    warmup = min((p - d - 1) * 2 + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
      order += [forward(warmup + i), backward(i)]
    order += [backward(k) for k in range(total - warmup, total)]
    orders.append(order)
  return _schedule('interleaved_1f1b', p, m, v, orders)


# Later schedules (bpipe, zb_h1) register here; build() and the CLI list it.
SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    'gpipe': gpipe,
    '1f1b': one_f_one_b,
    'interleaved_1f1b': interleaved_1f1b,
}


def build(name: str, stages: int, microbatches: int,
          virtual_stages: int = 1) -> Schedule:
  """Builds the named schedule.

  Raises:
    ConfigError: for an unknown name or sizes the schedule cannot run.
  """
  if name not in SCHEDULES:
    raise ConfigError(
        'pipeline.schedule',
        f'unknown schedule {name}; choose one of {", ".join(SCHEDULES)}')
  return SCHEDULES[name](stages, microbatches, virtual_stages)


def dependencies(action: Action, schedule: Schedule) -> tuple[Action, ...]:
  """The actions whose results `action` consumes.

  F(j,c) needs F(j,c-1); B(j,c) needs F(j,c) and the gradient from
  B(j,c+1); W(j,c) needs B(j,c).
  """
  j, c = action.microbatch, action.chunk
  if action.kind == FORWARD:
    return (Action(FORWARD, j, c - 1),) if c > 0 else ()
  if action.kind == BACKWARD:
    if c == schedule.num_chunks - 1:
      return (Action(FORWARD, j, c),)
    return (Action(FORWARD, j, c), Action(BACKWARD, j, c + 1))
  if action.kind == WEIGHT:
    return (Action(BACKWARD, j, c),)
  raise NotImplementedError(f'dependencies of {action.kind} actions')


def format_grid(grid: Sequence[Sequence[Sequence[Action]]],
                stages: int) -> str:
  """An aligned table: a band of F and B rows per stage, a column per tick."""
  rows = []  # (stage label, kind, cell labels)
  for s in range(stages):
    for kind in (FORWARD, BACKWARD):
      cells = [','.join(str(a) for a in grid[t][s] if a.kind == kind) or '.'
               for t in range(len(grid))]
      rows.append((f's{s}' if kind == FORWARD else '', kind, cells))
  width = max([len(x) for _, _, cells in rows for x in cells] +
              [len(str(len(grid) - 1))])
  label_width = len(f's{stages - 1}')
  lines = [f'{"tick":<{label_width + 4}}' +
           ' '.join(str(t).rjust(width) for t in range(len(grid)))]
  for label, kind, cells in rows:
    lines.append(f'{label:<{label_width}} {kind}  ' +
                 ' '.join(x.rjust(width) for x in cells))
  return '\n'.join(lines)


# ---------------------------------------------------------------- lowering


def lower(schedule: Schedule) -> Program:
  """Lowers a schedule to lockstep ticks and assigns buffer slots.

  Per tick every stage runs the next forward of its F stream if ready, then
  the next backward of its B stream if ready (streams keep the order's
  relative order). A forward may overtake backwards that are not ready yet,
  which keeps lockstep execution bubble-optimal; a backward never overtakes
  a forward that precedes it in the order, which keeps GPipe fill-drain.

  The schedule must be valid (see validate.py): lowering assumes one F and
  one B per (micro-batch, chunk).

  Raises:
    NotImplementedError: for W/EVICT/LOAD actions.
    ScheduleDeadlock: if a tick makes no progress while actions remain.
  """
  for order in schedule.orders:
    for a in order:
      if a.kind not in (FORWARD, BACKWARD):
        raise NotImplementedError(
            f'lockstep lowering of {a.kind} actions ({schedule.name})')
  f_tick, b_tick, grid = _assign_ticks(schedule)
  slots, counts = _assign_slots(schedule, f_tick, b_tick)
  return _tabulate(schedule, grid, f_tick, b_tick, slots, counts)


def _assign_ticks(schedule: Schedule) -> tuple[_Ticks, _Ticks, tuple]:
  """Greedy tick assignment; returns the F ticks, the B ticks and the grid."""
  p, last = schedule.stages, schedule.num_chunks - 1
  f_stream = [[a for a in o if a.kind == FORWARD] for o in schedule.orders]
  b_stream = [[a for a in o if a.kind == BACKWARD] for o in schedule.orders]
  f_before = [_forwards_before_backwards(o) for o in schedule.orders]
  f_next, b_next = [0] * p, [0] * p
  f_tick: _Ticks = {}
  b_tick: _Ticks = {}
  grid = []
  remaining = sum(len(x) for x in f_stream) + sum(len(x) for x in b_stream)
  t = 0
  while remaining:
    row = [[] for _ in range(p)]
    # Forwards first: phase 0 of this tick precedes every backward in it.
    # `.get(key, t) < t` reads "ran in an earlier tick"; absent = not yet.
    for s in range(p):
      if f_next[s] < len(f_stream[s]):
        a = f_stream[s][f_next[s]]
        if a.chunk == 0 or f_tick.get((a.microbatch, a.chunk - 1), t) < t:
          f_tick[(a.microbatch, a.chunk)] = t
          f_next[s] += 1
          row[s].append(a)
    for s in range(p):
      if b_next[s] < len(b_stream[s]):
        a = b_stream[s][b_next[s]]
        key = (a.microbatch, a.chunk)
        ready = (key in f_tick and
                 (a.chunk == last or
                  b_tick.get((a.microbatch, a.chunk + 1), t) < t) and
                 f_next[s] >= f_before[s][b_next[s]])
        if ready:
          b_tick[key] = t
          b_next[s] += 1
          row[s].append(a)
    progress = sum(len(r) for r in row)
    if not progress:
      heads = [[x[i] for x, i in ((f_stream[s], f_next[s]),
                                  (b_stream[s], b_next[s])) if i < len(x)]
               for s in range(p)]
      raise _deadlock(schedule, grid, heads)
    grid.append(tuple(tuple(r) for r in row))
    remaining -= progress
    t += 1
  return f_tick, b_tick, tuple(grid)


def _forwards_before_backwards(order: Sequence[Action]) -> list[int]:
  """For each backward of the order, how many forwards precede it."""
  seen, counts = 0, []
  for a in order:
    seen += a.kind == FORWARD
    if a.kind == BACKWARD:
      counts.append(seen)
  return counts


def _deadlock(schedule: Schedule, grid: Sequence,
              heads: Sequence[Sequence[Action]]) -> ScheduleDeadlock:
  waiting = [f'stage {s} waits on {" and ".join(map(str, h)) or "nothing"}'
             for s, h in enumerate(heads)]
  return ScheduleDeadlock(
      f'{schedule.name}: lockstep lowering makes no progress at tick '
      f'{len(grid)}; grid so far:\n{format_grid(grid, schedule.stages)}\n' +
      '\n'.join(waiting))


def _intervals(schedule: Schedule, f_tick: _Ticks, b_tick: _Ticks) -> dict:
  """Per stage and buffer, the [write, read] phase-times of each entry."""
  p, last = schedule.stages, schedule.num_chunks - 1
  out = {(s, buf): [] for s in range(p) for buf in ('act', 'grad', 'stash')}
  for (j, c), tf in f_tick.items():
    s = schedule.stage_of(c)
    tb = b_tick[(j, c)]
    out[(s, 'stash')].append((3 * tf + _PHASE_F, 3 * tb + _PHASE_B, (j, c)))
    if c > 0:
      t_in = f_tick[(j, c - 1)]
      out[(s, 'act')].append(
          (3 * t_in + _PHASE_RECV, 3 * tf + _PHASE_F, (j, c)))
    if c == last:
      # The executor writes the loss gradient during the last chunk's F.
      out[(s, 'grad')].append((3 * tf + _PHASE_F, 3 * tb + _PHASE_B, (j, c)))
    else:
      t_in = b_tick[(j, c + 1)]
      out[(s, 'grad')].append(
          (3 * t_in + _PHASE_RECV, 3 * tb + _PHASE_B, (j, c)))
  return out


def _colour_intervals(intervals: Sequence[tuple[int, int, tuple[int, int]]]
                      ) -> tuple[dict, int]:
  """Greedy interval colouring by write time, lowest free slot first.

  Args:
    intervals: (write, read, key) triples; a slot read at x is free for a
      write at any time > x.

  Returns:
    key -> slot, and the number of slots used (= the maximum overlap, which
    is optimal for interval graphs).
  """
  slot_of = {}
  busy: list[tuple[int, int]] = []  # (read time, slot)
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


def _assign_slots(schedule: Schedule, f_tick: _Ticks,
                  b_tick: _Ticks) -> tuple[dict, dict]:
  """Per (stage, buffer): key -> slot, and the number of slots used."""
  slots, counts = {}, {}
  for where, xs in _intervals(schedule, f_tick, b_tick).items():
    slots[where], counts[where] = _colour_intervals(xs)
  return slots, counts


def _tabulate(schedule: Schedule, grid: tuple, f_tick: _Ticks, b_tick: _Ticks,
              slot: dict, counts: dict) -> Program:
  p = schedule.stages
  last, ticks = schedule.num_chunks - 1, len(grid)
  fwd = np.full((ticks, p, 6), -1, np.int32)
  bwd = np.full((ticks, p, 5), -1, np.int32)
  recv = np.full((ticks, p, 2), -1, np.int32)
  fwd[:, :, F_VALID] = 0
  bwd[:, :, B_VALID] = 0
  for (j, c), t in f_tick.items():
    s = schedule.stage_of(c)
    fwd[t, s, [F_VALID, F_MB, F_CHUNK]] = 1, j, c
    fwd[t, s, F_STASH] = slot[(s, 'stash')][(j, c)]
    if c > 0:
      fwd[t, s, F_ACT] = slot[(s, 'act')][(j, c)]
    if c == last:
      fwd[t, s, F_GRAD] = slot[(s, 'grad')][(j, c)]
    else:
      # The output is the input of chunk c+1 on the next stage (cyclic).
      dst = schedule.stage_of(c + 1)
      recv[t, dst, R_ACT] = slot[(dst, 'act')][(j, c + 1)]
  for (j, c), t in b_tick.items():
    s = schedule.stage_of(c)
    bwd[t, s, [B_VALID, B_MB, B_CHUNK]] = 1, j, c
    bwd[t, s, B_STASH] = slot[(s, 'stash')][(j, c)]
    bwd[t, s, B_GRAD] = slot[(s, 'grad')][(j, c)]
    if c > 0:
      dst = schedule.stage_of(c - 1)
      recv[t, dst, R_GRAD] = slot[(dst, 'grad')][(j, c - 1)]

  def most(buf: str) -> int:
    return max([1] + [counts[(s, buf)] for s in range(p)])

  return Program(schedule=schedule, ticks=ticks, grid=grid, fwd=fwd, bwd=bwd,
                 recv=recv, num_act_slots=most('act'),
                 num_grad_slots=most('grad'), num_stash_slots=most('stash'),
                 peak_stash=tuple(counts[(s, 'stash')] for s in range(p)))
