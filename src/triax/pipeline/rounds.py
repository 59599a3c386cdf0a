"""Rounds: lockstep ticks packed where a model's actions cost unequal amounts.

A packed program groups ticks into rounds. A round gives each stage a run of consecutive
actions from its order whose costs (`TickUnits`, in forwards) add up to at most the
round's length; the stages meet only at the round's send, so a stage that finishes early
goes on to its next tick.

Invariants: every action still has a tick of its own (a stage's k-th action of the round
runs in the round's k-th tick), so tables, slots, validator and executor keep one action
per stage per tick; no collective runs inside a round; an output for another stage waits
in a slot of its sender's message pool (at most one per stage offset a round) until the
send after the round's last tick and is readable in the next round; messages between a
stage's own chunks, its stash and its cuts never wait for a send.

`RULES` chooses a round's length (`longest`, `fill`); `lower.lower` packs with each rule
and keeps the program the lockstep time model times fastest at the design costs
(`TickUnits`, a message costing `MESSAGE_UNITS`). Plain Python: no devices needed.
Why rounds, and why sends do not overlap the next round: docs/design/executor.md."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from triax.pipeline.ir import (
  BACKWARD,
  COMPUTE_KINDS,
  FORWARD,
  Action,
  Schedule,
  ScheduleDeadlock,
  dependencies,
)

RULES = ('longest', 'fill')
# What one pipeline message costs at the design point, in forwards of one
# stage: how the lowering weighs a send it cannot hide (a 530B layer's
# activation over InfiniBand beside its forward on an A100 is about 0.05-0.1).
MESSAGE_UNITS = 0.1
# The most actions a stage's ready run is looked at (a round is never longer).
_LOOKAHEAD = 8
# pipeline.tick_packing: 'auto' packs where the model's recompute makes B
# cost two forwards; 'off' runs the papers' one action per tick.
PACKINGS = ('auto', 'off')


@dataclasses.dataclass(frozen=True)
class TickUnits:
  """What each compute action of a stage costs the packing, in forwards."""

  forward: int = 1
  backward: int = 1
  weight: int = 1

  def of(self, kind: str) -> int:
    if kind == FORWARD:
      return self.forward
    return self.backward if kind == BACKWARD else self.weight

  @property
  def uniform(self) -> bool:
    return self.forward == self.backward == self.weight


# Full recomputation: B reruns the forward, then computes the input
# gradient (two forwards' work); W, the weight gradient, costs one.
FULL_RECOMPUTE = TickUnits(forward=1, backward=2, weight=1)


def units_for(remat: str, packing: str = 'auto') -> TickUnits | None:
  """The units a model's lockstep program packs by: None (one action per
  tick) unless its backward recomputes the whole forward."""
  if packing == 'off' or remat != 'full':
    return None
  return FULL_RECOMPUTE


@dataclasses.dataclass(frozen=True)
class Packing:
  """Where a packed program runs each compute action.

  Attributes:
    at: each compute action's tick.
    rounds: the first tick of each round, ascending.
    sends: the last tick of each round that makes messages for other
      stages: its send runs after its compute.
    ticks: ticks in all.
  """

  at: dict[Action, int]
  rounds: tuple[int, ...]
  sends: frozenset[int]
  ticks: int


def cross_offset(schedule: Schedule, a: Action) -> int | None:
  """The stage offset `a`'s output travels to another stage, or None (no
  output, or it stays on its stage)."""
  if a.kind == FORWARD and a.chunk < schedule.num_chunks - 1:
    to = schedule.stage_of(a.chunk + 1)
  elif a.kind == BACKWARD and a.chunk > 0:
    to = schedule.stage_of(a.chunk - 1)
  else:
    return None
  s = schedule.stage_of(a.chunk)
  return None if to == s else (to - s) % schedule.stages


def pack(run: Schedule, units: TickUnits, rule: str) -> Packing:
  """Packs the split schedule `run` (every B followed by its W somewhere)
  into rounds by `rule` (one of RULES).

  Raises:
    ScheduleDeadlock: if the orders cannot run to the end.
  """
  packer = _Packer(run, units)
  while packer.remaining:
    runs = [packer.ready_run(s) for s in range(run.stages)]
    if not any(runs):
      packer.stuck()
    length = _round_length(runs, units, rule)
    packer.place([_fitting(x, units, length) for x in runs])
  return packer.result()


def _round_length(runs: Sequence[Sequence[Action]], units: TickUnits, rule: str) -> int:
  """The round's length in units: at least every stage's first action."""
  shortest = max(units.of(x[0].kind) for x in runs if x)
  if rule == 'longest':
    return shortest
  lengths = {sum(units.of(a.kind) for a in x[:k]) for x in runs for k in range(1, len(x) + 1)}

  def idle(length: int) -> tuple[float, int]:
    used = sum(sum(units.of(a.kind) for a in _fitting(x, units, length)) for x in runs)
    return 1 - used / (len(runs) * length), length

  return min((n for n in lengths if n >= shortest), key=idle)


def _fitting(run: Sequence[Action], units: TickUnits, length: int) -> list[Action]:
  """The longest prefix of a ready run whose units fit in `length`."""
  out, used = [], 0
  for a in run:
    used += units.of(a.kind)
    if used > length:
      break
    out.append(a)
  return out


class _Packer:
  """The rounds placed so far, and what each stage may run next."""

  def __init__(self, run: Schedule, units: TickUnits):
    self.run, self.units = run, units
    self.streams = [[a for a in o if a.kind in COMPUTE_KINDS] for o in run.orders]
    self.next = [0] * run.stages
    self.remaining = sum(map(len, self.streams))
    self.round_of: dict[Action, int] = {}
    self.at: dict[Action, int] = {}
    self.rounds: list[int] = []
    self.sends: set[int] = set()
    self.tick = 0
    # Per action: its inputs, each with whether its own stage made it; the
    # offset its output travels (None: none to another stage).
    self.inputs, self.offset = {}, {}
    for s, stream in enumerate(self.streams):
      for a in stream:
        deps = dependencies(a, run)
        self.inputs[a] = tuple((d, run.stage_of_action(d) == s) for d in deps)
        self.offset[a] = cross_offset(run, a)

  def ready_run(self, s: int) -> list[Action]:
    """Stage s's next actions that can run in this round, in order: each
    input made by an earlier action of the run or landed in time (module
    docstring), and at most one message per stage offset pending."""
    got: list[Action] = []
    offsets: set[int] = set()
    for a in self.streams[s][self.next[s] : self.next[s] + _LOOKAHEAD]:
      if not all(self._available(d, mine, got) for d, mine in self.inputs[a]):
        break
      o = self.offset[a]
      if o is not None and o in offsets:
        break
      offsets.add(o)
      got.append(a)
    return got

  def _available(self, d: Action, mine: bool, earlier: list[Action]) -> bool:
    """Made in an earlier round (and sent after it, if by another stage), or
    earlier in this run of the stage's own."""
    return d in self.round_of or (mine and d in earlier)

  def place(self, cells: list[list[Action]]) -> None:
    here, start = len(self.rounds), self.tick
    width = max(len(c) for c in cells)
    for s, cell in enumerate(cells):
      for k, a in enumerate(cell):
        self.round_of[a], self.at[a] = here, start + k
        if self.offset[a] is not None:
          self.sends.add(start + width - 1)
      self.next[s] += len(cell)
      self.remaining -= len(cell)
    self.rounds.append(start)
    self.tick += width

  def stuck(self) -> None:
    heads = [
      str(self.streams[s][self.next[s]])
      for s in range(self.run.stages)
      if self.next[s] < len(self.streams[s])
    ]
    raise ScheduleDeadlock(
      f'{self.run.name}: packed lowering makes no progress at tick {self.tick}; '
      f'stages wait on {", ".join(heads)}'
    )

  def result(self) -> Packing:
    return Packing(
      at=self.at, rounds=tuple(self.rounds), sends=frozenset(self.sends), ticks=self.tick
    )


def round_ends(packing: Packing) -> list[int]:
  """The last tick of each round."""
  return [t - 1 for t in packing.rounds[1:]] + [packing.ticks - 1]


def land_ticks(packing: Packing, schedule: Schedule) -> dict[Action, int]:
  """The tick at whose end each action's output lands on the stage that
  reads it: its own tick on its own stage, else its round's last tick,
  whose send carries it."""
  ends = round_ends(packing)
  landed = {}
  for a, t in packing.at.items():
    if cross_offset(schedule, a) is None:
      landed[a] = t
    else:
      landed[a] = ends[bisect.bisect_right(packing.rounds, t) - 1]
  return landed
