"""What both synthesisers solve: the actions, their durations and lags, the limit.

A synthesis problem is p stages, m micro-batches and v chunks per stage placed by
`placement`, every backward split into B (input gradient) and W (weight gradient) as in
zb_h1, one `Costs` for every stage, and a memory limit K: the most residual sets
(micro-batch-chunks, what `simulate.Result.peak_inflight` counts) any stage may hold. A
set is held from its F until its W, so a stage's peak is a property of its order alone.

Optionally a cut limit C too: the most backwards whose W is still to run (each holds a cut,
the executor's 'cut' pool, about a residual set's bytes again: plan/cost/memory.py's
`chunk_cut`). Bounding both is how the planner fits a schedule between 1F1B (one cut) and
the zero-bubble orders (a cut per delayed W) in the executor's memory.

Time is the asynchronous model of `simulate.simulate_async`: an action starts once its
stage is free and its inputs have arrived (a producer's end plus t_transfer from another
stage), so a synthesised order timed there takes exactly the makespan computed for it."""

from __future__ import annotations

import dataclasses
import functools

from triax.pipeline.ir import BACKWARD, FORWARD, WEIGHT, Action
from triax.pipeline.simulate import Costs

# An action as (kind, microbatch, chunk): what the greedy passes key by.
Key = tuple[str, int, int]


def key(a: Action) -> Key:
  return (a.kind, a.microbatch, a.chunk)


@dataclasses.dataclass(frozen=True)
class Problem:
  """One synthesis request, sizes checked (see `synthesis.synthesize`)."""

  stages: int
  microbatches: int
  virtual_stages: int
  placement: tuple[int, ...]
  memory_limit: int
  costs: Costs
  cut_limit: int | None = None

  @property
  def num_chunks(self) -> int:
    return self.stages * self.virtual_stages

  def duration(self, kind: str) -> float:
    return self._durations[kind]

  @functools.cached_property
  def _durations(self) -> dict[str, float]:
    # Both synthesisers ask millions of times: computed once per problem.
    return {kind: self.costs.of(kind, self.virtual_stages) for kind in (FORWARD, BACKWARD, WEIGHT)}

  def hop(self, src_chunk: int, dst_chunk: int) -> float:
    """t_transfer when the two chunks sit on different stages, else 0."""
    same = self.placement[src_chunk] == self.placement[dst_chunk]
    return 0.0 if same else self.costs.t_transfer

  @functools.cached_property
  def chunks_of(self) -> tuple[tuple[int, ...], ...]:
    """Per stage, its chunks in layer order."""
    return tuple(
      tuple(c for c, s in enumerate(self.placement) if s == stage) for stage in range(self.stages)
    )

  @functools.cached_property
  def actions_of(self) -> tuple[tuple[Action, ...], ...]:
    """Per stage, every F, B and W it runs (in no particular order)."""
    return tuple(
      tuple(
        Action(kind, j, c)
        for c in chunks
        for j in range(self.microbatches)
        for kind in (FORWARD, BACKWARD, WEIGHT)
      )
      for chunks in self.chunks_of
    )

  def predecessors(self, a: Action) -> tuple[tuple[Action, float], ...]:
    """(input, lag): `a` may start `lag` after its input starts (see `_inputs`)."""
    return self._predecessors[a]

  @functools.cached_property
  def _predecessors(self) -> dict[Action, tuple[tuple[Action, float], ...]]:
    return {a: self._inputs(a) for actions in self.actions_of for a in actions}

  @functools.cached_property
  def keyed_inputs(self) -> dict[Key, tuple[tuple[Key, float, float], ...]]:
    """`predecessors` keyed by `key`, each input with its duration:
    (input, input's duration, lag). The greedy passes ask millions of times
    whether an input has run, and a tuple hashes in C (an Action in Python)."""
    return {
      key(a): tuple((key(d), self.duration(d.kind), lag) for d, lag in self.predecessors(a))
      for actions in self.actions_of
      for a in actions
    }

  def _inputs(self, a: Action) -> tuple[tuple[Action, float], ...]:
    """(input, lag): `a` may start `lag` after its input starts.

    The lag is the input's duration plus the hop between their stages:
    F(j,c) after F(j,c-1); B(j,c) after F(j,c) and B(j,c+1); W(j,c) after
    B(j,c) (`ir.dependencies` with a split backward).
    """
    j, c = a.microbatch, a.chunk
    f, b = self.duration(FORWARD), self.duration(BACKWARD)
    if a.kind == FORWARD:
      return ((Action(FORWARD, j, c - 1), f + self.hop(c - 1, c)),) if c > 0 else ()
    if a.kind == BACKWARD:
      deps = ((Action(FORWARD, j, c), f),)
      if c < self.num_chunks - 1:
        deps += ((Action(BACKWARD, j, c + 1), b + self.hop(c + 1, c)),)
      return deps
    return ((Action(BACKWARD, j, c), b),)

  def least_memory(self) -> int:
    """The fewest residual sets some stage must hold in any schedule.

    A micro-batch's set of a stage's first chunk is held until its W, after
    its B, after the backward of every later chunk, after their forwards:
    so each stage holds all of its chunks' sets of one micro-batch at once,
    v of them, and running one micro-batch at a time needs no more.
    """
    return max(len(chunks) for chunks in self.chunks_of)


def peak_held(order: tuple[Action, ...] | list[Action]) -> int:
  """The most residual sets a stage holds running `order` (F +1, W -1)."""
  return _peak(order, FORWARD)


def peak_cuts(order: tuple[Action, ...] | list[Action]) -> int:
  """The most cuts a stage holds running `order` (B +1, W -1)."""
  return _peak(order, BACKWARD)


def _peak(order, opens) -> int:
  """The most of what `opens` makes and W frees that `order` holds at once."""
  held = peak = 0
  for a in order:
    if a.kind == opens:
      held += 1
      peak = max(peak, held)
    elif a.kind == WEIGHT:
      held -= 1
  return peak


def within(problem: Problem, order) -> bool:
  """Whether one stage's order keeps to the problem's set and cut limits."""
  if peak_held(order) > problem.memory_limit:
    return False
  return problem.cut_limit is None or peak_cuts(order) <= problem.cut_limit


def asap(problem: Problem, orders) -> dict[Action, float] | None:
  """Start times of fixed per-stage orders run as soon as possible.

  The timing of `simulate.simulate_async` (which the result is checked
  against), without building a Schedule; None if the orders deadlock.
  """
  starts: dict[Action, float] = {}
  cursor, free = [0] * len(orders), [0.0] * len(orders)
  moved = True
  while moved:
    moved = False
    for s, order in enumerate(orders):
      while cursor[s] < len(order):
        a = order[cursor[s]]
        deps = problem.predecessors(a)
        if any(d not in starts for d, _ in deps):
          break
        t = max([free[s]] + [starts[d] + lag for d, lag in deps])
        starts[a] = t
        free[s] = t + problem.duration(a.kind)
        cursor[s] += 1
        moved = True
  if any(cursor[s] < len(order) for s, order in enumerate(orders)):
    return None
  return starts


def makespan(problem: Problem, orders) -> float | None:
  """The asynchronous makespan of fixed orders, or None if they deadlock."""
  starts = asap(problem, orders)
  if starts is None:
    return None
  return max((t + problem.duration(a.kind) for a, t in starts.items()), default=0.0)


def lower_bound(problem: Problem) -> float:
  """No schedule is shorter: each stage's work, after its earliest start and
  before its shortest tail (the one-machine bound).

  head(a) is the longest chain of inputs before a can start, tail(a) the
  longest chain from a's end to the last action's end; a stage runs all its
  work between its earliest head and its shortest tail.
  """
  head: dict[Action, float] = {}

  def head_of(a: Action) -> float:
    if a not in head:
      head[a] = max((head_of(d) + lag for d, lag in problem.predecessors(a)), default=0.0)
    return head[a]

  succ: dict[Action, list[tuple[Action, float]]] = {}
  for stage in problem.actions_of:
    for a in stage:
      for d, lag in problem.predecessors(a):
        succ.setdefault(d, []).append((a, lag))
  tail: dict[Action, float] = {}

  def tail_of(a: Action) -> float:
    if a not in tail:
      d = problem.duration(a.kind)
      tail[a] = max(
        (lag - d + problem.duration(b.kind) + tail_of(b) for b, lag in succ.get(a, ())), default=0.0
      )
    return tail[a]

  bound = 0.0
  for stage in problem.actions_of:
    work = sum(problem.duration(a.kind) for a in stage)
    bound = max(bound, min(map(head_of, stage)) + work + min(map(tail_of, stage)))
  return bound
