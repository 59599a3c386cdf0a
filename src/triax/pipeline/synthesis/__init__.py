"""Schedules synthesised under a memory limit, in triax's one representation.

`synthesize(p, m, v, K, costs, time_limit_s)` returns the least-makespan per-stage orders
it finds whose every stage holds at most K residual sets (micro-batch-chunks, what
`triax schedule --json` reports as `peak_inflight`), as an `ir.Schedule` with a split
backward (B and W, like zb_h1), validated and lowered like any builder's. Its `stash_cap`
is K, so the validator holds its lowered program to the limit, also when read back from
triax's JSON. With `cut_limit` C it also holds at most C cuts (problem.py); the exact
program does not model cuts, so a cut limit runs the heuristic.

Two methods (problem.py says what both solve): `heuristic` (the zero-bubble paper's greedy,
widened, then improved by local swaps) for any size, and `milp` (exact, HiGHS) for p <= 4
and m <= 8, started from the heuristic's orders. Both optimise the asynchronous makespan;
the lockstep one the executor runs is measured too (`Synthesis`).

`run` with method 'auto' (the CLI's and the planner's) never returns a schedule slower in
that makespan than a named schedule within the same limits: where one is faster, that one
is returned. A method named explicitly returns what that method found.
More: docs/design/schedules.md."""

from __future__ import annotations

import dataclasses
import logging
import time

from triax.errors import ConfigError
from triax.pipeline import lower as lower_lib
from triax.pipeline import simulate
from triax.pipeline import validate as validate_lib
from triax.pipeline.ir import (
  COMPUTE_KINDS,
  Schedule,
  interleaved_placement,
  v_placement,
  with_split_backward,
)
from triax.pipeline.schedules import SCHEDULES, build
from triax.pipeline.schedules.common import check_sizes
from triax.pipeline.synthesis import heuristic, milp
from triax.pipeline.synthesis.problem import Problem, asap, lower_bound, makespan, within

NAME = 'synthesized'
# The sizes the exact program is offered for; above them it rarely proves
# anything within seconds.
EXACT_STAGES, EXACT_MICROBATCHES = 4, 8
# The share of the time limit the heuristic's local search may take.
_IMPROVE_SHARE = 0.25
METHODS = ('auto', 'heuristic', 'milp')
# Randomised greedy passes after the deterministic policies (a fixed count,
# so results do not depend on the machine's speed).
_RESTARTS = 32

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Synthesis:
  """A synthesised schedule and how it was found.

  Attributes:
    schedule: the validated schedule.
    method: 'milp' or 'heuristic': which produced the orders; 'built-in'
      where a named schedule within the limits was faster (`schedule` is
      that one, by its name, its backward split as the synthesiser's).
    optimal: True if proved optimal in the asynchronous model (the program
      proved it, or the makespan meets `problem.lower_bound`).
    lower_bound: the best lower bound on the makespan proved (the makespan
      itself when optimal; `problem.lower_bound` when only the heuristic ran).
    async_time: the asynchronous makespan (what was optimised).
    lockstep: the lockstep timing of the lowered program (the executor's).
    warning: one line if the time limit stopped the program short of a
      proof, else None.
    beaten: with method 'built-in', the synthesised makespan it beat.
  """

  schedule: Schedule
  method: str
  optimal: bool
  lower_bound: float
  async_time: float
  lockstep: simulate.Result
  warning: str | None
  beaten: float | None = None


def synthesize(
  stages: int,
  microbatches: int,
  virtual_stages: int = 1,
  memory_limit: int | None = None,
  costs: simulate.Costs = simulate.Costs.design_point(split=True),
  time_limit_s: float = 10.0,
  method: str = 'auto',
  cut_limit: int | None = None,
) -> Schedule:
  """The least-makespan schedule found under the memory limit (see `run`)."""
  return run(
    stages, microbatches, virtual_stages, memory_limit, costs, time_limit_s, method, cut_limit
  ).schedule


