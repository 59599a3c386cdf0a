"""Time and memory models of a pipeline schedule.

Two models, because the papers and our executor run schedules differently:

- lockstep (`simulate_lockstep`): what triax's SPMD executor does. All
  stages advance tick by tick; a tick lasts as long as its slowest stage
  (F, then B, then W, back to back), plus its transfer phase if anything is
  sent in it.
- asynchronous (`simulate_async`): what the papers draw. Each stage runs the
  compute actions (F, B, W) of its order as soon as its compute stream is
  free and the inputs have arrived. EVICT/LOAD (BPipe) run on a separate
  copy stream of the sending stage, which overlaps compute: a copy starts
  once the compute actions before it in the order are done, its input is
  there and the previous copy of that stage has finished; the B that needs
  a loaded set waits for the LOAD to end.

Memory is counted as in-flight micro-batch-chunks: residual sets a stage
stashes, its own waiting for their backward (their W, if the schedule splits
the backward) and, under BPipe, its partner's evicted ones (each set is 1/v
of a stage's activations for one micro-batch). Transfer and copy time is
not busy time: the bubble counts compute only.

Plain Python: the planner times schedules without devices.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Action, Program, Schedule


@dataclasses.dataclass(frozen=True)
class Costs:
  """Durations on one stage, in any consistent time unit.

  Schedules that split the backward (zb_h1) charge B t_backward (input
  gradient only) and W t_weight (weight gradient); the others charge B
  t_backward for the whole backward and never run W. To compare the two
  like with like from one measured backward time T_bwd, give a fused
  schedule t_backward = T_bwd and a split one t_backward + t_weight = T_bwd;
  for matmul-dominated layers the input- and weight-gradient GEMMs cost the
  same FLOPs, so t_backward ~ t_weight ~ T_bwd / 2 (ZB-H1's design point
  t_F = t_B = t_W is a fused backward of twice the forward).

  Attributes:
    t_forward: forward of one micro-batch through all layers of one pipeline
      stage; a chunk's forward takes t_forward / v.
    t_backward: backward (input and weight gradient; input gradient only in
      schedules with W actions) likewise.
    t_weight: weight-gradient-only action (zero-bubble W) likewise.
    t_transfer: sending one activation or gradient to a neighbour stage.
    t_evict: moving one stage's residual set for one micro-batch to or from
      its partner (BPipe EVICT or LOAD); a chunk's set takes t_evict / v.
  """
  t_forward: float = 1.0
  t_backward: float = 1.0
  t_weight: float = 0.0
  t_transfer: float = 0.0
  t_evict: float = 0.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not (isinstance(value, numbers.Real) and math.isfinite(value) and
              value >= 0):
        raise ValueError(f'Costs.{field.name} must be a finite number >= 0; '
                         f'got {value!r}')

  def of(self, kind: str, virtual_stages: int) -> float:
    """Duration of one chunk action of this kind."""
    per_stage = {sched.FORWARD: self.t_forward,
                 sched.BACKWARD: self.t_backward,
                 sched.WEIGHT: self.t_weight,
                 sched.EVICT: self.t_evict,
                 sched.LOAD: self.t_evict}
    if kind not in per_stage:
      raise NotImplementedError(f'no time model for {kind} actions')
    return per_stage[kind] / virtual_stages


CostsLike = Costs | Sequence[Costs]


def per_stage(costs: CostsLike, stages: int) -> tuple[Costs, ...]:
  """One Costs per stage: the same for all, or a sequence of p (for
  heterogeneous devices)."""
  if isinstance(costs, Costs):
    return (costs,) * stages
  costs = tuple(costs)
  if len(costs) != stages or not all(isinstance(c, Costs) for c in costs):
    raise ValueError(f'want one Costs or a sequence of {stages} Costs; got '
                     f'{costs!r}')
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


def _result(model: str, schedule: Schedule, spans: list[Span],
            total: float, peak: Sequence[int],
            ticks: int | None = None) -> Result:
  busy = [0.0] * schedule.stages
  for span in spans:
    if span.action.kind not in sched.COPY_KINDS:
      busy[span.stage] += span.end - span.start
  capacity = schedule.stages * total
  # An all-zero cost model has no time to waste: call its bubble 0.
  bubble = 1.0 - sum(busy) / capacity if capacity > 0 else 0.0
  spans = sorted(spans, key=lambda x: (x.stage, x.start, x.end))
  return Result(model=model, schedule=schedule, total_time=total,
                bubble_fraction=bubble, busy=tuple(busy),
                peak_inflight=tuple(peak), timeline=tuple(spans),
                ticks=ticks)


def _frees(schedule: Schedule) -> set[tuple[int, int]]:
  """(micro-batch, chunk) pairs freed by their W rather than their B."""
  return {(a.microbatch, a.chunk) for o in schedule.orders for a in o
          if a.kind == sched.WEIGHT}


def _peak_inflight(sequences: Sequence[Sequence[Action]],
                   schedule: Schedule) -> list[int]:
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
      elif (a.kind == sched.WEIGHT or
            (a.kind == sched.BACKWARD and key not in has_w)):
        held -= 1
    peaks.append(peak)
  return peaks


def _lockstep_peaks(program: Program) -> list[int]:
  """Replays the grid phase by phase: F stashes, the freeing B or W frees,
  a copy frees on its sender when the transfer phase reads it and stashes on
  its receiver when the phase writes it."""
  schedule = program.schedule
  has_w = _frees(schedule)
  held = [0] * schedule.stages
  peak = [0] * schedule.stages
  for row in program.grid:
    arriving = []
    for s, cell in enumerate(row):
      for a in cell:
        key = (a.microbatch, a.chunk)
        if a.kind == sched.FORWARD:
          held[s] += 1
          peak[s] = max(peak[s], held[s])
        elif a.kind == sched.WEIGHT or (a.kind == sched.BACKWARD and
                                        key not in has_w):
          held[s] -= 1
        elif a.kind in sched.COPY_KINDS:
          held[s] -= 1
          home = schedule.stage_of(a.chunk)
          arriving.append(schedule.partner[home] if a.kind == sched.EVICT
                          else home)
    for s in arriving:
      held[s] += 1
      peak[s] = max(peak[s], held[s])
  return peak


def simulate_lockstep(program: Program, costs: CostsLike = Costs()) -> Result:
  """Times the lockstep program the executor runs.

  A stage runs its tick's F, B and W back to back; the tick lasts as long as
  the busiest stage, plus its transfer phase: the largest sender's
  t_transfer if an activation or gradient crosses stages in it (with one
  stage the ppermute is the identity), or the largest t_evict of its EVICTs
  and LOADs if that is longer. The evict/load ppermutes run beside the
  neighbour ones in that phase (other links, except at p = 2), so the phase
  takes the longest of them, not their sum.
  """
  schedule = program.schedule
  p, v, last = schedule.stages, schedule.virtual_stages, schedule.num_chunks - 1
  per = per_stage(costs, p)
  spans, now = [], 0.0
  for row in program.grid:
    longest, transfer, copying = 0.0, 0.0, 0.0
    copies = []
    for s, cell in enumerate(row):
      t = now
      for a in cell:
        if a.kind in sched.COPY_KINDS:
          copies.append((s, a))
          copying = max(copying, per[s].of(a.kind, v))
          continue
        spans.append(Span(s, a, t, t + per[s].of(a.kind, v)))
        t = spans[-1].end
        sends = (a.kind == sched.FORWARD and a.chunk != last) or (
            a.kind == sched.BACKWARD and a.chunk > 0)
        if sends and p > 1:
          transfer = max(transfer, per[s].t_transfer)
      longest = max(longest, t - now)
    for s, a in copies:
      start = now + longest
      spans.append(Span(s, a, start, start + per[s].of(a.kind, v)))
    now += longest + max(transfer, copying)
  return _result('lockstep', schedule, spans, now, _lockstep_peaks(program),
                 program.ticks)


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
  compute = [[a for a in o if a.kind not in sched.COPY_KINDS]
             for o in schedule.orders]
  copies = [[a for a in o if a.kind in sched.COPY_KINDS]
            for o in schedule.orders]
  issue = [sched.copy_issue_points(o) for o in schedule.orders]
  done: dict[Action, tuple[float, int]] = {}  # action -> (end, stage)
  cursor, copy_cursor = [0] * p, [0] * p
  free, copy_free = [0.0] * p, [0.0] * p
  ends: list[list[float]] = [[] for _ in range(p)]  # compute ends, in order
  spans = []
  progress = True
  while progress:
    progress = False
    for s in range(p):
      moved = True
      while moved:
        moved = False
        if cursor[s] < len(compute[s]):
          a = compute[s][cursor[s]]
          start = _ready_time(a, s, schedule, done, per)
          if start is not None:
            start = max(start, free[s])
            free[s] = start + per[s].of(a.kind, v)
            done[a] = (free[s], s)
            ends[s].append(free[s])
            spans.append(Span(s, a, start, free[s]))
            cursor[s] += 1
            moved = True
        k = copy_cursor[s]
        if k < len(copies[s]) and cursor[s] >= issue[s][k]:
          a = copies[s][k]
          start = _ready_time(a, s, schedule, done, per)
          if start is not None:
            issued = ends[s][issue[s][k] - 1] if issue[s][k] else 0.0
            start = max(start, copy_free[s], issued)
            copy_free[s] = start + per[s].of(a.kind, v)
            done[a] = (copy_free[s], s)
            spans.append(Span(s, a, start, copy_free[s]))
            copy_cursor[s] += 1
            moved = True
        progress |= moved
  stuck = [f'stage {s} waits at {stream[at]}'
           for s in range(p)
           for stream, at in ((compute[s], cursor[s]),
                              (copies[s], copy_cursor[s]))
           if at < len(stream)]
  if stuck:
    raise sched.ScheduleDeadlock(
        f'{schedule.name}: asynchronous orders deadlock: ' + '; '.join(stuck))
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
    freed = span_of[Action(sched.WEIGHT if (j, c) in has_w
                                 else sched.BACKWARD, j, c)].end
    if (j, c) in schedule.evicted:
      evict = span_of[Action(sched.EVICT, j, c)]
      load = span_of[Action(sched.LOAD, j, c)]
      holds += [(s, x.start, evict.end),
                (schedule.partner[s], evict.start, load.end),
                (s, load.start, freed)]
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


def _ready_time(a: Action, stage: int, schedule: Schedule,
                done: dict[Action, tuple[float, int]],
                per: Sequence[Costs]) -> float | None:
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
