"""Synthesised schedules in the planner: where memory, not the schedule, leaves bubble.

`candidates(cfg, cluster, profile, options, found)` returns plans whose schedule the
synthesiser (triax.pipeline.synthesis, its heuristic under a time limit) makes with at most
K residual sets and C cuts per stage, for the K and C the device's memory leaves; each is
the fastest that fits for its layout. A layout gets one only where one can win:

- a pipeline (p >= 2) with m >= 2p micro-batches;
- some named schedule of the layout is faster than its best that fits but runs out of
  memory;
- the layout's bubble-free bound is below the best plan found so far;
- it is among the `LAYOUTS` such layouts with the lowest bound (up to `PAIRS` (K, C)
  pairs each: a synthesis takes seconds).

K and C come from the bytes the layout's fastest fitting named plan leaves beside its
state, messages and workspace; the result is priced by the simulator (the memory model
reads the program's own slots). Syntheses are cached per (p, m, v, K, C, costs relative to
the forward, rounded to two digits). `sets_within` turns a byte limit into K for `triax
schedule --synthesize --memory_limit_mib`. Why: docs/design/planner_search.md."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from triax.errors import ConfigError
from triax.layout import Layout
from triax.pipeline import schedule as sched
from triax.pipeline import simulate, synthesis
from triax.plan.candidate import Estimate, Options, Plan, given_schedule
from triax.plan.cost import memory as memory_lib
from triax.plan.cost.simulator import action_costs, simulate_plan
from triax.plan.search.layouts import stack_layers

# The synthesiser's time limit per call, in seconds (its local search's
# share of it; the greedy passes before it take what they take).
TIME_LIMIT_S = 1.0
# Set limits K tried per layout, largest first: fewer sets mostly mean more
# bubble, and each try is a synthesis.
PAIRS = 3
# Layouts synthesised per search, lowest bubble-free bound first.
LAYOUTS = 4


def candidates(
  cfg, cluster, profile, options: Options, found: Sequence[Estimate]
) -> list[Estimate]:
  """Plans with a synthesised schedule where one can beat `found`'s named ones
  (see the module docstring); each the fastest that fits for its layout."""
  del cfg  # the layouts in `found` already passed the config's checks
  best = min((e.step_time for e in found if not e.oom), default=math.inf)
  out, tried = [], 0
  for group in sorted(_groups(found), key=_bound):
    faster = _faster_oom(group, best)
    if faster is None:
      continue
    if tried == LAYOUTS:
      break
    tried += 1
    priced = [
      _priced(faster.plan, k, c, profile, cluster, options)
      for k, c in _limits(faster, profile, options)
    ]
    fitting = [e for e in priced if e is not None and not e.oom]
    fits = min((x.step_time for x in group if not x.oom), default=math.inf)
    if fitting and min(e.step_time for e in fitting) < fits:
      out.append(min(fitting, key=lambda e: e.step_time))
      best = min(best, out[-1].step_time)
  return out


def _groups(found: Sequence[Estimate]) -> list[list[Estimate]]:
  """The named plans of `found` by layout: everything but the schedule alike."""
  groups: dict[Plan, list[Estimate]] = {}
  for e in found:
    p = e.plan
    if p.pipe >= 2 and p.microbatches >= 2 * p.pipe:
      unnamed = dataclasses.replace(p, layout=dataclasses.replace(p.layout, schedule=''))
      groups.setdefault(unnamed, []).append(e)
  return list(groups.values())


def _faster_oom(group: list[Estimate], best: float) -> Estimate | None:
  """The fastest named plan of the layout that runs out of memory where a
  slower one fits, or None where a synthesised schedule cannot win."""
  fits = min((e.step_time for e in group if not e.oom), default=math.inf)
  faster = [e for e in group if e.oom and e.step_time < fits]
  if not faster or _bound(group) >= best:
    return None
  return min(faster, key=lambda e: e.step_time)


def _bound(group: list[Estimate]) -> float:
  """No schedule of the layout beats its busiest stage's work: the
  bubble-free bound."""
  return min(e.tail_time + e.pipeline_time * (1 - e.bubble_fraction) for e in group)


def _limits(e: Estimate, profile, options: Options) -> list[tuple[int, int]]:
  """(K, C) pairs that fit beside what `e` holds but its sets and cuts:
  for the `PAIRS` largest K up to e's sets that leave room for a cut, the
  most cuts C <= K (a cut belongs to a held set) the rest holds."""
  plan = e.plan
  prog = plan.lowered
  if any(x > c for x, c in zip(e.state_memory, e.capacity)):
    return []  # a save, restore or evaluation does not fit: no schedule helps
  room = []  # per stage: bytes for sets and cuts, and one set's and one cut's
  for s in range(plan.pipe):
    own = plan.layers[s] // plan.virtual_stages
    held = max(plan.chunk_layers) if options.padded else own
    pool = memory_lib.pools(plan, profile, options, prog, s, held)
    rest = e.step_memory[s] - pool['stash'] - pool['cut']
    one_set = memory_lib.chunk_stash(plan, profile, held)
    one_cut = memory_lib.chunk_cut(plan, profile, held)
    room.append((e.capacity[s] - rest, one_set, max(one_cut, 1e-30)))
  out = []
  for k in range(prog.slots['stash'], plan.virtual_stages - 1, -1):
    c = min([k] + [math.floor((free - k * one_set) / one_cut) for free, one_set, one_cut in room])
    if c >= 1:
      out.append((k, c))
  return out[:PAIRS]


def _priced(plan: Plan, k: int, c: int, profile, cluster, options) -> Estimate | None:
  """`plan` with the synthesised schedule of at most k sets and c cuts, priced."""
  costs = _relative_costs(plan, profile, cluster, options)
  schedule = synthesised(plan.pipe, plan.microbatches, plan.virtual_stages, k, c, costs)
  if schedule is None:
    return None
  named = dataclasses.replace(plan.layout, schedule=given_schedule(schedule))
  return simulate_plan(dataclasses.replace(plan, layout=named), profile, cluster, options)


def _relative_costs(plan: Plan, profile, cluster, options) -> simulate.Costs:
  """The slowest stage's F, B, W and transfer, over its F, to two digits."""
  costs = action_costs(plan, profile, cluster, options)
  placement = plan.placement

  def stage_max(kind: str) -> float:
    per = [0.0] * plan.pipe
    for c, s in enumerate(placement):
      per[s] += costs.chunk[c][kind]
    return max(per)

  f = stage_max(sched.FORWARD)
  if not f > 0:
    f = 1.0
  two = lambda x: max(float(f'{x / f:.2g}'), 0.0)
  return simulate.Costs(
    t_forward=1.0,
    t_backward=max(two(stage_max(sched.BACKWARD)), 0.01),  # the synthesiser needs B > 0
    t_weight=two(stage_max(sched.WEIGHT)),
    t_transfer=two(max(costs.transfer)),
  )