def run(
  stages: int,
  microbatches: int,
  virtual_stages: int = 1,
  memory_limit: int | None = None,
  costs: simulate.Costs = simulate.Costs.design_point(split=True),
  time_limit_s: float = 10.0,
  method: str = 'auto',
  cut_limit: int | None = None,
) -> Synthesis:
  """Synthesises a schedule; see the module docstring.

  Args:
    stages, microbatches, virtual_stages: p, m, v. Chunks are placed as
      Megatron's c mod p and, for v = 2, also as a V (`ir.v_placement`,
      zb_v's); the better is kept, each given half the time limit.
    memory_limit: K, residual sets per stage; None: no limit (m*v).
    costs: t_forward, t_backward (input gradient only), t_weight and
      t_transfer; the forward and backward must take time.
    time_limit_s: the solver's time limit; a program stopped by it returns
      the best orders found and says so in `warning` (also logged).
    method: 'auto' (exact where p <= 4 and m <= 8 without a cut limit,
      else heuristic; a faster named schedule within the limits instead, if
      any), 'heuristic' or 'milp'.
    cut_limit: C, the most cuts (B done, W not yet) a stage holds; None:
      no limit. Not with method 'milp'.

  Raises:
    ConfigError: for bad sizes, costs or method, or a limit below the least
      any schedule needs (the message names that least).
  """
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  problems = [_problem(p, m, v, memory_limit, costs, placement) for placement in _placements(p, v)]
  if not time_limit_s > 0:
    raise ConfigError('synthesis.time_limit_s', f'must be a number > 0; got {time_limit_s}')
  if method not in METHODS:
    raise ConfigError('synthesis.method', f'choose one of {", ".join(METHODS)}; got {method!r}')
  named = method == 'auto'
  if cut_limit is not None:
    _check_cut_limit(cut_limit, method)
    problems = [dataclasses.replace(x, cut_limit=cut_limit) for x in problems]
    method = 'heuristic'
  found = [_solve(problem, time_limit_s / len(problems), method) for problem in problems]
  best = min(found, key=lambda x: x.async_time)
  # Optimal overall only if no other placement may do better.
  optimal = best.optimal and all(best.async_time <= x.lower_bound + 1e-9 for x in found)
  warnings = [x.warning for x in found if x.warning]
  best = dataclasses.replace(
    best,
    optimal=optimal,
    lower_bound=best.async_time if optimal else min(x.lower_bound for x in found),
    warning='; '.join(warnings) or None,
  )
  return _or_built_in(best, problems[0]) if named else best


def _or_built_in(found: Synthesis, problem: Problem) -> Synthesis:
  """`found`, or the fastest named schedule (its backward split, as the
  synthesiser's, timed at the same costs) whose lowered program holds no
  more residual sets and cuts per stage than the limits, moves included.
  `found`'s lower bound is kept: it bounds schedules that move nothing."""
  best = found
  for built in _named(problem):
    program = lower_lib.lower(built)
    if max(program.peaks['stash']) > problem.memory_limit:
      continue
    if problem.cut_limit is not None and max(program.peaks['cut']) > problem.cut_limit:
      continue
    took = simulate.simulate_async(built, problem.costs).total_time
    if took < best.async_time - 1e-9:
      best = dataclasses.replace(
        found,
        schedule=built,
        method='built-in',
        optimal=False,
        async_time=took,
        lockstep=simulate.simulate_lockstep(program, problem.costs),
        beaten=found.async_time,
      )
  return best


def _check_cut_limit(cut_limit, method: str) -> None:
  if isinstance(cut_limit, bool) or not isinstance(cut_limit, int) or cut_limit < 1:
    raise ConfigError(
      'synthesis.cut_limit',
      f'must be an integer >= 1 (a B holds its cut until its W); got {cut_limit!r}',
    )
  if method == 'milp':
    raise ConfigError(
      'synthesis.cut_limit', "the exact program does not model cuts; use method 'heuristic'"
    )


def _placements(stages, virtual_stages) -> list[tuple[int, ...]]:
  """Megatron's c mod p, and for v = 2 the V too: both are tried."""
  placements = [interleaved_placement(stages, virtual_stages)]
  if virtual_stages == 2:
    placements.append(v_placement(stages))
  return placements


def _solve(problem: Problem, time_limit_s: float, method: str) -> Synthesis:
  """One placement: the heuristic, then the program where asked or small."""
  began = time.monotonic()
  orders, found = _heuristic(problem, began + _IMPROVE_SHARE * time_limit_s)
  bound = lower_bound(problem)
  used, optimal, warning = 'heuristic', found <= bound + 1e-9, None
  small = problem.stages <= EXACT_STAGES and problem.microbatches <= EXACT_MICROBATCHES
  if not optimal and (method == 'milp' or (method == 'auto' and small)):
    left = max(0.0, time_limit_s - (time.monotonic() - began))  # the caller's limit, no floor
    exact = milp.solve(problem, orders, found, bound, left)
    if exact is not None:
      bound, optimal = max(bound, exact.bound), exact.optimal
      timed = makespan(problem, exact.orders)
      if timed is not None and timed < found - 1e-9:
        orders, found, used = exact.orders, timed, 'milp'
      if not optimal:
        warning = (
          f'synthesis: the time limit ({time_limit_s:g} s) stopped the exact program: '
          f'best makespan found {found:g}, proved lower bound {bound:g}'
        )
        _log.warning(warning)
  schedule = Schedule(
    NAME,
    problem.stages,
    problem.microbatches,
    problem.virtual_stages,
    tuple(tuple(o) for o in orders),
    stash_cap=problem.memory_limit,
    placement=problem.placement,
  )
  program = lower_lib.lower(schedule)
  validate_lib.check(schedule, program)
  return Synthesis(
    schedule=schedule,
    method=used,
    optimal=optimal,
    lower_bound=found if optimal else bound,
    async_time=found,
    lockstep=simulate.simulate_lockstep(program, problem.costs),
    warning=warning,
  )


