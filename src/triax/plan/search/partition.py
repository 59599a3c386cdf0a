"""Uneven layer partitions: a dynamic program minimising the slowest stage.

Stages are fixed in pipeline order (the search decides which devices form
each); what remains is how many of the L layers each holds. In a lockstep
pipeline every tick waits for its slowest stage, so the step time follows
the slowest stage's time per micro-batch: AMP, Metis and Alpa balance
stages the same way. A stage's time is any non-decreasing function of its
layer count (`cost(s, n)`: layers times its devices' per-layer time plus
the embedding or head it runs), and memory may forbid counts (`allowed`).

  best[s][l] = min over n of max(best[s-1][l-n], cost(s, n))

over counts n that are positive multiples of `unit` (v: a stage's chunks
must be equal). O(p L^2 / unit^2) evaluations: microseconds for real models.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

Cost = Callable[[int, int], float]
Allowed = Callable[[int, int], bool]


def balance(
  num_layers: int, stages: int, cost: Cost, allowed: Allowed = lambda s, n: True, unit: int = 1
) -> tuple[tuple[int, ...], float] | None:
  """The partition of `num_layers` over `stages` minimising max cost(s, n).

  Args:
    num_layers: L, layers to place.
    stages: p, in pipeline order.
    cost: seconds of stage s holding n layers; non-decreasing in n.
    allowed: whether stage s may hold n layers (memory).
    unit: every count is a positive multiple of this.

  Returns:
    (layers per stage, the slowest stage's cost), or None if no partition is
    allowed. Among optimal partitions, the one closest to even.
  """
  if num_layers % unit:
    return None
  units = num_layers // unit
  inf = math.inf
  # best[s][u]: (slowest cost, spread) of placing u units on stages 0..s-1.
  best = [[(inf, inf)] * (units + 1) for _ in range(stages + 1)]
  choice = [[0] * (units + 1) for _ in range(stages + 1)]
  best[0][0] = (0.0, 0.0)
  even = num_layers / stages
  for s in range(1, stages + 1):
    # Each later stage needs at least one unit.
    for u in range(s, units - (stages - s) + 1):
      for k in range(1, u - (s - 1) + 1):
        prev = best[s - 1][u - k]
        n = k * unit
        if prev[0] == inf or not allowed(s - 1, n):
          continue
        candidate = (max(prev[0], cost(s - 1, n)), prev[1] + (n - even) ** 2)
        if candidate < best[s][u]:
          best[s][u], choice[s][u] = candidate, k
  if best[stages][units][0] == inf:
    return None
  layers, u = [], units
  for s in range(stages, 0, -1):
    layers.append(choice[s][u] * unit)
    u -= choice[s][u]
  return tuple(reversed(layers)), best[stages][units][0]


def brute_force(
  num_layers: int, stages: int, cost: Cost, allowed: Allowed = lambda s, n: True, unit: int = 1
) -> float | None:
  """The optimal slowest-stage cost by enumeration (tests, small cases)."""
  best = math.inf
  for counts in itertools.product(range(unit, num_layers + 1, unit), repeat=stages):
    if sum(counts) != num_layers or not all(allowed(s, n) for s, n in enumerate(counts)):
      continue
    best = min(best, max(cost(s, n) for s, n in enumerate(counts)))
  return None if best == math.inf else best


def even(num_layers: int, stages: int, unit: int = 1) -> tuple[int, ...] | None:
  """The even split, or None if L is not a multiple of stages * unit."""
  if num_layers % (stages * unit):
    return None
  return (num_layers // stages,) * stages


def nearest_even(num_layers: int, stages: int, unit: int = 1) -> tuple[int, ...]:
  """The split nearest to even (the first stages take one unit more): what
  the learned planner prices when memory allows no split (it runs out)."""
  units, extra = divmod(num_layers // unit, stages)
  return tuple(unit * (units + (s < extra)) for s in range(stages))
