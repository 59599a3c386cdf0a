"""The exact synthesiser: a mixed-integer program solved by HiGHS.

Variables: the start time S_a of every F, B and W of every (stage, micro-batch, chunk),
the makespan C, and a binary o_ab (a before b) for each pair of actions on one stage whose
order the dependencies do not fix. Constraints:

  dependencies   S_b >= S_a + lag for each input a of b (`Problem.predecessors`), and
                 each kind of each chunk takes micro-batches in order;
  no overlap     big-M disjunctions on o_ab, M = the heuristic's makespan;
  memory         just after each F x of a stage: 1 + #{F before x} - #{W before x} <= K;
  makespan       C >= S_a + d_a for every action; minimise C.

The time model is the asynchronous one (`simulate.simulate_async`). The optimum is exact
among orders that take micro-batches in order per kind and chunk, as every builder does.
The lockstep makespan equals it when t_F = t_B = t_W and there is no transfer time; else
it can be longer, and the caller measures it with `simulate.simulate_lockstep`.
The formulation in full: docs/design/schedules.md."""

from __future__ import annotations

import dataclasses
import os
import sys

from triax.pipeline.ir import BACKWARD, FORWARD, WEIGHT, Action
from triax.pipeline.synthesis.problem import Problem, asap

Orders = list[list[Action]]


@dataclasses.dataclass(frozen=True)
class Solution:
  """What the solver returned.

  Attributes:
    orders: per stage, its actions by start time.
    makespan: C of the solution.
    optimal: True if HiGHS proved it optimal (within 1e-6).
    bound: the best lower bound HiGHS proved on C.
  """

  orders: Orders
  makespan: float
  optimal: bool
  bound: float


def solve(
  problem: Problem, start: Orders, upper: float, lower: float, time_limit_s: float
) -> Solution | None:
  """The least-makespan orders, or the best found within the time limit.

  Args:
    problem: the synthesis problem.
    start: feasible orders (the heuristic's), given to HiGHS as its first
      solution.
    upper: their makespan: the big M and a bound on every start.
    lower: a proved lower bound on the makespan (`problem.lower_bound`),
      given to HiGHS as C's lower bound: the relaxation alone is weak.
    time_limit_s: HiGHS's time limit.

  Returns:
    None if HiGHS found no solution in time (it was given one, so only if
    it rejected it and then found none).
  """
  import highspy  # only the exact path needs the solver

  model = _Model(problem, upper, lower)
  h = _quiet_highs(highspy)
  h.setOptionValue('time_limit', float(time_limit_s))
  h.setOptionValue('mip_rel_gap', 1e-6)
  h.setOptionValue('threads', 1)
  model.load(h)
  warm = highspy.HighsSolution()
  warm.col_value = model.values_of(start)
  warm.value_valid = True
  h.setSolution(warm)
  h.run()
  status = h.getModelStatus()
  info = h.getInfo()
  if info.primal_solution_status != 2:  # kSolutionStatusFeasible
    return None
  values = list(h.getSolution().col_value)
  return Solution(
    orders=model.orders_of(values),
    makespan=values[model.makespan],
    optimal=status == highspy.HighsModelStatus.kOptimal,
    bound=info.mip_dual_bound,
  )


def _quiet_highs(highspy):
  """A Highs with its output off: it prints a banner to fd 1 while it is
  made, before any option can be set, which would spoil `--json`."""
  sys.stdout.flush()
  saved = os.dup(1)
  try:
    with open(os.devnull, 'w') as null:
      os.dup2(null.fileno(), 1)
      h = highspy.Highs()
  finally:
    os.dup2(saved, 1)
    os.close(saved)
  h.setOptionValue('output_flag', False)
  return h


