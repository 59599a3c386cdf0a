"""Time and memory models of a pipeline schedule, one tick loop for every cost model.

- lockstep (`simulate_lockstep`): what triax's SPMD executor does with the lowered program
  (lower.py). All stages advance tick by tick, each running at most one compute action a
  tick (a fused backward as B then W; a fused tick's pair with its W); a tick lasts as
  long as its slowest stage's work plus its send phase (and BPipe's partner ppermute). A
  packed program (rounds.py) meets only at its sends. What an action and a send phase cost
  is the `TickCosts` given: `Costs` here, or plan/cost/simulator.py's per-chunk costs.
- asynchronous (`simulate_async`): what the papers draw, on the schedule as built. Each
  stage runs its compute actions as soon as its stream is free and its inputs have
  arrived; BPipe's EVICT/LOAD run on a separate copy stream of the sending stage.

Both return a `Result`. Memory is counted as in-flight micro-batch-chunks: residual sets a
stage stashes until their W (always their W in the lockstep program) and, under BPipe, its
partner's evicted ones. Transfer and copy time is not busy time: the bubble counts compute
only. Plain Python: the planner times schedules without devices.
Why two models: docs/design/time_model.md."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Protocol

from triax.pipeline import rounds as rounds_lib
from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Action, Program, Schedule


@dataclasses.dataclass(frozen=True)
class Costs:
  """Durations on one stage, in any consistent time unit.

  A fused schedule's B costs t_backward in the asynchronous model; its
  lockstep program runs it as B then W, charged t_backward - w and w (w =
  t_weight if 0 < t_weight < t_backward, else t_backward / 2). Comparing
  fused and split schedules like with like: docs/design/time_model.md.

  Attributes:
    t_forward: forward of one micro-batch through all layers of one pipeline
      stage; a chunk's forward takes t_forward / v.
    t_backward: backward (input and weight gradient; input gradient only in
      schedules with W actions) likewise.
    t_weight: weight-gradient-only action (zero-bubble W) likewise; for a
      fused schedule, the W part of t_backward its lockstep program runs
      (0 = half).
    t_transfer: sending one activation or gradient to a neighbour stage.
    t_evict: moving one stage's residual set for one micro-batch to or from
      its partner (BPipe EVICT or LOAD); a chunk's set takes t_evict / v.
    t_exchange: expert parallelism's all-to-alls in one micro-batch's
      forward through one stage, and as long again in its backward (B); a
      chunk's take t_exchange / v. F and B wait for theirs, except in a
      fused tick (`overlapped`).
  """

  t_forward: float = 1.0
  t_backward: float = 1.0
  t_weight: float = 0.0
  t_transfer: float = 0.0
  t_evict: float = 0.0
  t_exchange: float = 0.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
        raise ValueError(f'Costs.{field.name} must be a finite number >= 0; got {value!r}')

  @classmethod
  def design_point(cls, split: bool, units: rounds_lib.TickUnits | None = None) -> Costs:
    """The papers' unit costs, the default wherever none are measured: a
    backward of two forwards, as B and W of one each when it is split
    (ZB-H1's t_F = t_B = t_W). With `units` (a packed program's, rounds.py),
    theirs: full recomputation's B of two forwards, W of one."""
    if units is None:
      return cls(t_forward=1.0, t_backward=1.0 if split else 2.0, t_weight=1.0 if split else 0.0)
    backward = units.backward + (0 if split else units.weight)
    return cls(t_forward=units.forward, t_backward=backward, t_weight=units.weight)

  def of(self, kind: str, virtual_stages: int) -> float:
    """Duration of one chunk action of this kind, as the schedule has it."""
    per_stage = {
      sched.FORWARD: self.t_forward + self.t_exchange,
      sched.BACKWARD: self.t_backward + self.t_exchange,
      sched.WEIGHT: self.t_weight,
      sched.EVICT: self.t_evict,
      sched.LOAD: self.t_evict,
    }
    if kind not in per_stage:
      raise NotImplementedError(f'no time model for {kind} actions')
    return per_stage[kind] / virtual_stages

  @property
  def weight_part(self) -> float:
    """The W share of a fused t_backward when the lowering splits it."""
    if 0 < self.t_weight < self.t_backward:
      return self.t_weight
    return self.t_backward / 2

  def lockstep(self, kind: str, virtual_stages: int, fused: bool) -> float:
    """Duration of one chunk action in the lockstep program.

    Args:
      kind: 'F', 'B' or 'W'.
      virtual_stages: v.
      fused: True if the schedule was built with a fused backward, whose
        B the program runs as B then W.
    """
    if fused and kind == sched.BACKWARD:
      return (self.t_backward - self.weight_part + self.t_exchange) / virtual_stages
    if fused and kind == sched.WEIGHT:
      return self.weight_part / virtual_stages
    return self.of(kind, virtual_stages)

  def exchange(self, kind: str, virtual_stages: int) -> float:
    """The all-to-all part of one chunk action's duration."""
    return self.t_exchange / virtual_stages if kind in (sched.FORWARD, sched.BACKWARD) else 0.0

  def overlapped(self, kinds: Sequence[str], virtual_stages: int, fused: bool) -> float:
    """One fused tick's actions (a B, its W and another micro-batch's F):
    each one's all-to-alls run beside the others' compute, so the tick lasts
    the longer of their compute and their exchanges (at best: DualPipe's
    overlap, with nothing left exposed)."""
    total = sum(self.lockstep(k, virtual_stages, fused) for k in kinds)
    exchange = sum(self.exchange(k, virtual_stages) for k in kinds)
    return max(total - exchange, exchange)


