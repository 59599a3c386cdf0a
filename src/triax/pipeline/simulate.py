"""Time and memory models of a pipeline schedule.

Two models, because the papers and our executor run schedules differently:

- lockstep (`simulate_lockstep`): what triax's SPMD executor does. All
  stages advance tick by tick; a tick lasts as long as its slowest stage,
  plus one transfer if anything is sent in it.
- asynchronous (`simulate_async`): what the papers draw. Each stage runs its
  order as soon as the stage is free and the inputs have arrived.

Memory is counted as in-flight micro-batch-chunks: forwards whose stashed
residuals still wait for their backward (each is 1/v of a stage's
activations for one micro-batch).

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

  Attributes:
    t_forward: forward of one micro-batch through all layers of one pipeline
      stage; a chunk's forward takes t_forward / v.
    t_backward: backward (input and weight gradient) likewise.
    t_weight: weight-gradient-only action (zero-bubble W) likewise.
    t_transfer: sending one activation or gradient to a neighbour stage.
  """
  t_forward: float = 1.0
  t_backward: float = 1.0
  t_weight: float = 0.0
  t_transfer: float = 0.0

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
                 sched.WEIGHT: self.t_weight}
    if kind not in per_stage:
      raise NotImplementedError(f'no time model for {kind} actions yet')
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
  """One action on the timeline."""
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
    busy: per stage, time spent running actions.
    peak_inflight: per stage, the most micro-batch-chunks stashed at once.
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
    busy[span.stage] += span.end - span.start
  capacity = schedule.stages * total
  # An all-zero cost model has no time to waste: call its bubble 0.
  bubble = 1.0 - sum(busy) / capacity if capacity > 0 else 0.0
  spans = sorted(spans, key=lambda x: (x.stage, x.start, x.end))
  return Result(model=model, schedule=schedule, total_time=total,
                bubble_fraction=bubble, busy=tuple(busy),
                peak_inflight=tuple(peak), timeline=tuple(spans),
                ticks=ticks)


def _peak_inflight(sequences: Sequence[Sequence[Action]],
                   schedule: Schedule) -> list[int]:
  """Max stashed micro-batch-chunks while running each stage's sequence.

  A forward stashes; the last gradient action of that (micro-batch, chunk)
  frees: its W if the schedule has one, else its B.
  """
  has_w = {(a.microbatch, a.chunk) for o in schedule.orders for a in o
           if a.kind == sched.WEIGHT}
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


def simulate_lockstep(program: Program, costs: CostsLike = Costs()) -> Result:
  """Times the lockstep program the executor runs.

  A stage runs its tick's F then its B back to back; the tick lasts as long
  as the busiest stage, plus the largest sender's t_transfer if anything
  crosses stages in it (with one stage the ppermute is the identity).
  """
  schedule = program.schedule
  p, v, last = schedule.stages, schedule.virtual_stages, schedule.num_chunks - 1
  per = per_stage(costs, p)
  spans, now = [], 0.0
  for row in program.grid:
    longest, transfer = 0.0, 0.0
    for s, cell in enumerate(row):
      t = now
      for a in cell:
        spans.append(Span(s, a, t, t + per[s].of(a.kind, v)))
        t = spans[-1].end
        sends = (a.kind == sched.FORWARD and a.chunk != last) or (
            a.kind == sched.BACKWARD and a.chunk > 0)
        if sends and p > 1:
          transfer = max(transfer, per[s].t_transfer)
      longest = max(longest, t - now)
    now += longest + transfer
  peak = _peak_inflight(
      [[a for row in program.grid for a in row[s]] for s in range(p)],
      schedule)
  return _result('lockstep', schedule, spans, now, peak, program.ticks)


def simulate_async(schedule: Schedule, costs: CostsLike = Costs()) -> Result:
  """Times the per-stage orders as the papers run them.

  Each action starts when its stage has finished the previous action of its
  order and every input is ready, plus the producer's t_transfer for an input
  from another stage. With fixed per-stage orders this as-soon-as-possible
  timing is unique, so sweeping the stages until nothing moves is exact.

  Raises:
    ScheduleDeadlock: if the orders cannot all run to the end.
  """
  p, v = schedule.stages, schedule.virtual_stages
  per = per_stage(costs, p)
  done: dict[Action, tuple[float, int]] = {}  # action -> (end, stage)
  cursor, free = [0] * p, [0.0] * p
  spans = []
  progress = True
  while progress:
    progress = False
    for s, order in enumerate(schedule.orders):
      while cursor[s] < len(order):
        a = order[cursor[s]]
        start = _ready_time(a, s, schedule, done, per)
        if start is None:
          break
        start = max(start, free[s])
        free[s] = start + per[s].of(a.kind, v)
        done[a] = (free[s], s)
        spans.append(Span(s, a, start, free[s]))
        cursor[s] += 1
        progress = True
  stuck = [f'stage {s} waits at {order[cursor[s]]}'
           for s, order in enumerate(schedule.orders)
           if cursor[s] < len(order)]
  if stuck:
    raise sched.ScheduleDeadlock(
        f'{schedule.name}: asynchronous orders deadlock: ' + '; '.join(stuck))
  peak = _peak_inflight(schedule.orders, schedule)
  return _result('async', schedule, spans, max(free, default=0.0), peak)


def _ready_time(a: Action, stage: int, schedule: Schedule,
                done: dict[Action, tuple[float, int]],
                per: Sequence[Costs]) -> float | None:
  """When all inputs of `a` are on `stage`, or None if one is not done."""
  ready = 0.0
  for d in sched.dependencies(a, schedule):
    if d not in done:
      return None
    end, src = done[d]
    ready = max(ready, end + (per[src].t_transfer if src != stage else 0.0))
  return ready
