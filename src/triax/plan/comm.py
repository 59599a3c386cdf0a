"""Communication times: point-to-point and all-reduce over cluster devices.

On a cluster whose every group is this machine (`profile: local`), the fits
measured on the local mesh are used; otherwise the spec's links. Either way
a transfer costs latency + bytes / bandwidth, and an all-reduce over n
devices is a ring: 2(n-1) steps of bytes/n over the weakest link among them.
"""

from __future__ import annotations

from collections.abc import Sequence

from triax.plan.cluster import Cluster, Link
from triax.plan.profile import Profile, allreduce_time


class Comm:
  """Transfer and collective times on one cluster."""

  def __init__(self, cluster: Cluster, profile: Profile):
    self.cluster = cluster
    self.measured = cluster.local
    self.profile = profile

  def p2p(self, a: int, b: int, nbytes: float) -> float:
    """Sending nbytes from device a to device b."""
    if a == b or nbytes <= 0:
      return 0.0
    link = self.profile.machine.p2p if self.measured else self.cluster.link(a, b)
    return link.time(nbytes)

  def allreduce(self, devices: Sequence[int], nbytes: float) -> float:
    """Ring all-reduce of nbytes per device over `devices`."""
    n = len(set(devices))
    if n <= 1 or nbytes <= 0:
      return 0.0
    if self.measured:
      return allreduce_time(self.profile.machine.allreduce, n, nbytes)
    return allreduce_time(self.cluster.slowest_link(devices), n, nbytes)

  def link_of(self, a: int, b: int) -> Link:
    return self.profile.machine.p2p if self.measured else self.cluster.link(a, b)
