"""The schedule IR: actions, per-stage orders and the chunk-to-stage placement.

A `Schedule` lists, per pipeline stage, the order in which that stage runs
its actions: the asynchronous view of the papers, which
`simulate.simulate_async` times and `lower.lower` turns into the lockstep
program the executor runs. Model chunks are numbered globally, 0..p*v-1 in
layer order; `placement[c]` is the stage that holds chunk c (Megatron's
interleaving puts chunk c on stage c mod p, ZB-V folds the chunks into a V:
c on stage c for c < p and on 2p-1-c after). On its stage a chunk is known
by its local index: its rank among that stage's chunks in layer order.

Plain Python: the planner and the CLI use this without devices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

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


@dataclasses.dataclass(frozen=True, order=True)
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


def interleaved_placement(stages: int, virtual_stages: int) -> tuple[int, ...]:
  """Megatron's: chunk c on stage c mod p."""
  return tuple(c % stages for c in range(stages * virtual_stages))


def v_placement(stages: int) -> tuple[int, ...]:
  """ZB-V's: chunk c on stage c for c < p, on stage 2p-1-c for c >= p."""
  return tuple(range(stages)) + tuple(reversed(range(stages)))


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
    placement: placement[c] = the stage holding chunk c; every stage holds
      v chunks. None (the default) means Megatron's c mod p.
    overlaps: (forward, backward) pairs that torch runs as one overlapped
      action (DualPipeV's `(0F3;3B1)OVERLAP_F_B`), each backward right after
      its forward in their stage's order. The lockstep program still runs
      them in consecutive ticks; the mark is what a written CSV keeps.
    full_backwards: in a split schedule, the B actions torch runs as one
      full backward (its `B`, input and weight gradient), each with its W
      right after it in the order.
  """

  name: str
  stages: int
  microbatches: int
  virtual_stages: int
  orders: tuple[tuple[Action, ...], ...]
  partner: tuple[int, ...] | None = None
  stash_cap: int | None = None
  placement: tuple[int, ...] | None = None
  overlaps: frozenset[tuple[Action, Action]] = frozenset()
  full_backwards: frozenset[Action] = frozenset()

  def __post_init__(self):
    if self.placement is None:
      object.__setattr__(self, 'placement', interleaved_placement(self.stages, self.virtual_stages))
    else:
      object.__setattr__(self, 'placement', tuple(int(s) for s in self.placement))
    object.__setattr__(self, 'overlaps', frozenset(tuple(x) for x in self.overlaps))
    object.__setattr__(self, 'full_backwards', frozenset(self.full_backwards))

  @property
  def num_chunks(self) -> int:
    return self.stages * self.virtual_stages

  def stage_of(self, chunk: int) -> int:
    return self.placement[chunk]

  @functools.cached_property
  def _local(self) -> tuple[int, ...]:
    seen = [0] * self.stages
    local = []
    for s in self.placement:
      local.append(seen[s])
      seen[s] += 1
    return tuple(local)

  def local_of(self, chunk: int) -> int:
    """The chunk's index among its stage's chunks (layer order)."""
    return self._local[chunk]

  def chunks_of(self, stage: int) -> tuple[int, ...]:
    """The chunks stage `stage` holds, by local index."""
    return tuple(c for c, s in enumerate(self.placement) if s == stage)

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
    return frozenset((a.microbatch, a.chunk) for o in self.orders for a in o if a.kind == EVICT)

  @functools.cached_property
  def split_backward(self) -> bool:
    """True iff the schedule has W actions (B is the input gradient only)."""
    return any(a.kind == WEIGHT for o in self.orders for a in o)


class ScheduleDeadlock(RuntimeError):
  """A schedule cannot make progress (lockstep lowering or async timing)."""


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


def walk_async(schedule: Schedule, run: Callable[[int, Action, int | None], bool]) -> list:
  """Runs the per-stage orders as the papers do, stage by stage until nothing moves.

  Each stage runs its compute actions in order, and its copies (EVICT,
  LOAD) in order on a copy stream, a copy once the compute actions before
  it in the order have run (`copy_issue_points`). `run(stage, action,
  issued)` runs `action` if its inputs are ready and says whether it did;
  `issued` is None for a compute action, else how many of the stage's
  compute actions precede the copy. Returns (stage, action) where each
  stream stopped short of its end: empty when the orders run to the end.
  """
  compute = [[a for a in o if a.kind not in COPY_KINDS] for o in schedule.orders]
  copies = [[a for a in o if a.kind in COPY_KINDS] for o in schedule.orders]
  issue = [copy_issue_points(o) for o in schedule.orders]
  at, at_copy = [0] * schedule.stages, [0] * schedule.stages
  progress = True
  while progress:
    progress = False
    for s in range(schedule.stages):
      moved = True
      while moved:
        moved = False
        if at[s] < len(compute[s]) and run(s, compute[s][at[s]], None):
          at[s] += 1
          moved = True
        k = at_copy[s]
        if k < len(copies[s]) and at[s] >= issue[s][k] and run(s, copies[s][k], issue[s][k]):
          at_copy[s] += 1
          moved = True
        progress |= moved
  return [
    (s, stream[cursor])
    for s in range(schedule.stages)
    for stream, cursor in ((compute[s], at[s]), (copies[s], at_copy[s]))
    if cursor < len(stream)
  ]


def with_split_backward(schedule: Schedule) -> Schedule:
  """The schedule with each fused B followed at once by its own W.

  B then computes the input gradient only and W the weight gradients, so
  every compute action costs about one forward (t_F ~ t_B ~ t_W): what lets
  the lockstep executor run one action per stage per tick without a tick
  lasting a fused backward's two. A schedule that already splits is
  returned as it is.
  """
  if schedule.split_backward:
    return schedule
  orders = []
  for order in schedule.orders:
    out = []
    for a in order:
      out.append(a)
      if a.kind == BACKWARD:
        out.append(Action(WEIGHT, a.microbatch, a.chunk))
    orders.append(tuple(out))
  return dataclasses.replace(schedule, orders=tuple(orders))