CostsLike = Costs | Sequence[Costs]


def per_stage(costs: CostsLike, stages: int) -> tuple[Costs, ...]:
  """One Costs per stage: the same for all, or a sequence of p (for
  heterogeneous devices)."""
  if isinstance(costs, Costs):
    return (costs,) * stages
  costs = tuple(costs)
  if len(costs) != stages or not all(isinstance(c, Costs) for c in costs):
    raise ValueError(f'want one Costs or a sequence of {stages} Costs; got {costs!r}')
  return costs


@dataclasses.dataclass(frozen=True)
class Span:
  """One action on the timeline; EVICT/LOAD spans are on the sender's copy
  stream."""

  stage: int
  action: Action
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class Result:
  """Outcome of one time model.

  Attributes:
    model: 'lockstep' or 'async'.
    schedule: the schedule timed.
    total_time: time of the whole step.
    bubble_fraction: 1 - sum(busy) / (p * total_time).
    busy: per stage, time spent running compute actions (F, B, W).
    peak_inflight: per stage, the most micro-batch-chunks stashed at once
      (own and guest).
    timeline: every action with its stage, start and end, by stage then time.
    ticks: lockstep ticks (None for the asynchronous model).
  """

  model: str
  schedule: Schedule
  total_time: float
  bubble_fraction: float
  busy: tuple[float, ...]
  peak_inflight: tuple[int, ...]
  timeline: tuple[Span, ...]
  ticks: int | None = None


def _result(
  model: str,
  schedule: Schedule,
  spans: list[Span],
  total: float,
  peak: Sequence[int],
  ticks: int | None = None,
) -> Result:
  busy = [0.0] * schedule.stages
  for span in spans:
    if span.action.kind not in sched.COPY_KINDS:
      busy[span.stage] += span.end - span.start
  capacity = schedule.stages * total
  # An all-zero cost model has no time to waste: call its bubble 0.
  bubble = 1.0 - sum(busy) / capacity if capacity > 0 else 0.0
  spans = sorted(spans, key=lambda x: (x.stage, x.start, x.end))
  return Result(
    model=model,
    schedule=schedule,
    total_time=total,
    bubble_fraction=bubble,
    busy=tuple(busy),
    peak_inflight=tuple(peak),
    timeline=tuple(spans),
    ticks=ticks,
  )


def _frees(schedule: Schedule) -> set[tuple[int, int]]:
  """(micro-batch, chunk) pairs freed by their W rather than their B."""
  return {(a.microbatch, a.chunk) for o in schedule.orders for a in o if a.kind == sched.WEIGHT}


