"""GPipe (Huang et al., NeurIPS'19): fill-drain."""

from triax.pipeline.ir import BACKWARD, FORWARD, Action, Schedule
from triax.pipeline.schedules.common import check_sizes, schedule


def gpipe(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """Each stage runs all its forwards, then all backwards.

  With v > 1 this is circular GPipe: forwards chunk-major (every micro-batch
  through local chunk 0, then local chunk 1, ...), backwards in reverse chunk
  order. Every stage holds all m micro-batches' residuals at the turn.
  """
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  orders = []
  for s in range(p):
    forwards = [Action(FORWARD, j, local * p + s) for local in range(v) for j in range(m)]
    backwards = [
      Action(BACKWARD, j, local * p + s) for local in reversed(range(v)) for j in range(m)
    ]
    orders.append(forwards + backwards)
  return schedule('gpipe', p, m, v, orders)
