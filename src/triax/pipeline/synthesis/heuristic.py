"""The list-scheduling synthesiser: the zero-bubble paper's greedy, widened.

Qi et al. (ICLR'24, "Zero Bubble Pipeline Parallelism", section 3.2)
schedule each stage greedily: forwards while the memory limit allows, a
backward as soon as its gradient arrives, and weight gradients (W) into the
bubbles, or when memory is full. `list_schedule` plays that out in the
asynchronous time model (`problem`): the stage that frees first decides
next, from the F's and B's whose inputs have arrived. A `Policy` says how it
breaks the paper's ties: F or B first when both are ready, how many residual
sets it lets the forwards fill (the paper's warm-up depth), and whether a W
only fills a gap it cannot overrun (`strict`) or any idle moment (`eager`).
`synthesize` runs every policy, keeps the shortest orders, then improves
them by swapping neighbouring actions of a stage while that shortens the
step and keeps within the limit.

Each kind of each chunk takes micro-batches in order (every builder does),
so a stage only ever chooses among its chunks' next F, next B and its
oldest waiting W.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import random
import time

from triax.pipeline.ir import BACKWARD, FORWARD, WEIGHT, Action
from triax.pipeline.synthesis.problem import Key, Problem, key, within

Orders = list[list[Action]]


@dataclasses.dataclass(frozen=True)
class Policy:
  """How the greedy breaks ties (see the module docstring).

  With a `seed`,
  each decision draws F-or-B first and strict-or-eager W at
  random instead (the randomised restarts of `synthesize`).
  """

  forward_first: bool
  cap: int
  eager_w: bool
  taper: int = 0
  seed: int | None = None

  def cap_of(self, stage: int, least: int) -> int:
    """Stage s's warm-up depth: `cap` less `taper` per stage (1F1B's p-s is a taper of 1)."""
    return max(least, self.cap - self.taper * stage)


class Deadlock(Exception):
  """A policy left every stage waiting; `synthesize` drops that policy."""


def policies(problem: Problem) -> list[Policy]:
  """The tie-breaking rules tried: warm-up depths from the limit down to v."""
  low = problem.least_memory()
  caps = range(problem.memory_limit, max(low, problem.memory_limit - problem.stages) - 1, -1)
  return [
    Policy(forward_first=f, cap=cap, eager_w=e, taper=taper)
    for cap, f, e, taper in itertools.product(caps, (True, False), (False, True), (0, 1, 2))
  ]


def list_schedule(problem: Problem, policy: Policy) -> Orders:
  """Per-stage orders from one greedy pass (see the module docstring).

  A forward may raise its stage's residual sets to `policy.cap` only while
  the oldest micro-batch still to run forwards there keeps room for them:
  that micro-batch can then always finish, and the pass cannot deadlock.

  Raises:
    Deadlock: if no stage can run anything (not expected; checked).
  """
  return _Pass(problem, policy).run()


class _Pass:
  def __init__(self, problem: Problem, policy: Policy):
    self.pr, self.policy = problem, policy
    p = problem.stages
    # Actions keyed as tuples (problem.key): a tuple hashes in C.
    self.inputs = problem.keyed_inputs
    self.ends: dict[Key, float] = {}
    # An action's ready time, once all its inputs have run (it cannot change
    # after): a pass asks again at every step of its stage.
    self.ready: dict[Key, float] = {}
    self.free = [0.0] * p
    self.orders: Orders = [[] for _ in range(p)]
    self.next = {(k, c): 0 for k in (FORWARD, BACKWARD) for c in range(problem.num_chunks)}
    self.waiting = [collections.deque() for _ in range(p)]
    self.held = [0] * p
    self.left = [len(x) for x in problem.actions_of]
    self.gap_floor = min(problem.duration(FORWARD), problem.duration(BACKWARD))
    # Past this, stages only wait on each other: a deadlock.
    self.horizon = sum(
      problem.duration(a.kind) + problem.costs.t_transfer for o in problem.actions_of for a in o
    )
    self.rng = None if policy.seed is None else random.Random(policy.seed)

  def coin(self, default: bool) -> bool:
    return default if self.rng is None else self.rng.random() < 0.5

  def run(self) -> Orders:
    # The stage that frees first steps next (the lowest index among equals):
    # only the stepped stage's time changes, so a heap keeps the order.
    heap = [(self.free[s], s) for s in range(self.pr.stages) if self.left[s]]
    heapq.heapify(heap)
    while heap:
      _, s = heapq.heappop(heap)
      self.step(s)
      if self.left[s]:
        heapq.heappush(heap, (self.free[s], s))
    return self.orders

  def ready_time(self, action: Key) -> float | None:
    """When the action may start; None while an input has not run."""
    t = self.ready.get(action)
    if t is not None:
      return t
    t = 0.0
    for dep, dep_duration, lag in self.inputs[action]:
      end = self.ends.get(dep)
      if end is None:
        return None
      t = max(t, end - dep_duration + lag)
    self.ready[action] = t
    return t

  def candidates(self, s: int) -> list[tuple[Action, float]]:
    out = []
    for c in self.pr.chunks_of[s]:
      for kind in (FORWARD, BACKWARD):
        j = self.next[(kind, c)]
        if j < self.pr.microbatches:
          r = self.ready_time((kind, j, c))
          if r is not None:
            out.append((Action(kind, j, c), r))
    return out

  def room(self, s: int, a: Action) -> bool:
    """May F `a` run on stage s without starving the oldest micro-batch?

    The oldest micro-batch still owing forwards here keeps room for them;
    a micro-batch starting here also stays under the policy's cap.
    """
    chunks = self.pr.chunks_of[s]
    oldest = min(self.next[(FORWARD, c)] for c in chunks)
    owed = sum(1 for c in chunks if self.next[(FORWARD, c)] == oldest)
    limit = self.pr.memory_limit
    cap = self.policy.cap_of(s, len(chunks))
    if a.microbatch != oldest:
      return self.held[s] + 1 + owed <= min(cap, limit)
    if owed < len(chunks):  # started: its room is kept
      return self.held[s] + owed <= limit
    return self.held[s] + owed <= min(cap, limit)

  def step(self, s: int) -> None:
    t = self.free[s]
    cands = self.candidates(s)
    now = [(a, r) for a, r in cands if r <= t]
    fs = [a for a, _ in now if a.kind == FORWARD and self.room(s, a)]
    # A B past the cut limit waits for a W, which is always ready.
    cut_full = self.pr.cut_limit is not None and len(self.waiting[s]) >= self.pr.cut_limit
    bs = [a for a, _ in now if a.kind == BACKWARD and not cut_full]
    blocked = any(a not in fs and a not in bs for a, _ in now)
    # Deeper chunks first: their work is nearer the loss and the backward.
    fs.sort(key=lambda a: -a.chunk)
    bs.sort(key=lambda a: -a.chunk)
    first, second = (fs, bs) if self.coin(self.policy.forward_first) else (bs, fs)
    if first or second:
      self.run_action(s, (first or second)[0], t)
      return
    nxt = self.next_event(s, t, cands)
    if self.waiting[s]:
      d_w = self.pr.duration(WEIGHT)
      if blocked or self.coin(self.policy.eager_w) or nxt is None or nxt - t >= d_w:
        self.run_action(s, self.waiting[s][0], t)
        return
    if nxt is None or nxt > self.horizon:
      raise Deadlock(f'stage {s} at {t}')
    self.free[s] = nxt

  def next_event(self, s: int, t: float, cands) -> float | None:
    """The earliest time anything new can be ready on s (a lower bound)."""
    times = [r for _, r in cands if r > t]
    times += [
      self.free[q] + self.gap_floor
      for q in range(self.pr.stages)
      if q != s and self.left[q] and self.free[q] + self.gap_floor > t
    ]
    return min(times, default=None)

  def run_action(self, s: int, a: Action, t: float) -> None:
    start = t if a.kind == WEIGHT else max(t, self.ready_time(key(a)))
    end = start + self.pr.duration(a.kind)
    self.ends[key(a)] = end
    self.free[s] = end
    self.orders[s].append(a)
    self.left[s] -= 1
    if a.kind == FORWARD:
      self.held[s] += 1
      self.next[(FORWARD, a.chunk)] += 1
    elif a.kind == BACKWARD:
      self.next[(BACKWARD, a.chunk)] += 1
      self.waiting[s].append(Action(WEIGHT, a.microbatch, a.chunk))
    else:
      self.held[s] -= 1
      self.waiting[s].popleft()


def improve(problem: Problem, orders: Orders, score, deadline: float, window: int = 6) -> Orders:
  """Moves single actions of a stage while that lowers the score.

  `score(orders)` is a sortable (makespan first) or None for orders that
  cannot run; a move takes one action up to `window` places earlier or
  later in its stage's order, never past another micro-batch of its own
  kind and chunk, and is kept only if the stage stays within the limit.
  Stops at a pass that finds nothing, or at `deadline` (time.monotonic()).
  """
  best = score(orders)
  improved = True
  while improved and time.monotonic() < deadline:
    improved = False
    for s in range(len(orders)):
      i = 0
      while i < len(orders[s]):
        if time.monotonic() >= deadline:
          return orders
        moved = _best_move(problem, orders, s, i, window, score, best)
        if moved is not None:
          orders, best, improved = moved[0], moved[1], True
        i += 1
  return orders


def _best_move(problem, orders, s, i, window, score, best):
  order = orders[s]
  x = order[i]
  found = None
  for k in range(max(0, i - window), min(len(order), i + window + 1)):
    if k == i:
      continue
    lo, hi = min(i, k), max(i, k)
    if any(y.kind == x.kind and y.chunk == x.chunk for y in order[lo : hi + 1] if y != x):
      continue  # micro-batches stay in order
    trial = order[:i] + order[i + 1 :]
    trial.insert(k, x)
    if not within(problem, trial):
      continue
    candidate = orders[:s] + [trial] + orders[s + 1 :]
    value = score(candidate)
    if value is not None and value < (best if found is None else found[1]):
      found = (candidate, value)
  return found
