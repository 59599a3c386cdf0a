"""Host memory's copies: what pipeline.offload_stash and train.offload_optimizer
cost over each device's link to its host (a cluster group's host_bandwidth).

The executor's offloaded stash (pipeline/executor.py, `_HostStash`) copies one
residual set out and one in every tick, at the tick's top level, where XLA
runs them beside the tick's compute: the link's two directions at once, so a
tick lasts the longer of its compute and one set's copy (PipeOffload's
premise). The offloaded optimizer state comes to the device for the update
and goes back after it: its moments cross the link twice, one way and then
the other, with nothing to hide behind.
"""

from __future__ import annotations

from triax.errors import ConfigError
from triax.plan.candidate import Options, Plan
from triax.plan.cluster import Cluster
from triax.plan.cost import memory as memory_lib
from triax.plan.cost.profile import Profile


def require(cluster: Cluster, options: Options) -> None:
  """Before a search: every group states its host link if the plans offload.

  Raises:
    ConfigError(the offload's key, ...): a group without host_bandwidth.
  """
  for key, on in (
    ('pipeline.offload_stash', options.offload_stash),
    ('train.offload_optimizer', options.offload_optimizer),
  ):
    if on:
      _check(cluster, cluster.groups, key)


def link(plan: Plan, cluster: Cluster, stage: int, key: str) -> float:
  """The slowest host link (bytes/s one way) of the stage's devices.

  Raises:
    ConfigError(key, ...): a group of them states no host_bandwidth.
  """
  groups = {cluster.devices[d].group for d in plan.stages[stage]}
  _check(cluster, groups, key)
  return min(cluster.groups[g].host_bandwidth for g in groups)


def _check(cluster: Cluster, groups, key: str) -> None:
  missing = sorted(g for g in groups if cluster.groups[g].host_bandwidth is None)
  if missing:
    raise ConfigError(
      key,
      f"pricing its host copies needs the host_bandwidth of {cluster.name}'s group "
      f"{', '.join(missing)} (one device's link to host memory, one way, e.g. 64 GB/s for "
      'PCIe Gen5 x16); add it to the cluster file',
    )


def stash_seconds(
  plan: Plan, profile: Profile, cluster: Cluster, options: Options
) -> tuple[float, ...]:
  """Per stage, one residual set copied one way; () without offload_stash."""
  if not options.offload_stash or not plan.uses_executor:
    return ()
  return tuple(
    memory_lib.chunk_stash(plan, profile, memory_lib.stage_layers(plan, options, s))
    / link(plan, cluster, s, 'pipeline.offload_stash')
    for s in range(plan.pipe)
  )


def optimizer_seconds(plan: Plan, profile: Profile, cluster: Cluster, options: Options) -> float:
  """The moments' trip to the device and back in one step, the slowest stage's;
  0 without offload_optimizer."""
  if not options.offload_optimizer:
    return 0.0
  out = 0.0
  for s in range(plan.pipe):
    layers = memory_lib.stage_layers(plan, options, s)
    params, experts = memory_lib.stage_params(plan, profile, layers)
    per_param = memory_lib.stage_moments(plan, profile, options, layers)
    moments = memory_lib.state(plan, profile, params, experts, per_param)['moments']
    out = max(out, 2 * moments / link(plan, cluster, s, 'train.offload_optimizer'))
  return out