@functools.lru_cache(maxsize=256)
def synthesised(
  p: int, m: int, v: int, k: int, c: int, costs: simulate.Costs
) -> sched.Schedule | None:
  """The heuristic's schedule for these sizes, limits and costs (None: none within them)."""
  try:
    return synthesis.synthesize(p, m, v, k, costs, TIME_LIMIT_S, 'heuristic', cut_limit=c)
  except ConfigError:
    return None


def sets_within(cfg, stages: int, microbatches: int, virtual_stages: int, limit_bytes: float):
  """(K, bytes of one set): how many residual sets of one micro-batch of one
  chunk fit in `limit_bytes`, priced as the planner prices them.

  A micro-batch is global_batch / (mesh.data x microbatches) sequences; a
  chunk the largest of num_layers split over stages x virtual_stages; the
  tensor and context degrees, sequence parallelism and remat are the
  config's (`memory.chunk_stash` of the analytic profile).

  Raises:
    ConfigError: keyed by the config key or flag that makes no set size.
  """
  from triax.plan.cost import analytic

  p, m, v = stages, microbatches, virtual_stages
  mesh, batch = cfg.mesh, cfg.train.global_batch_size
  if mesh.data < 1:
    raise ConfigError(
      '--config',
      f'mesh.data is {mesh.data} (every device): a set holds global_batch / '
      '(data x microbatches) sequences; give the data degree, e.g. --config.mesh.data=1',
    )
  try:
    layout = Layout.from_config(cfg)
  except ValueError as e:
    raise ConfigError('--config', str(e)) from None
  size = mesh.data * mesh.context * mesh.tensor
  try:
    plan = Plan(
      layout=dataclasses.replace(layout, pipe=p, schedule='1f1b', microbatches=m, virtual_stages=v),
      remat=cfg.model.remat,
      layers=(v,) * p,
      stages=tuple(tuple(range(s * size, (s + 1) * size)) for s in range(p)),
      global_batch=batch,
    )
  except ValueError as e:
    raise ConfigError('--microbatches', f'{e}; choose micro-batches that divide it') from None
  profile = analytic.build(cfg.model, [mesh.tensor])
  # The largest chunk, in whole stack entries (a MoE family's groups of model.moe_every).
  entry = profile.layers_per_entry
  widest = -(-(stack_layers(cfg) // entry) // (p * v)) * entry
  per_set = memory_lib.chunk_stash(plan, profile, widest)
  return int(limit_bytes // per_set), per_set
