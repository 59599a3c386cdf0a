"""Compute time of one function on one device type, from the local profile.

This machine's groups (`profile: local`) use the local measurements
(interpolated in the micro-batch size; see Profile.local_seconds), or where
a tensor degree was not measured the local fit:

  time = c0 + k * max(flops / local_peak, bytes / local_bandwidth)

Every other group is derived by a roofline with this machine's efficiency:

  time = overhead_per_layer + max(flops / peak, bytes / bandwidth) / e

where e = 1/k of the local fit, capped at 1 (or the group's `efficiency`,
if the spec sets one), peak is the group's peak at the model's compute dtype and
bandwidth its memory bandwidth. The assumption — every device reaches the
same fraction of its roofline as this one — is what `assumption()` prints.
"""

from __future__ import annotations

from triax.plan.cluster import Group
from triax.plan.cost.profile import FUNCTIONS, LAYER_FUNCTIONS, Profile, variant


def seconds(
  profile: Profile, group: Group, function: str, b: int, t: int, expert: int = 1
) -> float:
  """Time of `function` (a profile fits key) on b sequences at degree t; the
  analytic model reads a routed expert's weights over `expert` devices (a
  measured profile's fits know no expert degree)."""
  if profile.analytic is not None:
    return profile.analytic.seconds(group, function, b, t, expert)
  if group.local:
    return profile.local_seconds(function, b, t)
  base = function.split('/')[0]
  work = profile.shards[t].work[base]
  fit = profile.fits[base]
  efficiency = group.efficiency or min(1.0, fit.efficiency)
  roof = max(work.flops(b) / group.peak(profile.dtype), work.bytes(b) / group.memory_bandwidth)
  overhead = group.overhead_per_layer if base in LAYER_FUNCTIONS else 0.0
  return overhead + roof / efficiency


def layer_seconds(
  profile: Profile, group: Group, b: int, t: int, remat: str, expert: int = 1
) -> tuple[float, float]:
  """(forward, backward) seconds of one layer under a remat policy.

  Measured on this machine when the profile holds the policy; otherwise
  the recomputation is priced on paper: full remat reruns the forward in
  the backward, dots its attention core, attention the core's scores (Q
  K^T: half its FLOPs).
  """
  if profile.analytic is not None:
    return profile.analytic.layer_seconds(group, b, t, remat, expert)
  if group.local and variant('layer_bwd', remat) in profile.fits:
    return (
      seconds(profile, group, variant('layer_fwd', remat), b, t),
      seconds(profile, group, variant('layer_bwd', remat), b, t),
    )
  fwd = seconds(profile, group, 'layer_fwd', b, t)
  bwd = seconds(profile, group, 'layer_bwd', b, t)
  if remat == 'full':
    bwd += fwd
  elif remat == 'dots':
    bwd += fwd * profile.shards[t].attention_fraction
  elif remat == 'attention':
    bwd += fwd * profile.shards[t].attention_fraction / 2
  return fwd, bwd


def node_share(
  profile: Profile, group: Group, function: str, b: int, t: int, shared_cores: int | None
) -> float:
  """Seconds of a shared node's capacity one device running `function`
  takes: on this machine, the measured time with every local device running
  it divided by their number; on a spec'd node with `shared_cores`, its
  time over that core count; 0 where devices do not share."""
  if not shared_cores:
    return 0.0
  if group.local and profile.machine.num_devices > 1:
    return profile.local_seconds(function, b, t, concurrent=True) / profile.machine.num_devices
  return seconds(profile, group, function, b, t) / shared_cores


def bandwidth(profile: Profile, group: Group) -> float:
  """Memory bandwidth of a group (the measured one for local groups)."""
  return profile.machine.memory_bandwidth if group.local else group.memory_bandwidth


def assumption(profile: Profile) -> str:
  """One paragraph stating how device types other than this one are timed."""
  m = profile.machine
  effs = ', '.join(f'{f} {min(1.0, profile.fits[f].efficiency):.0%}' for f in FUNCTIONS)
  return (
    f'Roofline assumption: a device that is not this machine runs each function at '
    f'the same fraction of max(flops/peak, bytes/bandwidth) as this {m.backend} '
    f'backend does ({effs}; local peak {m.matmul_flops / 1e9:.1f} GFLOP/s measured on '
    f'a 1024^2 matmul, bandwidth {m.memory_bandwidth / 1e9:.1f} GB/s on a copy), '
    "plus the spec's overhead_per_layer; a group's `efficiency` overrides it."
  )