def _peak_inflight(sequences: Sequence[Sequence[Action]], schedule: Schedule) -> list[int]:
  """Max stashed micro-batch-chunks while running each stage's sequence.

  A forward stashes; the last gradient action of that (micro-batch, chunk)
  frees: its W if the schedule has one, else its B.
  """
  has_w = _frees(schedule)
  peaks = []
  for actions in sequences:
    held = peak = 0
    for a in actions:
      key = (a.microbatch, a.chunk)
      if a.kind == sched.FORWARD:
        held += 1
        peak = max(peak, held)
      elif a.kind == sched.WEIGHT or (a.kind == sched.BACKWARD and key not in has_w):
        held -= 1
    peaks.append(peak)
  return peaks


@dataclasses.dataclass(frozen=True)
class Tick:
  """One lockstep tick, as a cost model sees it.

  Attributes:
    index: the tick, 0..T-1.
    compute: per stage, the compute action it runs, or None (idle); in a
      fused tick, its F.
    fused: per stage, the B and W a fused tick runs before its F (see
      `lower.lower`'s fuse_overlaps), or () where it runs one action.
    messages: (sender, receiver) of each activation or gradient that
      crosses stages in the tick's send phase (one whose neighbouring chunk
      is on the same stage stays there and is not listed).
    copies: (sender, action) of each EVICT or LOAD sent in the tick.
    movers: the stages that send a residual set in the tick's partner
      ppermute: in a tick where any stage moves one, every paired stage
      (the executor runs that ppermute on all devices together, an idle
      pair sending a slot nobody keeps); else none.
  """

  index: int
  compute: tuple[Action | None, ...]
  messages: tuple[tuple[int, int], ...]
  copies: tuple[tuple[int, Action], ...]
  movers: tuple[int, ...]
  fused: tuple[tuple[Action, ...], ...] = ()

  # Ticks it spans: 1 (a `Round` spans several).
  span = 1

  def actions(self, stage: int) -> tuple[Action, ...]:
    """The compute actions `stage` runs in the tick, in the executor's order."""
    one = self.compute[stage]
    return (self.fused[stage] if self.fused else ()) + ((one,) if one is not None else ())


@dataclasses.dataclass(frozen=True)
class Round:
  """A packed program's round (rounds.py) as a cost model sees it: what a
  `Tick` says, for the round's ticks together. Each stage runs its actions
  one after another, and the messages they make travel in one send phase.

  Attributes:
    index: the round, 0..R-1.
    ticks: its ticks.
  """

  index: int
  ticks: tuple[Tick, ...]
  copies = ()
  movers = ()

  @property
  def span(self) -> int:
    return len(self.ticks)

  @property
  def compute(self) -> tuple[Action | None, ...]:
    """Per stage, its first action in the round, or None."""
    return tuple(next(iter(self.actions(s)), None) for s in range(len(self.ticks[0].compute)))

  @property
  def messages(self) -> tuple[tuple[int, int], ...]:
    return tuple(m for t in self.ticks for m in t.messages)

  @property
  def offsets(self) -> frozenset[int]:
    """The stage offsets its messages travel: its send's ppermutes."""
    p = len(self.ticks[0].compute)
    return frozenset((to - s) % p for s, to in self.messages)

  def actions(self, stage: int) -> tuple[Action, ...]:
    return tuple(a for t in self.ticks for a in t.actions(stage))


