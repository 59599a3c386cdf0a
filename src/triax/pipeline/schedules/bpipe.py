"""BPipe (Kim et al., ICML'23): 1F1B with activation eviction to a partner."""

from __future__ import annotations

from collections.abc import Sequence

from triax.pipeline.ir import (
  BACKWARD,
  EVICT,
  FORWARD,
  LOAD,
  WEIGHT,
  Action,
  Schedule,
  ScheduleDeadlock,
  with_split_backward,
)
from triax.pipeline.lower import compute_ticks
from triax.pipeline.schedules.common import check_sizes, one_chunk_only, schedule
from triax.pipeline.schedules.one_f_one_b import one_f_one_b


def bpipe(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """Stage s pairs with p-1-s; the heavy stage evicts stashed residuals to it.

  The F/B order and lockstep ticks are 1F1B's. 1F1B's stage s holds p-s
  residual sets, so a pair (s, p-1-s) holds p+1 between them; BPipe caps
  every stage at the least capacity that fits both (about (p+1)/2, found by
  trying, see `_plan_evictions`). The heavy stage of each pair EVICTs a set
  to its partner whenever it would otherwise exceed the cap, and the
  partner LOADs it back just before its B. The partner keeps the guest in
  its own stash pool, under the same cap. With p odd the middle stage pairs
  with itself and evicts nothing.

  Policy (lockstep): an evicted set leaves at the end of its F's tick and
  comes back at the end of the tick before its B, the two choices that
  free the heavy stage longest. Scanning ticks in order, whenever the heavy
  stage would exceed the cap it evicts the set whose B is furthest away
  among those the partner has room for. In the orders EVICT follows its F
  and LOAD follows the partner's own B of that micro-batch, which is where
  the asynchronous model issues them on the copy stream.

  Raises:
    ConfigError: for v > 1 (interleaved BPipe is not built).
  """
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  one_chunk_only('bpipe', v)
  return evict_to_partners(one_f_one_b(p, m), 'bpipe')


def evict_to_partners(base: Schedule, name: str, cap: int | None = None) -> Schedule:
  """`base` (one chunk per stage) with BPipe's evictions added (see `bpipe`).

  With `cap` None the least cap that fits is found by trying; else exactly
  `cap` is planned for. bpipe_zb reuses this on zero-bubble orders, whose
  W's keep their sets home from the B to the W: those sets count against
  the cap but are never moved.

  Raises:
    ScheduleDeadlock: if no eviction plan fits `cap`.
  """
  p, m = base.stages, base.microbatches
  at = compute_ticks(with_split_backward(base))
  partner = tuple(p - 1 - s for s in range(p))
  held = _held(base, at)
  lower_bound = max([-(-(max(held[s]) + max(held[partner[s]])) // 2) for s in range(p)] or [1])
  caps = range(lower_bound, max(max(h) for h in held) + 1) if cap is None else (cap,)
  for cap in caps:
    try:
      evicted = _plan_evictions(base, at, partner, cap)
      break
    except ScheduleDeadlock:
      # The largest cap of the search evicts nothing, so only a given one fails.
      if cap == caps[-1]:
        raise
  orders = []
  for s, order in enumerate(base.orders):
    order = list(order)
    for j, c in sorted(evicted):
      if base.stage_of(c) == s:
        order.insert(order.index(Action(FORWARD, j, c)) + 1, Action(EVICT, j, c))
    orders.append(order)
  # In the orders a load follows the partner's B of the same micro-batch:
  # the gradient still has to cross the stages between the two, which is
  # the time the asynchronous model has to hide the transfer in.
  for j, c in sorted(evicted):
    order = orders[partner[base.stage_of(c)]]
    order.insert(
      order.index(Action(BACKWARD, j, partner[base.stage_of(c)])) + 1, Action(LOAD, j, c)
    )
  return schedule(name, p, m, 1, orders, partner=partner, stash_cap=cap)


def bpipe_stash_cap(stages: int, microbatches: int) -> int:
  """The per-stage stash capacity `bpipe` plans for."""
  return bpipe(stages, microbatches).stash_cap


def _held(schedule: Schedule, at: dict) -> list[list[int]]:
  """Per stage and tick, residual sets held during the compute phase (F to W)."""
  ticks = max(at.values()) + 1
  held = [[0] * ticks for _ in range(schedule.stages)]
  for a, tf in at.items():
    if a.kind == FORWARD:
      for t in range(tf, at[Action(WEIGHT, a.microbatch, a.chunk)] + 1):
        held[schedule.stage_of(a.chunk)][t] += 1
  return held


def _plan_evictions(
  schedule: Schedule, at: dict, partner: Sequence[int], cap: int
) -> set[tuple[int, int]]:
  """Chooses the residual sets to evict so every stage fits in `cap` slots.

  A set evicted at the end of its F's tick tf and loaded at the end of tick
  tb-1 is absent from the heavy stage and present on the light one exactly
  in ticks tf+1..tb-1.

  Raises:
    ScheduleDeadlock: if no choice fits.
  """
  p = schedule.stages
  held = _held(schedule, at)
  ticks = len(held[0])
  f_tick = {(a.microbatch, a.chunk): t for a, t in at.items() if a.kind == FORWARD}
  b_tick = {(a.microbatch, a.chunk): t for a, t in at.items() if a.kind == BACKWARD}
  evicted: set[tuple[int, int]] = set()
  for s in range(p):
    light = partner[s]
    if light == s:
      if max(held[s]) > cap:
        raise ScheduleDeadlock(f'{schedule.name}: middle stage {s} holds {max(held[s])} > {cap}')
      continue
    heavy_peak, light_peak = max(held[s]), max(held[light])
    # Each pair is planned once, from its heavier stage.
    if heavy_peak < light_peak or (heavy_peak == light_peak and s > light):
      continue
    own = sorted(key for key in f_tick if schedule.stage_of(key[1]) == s)
    for t in range(ticks):
      while held[s][t] > cap:
        candidates = sorted(
          (
            key
            for key in own
            if key not in evicted
            and f_tick[key] < t < b_tick[key]
            and b_tick[key] - f_tick[key] >= 2
          ),
          key=lambda key: (-b_tick[key], -f_tick[key]),
        )
        for key in candidates:
          away = range(f_tick[key] + 1, b_tick[key])
          if all(held[light][x] < cap for x in away):
            break
        else:
          raise ScheduleDeadlock(
            f'{schedule.name}: stage {s} holds {held[s][t]} residual sets at tick {t} and '
            f'neither it nor partner {light} has room under a cap of {cap}'
          )
        evicted.add(key)
        for x in away:
          held[s][x] -= 1
          held[light][x] += 1
    if max(held[light]) > cap:
      raise ScheduleDeadlock(f'{schedule.name}: stage {light} holds {max(held[light])} > {cap}')
  return evicted
