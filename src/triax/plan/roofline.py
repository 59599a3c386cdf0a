"""Compute time of one function on one device type, from the local profile.

This machine's groups (`profile: local`) use the local fit directly:

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
from triax.plan.profile import FUNCTIONS, Profile


def seconds(profile: Profile, group: Group, function: str, b: int, t: int) -> float:
  """Time of `function` (a profile.FUNCTIONS name) on b sequences at degree t."""
  if group.local:
    return profile.local_seconds(function, b, t)
  work = profile.shards[t].work[function]
  fit = profile.fits[function]
  efficiency = group.efficiency or min(1.0, fit.efficiency)
  roof = max(work.flops(b) / group.peak(profile.dtype),
             work.bytes(b) / group.memory_bandwidth)
  overhead = group.overhead_per_layer if function.startswith('layer') else 0.0
  return overhead + roof / efficiency


def memory_seconds(profile: Profile, group: Group, function: str, b: int, t: int) -> float:
  """The part of `seconds` spent moving bytes (at most all of it): what
  devices sharing one memory system cannot overlap."""
  total = seconds(profile, group, function, b, t)
  return min(total, profile.shards[t].work[function].bytes(b) / bandwidth(profile, group))


def bandwidth(profile: Profile, group: Group) -> float:
  """Memory bandwidth of a group (the measured one for local groups)."""
  return profile.machine.memory_bandwidth if group.local else group.memory_bandwidth


def assumption(profile: Profile) -> str:
  """One paragraph stating how device types other than this one are timed."""
  m = profile.machine
  effs = ', '.join(f'{f} {min(1.0, profile.fits[f].efficiency):.0%}' for f in FUNCTIONS)
  return (f'Roofline assumption: a device that is not this machine runs each function at '
          f'the same fraction of max(flops/peak, bytes/bandwidth) as this {m.backend} '
          f'backend does ({effs}; local peak {m.matmul_flops / 1e9:.1f} GFLOP/s measured on '
          f'a 1024^2 matmul, bandwidth {m.memory_bandwidth / 1e9:.1f} GB/s on a copy), '
          'plus the spec\'s overhead_per_layer; a group\'s `efficiency` overrides it.')