def rounds(program: Program) -> list[Round]:
  """A packed program's rounds as cost models see them."""
  all_ticks = ticks(program)
  bounds = list(program.rounds) + [program.ticks]
  return [Round(r, tuple(all_ticks[a:b])) for r, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def send_phase(tick: Tick, transfer: Sequence[float], floor: float = 0.0) -> float:
  """The send phase that ends a tick: the longest of its neighbour ppermutes.

  They run side by side (one per stage offset, other links), so the phase
  takes the longest of them, not their sum.

  Args:
    tick: the tick.
    transfer: per stage, one activation or gradient sent to another stage;
      charged for each message the tick sends across stages.
    floor: what the tick's neighbour ppermutes cost whatever they carry
      (the executor runs one per stage offset in every tick); 0 charges
      only the messages.
  """
  return max([floor] + [transfer[s] for s, _ in tick.messages])


def move_phase(tick: Tick, evict: Sequence[float]) -> float:
  """The partner ppermute that opens a tick where residual sets move.

  It runs before the tick's compute, not beside the neighbour ppermutes
  (see executor.move), so it adds to the tick: the slowest of the tick's
  movers, 0 where none moves.

  Args:
    tick: the tick.
    evict: per stage, one residual set sent to its partner.
  """
  return max([0.0] + [evict[s] for s in tick.movers])


class TickCosts(Protocol):
  """What `simulate_lockstep` asks of a cost model.

  `Costs` (one per stage or for all) is the simple one (see `StageCosts`);
  the planner's per-chunk costs with shared cores and the executor's
  per-tick ppermutes are another (plan/cost/simulator.py).
  """

  def duration(self, stage: int, action: Action) -> float:
    """The time `stage` takes for one compute action, with its devices to itself."""

  def overlapped(self, stage: int, actions: Sequence[Action]) -> float:
    """The time `stage` takes for a fused tick's actions (B, W, then F) run
    in one computation, with its devices to itself."""

  def tick_time(self, tick: Tick, work: Sequence[float]) -> float:
    """The compute phase of `tick`, given each stage's duration (0 if idle):
    at least the slowest stage's, more where stages share cores."""

  def transfer(self, tick: Tick) -> float:
    """The send phase that ends `tick`: its neighbour ppermutes."""

  def move(self, tick: Tick) -> float:
    """The partner ppermute that opens `tick`: 0 where no set moves."""

  def copy(self, stage: int, action: Action) -> float:
    """One EVICT or LOAD sent by `stage` (drawn on its timeline only; the
    time it costs the step is in `move`)."""


class StageCosts:
  """`Costs` (one for every stage or one per stage) as a lockstep cost model.

  Compute actions cost their kind's time over v (`Costs.lockstep`: a fused
  backward runs as B then W). The send phase (`send_phase`) lasts the
  slowest sender's t_transfer if an activation or gradient crosses stages
  in the tick; a tick where residuals move opens with t_evict / v
  (`move_phase`: the executor's residual ppermute runs on every paired
  stage then).
  """

  def __init__(self, program: Program, costs: CostsLike):
    schedule = program.schedule
    self._per = per_stage(costs, schedule.stages)
    self._v = schedule.virtual_stages
    self._fused = not program.source.split_backward
    self._transfer = [c.t_transfer for c in self._per]
    self._evict = [c.t_evict / self._v for c in self._per]

  def duration(self, stage: int, action: Action) -> float:
    return self._per[stage].lockstep(action.kind, self._v, self._fused)

  def overlapped(self, stage: int, actions: Sequence[Action]) -> float:
    return self._per[stage].overlapped([a.kind for a in actions], self._v, self._fused)

  def tick_time(self, tick: Tick, work: Sequence[float]) -> float:
    return max(work, default=0.0)

  def transfer(self, tick: Tick) -> float:
    return send_phase(tick, self._transfer)

  def move(self, tick: Tick) -> float:
    return move_phase(tick, self._evict)

  def copy(self, stage: int, action: Action) -> float:
    return self._per[stage].of(action.kind, self._v)


def ticks(program: Program) -> list[Tick]:
  """The program's ticks as cost models see them."""
  schedule = program.schedule
  last = schedule.num_chunks - 1
  paired = (
    () if program.partner is None else tuple(s for s, q in enumerate(program.partner) if q != s)
  )
  out = []
  for t, row in enumerate(program.grid):
    compute, messages, copies, fused = [], [], [], []
    moving = any(a.kind in sched.COPY_KINDS for cell in row for a in cell)
    for s, cell in enumerate(row):
      run = [a for a in cell if a.kind in sched.COMPUTE_KINDS]
      compute.append(run[0] if run else None)
      fused.append(tuple(run[1:]))
      copies += [(s, a) for a in cell if a.kind in sched.COPY_KINDS]
      for a in run:
        if a.kind == sched.FORWARD and a.chunk < last:
          to = schedule.stage_of(a.chunk + 1)
        elif a.kind == sched.BACKWARD and a.chunk > 0:
          to = schedule.stage_of(a.chunk - 1)
        else:
          continue
        if to != s:
          messages.append((s, to))
    out.append(
      Tick(
        index=t,
        compute=tuple(compute),
        messages=tuple(messages),
        copies=tuple(copies),
        movers=paired if moving else (),
        fused=tuple(fused),
      )
    )
  return out


def simulate_lockstep(program: Program, costs: CostsLike | TickCosts = Costs()) -> Result:
  """Times the lockstep program the executor runs.

  Each tick lasts its compute phase (`costs.tick_time`: for `Costs`, the
  slowest stage's one compute action) plus its send phase
  (`costs.transfer`) and the partner ppermute that opens it (`costs.move`,
  0 where no residual set moves). Where sharing stretches a tick's compute
  beyond the slowest stage, every stage's action is drawn stretched alike. Peak
  in-flight is the program's stash peak: a residual set is held from its F
  until its W frees it, and an evicted set on the partner while away.

  Args:
    program: the lowered schedule.
    costs: a `Costs`, one per stage, or any `TickCosts`.
  """
  if isinstance(costs, Costs) or (not hasattr(costs, 'duration') and isinstance(costs, Sequence)):
    costs = StageCosts(program, costs)
  if program.packed:
    return _simulate_rounds(program, costs)
  spans, now = [], 0.0
  for tick in ticks(program):
    work = [_work(costs, s, tick.actions(s)) for s in range(len(tick.compute))]
    compute = costs.tick_time(tick, work)
    longest = max(work, default=0.0)
    stretch = compute / longest if longest > 0 else 1.0
    for s, a in tick.copies:
      spans.append(Span(s, a, now, now + costs.copy(s, a)))
    now += costs.move(tick)
    for s in range(len(tick.compute)):
      # A fused tick's actions drawn one after another, in its time.
      acts = tick.actions(s)
      alone = [costs.duration(s, a) for a in acts]
      scale = work[s] * stretch / sum(alone) if sum(alone) > 0 else 0.0
      start = now
      for a, d in zip(acts, alone):
        spans.append(Span(s, a, start, start + d * scale))
        start += d * scale
    now += compute + costs.transfer(tick)
  return _result('lockstep', program.schedule, spans, now, program.peaks['stash'], program.ticks)


def _simulate_rounds(program: Program, costs: TickCosts) -> Result:
  """`simulate_lockstep` of a packed program: round by round, each stage's
  actions one after another, the round as long as its busiest stage, then
  its send phase where its stages make messages for others."""
  spans, now = [], 0.0
  for view in rounds(program):
    alone = [[costs.duration(s, a) for a in view.actions(s)] for s in range(len(view.compute))]
    work = [sum(d) for d in alone]
    compute = costs.tick_time(view, work)
    longest = max(work, default=0.0)
    stretch = compute / longest if longest > 0 else 1.0
    for s, durations in enumerate(alone):
      at = 0.0  # into the round, before the stretch
      for a, d in zip(view.actions(s), durations):
        spans.append(Span(s, a, now + at * stretch, now + (at + d) * stretch))
        at += d
    now += compute
    if view.ticks[-1].index in program.sends:
      now += costs.transfer(view)
  return _result('lockstep', program.schedule, spans, now, program.peaks['stash'], program.ticks)


def _work(costs: TickCosts, stage: int, actions: Sequence[Action]) -> float:
  """A stage's compute in a tick: its one action, or a fused tick's."""
  if len(actions) > 1:
    return costs.overlapped(stage, actions)
  return sum(costs.duration(stage, a) for a in actions)


def simulate_async(schedule: Schedule, costs: CostsLike = Costs()) -> Result:
  """Times the per-stage orders as the papers run them.

  Each compute action starts when its stage has finished the previous
  compute action of its order and every input is ready, plus the producer's
  t_transfer for an input from another stage. Copies (EVICT, LOAD) run on
  the sender's copy stream (see the module docstring); their duration
  t_evict includes the transfer. With fixed per-stage orders this
  as-soon-as-possible timing is unique, so sweeping the stages until
  nothing moves is exact.

  Raises:
    ScheduleDeadlock: if the orders cannot all run to the end.
  """
  p, v = schedule.stages, schedule.virtual_stages
  per = per_stage(costs, p)
  done: dict[Action, tuple[float, int]] = {}  # action -> (end, stage)
  free, copy_free = [0.0] * p, [0.0] * p
  ends: list[list[float]] = [[] for _ in range(p)]  # compute ends, in order
  spans = []

  def run(s: int, a: Action, issued: int | None) -> bool:
    start = _ready_time(a, s, schedule, done, per)
    if start is None:
      return False
    if issued is None:
      start = max(start, free[s])
      free[s] = end = start + per[s].of(a.kind, v)
      ends[s].append(end)
    else:
      start = max(start, copy_free[s], ends[s][issued - 1] if issued else 0.0)
      copy_free[s] = end = start + per[s].of(a.kind, v)
    done[a] = (end, s)
    spans.append(Span(s, a, start, end))
    return True

  stuck = sched.walk_async(schedule, run)
  if stuck:
    raise sched.ScheduleDeadlock(
      f'{schedule.name}: asynchronous orders deadlock: '
      + '; '.join(f'stage {s} waits at {a}' for s, a in stuck)
    )
  if schedule.evicted:
    peak = _async_peaks(schedule, spans)
  else:
    peak = _peak_inflight(schedule.orders, schedule)
  total = max(free + copy_free, default=0.0)
  return _result('async', schedule, spans, total, peak)


def _async_peaks(schedule: Schedule, spans: Sequence[Span]) -> list[int]:
  """Peak residual sets per stage from the timeline, when sets move.

  A set is held on its stage from its F's start to the end of its EVICT,
  on the partner from the EVICT's start to the LOAD's end, and home again
  from the LOAD's start to the end of its freeing B or W: a moving set
  holds a slot at both ends. At equal times, sets whose holding ends there
  leave before new ones arrive, and a zero-length holding counts at its
  instant.
  """
  has_w = _frees(schedule)
  span_of = {x.action: x for x in spans}
  holds = []  # (stage, start, end)
  for a, x in span_of.items():
    if a.kind != sched.FORWARD:
      continue
    j, c = a.microbatch, a.chunk
    s = schedule.stage_of(c)
    freed = span_of[Action(sched.WEIGHT if (j, c) in has_w else sched.BACKWARD, j, c)].end
    if (j, c) in schedule.evicted:
      evict = span_of[Action(sched.EVICT, j, c)]
      load = span_of[Action(sched.LOAD, j, c)]
      holds += [
        (s, x.start, evict.end),
        (schedule.partner[s], evict.start, load.end),
        (s, load.start, freed),
      ]
    else:
      holds.append((s, x.start, freed))
  events = [[] for _ in range(schedule.stages)]
  for s, start, end in holds:
    events[s].append((start, 1, 1))
    events[s].append((end, 0 if end > start else 2, -1))
  peaks = []
  for stage_events in events:
    held = peak = 0
    for _, _, delta in sorted(stage_events):
      held += delta
      peak = max(peak, held)
    peaks.append(peak)
  return peaks


def _ready_time(
  a: Action,
  stage: int,
  schedule: Schedule,
  done: dict[Action, tuple[float, int]],
  per: Sequence[Costs],
) -> float | None:
  """When all inputs of `a` are on `stage`, or None if one is not done.

  A compute input from another stage arrives t_transfer after it ends; a
  copy's end is already its arrival.
  """
  ready = 0.0
  for d in sched.dependencies(a, schedule):
    if d not in done:
      return None
    end, src = done[d]
    hop = src != stage and d.kind not in sched.COPY_KINDS
    ready = max(ready, end + (per[src].t_transfer if hop else 0.0))
  return ready
