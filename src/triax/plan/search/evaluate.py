"""Pricing candidates: the one API both searches (exhaustive and learned) call.

A candidate is a `Layout` (triax/layout.py; plan/search/layouts.py lists
them) with the devices of each stage, a remat policy and a state sharding;
`price` gives it its layer splits (the even one and the dynamic program's
under each stage's memory) and simulates each. `evaluate` does that for
every device order, remat and sharding of a list of layouts (the
exhaustive search, and the baselines of both), for the exhaustive search
adding plans with a synthesised schedule where one can win
(plan/search/synthesized.py). `valid` is what every plan shown must pass
(the config validator), `top_plans` picks the plans shown, `rank` orders
them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from triax import config as config_lib
from triax.errors import ConfigError
from triax.layout import Layout
from triax.plan.candidate import STATE_SHARDINGS, Estimate, Options, Plan
from triax.plan.cluster import Cluster, Group
from triax.plan.cost import experts as experts_lib
from triax.plan.cost import memory as memory_lib
from triax.plan.cost import profile as profile_lib
from triax.plan.cost import roofline
from triax.plan.cost.simulator import simulate_plan
from triax.plan.search import partition, synthesized
from triax.plan.search.layouts import entry_layers, stack_layers

# Least recomputation first: `evaluate` stops at the first that fits where
# recomputation can only be slower (`remat_measured`).
REMATS = profile_lib.REMATS  # one list: the profile's, in order of more recompute


def speed(profile: profile_lib.Profile, group: Group, b: float, t: int, expert: int = 1) -> float:
  """Seconds of one layer's forward + backward: lower is faster."""
  return sum(roofline.seconds(profile, group, f, b, t, expert) for f in ('layer_fwd', 'layer_bwd'))


def assignments(
  cluster: Cluster, profile: profile_lib.Profile, layout: Layout, b: float
) -> list[tuple[tuple[int, ...], ...]]:
  """Ways to form the pipeline stages from the cluster's devices.

  Devices are sorted (fastest first, slowest first, or left in node order)
  and cut into consecutive groups of data*context*tensor: a stage gets
  devices of one speed where it can (it runs at its slowest), and
  consecutive devices mostly share a node (tensor groups, then context
  rings, want the fast intra-node links: Plan.stages is tensor-minor).
  """
  size = layout.data * layout.context * layout.tensor
  fast = {name: speed(profile, g, b, layout.tensor) for name, g in cluster.groups.items()}
  node_order = [d.index for d in cluster.devices]
  fast_first = sorted(node_order, key=lambda i: (fast[cluster.devices[i].group], i))
  slow_first = sorted(node_order, key=lambda i: (-fast[cluster.devices[i].group], i))
  out = []
  for order in (fast_first, node_order, slow_first):
    stages = tuple(tuple(order[k * size : (k + 1) * size]) for k in range(layout.pipe))
    if stages not in out:
      out.append(stages)
  return out


def state_shardings(cfg, data: int) -> tuple[str, ...]:
  """The state shardings a layout with `data` replicas can use: all of
  STATE_SHARDINGS with data > 1, FSDP only where d_model divides by data."""
  if data == 1:
    return ('replicated',)
  return tuple(k for k in STATE_SHARDINGS if k != 'fsdp' or cfg.model.d_model % data == 0)


def partitions(
  cfg, layout: Layout, stages, profile, cluster: Cluster, options: Options, remat: str, sharding
) -> list[tuple[int, ...]]:
  """The even split (if any) and the balanced one for these stages: each
  stage's v chunks of whole stack entries (`entry_layers`)."""
  p, v, t = layout.pipe, layout.virtual_stages, layout.tensor
  num_layers = stack_layers(cfg)
  unit = v * entry_layers(cfg)
  rows = cfg.train.global_batch_size // (layout.data * layout.microbatches)
  b = rows / layout.context  # what a device computes (Plan.compute_batch)
  out = []
  even = partition.even(num_layers, p, unit)
  if even:
    out.append(even)
  if p == 1:
    return out or [(num_layers,)]
  groups = [[cluster.groups[cluster.devices[d].group] for d in stage] for stage in stages]
  e = layout.expert
  per_layer = [max(speed(profile, g, b, t, e) for g in gs) for gs in groups]
  edge = [0.0] * p
  edge[0] += max(roofline.seconds(profile, g, 'embed', b, t, e) for g in groups[0])
  edge[-1] += max(roofline.seconds(profile, g, 'head', b, t, e) for g in groups[-1])
  shard = profile.shards[t]
  fixed = shard.stash_fixed_per_seq * memory_lib.residual_share(layout)
  stash = rows * (memory_lib.layer_stash(layout, shard, remat) + fixed)
  capacity = [min(g.memory for g in gs) * options.memory_fraction for gs in groups]

  # Memory of a stage holding n layers, its stash slots taken as p (1F1B's
  # steady state): a screen only; the simulator checks the real program.
  moments = max(options.optimizer_state)  # a screen: the larger of the layers' and edges'
  state_copies = sum(memory_lib.copies(sharding, layout.data, moments=moments).values())

  # A MoE layer's experts split over the expert degree, and an edge's (MTP's).
  layer = experts_lib.layer_params(layout, shard)
  edges = shard.edge_param_bytes - shard.edge_expert_param_bytes * (1 - 1 / layout.expert)

  def allowed(s, n):
    params = state_copies * (layer * n + edges)
    return params + p * stash * n / v <= capacity[s]

  balanced = partition.balance(
    num_layers, p, lambda s, n: edge[s] + n * per_layer[s], allowed, unit=unit
  )
  if balanced and balanced[0] not in out:
    out.append(balanced[0])
  return out


def price(
  cfg,
  cluster: Cluster,
  profile: profile_lib.Profile,
  options: Options,
  layout: Layout,
  stages,
  remat: str,
  sharding: str,
  always: bool = False,
) -> list[Estimate]:
  """The candidate simulated with each of its layer splits (`partitions`).

  always: when the memory screen refuses every split, price the one
  nearest to even anyway (it runs out of memory): the learned planner's
  reward needs a price for every choice it makes."""
  splits = partitions(cfg, layout, stages, profile, cluster, options, remat, sharding)
  if not splits and always:
    unit = layout.virtual_stages * entry_layers(cfg)
    splits = [partition.nearest_even(stack_layers(cfg), layout.pipe, unit)]
  out = []
  for split in splits:
    plan = Plan(
      layout=layout,
      remat=remat,
      layers=split,
      stages=stages,
      global_batch=cfg.train.global_batch_size,
      state_sharding=sharding,
    )
    out.append(simulate_plan(plan, profile, cluster, options))
  return out


def evaluate(
  cfg,
  cluster: Cluster,
  profile,
  options: Options,
  layouts: Iterable[Layout],
  synthesize: bool = False,
):
  """Every device order, remat and state sharding of `layouts`, priced.

  Remat beyond 'none' is tried only where 'none' runs out of memory (on
  paper recomputation never speeds up), unless it was measured here; only
  the policies the model composes with (config.remat_policies: not dots
  under model.fp8).
  synthesize: also plans with a synthesised schedule where one can win
  (a search's whole set of layouts; off for callers that keep to named
  schedules, as elastic/replan.py's layout keys do)."""
  found = []
  batch = cfg.train.global_batch_size
  remats = [r for r in REMATS if r in config_lib.remat_policies(cfg.model)]
  for layout in layouts:
    b = batch // (layout.data * layout.microbatches) / layout.context
    for stages in assignments(cluster, profile, layout, b):
      for remat in remats:
        fits = False
        for sharding in state_shardings(cfg, layout.data):
          priced = price(cfg, cluster, profile, options, layout, stages, remat, sharding)
          found += priced
          fits |= any(not e.oom for e in priced)
        if fits and not remat_measured(profile, cluster):
          break  # on paper, more recomputation would only be slower
  if not synthesize:
    return found
  # Where memory leaves the named schedules bubble, a synthesised one may fill it.
  return found + synthesized.candidates(cfg, cluster, profile, options, found)


def remat_measured(profile: profile_lib.Profile, cluster: Cluster) -> bool:
  """Whether every group's remat costs were measured (this machine with
  every policy profiled): then recomputation may be faster, and is tried."""
  return cluster.local and all(profile_lib.variant('layer_bwd', r) in profile.fits for r in REMATS)


def rank(e: Estimate) -> tuple:
  """Sort key of plans: the predicted step time; of equals, the one without
  context parallelism, then without SP (the simpler mesh; plans without
  them read as they did)."""
  return (e.step_time, e.plan.context, e.plan.sequence_parallel)


def with_plan(cfg, plan: Plan):
  """A copy of cfg with the plan's overrides applied."""
  import ml_collections

  from triax.plan.search import emit

  return emit.apply(ml_collections.ConfigDict(cfg.to_dict()), emit.overrides(plan, cfg=cfg))


def valid(cfg, plan: Plan, num_devices: int) -> bool:
  """Whether triax's config validator accepts the plan (sizes, schedule rules)."""
  try:
    config_lib.validate(with_plan(cfg, plan), num_devices)
    return True
  except (ConfigError, ValueError):
    return False


def top_plans(cfg, found: Sequence[Estimate], top_k: int, num_devices: int) -> list[Estimate]:
  """The best `top_k` plans of `found` that fit and that the validator
  accepts, by `rank`; device orders that change nothing predicted (one
  stage, say) show once."""
  top, seen = [], set()
  for e in sorted((e for e in found if not e.oom), key=rank):
    if len(top) == top_k:
      break
    key = (e.plan.describe(), round(e.step_time, 12))
    if key not in seen and valid(cfg, e.plan, num_devices):
      seen.add(key)
      top.append(e)
  return top
