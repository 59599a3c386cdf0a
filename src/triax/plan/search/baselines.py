"""The plans every search reports beside its winner, one rule each, for both searches.

  even_split           the winner's degrees, schedule, devices and state
                       sharding with an even layer split (any remat): the
                       fastest such plan the search priced, else the winner
                       re-priced with the even split;
  data_parallel        the fastest data-parallel-only plan (d = devices)
                       with a replicated state (a MoE model's experts
                       whole on every device: no expert parallelism);
  zero3                the same with FSDP (ZeRO-3);
  homogeneous_slowest  the plan the search picks when every device is
                       assumed to be the slowest type (`homogenized`),
                       timed on the real cluster.

None where no such plan fits. Each search hands over what only it knows:
the plans it priced, its data-parallel ones, and its plans for the
homogenized cluster (`compute`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from triax.plan.candidate import Estimate, Options
from triax.plan.cluster import Cluster
from triax.plan.cost import profile as profile_lib
from triax.plan.cost.simulator import simulate_plan
from triax.plan.search import evaluate, partition

BASELINES = ('even_split', 'data_parallel', 'zero3', 'homogeneous_slowest')
# What the report calls each.
NAMES = {
  'even_split': 'same degrees, even layer split',
  'data_parallel': 'data parallel only',
  'zero3': 'ZeRO-3: data parallel only, FSDP',
  'homogeneous_slowest': 'best plan if all devices were the slowest type',
}


def compute(
  cfg,
  cluster: Cluster,
  profile: profile_lib.Profile,
  options: Options,
  best: Estimate | None,
  found: Sequence[Estimate],
  data_parallel: Sequence[Estimate],
  on_slowest: Callable[[Cluster], Sequence[Estimate]],
) -> dict[str, Estimate | None]:
  """The baselines of one search (None where none fits).

  Args:
    best: the search's winner, or None.
    found: the plans the search priced.
    data_parallel: priced plans among which the data-parallel ones are
      (the exhaustive search's `found`; the learned one prices them apart).
    on_slowest: the search's plans for a cluster, best first (called with
      the homogenized cluster).
  """
  out: dict[str, Estimate | None] = dict.fromkeys(BASELINES)
  if best is not None:
    out['even_split'] = even_split(best, found, profile, cluster, options)
  n = cluster.num_devices
  dp = [e for e in data_parallel if not e.oom and e.plan.data == n and e.plan.expert == 1]
  for key, sharding in (('data_parallel', 'replicated'), ('zero3', 'fsdp')):
    mine = [e for e in dp if e.plan.state_sharding == sharding]
    if mine:
      out[key] = min(mine, key=evaluate.rank)
  slow = homogenized(cluster, profile, cfg)
  for e in on_slowest(slow):
    if not e.oom and evaluate.valid(cfg, e.plan, n):
      real = simulate_plan(e.plan, profile, cluster, options)
      if not real.oom:
        out['homogeneous_slowest'] = real
        break
  return out


def even_split(best: Estimate, found, profile, cluster, options) -> Estimate | None:
  """The fastest fitting plan of `found` that is the winner but for its
  layer split (even) and remat; else the winner re-priced with the even split."""
  shape = lambda p: {**dataclasses.asdict(p), 'remat': None, 'layers': None}
  even = [e for e in found if not e.oom and e.plan.even and shape(e.plan) == shape(best.plan)]
  if even:
    return min(even, key=evaluate.rank)
  plan = best.plan
  # Chunks of whole stack entries (a MoE family's groups of model.moe_every).
  unit = plan.virtual_stages * profile.layers_per_entry
  layers = partition.even(plan.num_layers, plan.pipe, unit)
  if layers is None:
    return None
  e = simulate_plan(dataclasses.replace(plan, layers=layers), profile, cluster, options)
  return None if e.oom else e


def homogenized(cluster: Cluster, profile: profile_lib.Profile, cfg) -> Cluster:
  """The cluster with every device replaced by its slowest type (same nodes
  and links): what a planner that ignores heterogeneity would see."""
  batch = cfg.train.global_batch_size
  slowest = max(
    cluster.groups.values(),
    key=lambda g: (evaluate.speed(profile, g, max(1, batch // cluster.num_devices), 1), -g.memory),
  )
  group = dataclasses.replace(
    slowest, count=cluster.num_devices, memory=min(g.memory for g in cluster.groups.values())
  )
  nodes = tuple(
    dataclasses.replace(node, devices={group.name: sum(node.devices.values())})
    for node in cluster.nodes
  )
  devices = tuple(dataclasses.replace(d, group=group.name) for d in cluster.devices)
  return dataclasses.replace(cluster, groups={group.name: group}, nodes=nodes, devices=devices)
