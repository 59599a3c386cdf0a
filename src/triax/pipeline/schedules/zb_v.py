"""ZB-V (Qi et al., ICLR'24, "Zero Bubble Pipeline Parallelism", section 6)."""

from triax.errors import ConfigError
from triax.pipeline.ir import BACKWARD, FORWARD, WEIGHT, Action, Schedule, v_placement
from triax.pipeline.schedules.common import check_sizes, schedule


def zb_v(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
  """Two chunks per stage folded into a V, backward split into B and W.

  Stage d holds chunk a = d (the way down) and chunk b = 2p-1-d (the way
  back up). Its order, torch's `ScheduleZBVZeroBubble`'s, with n = max(m, 2p-1):

    warm-up     2(p-d)-1 F(a); then d times F(b) F(a); then p-d times
                F(b) B(b) W(b);
    steady      F(a) B(a) W(a) F(b) B(b) W(b) until both chunks have run
                n forwards (F(a) dropped once it has);
    cool-down   d times B(a) B(b), their W's put off; p-d times B(a) and
                the oldest waiting W(a); then the waiting W(b)'s, then the
                waiting W(a)'s.

  Each kind of each chunk takes micro-batches in order; actions of
  micro-batches >= m are dropped (smaller m keep the V's shape with holes).

  Invariants: every stage stashes at most 2p chunk residual sets (p
  micro-batches of a stage, 1F1B's largest stage); with t_F = t_B = t_W = 1
  the step takes max(6m + p - 1, 4m + 4p - 2) ticks, no steady-phase bubble.
  Why: docs/design/schedules.md.

  Raises:
    ConfigError: for v != 2.
  """
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  if v != 2:
    raise ConfigError(
      'pipeline.virtual_stages', f'zb_v runs exactly 2 model chunks per stage (a V); got {v}'
    )
  n = max(m, 2 * p - 1)
  orders = [[x for x in _stage_order(p, n, d) if x.microbatch < m] for d in range(p)]
  return schedule('zb_v', p, m, 2, orders, placement=v_placement(p))


def _stage_order(p: int, n: int, d: int) -> list[Action]:
  """Stage d's order for n >= 2p-1 micro-batches (see `zb_v`)."""
  a, b = d, 2 * p - 1 - d
  order: list[Action] = []
  count = {(kind, c): 0 for kind in (FORWARD, BACKWARD, WEIGHT) for c in (a, b)}

  def run(kind: str, chunk: int) -> None:
    order.append(Action(kind, count[(kind, chunk)], chunk))
    count[(kind, chunk)] += 1

  def repeat(times: int, *steps: tuple[str, int]) -> None:
    for _ in range(times):
      for kind, chunk in steps:
        run(kind, chunk)

  repeat(2 * (p - d) - 1, (FORWARD, a))
  repeat(d, (FORWARD, b), (FORWARD, a))
  repeat(p - d, (FORWARD, b), (BACKWARD, b), (WEIGHT, b))
  while count[(FORWARD, b)] < count[(FORWARD, a)] or count[(FORWARD, a)] < n:
    if count[(FORWARD, a)] < n:
      run(FORWARD, a)
    repeat(1, (BACKWARD, a), (WEIGHT, a), (FORWARD, b), (BACKWARD, b), (WEIGHT, b))
  repeat(d, (BACKWARD, a), (BACKWARD, b))
  repeat(p - d, (BACKWARD, a), (WEIGHT, a))
  repeat(count[(BACKWARD, b)] - count[(WEIGHT, b)], (WEIGHT, b))
  repeat(count[(BACKWARD, a)] - count[(WEIGHT, a)], (WEIGHT, a))
  return order
