"""ZB-H1 (Qi et al., ICLR'24, "Zero Bubble Pipeline Parallelism")."""

from triax.pipeline.ir import BACKWARD, WEIGHT, Action, Schedule
from triax.pipeline.schedules.common import check_sizes, one_chunk_only, schedule
from triax.pipeline.schedules.one_f_one_b import one_f_one_b


def zb_h1(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """1F1B with the backward split into B (input gradient) and W (weights).

  Stage s runs 1F1B's F/B order and lags its W's by s backwards: W(k)
  follows B(k+s), and the last s W's close the step. The lag fills the
  cool-down bubbles with W's while stage s holds at most (p-s) + s = p
  micro-batches, stage 0's 1F1B peak, so the largest per-stage memory is
  1F1B's. With t_F = t_B = t_W = t the step takes 3mt + (p-1)t, a bubble of
  (p-1)t per stage against 1F1B's (p-1)*3t: a third (the paper's
  (p-1)(t_F + t_B - t_W)). The lockstep executor runs these orders one
  action per tick, so its ticks are exactly that: 3m + p - 1.
  """
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  one_chunk_only('zb_h1', v)
  orders = []
  for s, base in enumerate(one_f_one_b(p, m).orders):
    order, pending = [], []
    for a in base:
      order.append(a)
      if a.kind == BACKWARD:
        pending.append(Action(WEIGHT, a.microbatch, a.chunk))
        if len(pending) > s:
          order.append(pending.pop(0))
    orders.append(order + pending)
  return schedule('zb_h1', p, m, 1, orders)