class _Model:
  """The variables and rows of the program, and the maps back to orders."""

  def __init__(self, problem: Problem, upper: float, lower: float):
    self.pr, self.upper, self.lower = problem, upper, lower
    self.actions = [a for stage in problem.actions_of for a in stage]
    self.col = {a: i for i, a in enumerate(self.actions)}
    self.makespan = len(self.actions)
    self.edges = self._edges()
    self.rank, self.reach = self._closure()
    self.pairs: dict[tuple[Action, Action], int] = {}  # (a, b) -> column of o_ab
    for stage in problem.actions_of:
      for i, a in enumerate(stage):
        for b in stage[i + 1 :]:
          if not self.fixed(a, b) and not self.fixed(b, a):
            self.pairs[(a, b)] = self.makespan + 1 + len(self.pairs)
    self.num_cols = self.makespan + 1 + len(self.pairs)

  def _edges(self) -> list[tuple[Action, Action, float]]:
    """(a, b, lag): S_b >= S_a + lag: the dependencies and the in-order rule."""
    pr = self.pr
    edges = [(d, a, lag) for a in self.actions for d, lag in pr.predecessors(a)]
    for c in range(pr.num_chunks):
      for kind in (FORWARD, BACKWARD, WEIGHT):
        for j in range(pr.microbatches - 1):
          edges.append((Action(kind, j, c), Action(kind, j + 1, c), pr.duration(kind)))
    return edges

  def _closure(self) -> tuple[dict[Action, int], dict[Action, int]]:
    """A topological rank and, per action, the bitset of actions after it."""
    succ = {a: [] for a in self.actions}
    indeg = {a: 0 for a in self.actions}
    for a, b, _ in self.edges:
      succ[a].append(b)
      indeg[b] += 1
    topo, todo = [], [a for a in self.actions if indeg[a] == 0]
    while todo:
      a = todo.pop()
      topo.append(a)
      for b in succ[a]:
        indeg[b] -= 1
        if indeg[b] == 0:
          todo.append(b)
    reach = {}
    for a in reversed(topo):
      bits = 0
      for b in succ[a]:
        bits |= reach[b] | (1 << self.col[b])
      reach[a] = bits
    return {a: i for i, a in enumerate(topo)}, reach

  def fixed(self, a: Action, b: Action) -> bool:
    """True if the dependencies put a before b."""
    return bool(self.reach[a] >> self.col[b] & 1)

  def before(self, a: Action, b: Action) -> tuple[float, dict[int, float]]:
    """'a runs before b' as constant + linear terms in the binaries."""
    if self.fixed(a, b):
      return 1.0, {}
    if self.fixed(b, a):
      return 0.0, {}
    if (a, b) in self.pairs:
      return 0.0, {self.pairs[(a, b)]: 1.0}
    return 1.0, {self.pairs[(b, a)]: -1.0}

  def rows(self):
    """(lower, upper, {column: coefficient}) for every constraint."""
    inf, m_big, col = float('inf'), self.upper, self.col
    for a, b, lag in self.edges:
      yield lag, inf, {col[b]: 1.0, col[a]: -1.0}
    for (a, b), o in self.pairs.items():
      da, db = self.pr.duration(a.kind), self.pr.duration(b.kind)
      yield da - m_big, inf, {col[b]: 1.0, col[a]: -1.0, o: -m_big}
      yield db, inf, {col[a]: 1.0, col[b]: -1.0, o: m_big}
    for a in self.actions:
      yield self.pr.duration(a.kind), inf, {self.makespan: 1.0, col[a]: -1.0}
    for stage in self.pr.actions_of:
      for x in stage:
        if x.kind != FORWARD:
          continue
        const, terms = 1.0, {}
        for y in stage:
          if y == x or y.kind == BACKWARD:
            continue
          sign = 1.0 if y.kind == FORWARD else -1.0
          k, lin = self.before(y, x)
          const += sign * k
          for o, coef in lin.items():
            terms[o] = terms.get(o, 0.0) + sign * coef
        if terms:
          yield -inf, self.pr.memory_limit - const, terms

  def load(self, h) -> None:
    import numpy as np

    n = self.num_cols
    lower = np.zeros(n)
    upper = np.full(n, self.upper)
    for a, i in self.col.items():
      upper[i] = self.upper - self.pr.duration(a.kind)
    binaries = np.arange(self.makespan + 1, n, dtype=np.int32)
    upper[binaries] = 1.0
    lower[self.makespan] = self.lower
    cost = np.zeros(n)
    cost[self.makespan] = 1.0
    h.addCols(
      n, cost, lower, upper, 0, np.array([], np.int32), np.array([], np.int32), np.array([])
    )
    lo, hi, starts, index, value = [], [], [], [], []
    for row_lo, row_hi, terms in self.rows():
      lo.append(row_lo)
      hi.append(row_hi)
      starts.append(len(index))
      index += terms.keys()
      value += terms.values()
    h.addRows(
      len(lo),
      np.array(lo),
      np.array(hi),
      len(index),
      np.array(starts, np.int32),
      np.array(index, np.int32),
      np.array(value),
    )
    import highspy

    h.changeColsIntegrality(
      len(binaries), binaries, np.array([highspy.HighsVarType.kInteger] * len(binaries))
    )

  def values_of(self, orders: Orders) -> list[float]:
    """Column values for given orders: ASAP starts, the binaries they imply."""
    starts = asap(self.pr, orders)
    values = [0.0] * self.num_cols
    for a, t in starts.items():
      values[self.col[a]] = t
    values[self.makespan] = max(t + self.pr.duration(a.kind) for a, t in starts.items())
    position = {a: i for order in orders for i, a in enumerate(order)}
    for (a, b), o in self.pairs.items():
      values[o] = 1.0 if position[a] < position[b] else 0.0
    return values

  def orders_of(self, values: list[float]) -> Orders:
    """Each stage's actions by start, ties by the dependencies' order."""
    return [
      sorted(stage, key=lambda a: (round(values[self.col[a]], 6), self.rank[a]))
      for stage in self.pr.actions_of
    ]
