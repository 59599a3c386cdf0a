"""Pipeline schedules as data: the IR, its builders and the lockstep lowering.

A `Schedule` lists, per pipeline stage, the order in which that stage runs its
actions: the asynchronous view of the papers, which `simulate.simulate_async`
times. The SPMD executor cannot run that directly: every stage advances in
lockstep ticks, and in one tick each stage runs

  phase 0: at most one forward (F),
  phase 1: at most one backward (B); with a split backward (zero-bubble
           schedules) B computes the input gradient only,
  phase 2: at most one weight-gradient action (W), split schedules only,
  phase 3: transfers. One ppermute each way moves the activation its
           predecessor produced in this tick's F and the gradient its
           successor produced in this tick's B; BPipe schedules add one
           ppermute over the partner pairing for EVICTs (stashed residuals,
           heavy stage -> light partner) and one for LOADs (back again). All
           send slots are read before any receive slot is written, so a slot
           sent from may be received into in the same tick.

`lower` turns a schedule into that lockstep `Program` and assigns every
in-flight tensor (received activation, received or loss gradient, stashed
forward residuals, a partner's evicted residuals) a buffer slot, so the
executor can allocate fixed ring buffers of `num_*_slots` entries. Own and
evicted (guest) residuals share one stash pool per stage: every device
compiles the same buffers, so separate pools would save nothing.

Model chunks are numbered globally, 0..p*v-1 in layer order; chunk c lives on
stage c % p as that stage's local chunk c // p.

Plain Python and numpy: the planner and the CLI use this without devices.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
from collections.abc import Callable, Sequence

import numpy as np

from triax.errors import ConfigError

# Action kinds. F, B and W run on the compute stream of the stage that holds
# the chunk. EVICT and LOAD (BPipe) move one stashed residual set between
# partner stages; they are recorded on the sending stage: EVICT on the stage
# holding the chunk, LOAD on its partner.
FORWARD = 'F'
BACKWARD = 'B'
WEIGHT = 'W'
EVICT = 'EVICT'
LOAD = 'LOAD'
KINDS = (FORWARD, BACKWARD, WEIGHT, EVICT, LOAD)
COMPUTE_KINDS = (FORWARD, BACKWARD, WEIGHT)
COPY_KINDS = (EVICT, LOAD)

# Columns of Program.fwd.
F_VALID, F_MB, F_CHUNK, F_ACT, F_STASH, F_GRAD = range(6)
# Columns of Program.bwd.
B_VALID, B_MB, B_CHUNK, B_STASH, B_GRAD = range(5)
# Columns of Program.wgt.
W_VALID, W_MB, W_CHUNK, W_STASH, W_GRAD = range(5)
# Columns of Program.recv.
R_ACT, R_GRAD = range(2)
# Columns of Program.evict and Program.load.
X_SEND, X_RECV = range(2)

# (micro-batch, chunk) -> the tick its F (or B) runs in.
_Ticks = dict[tuple[int, int], int]

# Phases inside a tick; a buffer event at tick t happens at _PHASES*t+phase.
# The transfer phase is split into its reads (sends) and its writes
# (receives), which is what lets a slot be sent from and received into in
# the same tick.
_PHASE_F, _PHASE_B, _PHASE_W, _PHASE_SEND, _PHASE_RECV = range(5)
_PHASES = 5
PHASE_OF_KIND = {FORWARD: _PHASE_F, BACKWARD: _PHASE_B, WEIGHT: _PHASE_W,
                 EVICT: _PHASE_SEND, LOAD: _PHASE_SEND}


@dataclasses.dataclass(frozen=True)
class Action:
  """One unit of pipeline work.

  Attributes:
    kind: 'F' forward; 'B' backward (input and weight gradient, or the input
      gradient only when the schedule has W actions); 'W' weight gradient
      (zero-bubble); 'EVICT'/'LOAD' (BPipe) send the residuals stashed by
      F(microbatch, chunk) to the partner stage and back.
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
    partner: for schedules that move residuals (BPipe), each stage's
      partner (an involution; p-1-s for BPipe), else None.
    stash_cap: the most stash slots (own + guest residual sets) the
      schedule promises any stage needs in the lockstep program, or None
      for no promise. The validator holds lowered programs to it.
  """
  name: str
  stages: int
  microbatches: int
  virtual_stages: int
  orders: tuple[tuple[Action, ...], ...]
  partner: tuple[int, ...] | None = None
  stash_cap: int | None = None

  @property
  def num_chunks(self) -> int:
    return self.stages * self.virtual_stages

  def stage_of(self, chunk: int) -> int:
    return chunk % self.stages

  def stage_of_action(self, action: Action) -> int:
    """The stage that runs `action`: a LOAD is sent by the chunk's partner."""
    s = self.stage_of(action.chunk)
    if action.kind == LOAD:
      if self.partner is None:
        raise ValueError(f'{self.name}: {action} needs a partner pairing')
      return self.partner[s]
    return s

  # cached_property writes the instance __dict__ directly, which a frozen
  # dataclass allows; dependencies() asks for these once per action.
  @functools.cached_property
  def evicted(self) -> frozenset[tuple[int, int]]:
    """(micro-batch, chunk) pairs whose residuals are evicted."""
    return frozenset((a.microbatch, a.chunk) for o in self.orders for a in o
                     if a.kind == EVICT)

  @functools.cached_property
  def split_backward(self) -> bool:
    """True iff the schedule has W actions (B is the input gradient only)."""
    return any(a.kind == WEIGHT for o in self.orders for a in o)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """A schedule lowered to lockstep ticks, with buffer slots assigned.

  `eq=False` because numpy arrays have no single truth value; compare fields.
  Every table is int32 [T, p, columns]; an idle entry is VALID=0 (where the
  table has a VALID column) and -1 elsewhere.

  Attributes:
    schedule: the schedule this was lowered from.
    ticks: T, the number of lockstep ticks.
    grid: [tick][stage] -> the actions the stage runs, in phase order (F, B,
      W, EVICT, LOAD); copies are listed on the sending stage.
    fwd: int32 [T, p, 6], columns F_*: VALID, MB, CHUNK, ACT (slot holding
      the input activation; -1 for chunk 0), STASH (slot the residuals go
      to), GRAD (slot the executor writes the loss gradient to, for the last
      chunk; else -1).
    bwd: int32 [T, p, 5], columns B_*: VALID, MB, CHUNK, STASH, GRAD (slot
      holding the output gradient). Without W actions B frees both slots;
      with them (split_backward) B only reads them and W frees them.
    recv: int32 [T, p, 2], columns R_*: act slot that stores the activation
      arriving at the end of this tick, grad slot likewise; -1 for none.
    num_act_slots: act buffer entries the executor allocates (max over
      stages, >= 1).
    num_grad_slots: grad buffer entries, likewise.
    num_stash_slots: stash pool entries, likewise: own and guest residuals
      share the pool.
    peak_stash: per stage, the most stash slots in use at once (own +
      guest residual sets).
    wgt: int32 [T, p, 5], columns W_*: VALID, MB, CHUNK, STASH, GRAD (the
      slots B read; W reads and frees them). All idle without W actions.
    evict: int32 [T, p, 2], columns X_SEND (stash slot whose contents this
      stage sends to its partner in the transfer phase, -1 none) and X_RECV
      (stash slot into which it stores what its partner sends then, -1
      none). Carries residuals heavy -> light.
    load: int32 [T, p, 2], same columns, light -> heavy.
    split_backward: True iff the schedule has W actions.
    partner: the partner pairing for evict/load (one ppermute each over
      pairs (s, partner[s])), or None when nothing moves (the executor can
      then leave both ppermutes out).
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
  wgt: np.ndarray
  evict: np.ndarray
  load: np.ndarray
  split_backward: bool
  partner: tuple[int, ...] | None


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


def _one_chunk_only(name: str, virtual_stages: int) -> None:
  if virtual_stages != 1:
    raise ConfigError(
        'pipeline.virtual_stages',
        f'{name} runs one model chunk per stage; got {virtual_stages} '
        '(use interleaved_1f1b for virtual stages)')


def _schedule(name: str, stages: int, microbatches: int, virtual_stages: int,
              orders: Sequence[Sequence[Action]], **extra) -> Schedule:
  return Schedule(name, stages, microbatches, virtual_stages,
                  tuple(tuple(order) for order in orders), **extra)


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
  _one_chunk_only('1f1b', v)
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


def zb_h1(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """ZB-H1 (Qi et al., ICLR'24, "Zero Bubble Pipeline Parallelism").

  The backward is split into B (input gradient, on the critical path) and W
  (weight gradient, deferrable). Stage s runs 1F1B's F/B order and lags its
  W's by s backwards: W(k) follows B(k+s), and the last s W's close the
  step. The lag fills the cool-down bubbles with W's while stage s holds at
  most (p-s) + s = p micro-batches, stage 0's 1F1B peak, so the largest
  per-stage memory is 1F1B's.

  Asynchronous model, t_F = t_B = t_W = t: the step takes 3mt + (p-1)t,
  a bubble of (p-1)t per stage against (p-1)*3t for 1F1B with its fused
  backward of 2t: a third. (The paper's (p-1)(t_F + t_B - t_W).)

  Lockstep (the executor): `lower` keeps 1F1B's F/B ticks (m + 2(p-1)) and
  places each W where its tick's slowest stage already waits; with equal
  costs the step takes 3m + 2(p-1) instead of 1F1B's 3(m+p-1), two thirds
  of 1F1B's bubble time, because in lockstep the last stages' F+B warm-up
  ticks cannot be filled. The largest peak stash stays 1F1B's (2p-1 at
  stage 0 for m >= 2p-1); the other stages hold more than under 1F1B (p=4:
  7, 5, 4, 3 against 7, 5, 3, 1), and gradient slots wait for their W.
  """
  p, m, v = _check_sizes(stages, microbatches, virtual_stages)
  _one_chunk_only('zb_h1', v)
  orders = []
  for s, base in enumerate(one_f_one_b(p, m).orders):
    order, pending = [], []
    for a in base:
      order.append(a)
      if a.kind == BACKWARD:
        pending.append(Action(WEIGHT, a.microbatch, a.chunk))
        if len(pending) > s:
          order.append(pending.pop(0))
    orders.append(order + pending)
  return _schedule('zb_h1', p, m, 1, orders)


def bpipe_stash_cap(stages: int, microbatches: int) -> int:
  """BPipe's per-stage stash capacity: min(p, m) residual sets.

  In lockstep 1F1B stage s holds 2(p-1-s)+1 micro-batches at peak, so a pair
  (s, p-1-s) holds 2p at once in the steady state, and ceil((2p-1)/2) = p,
  half of stage 0's peak rounded up, is the least both partners can share.
  With m < 2p-1 fewer are in flight, but in the middle pair all m can be
  at once (both stages' warm-ups overlap), so min(p, m) is the least
  capacity for 1F1B's ticks in every case; `bpipe` reaches it.
  """
  return min(stages, microbatches)


def bpipe(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """BPipe (Kim et al., ICML'23): 1F1B with activation eviction.

  Stage s pairs with p-1-s. The F/B order and lockstep ticks are 1F1B's;
  the heavy stage of each pair (the smaller s) EVICTs a stashed residual set
  to its partner whenever it would otherwise hold more than
  `bpipe_stash_cap` sets, and the partner LOADs it back just before its B.
  The partner keeps the guest in its own stash pool, which has the same cap.
  With p odd the middle stage pairs with itself and evicts nothing.

  Policy (lockstep): an evicted set leaves at the end of its F's tick and
  comes back at the end of the tick before its B, the two choices that
  free the heavy stage longest. Scanning ticks in order, whenever the heavy
  stage would exceed the cap it evicts the micro-batch whose B is furthest
  away (here the one it just forwarded) among those the partner has room
  for; for equal-length intervals this greedy evicts as few sets as any
  policy can. In the orders EVICT follows its F and LOAD follows the
  partner's own B of that micro-batch, which is where the asynchronous
  model issues them on the copy stream.

  Raises:
    ConfigError: for v > 1 (interleaved BPipe is not built).
  """
  p, m, v = _check_sizes(stages, microbatches, virtual_stages)
  _one_chunk_only('bpipe', v)
  base = one_f_one_b(p, m)
  f_tick, b_tick, _ = _assign_ticks(base)
  partner = tuple(p - 1 - s for s in range(p))
  cap = bpipe_stash_cap(p, m)
  evicted = _plan_evictions(base, f_tick, b_tick, partner, cap)
  orders = []
  for s, order in enumerate(base.orders):
    order = list(order)
    for j, c in sorted(evicted):
      if base.stage_of(c) == s:
        order.insert(order.index(Action(FORWARD, j, c)) + 1,
                     Action(EVICT, j, c))
    orders.append(order)
  # In the orders a load follows the partner's B of the same micro-batch:
  # the gradient still has to cross the stages between the two, which is
  # the time the asynchronous model has to hide the transfer in. (Lockstep
  # ignores the position and loads in the tick before the B.)
  for j, c in sorted(evicted):
    order = orders[partner[base.stage_of(c)]]
    order.insert(order.index(Action(BACKWARD, j, partner[base.stage_of(c)]))
                 + 1, Action(LOAD, j, c))
  return _schedule('bpipe', p, m, 1, orders, partner=partner, stash_cap=cap)


def _plan_evictions(schedule: Schedule, f_tick: _Ticks, b_tick: _Ticks,
                    partner: Sequence[int], cap: int) -> set[tuple[int, int]]:
  """Chooses the residual sets to evict so every stage fits in `cap` slots.

  Works on the lockstep occupancy at phase 0 of each tick, after the F's
  write and before anything is freed: the most a tick ever holds. A set
  evicted at the end of F's tick tf and loaded at the end of tick tb-1 is
  absent from the heavy stage and present on the light one exactly in ticks
  tf+1..tb-1.

  Raises:
    ScheduleDeadlock: if no choice fits (never for 1F1B with min(p, m)).
  """
  p = schedule.stages
  ticks = max(b_tick.values()) + 1
  held = [[0] * ticks for _ in range(p)]
  for key, tf in f_tick.items():
    for t in range(tf, b_tick[key] + 1):
      held[schedule.stage_of(key[1])][t] += 1
  evicted: set[tuple[int, int]] = set()
  for s in range(p):
    light = partner[s]
    if light == s:
      continue
    heavy_peak, light_peak = max(held[s]), max(held[light])
    # Each pair is planned once, from its heavier stage.
    if heavy_peak < light_peak or (heavy_peak == light_peak and s > light):
      continue
    own = sorted(key for key in f_tick if schedule.stage_of(key[1]) == s)
    for t in range(ticks):
      while held[s][t] > cap:
        candidates = sorted(
            (key for key in own if key not in evicted and
             f_tick[key] < t < b_tick[key]),
            key=lambda key: (-b_tick[key], -f_tick[key]))
        for key in candidates:
          away = range(f_tick[key] + 1, b_tick[key])
          if all(held[light][x] < cap for x in away):
            break
        else:
          raise ScheduleDeadlock(
              f'{schedule.name}: stage {s} holds {held[s][t]} residual sets '
              f'at tick {t} and neither it nor partner {light} has room '
              f'under a cap of {cap}')
        evicted.add(key)
        for x in away:
          held[s][x] -= 1
          held[light][x] += 1
  return evicted


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    'gpipe': gpipe,
    '1f1b': one_f_one_b,
    'interleaved_1f1b': interleaved_1f1b,
    'bpipe': bpipe,
    'zb_h1': zb_h1,
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

  F(j,c) needs F(j,c-1); B(j,c) needs F(j,c), the gradient from B(j,c+1)
  and, if its residuals were evicted, their LOAD(j,c); W(j,c) needs B(j,c);
  EVICT(j,c) needs F(j,c); LOAD(j,c) needs EVICT(j,c).
  """
  j, c = action.microbatch, action.chunk
  if action.kind == FORWARD:
    return (Action(FORWARD, j, c - 1),) if c > 0 else ()
  if action.kind == BACKWARD:
    deps = (Action(FORWARD, j, c),)
    if c < schedule.num_chunks - 1:
      deps += (Action(BACKWARD, j, c + 1),)
    if (j, c) in schedule.evicted:
      deps += (Action(LOAD, j, c),)
    return deps
  if action.kind == WEIGHT:
    return (Action(BACKWARD, j, c),)
  if action.kind == EVICT:
    return (Action(FORWARD, j, c),)
  if action.kind == LOAD:
    return (Action(EVICT, j, c),)
  raise NotImplementedError(f'dependencies of {action.kind} actions')


def copy_issue_points(order: Sequence[Action]) -> list[int]:
  """For each copy action of an order, how many compute actions precede it.

  Copies run on a stage's copy stream: one is issued once the compute
  stream has finished every compute action before it in the order, and the
  compute stream never waits for a copy except through a dependency.
  """
  seen, points = 0, []
  for a in order:
    if a.kind in COPY_KINDS:
      points.append(seen)
    else:
      seen += 1
  return points


_SHORT = {EVICT: 'E', LOAD: 'L'}


def format_grid(grid: Sequence[Sequence[Sequence[Action]]], stages: int,
                partner: Sequence[int] | None = None) -> str:
  """An aligned table: a band of rows per stage, a column per tick.

  Each stage gets an F and a B row, a W row if any stage runs W, and an X
  row if residuals move: 'E3.0'/'L3.0' where the stage sends EVICT/LOAD of
  micro-batch 3, chunk 0, and 'e3.0'/'l3.0' where it receives them (shown
  only when `partner` is given).
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
            arriving[t][partner[s]].append(
                f'{_SHORT[a.kind].lower()}{a.microbatch}.{a.chunk}')
  rows = []  # (stage label, band, cell labels)
  for s in range(stages):
    for kind in bands:
      cells = [','.join(str(a) for a in grid[t][s] if a.kind == kind) or '.'
               for t in range(len(grid))]
      rows.append((f's{s}' if kind == FORWARD else '', kind, cells))
    if copies:
      cells = [','.join([f'{_SHORT[a.kind]}{a.microbatch}.{a.chunk}'
                         for a in grid[t][s] if a.kind in COPY_KINDS] +
                        arriving[t][s]) or '.' for t in range(len(grid))]
      rows.append(('', 'X', cells))
  width = max([len(x) for _, _, cells in rows for x in cells] +
              [len(str(len(grid) - 1))])
  label_width = len(f's{stages - 1}')
  lines = [f'{"tick":<{label_width + 4}}' +
           ' '.join(str(t).rjust(width) for t in range(len(grid)))]
  for label, kind, cells in rows:
    lines.append(f'{label:<{label_width}} {kind}  ' +
                 ' '.join(x.rjust(width) for x in cells))
  return '\n'.join(lines)


def transfers_per_step(program: Program) -> dict:
  """Residual sets moved between partner stages in one step.

  Returns:
    {'evictions': per stage, EVICTs it sends; 'loads': per stage, LOADs it
    sends; 'total': all sets moved}. Bytes per step = total x the bytes of
    one stash slot, which the executor knows.
  """
  p = program.schedule.stages
  sent = {EVICT: [0] * p, LOAD: [0] * p}
  for row in program.grid:
    for s, cell in enumerate(row):
      for a in cell:
        if a.kind in sent:
          sent[a.kind][s] += 1
  return {'evictions': tuple(sent[EVICT]), 'loads': tuple(sent[LOAD]),
          'total': sum(sent[EVICT]) + sum(sent[LOAD])}


# ---------------------------------------------------------------- lowering


def lower(schedule: Schedule) -> Program:
  """Lowers a schedule to lockstep ticks and assigns buffer slots.

  F and B: per tick every stage runs the next forward of its F stream if
  ready, then the next backward of its B stream if ready (streams keep the
  order's relative order). A forward may overtake backwards that are not
  ready yet, which keeps lockstep execution bubble-optimal; a backward never
  overtakes a forward that precedes it in the order, which keeps GPipe
  fill-drain. W, EVICT and LOAD never move an F or a B.

  W: see `_assign_weight_ticks`: each stage's W's keep their order, one per
  tick, no earlier than their B's tick, each into the first tick where it
  does not lengthen the tick (assuming t_F = t_B = t_W), without raising the
  largest per-stage stash above running every W as early as possible.

  EVICT runs in the transfer phase of its F's tick, LOAD in that of the tick
  before its B: the residuals leave as early and return as late as the
  table allows (the orders' positions of copies matter to the asynchronous
  model only).

  The schedule must be valid (see validate.py): lowering assumes one F and
  one B per (micro-batch, chunk), at most one W and one EVICT/LOAD pair.

  Raises:
    ScheduleDeadlock: if a tick makes no progress while actions remain.
    ValueError: for copies the lockstep table cannot hold (an F and its B
      less than two ticks apart, two copies of one kind from one stage in a
      tick, an eviction to a stage's own self).
  """
  f_tick, b_tick, _ = _assign_ticks(schedule)
  at = {Action(FORWARD, j, c): t for (j, c), t in f_tick.items()}
  at.update({Action(BACKWARD, j, c): t for (j, c), t in b_tick.items()})
  ticks = max(at.values(), default=-1) + 1
  at.update(_assign_weight_ticks(schedule, at, ticks))
  at.update(_assign_copy_ticks(schedule, at))
  ticks = max(at.values(), default=-1) + 1
  grid = [[[] for _ in range(schedule.stages)] for _ in range(ticks)]
  for a, t in at.items():
    grid[t][schedule.stage_of_action(a)].append(a)
  grid = tuple(tuple(tuple(sorted(cell, key=lambda a: KINDS.index(a.kind)))
                     for cell in row) for row in grid)
  slots, counts = _assign_slots(schedule, at)
  return _tabulate(schedule, grid, at, slots, counts)


def _assign_ticks(schedule: Schedule) -> tuple[_Ticks, _Ticks, tuple]:
  """Greedy F/B tick assignment; returns the F ticks, the B ticks and the
  F/B grid."""
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


def _stash_peak(f_ticks: Sequence[int], w_ticks: Sequence[int]) -> int:
  """Most residual sets one stage holds when its k-th W frees a set.

  At phase 0 of tick t a stage holds the sets forwarded at ticks <= t less
  those W freed at ticks < t; the count only grows at an F.
  """
  w_ticks = sorted(w_ticks)
  return max([k + 1 - bisect.bisect_left(w_ticks, t)
              for k, t in enumerate(sorted(f_ticks))], default=0)


def _assign_weight_ticks(schedule: Schedule, at: dict[Action, int],
                         ticks: int) -> dict[Action, int]:
  """Places every W into a tick, given the F and B ticks.

  In lockstep a tick lasts as long as its busiest stage, so a W is free
  wherever its stage has less work than that stage; the lowering does not
  know the costs and assumes t_F = t_B = t_W (ZB-H1's design point), i.e.
  a stage's work in a tick is its number of actions.

  Rules: a stage's W's keep their order and run at most one per tick, each
  at or after its B's tick (phase 2 follows phase 1). Taking W's in the
  order of their B's ticks, each goes into the earliest allowed tick where
  it does not lengthen the tick, else where it lengthens it least. Deferring
  a W holds its stash and gradient slots, so no W may be later than where
  the stage would exceed `cap`, the largest per-stage stash of running
  every W as early as possible: a stage's k-th W must precede its
  (cap+k+1)-th F. W's also keep to the F/B ticks when they fit.
  """
  p = schedule.stages
  streams = [[a for a in o if a.kind == WEIGHT] for o in schedule.orders]
  if not any(streams):
    return {}

  def b_of(w: Action) -> int:
    return at[Action(BACKWARD, w.microbatch, w.chunk)]

  f_ticks = [sorted(t for a, t in at.items() if a.kind == FORWARD and
                    schedule.stage_of(a.chunk) == s) for s in range(p)]
  cap = 0
  for s, stream in enumerate(streams):
    asap, prev = [], -1
    for w in stream:
      prev = max(b_of(w), prev + 1)
      asap.append(prev)
    cap = max(cap, _stash_peak(f_ticks[s], asap))
  work = [[0] * p for _ in range(ticks)]
  for a, t in at.items():
    work[t][schedule.stage_of(a.chunk)] += 1
  placed: dict[Action, int] = {}
  prev = [-1] * p
  heads = [(b_of(stream[0]), s, 0) for s, stream in enumerate(streams)
           if stream]
  heapq.heapify(heads)
  while heads:
    _, s, k = heapq.heappop(heads)
    stream = streams[s]
    earliest = max(b_of(stream[k]), prev[s] + 1)
    latest = ticks - 1 - (len(stream) - 1 - k)
    if cap + k < len(f_ticks[s]):
      latest = min(latest, f_ticks[s][cap + k] - 1)
    best = None
    for t in range(earliest, max(earliest, latest) + 1):
      if t == len(work):
        work.append([0] * p)
      longer = max(0, work[t][s] + 1 - max(work[t]))
      if best is None or longer < best[0]:
        best = (longer, t)
      if not longer:
        break
    t = best[1]
    placed[stream[k]] = t
    work[t][s] += 1
    prev[s] = t
    if k + 1 < len(stream):
      heapq.heappush(heads, (b_of(stream[k + 1]), s, k + 1))
  return placed


def _assign_copy_ticks(schedule: Schedule,
                       at: dict[Action, int]) -> dict[Action, int]:
  """EVICT at its F's tick, LOAD at the tick before its B (see `lower`)."""
  placed: dict[Action, int] = {}
  for order in schedule.orders:
    for a in order:
      if a.kind not in COPY_KINDS:
        continue
      j, c = a.microbatch, a.chunk
      tf, tb = at[Action(FORWARD, j, c)], at[Action(BACKWARD, j, c)]
      if tb - tf < 2:
        raise ValueError(
            f'{schedule.name}: cannot evict {j}.{c}: its F (tick {tf}) and '
            f'B (tick {tb}) leave no tick for the residuals to be away')
      s = schedule.stage_of(c)
      if schedule.partner is None or schedule.partner[s] == s:
        raise ValueError(f'{schedule.name}: {a}: stage {s} has no partner to '
                         'move residuals to')
      placed[a] = tf if a.kind == EVICT else tb - 1
  seen = set()
  for a, t in placed.items():
    where = (schedule.stage_of_action(a), a.kind, t)
    if where in seen:
      raise ValueError(f'{schedule.name}: stage {where[0]} would send two '
                       f'{a.kind}s at tick {t}; the table holds one')
    seen.add(where)
  return placed


def _time(tick: int, phase: int) -> int:
  return _PHASES * tick + phase


def _intervals(schedule: Schedule, at: dict[Action, int]) -> dict:
  """Per stage and buffer, the [write, read] phase-times of each entry.

  Stash keys are (micro-batch, chunk, segment): segment 0 from the F until
  the set is freed or evicted, 1 on the partner while evicted, 2 back home
  from the LOAD until freed. The last reader frees: W if the schedule has
  one for the set, else B; gradients are freed by the same action.
  """
  p, last = schedule.stages, schedule.num_chunks - 1
  out = {(s, buf): [] for s in range(p) for buf in ('act', 'grad', 'stash')}
  for a, tf in at.items():
    if a.kind != FORWARD:
      continue
    j, c = a.microbatch, a.chunk
    s = schedule.stage_of(c)
    w = Action(WEIGHT, j, c)
    freed = (_time(at[w], _PHASE_W) if w in at else
             _time(at[Action(BACKWARD, j, c)], _PHASE_B))
    evict = Action(EVICT, j, c)
    if evict in at:
      te, tl = at[evict], at[Action(LOAD, j, c)]
      guest = schedule.partner[s]
      out[(s, 'stash')].append(
          (_time(tf, _PHASE_F), _time(te, _PHASE_SEND), (j, c, 0)))
      out[(guest, 'stash')].append(
          (_time(te, _PHASE_RECV), _time(tl, _PHASE_SEND), (j, c, 1)))
      out[(s, 'stash')].append((_time(tl, _PHASE_RECV), freed, (j, c, 2)))
    else:
      out[(s, 'stash')].append((_time(tf, _PHASE_F), freed, (j, c, 0)))
    if c > 0:
      out[(s, 'act')].append(
          (_time(at[Action(FORWARD, j, c - 1)], _PHASE_RECV),
           _time(tf, _PHASE_F), (j, c)))
    if c == last:
      # The executor writes the loss gradient during the last chunk's F.
      out[(s, 'grad')].append((_time(tf, _PHASE_F), freed, (j, c)))
    else:
      out[(s, 'grad')].append(
          (_time(at[Action(BACKWARD, j, c + 1)], _PHASE_RECV), freed, (j, c)))
  return out


def _colour_intervals(intervals: Sequence[tuple[int, int, tuple]]
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


def _assign_slots(schedule: Schedule,
                  at: dict[Action, int]) -> tuple[dict, dict]:
  """Per (stage, buffer): key -> slot, and the number of slots used."""
  slots, counts = {}, {}
  for where, xs in _intervals(schedule, at).items():
    slots[where], counts[where] = _colour_intervals(xs)
  return slots, counts


def _tabulate(schedule: Schedule, grid: tuple, at: dict[Action, int],
              slot: dict, counts: dict) -> Program:
  p = schedule.stages
  last, ticks = schedule.num_chunks - 1, len(grid)
  fwd = np.full((ticks, p, 6), -1, np.int32)
  bwd = np.full((ticks, p, 5), -1, np.int32)
  wgt = np.full((ticks, p, 5), -1, np.int32)
  recv = np.full((ticks, p, 2), -1, np.int32)
  evict = np.full((ticks, p, 2), -1, np.int32)
  load = np.full((ticks, p, 2), -1, np.int32)
  fwd[:, :, F_VALID] = 0
  bwd[:, :, B_VALID] = 0
  wgt[:, :, W_VALID] = 0

  def stash(s: int, j: int, c: int, segment: int) -> int:
    return slot[(s, 'stash')][(j, c, segment)]

  def home(j: int, c: int) -> int:
    """The slot B and W read: back from the partner if evicted."""
    s = schedule.stage_of(c)
    return stash(s, j, c, 2 if (j, c) in schedule.evicted else 0)

  for a, t in at.items():
    j, c = a.microbatch, a.chunk
    s = schedule.stage_of(c)
    if a.kind == FORWARD:
      fwd[t, s, [F_VALID, F_MB, F_CHUNK]] = 1, j, c
      fwd[t, s, F_STASH] = stash(s, j, c, 0)
      if c > 0:
        fwd[t, s, F_ACT] = slot[(s, 'act')][(j, c)]
      if c == last:
        fwd[t, s, F_GRAD] = slot[(s, 'grad')][(j, c)]
      else:
        # The output is the input of chunk c+1 on the next stage (cyclic).
        dst = schedule.stage_of(c + 1)
        recv[t, dst, R_ACT] = slot[(dst, 'act')][(j, c + 1)]
    elif a.kind == BACKWARD:
      bwd[t, s, [B_VALID, B_MB, B_CHUNK]] = 1, j, c
      bwd[t, s, B_STASH] = home(j, c)
      bwd[t, s, B_GRAD] = slot[(s, 'grad')][(j, c)]
      if c > 0:
        dst = schedule.stage_of(c - 1)
        recv[t, dst, R_GRAD] = slot[(dst, 'grad')][(j, c - 1)]
    elif a.kind == WEIGHT:
      wgt[t, s, [W_VALID, W_MB, W_CHUNK]] = 1, j, c
      wgt[t, s, W_STASH] = home(j, c)
      wgt[t, s, W_GRAD] = slot[(s, 'grad')][(j, c)]
    elif a.kind == EVICT:
      guest = schedule.partner[s]
      evict[t, s, X_SEND] = stash(s, j, c, 0)
      evict[t, guest, X_RECV] = stash(guest, j, c, 1)
    elif a.kind == LOAD:
      guest = schedule.partner[s]
      load[t, guest, X_SEND] = stash(guest, j, c, 1)
      load[t, s, X_RECV] = stash(s, j, c, 2)

  def most(buf: str) -> int:
    return max([1] + [counts[(s, buf)] for s in range(p)])

  return Program(schedule=schedule, ticks=ticks, grid=grid, fwd=fwd, bwd=bwd,
                 recv=recv, num_act_slots=most('act'),
                 num_grad_slots=most('grad'), num_stash_slots=most('stash'),
                 peak_stash=tuple(counts[(s, 'stash')] for s in range(p)),
                 wgt=wgt, evict=evict, load=load,
                 split_backward=schedule.split_backward,
                 partner=schedule.partner if schedule.evicted else None)