def least_memory(stages: int, microbatches: int, virtual_stages: int = 1) -> int:
  """The fewest residual sets per stage any schedule of these sizes needs."""
  placement = interleaved_placement(stages, virtual_stages)
  return _problem(
    stages, microbatches, virtual_stages, None, simulate.Costs(), placement
  ).least_memory()


def _problem(stages, microbatches, virtual_stages, memory_limit, costs, placement) -> Problem:
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  for name in ('t_forward', 't_backward'):
    if not getattr(costs, name) > 0:
      raise ConfigError(
        f'synthesis.{name}', f'must be > 0 to synthesise; got {getattr(costs, name)}'
      )
  problem = Problem(p, m, v, placement, m * v, costs)
  if memory_limit is None:
    return problem
  least = problem.least_memory()
  if isinstance(memory_limit, bool) or not isinstance(memory_limit, int):
    raise ConfigError('synthesis.memory_limit', f'must be an integer; got {memory_limit!r}')
  if memory_limit < least:
    raise ConfigError(
      'synthesis.memory_limit',
      f'{memory_limit} is below the least any schedule needs: {least} residual sets per '
      f'stage (each stage holds its {v} chunk set(s) of a micro-batch at once)',
    )
  return dataclasses.replace(problem, memory_limit=memory_limit)


def _heuristic(problem: Problem, deadline: float) -> tuple[list, float]:
  """The best of the greedy orders over every policy and `_RESTARTS`
  randomised ones and of the named schedules that meet the limit (with
  their backward split, `_built_in`), improved by moving single actions."""
  runs = []
  for policy in heuristic.policies(problem):
    runs.append((policy, _greedy(problem, policy)))
  runs = [(t, i, policy, orders) for i, (policy, (t, orders)) in enumerate(runs) if orders]
  seeds = [(makespan(problem, orders), -2, None, orders) for orders in _built_in(problem)]
  if not runs:
    raise ConfigError('synthesis.memory_limit', 'no schedule found within the limit')
  runs.sort(key=lambda x: (x[0], x[1]))
  for k in range(_RESTARTS):
    policy = dataclasses.replace(runs[k % min(3, len(runs))][2], seed=k)
    t, orders = _greedy(problem, policy)
    if orders and t < runs[0][0] - 1e-9:
      runs.insert(0, (t, -1, policy, orders))
  best = min(runs[:1] + seeds, key=lambda x: x[0])[3]
  best = heuristic.improve(problem, best, lambda o: _score(problem, o), deadline)
  return best, makespan(problem, best)


def _named(problem: Problem):
  """Every named schedule of the problem's sizes, each fused backward split
  into B then W."""
  for name in SCHEDULES:
    try:
      built = build(name, problem.stages, problem.microbatches, problem.virtual_stages)
    except ConfigError:
      continue
    yield with_split_backward(built)


def _built_in(problem: Problem) -> list[list]:
  """The compute orders of every named schedule of these sizes and placement
  within the memory limit, each fused backward split into B then W."""
  out = []
  for built in _named(problem):
    orders = [[a for a in o if a.kind in COMPUTE_KINDS] for o in built.orders]
    if built.evicted or built.placement != problem.placement:
      continue
    if all(within(problem, o) for o in orders):
      out.append(orders)
  return out


def _greedy(problem: Problem, policy) -> tuple[float, list | None]:
  try:
    orders = heuristic.list_schedule(problem, policy)
  except heuristic.Deadlock:
    return float('inf'), None
  t = makespan(problem, orders)
  return (float('inf'), None) if t is None else (t, orders)


def _score(problem: Problem, orders) -> tuple[float, float] | None:
  """Makespan, then the sum of action ends: the second lets the local search
  cross plateaus of equal makespan toward earlier work."""
  starts = asap(problem, orders)
  if starts is None:
    return None
  ends = [t + problem.duration(a.kind) for a, t in starts.items()]
  return max(ends), sum(ends)
