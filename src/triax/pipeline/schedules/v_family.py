"""V-Min, V-Half and V-ZB (Qi et al., NeurIPS'24, "Pipeline Parallelism with
Controllable Memory").

Each schedule repeats one building block, the actions of one micro-batch on every stage,
every `INTERVAL` time units, two chunks per stage folded into a V (`ir.v_placement`). The
three differ only in the spacing of the block's actions, so they share one builder and one
block type, `VBlock`, and each is one `VBlock` of data; a new member of the family is a new
`VBlock`. Each stage's order is its actions sorted by block time; the lowering runs every
action as soon as its inputs are there (the paper's 'squeeze').

Invariant: peak memory on the busiest stage, in micro-batches of a whole stage's
activations (two chunk residual sets each; `triax schedule --json` counts chunk sets), is
exactly the table the authors publish: 1F1B p, V-Min (p+4)//3, V-Half (p+2)//2, V-ZB p
(tests/test_v_schedules.py). How the blocks are built: docs/design/schedules.md."""

from __future__ import annotations

import dataclasses
import math

from triax.errors import ConfigError
from triax.pipeline.ir import (
  BACKWARD,
  FORWARD,
  WEIGHT,
  Action,
  Schedule,
  dependencies,
  v_placement,
)
from triax.pipeline.schedules.common import check_sizes, schedule

# One micro-batch's 6 chunk actions per stage, one time unit each.
INTERVAL = 6


@dataclasses.dataclass(frozen=True)
class VBlock:
  """A V-shape building block: where one micro-batch's F's and B's sit.

  With a = chunk d and b = chunk 2p-1-d on stage d, the forward runs down the
  V (F(a) on stages 0..p-1) and back up (F(b) on stages p-1..0), the
  backward the other way round. Times, with F(a) on stage 0 at 0:

    F(a) on stage d      f_down * d
    F(b) on stage d      F(a) on stage p-1 + fold_f + f_up * (p-1-d)
    B(b) on stage d      F(b) on stage 0 + turn + gap(p) + b_up * d
    B(a) on stage d      B(b) on stage p-1 + fold_b + b_down * (p-1-d)

  `gap(p)` is `gap` where p % gap_mod == 0, else 0: the extra delay at the
  turn that keeps the 4 times distinct modulo the interval for those p.
  Lifespans sum to the same on every stage when f_down + b_down = f_up +
  b_up, so memory is balanced.
  """

  name: str
  f_down: int
  fold_f: int
  f_up: int
  turn: int
  b_up: int
  fold_b: int
  b_down: int
  gap: int = 0
  gap_mod: int = 1

  def times(self, p: int, d: int) -> dict[str, int]:
    """Stage d's F/B times within the block, keyed 'Fa', 'Fb', 'Bb', 'Ba'."""
    fa = self.f_down * d
    fb = self.f_down * (p - 1) + self.fold_f + self.f_up * (p - 1 - d)
    fb0 = self.f_down * (p - 1) + self.fold_f + self.f_up * (p - 1)
    gap = self.gap if p % self.gap_mod == 0 else 0
    bb = fb0 + self.turn + gap + self.b_up * d
    bb_last = fb0 + self.turn + gap + self.b_up * (p - 1)
    ba = bb_last + self.fold_b + self.b_down * (p - 1 - d)
    return {'Fa': fa, 'Fb': fb, 'Bb': bb, 'Ba': ba}

  def min_microbatches(self, p: int) -> int:
    """Blocks in flight at once: the fewest micro-batches whose repeated
    blocks overlap into a steady phase, below which the schedule is a
    fill-and-drain with none of the block's shape."""
    last = max(max(self.times(p, d).values()) for d in range(p))
    return max(1, math.ceil((last + 1) / INTERVAL))


# The paper's V-Min block: every hop one unit, the B's right behind the F's
# (lifespan ~4p, memory ~p/3 micro-batches); two more units at the turn
# when 3 | p, where B(b) would otherwise share F(a)'s residue.
V_MIN = VBlock(
  'v_min', f_down=1, fold_f=1, f_up=1, turn=1, b_up=1, fold_b=1, b_down=1, gap=2, gap_mod=3
)
# V-Half: the down-leg hops two units (lifespan ~6p, ~p/2 micro-batches);
# three more units at the turn for even p.
V_HALF = VBlock(
  'v_half', f_down=2, fold_f=1, f_up=1, turn=1, b_up=2, fold_b=2, b_down=1, gap=3, gap_mod=2
)
# V-ZB: down-leg hops of four, up-leg hops of two (lifespan 12p-2, 1F1B's p
# micro-batches): enough W's wait on every stage to fill the pipeline's
# drain, which leaves only the fill's p-1 units of bubble.
V_ZB = VBlock('v_zb', f_down=4, fold_f=3, f_up=2, turn=1, b_up=4, fold_b=3, b_down=2)


