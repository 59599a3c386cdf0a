"""PipeDream-Flush 1F1B (Narayanan et al., 2021)."""

from triax.pipeline.ir import BACKWARD, FORWARD, Action, Schedule
from triax.pipeline.schedules.common import check_sizes, one_chunk_only, schedule


def one_f_one_b(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """Warm-up forwards, then F/B pairs, then cool-down backwards.

  Stage s warms up with min(p-1-s, m) forwards, so it never holds more than
  p-s micro-batches (the lockstep executor runs exactly that order).
  """
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  one_chunk_only('1f1b', v)
  orders = []
  for s in range(p):
    warmup = min(p - 1 - s, m)
    order = [Action(FORWARD, j, s) for j in range(warmup)]
    for i in range(m - warmup):
      order += [Action(FORWARD, warmup + i, s), Action(BACKWARD, i, s)]
    order += [Action(BACKWARD, j, s) for j in range(m - warmup, m)]
    orders.append(order)
  return schedule('1f1b', p, m, 1, orders)
