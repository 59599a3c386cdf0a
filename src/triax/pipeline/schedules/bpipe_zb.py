"""BPipe inside zero-bubble: ZB-H1's split backward with BPipe's evictions.

BPipe (Kim et al., ICML'23) evens out 1F1B's memory: stage s holds p-s
residual sets, so the pair (s, p-1-s) holds p+1 and each can be capped at
about (p+1)/2 by evicting sets to the partner. ZB-H1 (Qi et al., ICLR'24)
removes two thirds of 1F1B's bubble by making stage s wait s backwards
before each W, which raises every stage to p sets: a pair then holds 2p
and there is nothing left to balance. The two only compose when the W's
wait where they buy time and the partner has room.
"""

import dataclasses

from triax.errors import ConfigError
from triax.pipeline.ir import (
  BACKWARD,
  COMPUTE_KINDS,
  LOAD,
  WEIGHT,
  Action,
  Schedule,
  ScheduleDeadlock,
)
from triax.pipeline.lower import compute_ticks
from triax.pipeline.schedules.bpipe import bpipe_stash_cap, evict_to_partners
from triax.pipeline.schedules.common import check_sizes, one_chunk_only, schedule
from triax.pipeline.schedules.one_f_one_b import one_f_one_b


def bpipe_zb(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """1F1B's F/B order with the backward split, W's put off only at the tail,
  and BPipe's evictions between partners s and p-1-s.

  Stage s runs each W right after its B (1F1B split, as bpipe's lockstep
  program does) except over the last q+1 backwards of the last q stages,
  where stage s lags its W's by s backwards as in ZB-H1 (the lagged W's
  close the step). That is the part of ZB-H1's lag that shortens the
  step, one tick per unit of q (3m+2p-2-q ticks: bpipe's at q = 0,
  zb_h1's 3m+p-1 at q = p-1), and it comes when the partners of those
  stages, the first q, are in their cool-down and hold few sets. q is the
  largest for which BPipe's own cap, the one `bpipe` plans for 1F1B, still
  fits (found by trying q = 1, 2, ... until one does not). Only sets
  waiting for their B move; a set waiting for its W stays home and counts
  against the cap. A stage then holds at most q+1 B-to-W cuts (zb_h1: p).

  At p = 8, m = 32: q = 3, 107 ticks (zb_h1 103), 5 residual sets and 4
  cuts per stage (zb_h1 8 and 8; bpipe 5 and 1, in 110 ticks).

  Raises:
    ConfigError: for v > 1, p < 3, or m so small that BPipe's cap is
      zb_h1's own min(m, p) sets (the error names the least m that is not;
      at p = 8 it is 6): then nothing moves and the schedule is zb_h1.
  """
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  one_chunk_only('bpipe_zb', v)
  if p < 3:
    raise ConfigError(
      'mesh.pipe',
      f"bpipe_zb needs at least 3 pipeline stages; got {p} (with fewer BPipe's cap is "
      "zb_h1's own: use zb_h1)",
    )
  best = evict_to_partners(_tail_deferred(p, m, 0), 'bpipe_zb')
  if best.stash_cap >= min(m, p):
    least = next(n for n in range(m + 1, p + 1) if bpipe_stash_cap(p, n) < n)
    raise ConfigError(
      'pipeline.microbatches',
      f'bpipe_zb at {p} stages needs at least {least} micro-batches; got {m} (with fewer '
      f"BPipe's cap is zb_h1's own {min(m, p)} sets and nothing moves: use zb_h1)",
    )
  for q in range(1, p):
    try:
      best = evict_to_partners(_tail_deferred(p, m, q), 'bpipe_zb', best.stash_cap)
    except ScheduleDeadlock:
      break
  return _loads_before_their_backward(best)


def _loads_before_their_backward(s: Schedule) -> Schedule:
  """Each LOAD moved to after the partner's last compute action two or
  more ticks before its B's tick in the lockstep program.

  Only the asynchronous model reads where copies sit in the orders. bpipe
  puts a LOAD after the partner's own B of that micro-batch, which under
  zero-bubble comes early: the set would be back home while the home
  stage is full (the model's peaks above the lockstep program's). Here the
  set comes home about when the lockstep program lands it, with one
  action's time for the copy to hide in.
  """
  at = compute_ticks(s)
  orders = [list(o) for o in s.orders]
  for j, c in sorted(s.evicted, key=lambda x: at[Action(BACKWARD, *x)]):
    sender = orders[s.partner[s.stage_of(c)]]
    sender.remove(Action(LOAD, j, c))
    before = at[Action(BACKWARD, j, c)] - 1
    i = max(
      (i for i, a in enumerate(sender) if a.kind in COMPUTE_KINDS and at[a] < before), default=-1
    )
    sender.insert(i + 1, Action(LOAD, j, c))
  return dataclasses.replace(s, orders=tuple(map(tuple, orders)))


def _tail_deferred(p: int, m: int, q: int) -> Schedule:
  """1F1B split; over its last q+1 backwards, each of the last q stages
  lags its W's as ZB-H1 does (stage s by s backwards)."""
  orders = []
  for s, base in enumerate(one_f_one_b(p, m).orders):
    order, pending, seen = [], [], 0
    for a in base:
      order.append(a)
      if a.kind == BACKWARD:
        pending.append(Action(WEIGHT, a.microbatch, a.chunk))
        seen += 1
        lag = s if s >= p - q and seen > m - (q + 1) else 0
        while len(pending) > lag:
          order.append(pending.pop(0))
    orders.append(order + pending)
  return schedule('bpipe_zb', p, m, 1, orders)