def v_min(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
  """V-Min: about a third of 1F1B's activations.

  Peak (p+4)//3 micro-batches per stage, 2 * ((p+4)//3) chunk residual sets
  (the paper's V-Min memory: lifespan 4p + O(1) over an interval of 6). The
  step is the block's span longer than 6m, so the bubble is about 1F1B's
  (0.103 against 0.111 at p=4, m=16, t_F = t_B = t_W = 1; the paper's
  authors: similar throughput to 1F1B in practice).

  Raises:
    ConfigError: for v != 2, or m below the block's minimum
      (`VBlock.min_microbatches`).
  """
  return build_v(V_MIN, stages, microbatches, virtual_stages)


def v_half(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
  """V-Half: about half of 1F1B's activations.

  Peak (p+2)//2 micro-batches per stage, 2 * ((p+2)//2) chunk residual sets
  (the paper's V-Half memory: lifespan 6p + O(1) over an interval of 6);
  the bubble is below 1F1B's (0.086 against 0.111 at p=4, m=16).

  Raises:
    ConfigError: for v != 2, or m below the block's minimum.
  """
  return build_v(V_HALF, stages, microbatches, virtual_stages)


def v_zb(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
  """V-ZB: 1F1B's activations, zero bubble.

  Peak p micro-batches per stage, 2p chunk residual sets (the paper's V-ZB
  memory, 1F1B's: lifespan 12p - 2 over an interval of 6); with t_F = t_B =
  t_W = 1 the step takes 6m + p - 1, the least any schedule takes (zb_v's).

  Raises:
    ConfigError: for v != 2, or m below the block's minimum.
  """
  return build_v(V_ZB, stages, microbatches, virtual_stages)


def build_v(block: VBlock, stages: int, microbatches: int, virtual_stages: int) -> Schedule:
  """The schedule of `block` repeated every interval for m micro-batches."""
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  if v != 2:
    raise ConfigError(
      'pipeline.virtual_stages',
      f'{block.name} runs exactly 2 model chunks per stage (a V); got {v}',
    )
  least = block.min_microbatches(p)
  if m < least:
    raise ConfigError(
      'pipeline.microbatches',
      f'{block.name} with {p} stages needs at least {least} micro-batches '
      f'(its building block spans {least} intervals); got {m}',
    )
  orders = [_stage_order(block, p, m, d) for d in range(p)]
  orders = _drain_with_waiting_weights(block.name, p, m, orders)
  return schedule(block.name, p, m, 2, orders, placement=v_placement(p))


def _stage_order(block: VBlock, p: int, m: int, d: int) -> list[Action]:
  """Stage d's actions by time: the block's F/B's every interval, each W in
  the first unit after its B that no F or B of any micro-batch takes."""
  a, b = d, 2 * p - 1 - d
  times = block.times(p, d)
  if len({t % INTERVAL for t in times.values()}) != 4:
    raise AssertionError(f'{block.name}: stage {d} block times {times} collide modulo {INTERVAL}')
  chunk_kind = {'Fa': (FORWARD, a), 'Fb': (FORWARD, b), 'Bb': (BACKWARD, b), 'Ba': (BACKWARD, a)}
  at: dict[int, Action] = {}
  for key, t in times.items():
    kind, chunk = chunk_kind[key]
    for j in range(m):
      at[t + INTERVAL * j] = Action(kind, j, chunk)
  waiting: list[Action] = []  # W's whose B has run, oldest first
  order: list[Action] = []
  t = 0
  end = max(at)
  while t <= end or waiting:
    if t in at:
      order.append(at[t])
      if at[t].kind == BACKWARD:
        waiting.append(Action(WEIGHT, at[t].microbatch, at[t].chunk))
    elif waiting:
      order.append(waiting.pop(0))
    t += 1
  return order


def _drain_with_waiting_weights(
  name: str, p: int, m: int, orders: list[list[Action]]
) -> list[list[Action]]:
  """Reorders each stage's drain, after its last F, to run a B as soon as its
  gradient arrives and a waiting W only while no B can run.

  The block's order puts W's right behind their B's, which the steady
  phase needs but the drain does not: there the last micro-batches' B's
  climb the V one stage a unit, and a stage that ran its W's early idles
  waiting for them. This is the paper's reordering of the repeated blocks'
  tail, done as the lockstep executor will run it (one action a unit, each
  in the first unit after its inputs exist), so the order it returns lowers
  to exactly the ticks simulated here. Memory cannot grow: no F is moved.
  """
  provisional = schedule(name, p, m, 2, orders, placement=v_placement(p))
  split = [max(i for i, a in enumerate(o) if a.kind == FORWARD) + 1 for o in orders]
  fixed = [o[:k] for o, k in zip(orders, split)]
  drain = [[a for a in o[k:] if a.kind == BACKWARD] for o, k in zip(orders, split)]
  # The drain starts with the W's of B's that ran before the last F; each
  # of its own B's adds one.
  waiting = []
  for o, k in zip(orders, split):
    ran = {(a.microbatch, a.chunk) for a in o[:k] if a.kind == BACKWARD}
    waiting.append([a for a in o[k:] if a.kind == WEIGHT and (a.microbatch, a.chunk) in ran])
  out: list[list[Action]] = [[] for _ in range(p)]
  done: dict[Action, int] = {}

  def ready(a: Action, t: int) -> bool:
    return all(d in done and done[d] < t for d in dependencies(a, provisional))

  t = 0
  while any(fixed) or any(drain) or any(waiting):
    ran = []
    for s in range(p):
      if fixed[s]:
        if ready(fixed[s][0], t):
          ran.append((s, fixed[s].pop(0)))
      elif drain[s] and ready(drain[s][0], t):
        b = drain[s].pop(0)
        waiting[s].append(Action(WEIGHT, b.microbatch, b.chunk))
        ran.append((s, b))
      elif waiting[s]:
        ran.append((s, waiting[s].pop(0)))
    if not ran and t > 4 * sum(map(len, orders)):
      raise AssertionError(f'{name}: the drain makes no progress')
    for s, a in ran:
      out[s].append(a)
      done[a] = t
    t += 1
  return out
