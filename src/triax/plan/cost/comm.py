"""Communication times over cluster devices: point-to-point, all-reduce, reduce-scatter,
all-gather, all-to-all (`Comm`).

On a cluster whose every group is this machine (`profile: local`), the fits measured on
the local mesh are used; otherwise the spec's links. A transfer costs latency + bytes /
bandwidth over the path between its two devices (inter-node capped by the node's NIC).
Collectives:

- all-reduce on one node, or one device per node: a ring, 2(n-1) steps of bytes/n over the
  weakest link (`allreduce_time`);
- all-reduce over k > 1 devices on each of several nodes: hierarchical, as NCCL runs it
  (reduce-scatter in the node, all-reduce of the 1/k shard across nodes, all-gather in the
  node);
- reduce-scatter or all-gather of nbytes whole: either half of the above;
- all-to-all of nbytes per device: (n-1)/n leaves each device, all links busy at once; the
  intra-node and inter-node parts run at the same time.

The reasoning: docs/design/planner_costs.md."""

from __future__ import annotations

from collections.abc import Sequence

from triax.plan.cluster import Cluster, Link
from triax.plan.cost.profile import Profile


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
    by_node: dict[str, list[int]] = {}
    for d in dict.fromkeys(devices):
      by_node.setdefault(self.cluster.devices[d].node, []).append(d)
    k = max(len(v) for v in by_node.values())
    if len(by_node) == 1 or k == 1:
      return allreduce_time(self.cluster.slowest_link(devices), n, nbytes)
    return self._hierarchical(list(by_node.values()), k, nbytes)

  def allgather(self, devices: Sequence[int], nbytes: float) -> float:
    """All-gather of nbytes (the whole, 1/n from each device) over `devices`."""
    return self.allreduce(devices, nbytes) / 2

  def reduce_scatter(self, devices: Sequence[int], nbytes: float) -> float:
    """Reduce-scatter of nbytes per device into 1/n shards over `devices`."""
    return self.allreduce(devices, nbytes) / 2

  def alltoall(self, devices: Sequence[int], nbytes: float) -> float:
    """All-to-all over `devices` of an nbytes buffer per device (1/n of it
    for each device, its own share staying put)."""
    n = len(set(devices))
    if n <= 1 or nbytes <= 0:
      return 0.0
    if self.measured:
      return (n - 1) * self.profile.machine.p2p.time(nbytes / n)
    by_node: dict[str, list[int]] = {}
    for d in dict.fromkeys(devices):
      by_node.setdefault(self.cluster.devices[d].node, []).append(d)
    if len(by_node) == 1:
      link = self.cluster.slowest_link(devices)
      return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth
    c, k = self.cluster, max(len(v) for v in by_node.values())
    heads = [devs[0] for devs in by_node.values()]
    cross = c.slowest_link(heads)
    caps = [c.node(c.devices[h].node).nic_bandwidth for h in heads]
    bandwidth = min([cross.bandwidth] + [x / k for x in caps if x])
    inter = (n - k) / n * nbytes / bandwidth
    intra = 0.0
    if k > 1:
      link = min(
        (c.slowest_link(devs) for devs in by_node.values() if len(devs) > 1),
        key=lambda l: (l.bandwidth, -l.latency),
      )
      intra = (k - 1) / n * nbytes / link.bandwidth
    return (n - 1) * cross.latency + max(inter, intra)

  def _hierarchical(self, nodes: list[list[int]], k: int, nbytes: float) -> float:
    """Reduce-scatter in each node, all-reduce of a 1/k shard across nodes
    (k at once), all-gather in each node; `nodes` lists the devices per node."""
    c = self.cluster
    intra = min(
      (c.slowest_link(devs) for devs in nodes if len(devs) > 1),
      key=lambda l: (l.bandwidth, -l.latency),
    )
    # One representative per node; k of them share each node's NIC.
    heads = [devs[0] for devs in nodes]
    cross = c.slowest_link(heads)
    caps = [c.node(c.devices[h].node).nic_bandwidth for h in heads]
    caps = [x / k for x in caps if x]
    cross = Link(min([cross.bandwidth] + caps), cross.latency)
    half = (k - 1) * intra.latency + (k - 1) / k * nbytes / intra.bandwidth
    return 2 * half + allreduce_time(cross, len(nodes), nbytes / k)

  def ring_step(self, ring: Sequence[int], nbytes: float) -> float:
    """Every device of `ring` sending nbytes to the next at once (ring
    attention's one K/V block pass): as long as the slowest of those links."""
    n = len(ring)
    if n <= 1 or nbytes <= 0:
      return 0.0
    return max(self.p2p(ring[i], ring[(i + 1) % n], nbytes) for i in range(n))


def allreduce_time(link: Link, n: int, nbytes: float) -> float:
  """Ring all-reduce of nbytes over n devices: 2(n-1) steps of nbytes/n."""
  if n <= 1 or nbytes <= 0:
    return 0.0
  return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth
