"""Cluster specs: device groups, nodes and links, read from YAML and checked.

A spec (experiments/clusters/*.yaml) names what the planner may use:

  name: heterog_testbed
  groups:                  # one entry per device type
    - {name: v100, type: Tesla V100-PCIE-16GB, count: 2, memory: 16 GB,
       peak_flops: {bfloat16: 112 TFLOP/s}, memory_bandwidth: 900 GB/s}
  nodes:                   # where the devices sit; optional nic_bandwidth, count
    - {name: n0, devices: {v100: 2}}
  links:
    intra_node: {bandwidth: 12 GB/s, latency: 10 us}
    inter_node: {bandwidth: 100 Gb/s, latency: 25 us}

Quantities are SI numbers or strings with a unit ('16 GiB', '100 Gb/s', '10 us'): bits and
bytes never mix silently. A group's peak_flops lists bfloat16 and float32 at least, and
`float8` (the dense FP8 tensor-core peak) where the device has one. A group may be
`profile: local` (measured here; its figures may say `measured`) and carry
`matmul_efficiency` (plan/cost/analytic.py), `host_bandwidth` (plan/cost/host.py) and
`ragged_dot` (plan/cost/experts.py); a node's `shared_cores: N` lets at most N of its
devices compute at full speed at once. `resize` sizes a cluster of identical nodes to N devices.

Every problem raises ConfigError('--cluster', '<file>: <what, how to fix>'). Each key's
meaning: docs/design/planner_costs.md."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any

from triax.errors import ConfigError

# dtype names of config.model.dtype that a group's peak_flops may list.
DTYPES = ('bfloat16', 'float16', 'float32')
# peak_flops's key for the dense FP8 tensor-core peak (model.fp8's GEMMs,
# plan/cost/analytic.py); absent where the device has no FP8 tensor cores.
FLOAT8 = 'float8'
PEAK_KEYS = (*DTYPES, FLOAT8)
MEASURED = 'measured'
# Group.ragged_dot's kinds. XLA:GPU expands a ragged_dot into one dense dot
# over every group with the rows outside each group masked: E x the routed
# experts' FLOPs and [groups, rows, width] buffers (plan/cost/experts.py).
RAGGED_DOT = ('grouped', 'dense')

_UNITS = {
  'bytes': {
    'B': 1,
    'KB': 1e3,
    'MB': 1e6,
    'GB': 1e9,
    'TB': 1e12,
    'KiB': 2**10,
    'MiB': 2**20,
    'GiB': 2**30,
    'TiB': 2**40,
  },
  'bandwidth': {
    'B/s': 1,
    'KB/s': 1e3,
    'MB/s': 1e6,
    'GB/s': 1e9,
    'TB/s': 1e12,
    'GiB/s': 2**30,
    'b/s': 1 / 8,
    'Kb/s': 1e3 / 8,
    'Mb/s': 1e6 / 8,
    'Gb/s': 1e9 / 8,
    'Tb/s': 1e12 / 8,
    'Gbps': 1e9 / 8,
    'Mbps': 1e6 / 8,
  },
  'flops': {'FLOP/s': 1, 'GFLOP/s': 1e9, 'TFLOP/s': 1e12, 'PFLOP/s': 1e15},
  'seconds': {'s': 1, 'ms': 1e-3, 'us': 1e-6, 'ns': 1e-9},
}
_EXAMPLE = {
  'bytes': "'16 GB'",
  'bandwidth': "'100 Gb/s' or '12 GB/s'",
  'flops': "'125 TFLOP/s'",
  'seconds': "'10 us'",
}


@dataclasses.dataclass(frozen=True)
class Link:
  """A point-to-point path: time(bytes) = latency + bytes / bandwidth."""

  bandwidth: float
  latency: float

  def time(self, nbytes: float) -> float:
    return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Group:
  """One device type and how many of it the cluster has.

  Attributes:
    name: short id used by nodes and plans.
    type: the device's marketing name, for people.
    count: devices of this type in the cluster.
    peak_flops: dtype -> dense peak FLOP/s (None where `measured`); FLOAT8's
      entry, where present, is the FP8 tensor cores' peak.
    memory: bytes per device.
    memory_bandwidth: bytes/s per device (None where `measured`).
    local: times come from measuring this machine, not from the roofline.
    efficiency: optional fixed roofline efficiency; None = calibrate on the
      local measurement.
    overhead_per_layer: seconds added per layer action (kernel launches),
      a floor the roofline cannot see for small layers.
    matmul_efficiency: fraction of peak a large matmul sustains (the
      analytic model's calibration constant); None = not stated.
    host_bandwidth: bytes/s one way between a device and its host's memory;
      None = not stated.
    ragged_dot: how the device's compiler runs a grouped matmul (jax's
      ragged_dot, dropless MoE's experts): 'grouped' (each group's rows
      only, XLA:TPU's) or 'dense' (one product over every group, masked:
      XLA:GPU's with jax 0.10 to 0.12); see RAGGED_DOT.
  """

  name: str
  type: str
  count: int
  peak_flops: dict[str, float | None]
  memory: float
  memory_bandwidth: float | None
  local: bool = False
  efficiency: float | None = None
  overhead_per_layer: float = 0.0
  matmul_efficiency: float | None = None
  host_bandwidth: float | None = None
  ragged_dot: str = 'grouped'

  def peak(self, dtype: str) -> float | None:
    """Peak FLOP/s at the compute dtype (float16 falls back to bfloat16)."""
    if dtype in self.peak_flops:
      return self.peak_flops[dtype]
    if dtype == 'float16' and 'bfloat16' in self.peak_flops:
      return self.peak_flops['bfloat16']
    raise KeyError(dtype)

  def fp8_peak(self) -> float | None:
    """Dense FP8 tensor-core peak FLOP/s; None where the spec lists none
    (no FP8 tensor cores, or `measured`)."""
    return self.peak_flops.get(FLOAT8)


@dataclasses.dataclass(frozen=True)
class Node:
  """A host: which devices it holds and what its network can do."""

  name: str
  devices: dict[str, int]
  nic_bandwidth: float | None = None
  intra_bandwidth: float | None = None
  shared_cores: int | None = None


@dataclasses.dataclass(frozen=True)
class Device:
  """One device, numbered 0..N-1 in node order, then group order."""

  index: int
  group: str
  node: str


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A validated spec. `devices` lists every device once."""

  name: str
  description: str
  path: str
  groups: dict[str, Group]
  nodes: tuple[Node, ...]
  intra_node: Link
  inter_node: Link
  devices: tuple[Device, ...]

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  def node(self, name: str) -> Node:
    return self._nodes_by_name[name]

  @functools.cached_property
  def _nodes_by_name(self) -> dict[str, Node]:
    # Specs of thousands of devices ask for a device's node per link.
    return {n.name: n for n in self.nodes}

  def link(self, a: int, b: int) -> Link:
    """The path between devices a and b (index), node NICs included."""
    da, db = self.devices[a], self.devices[b]
    if da.node == db.node:
      bw = self.node(da.node).intra_bandwidth or self.intra_node.bandwidth
      return Link(bw, self.intra_node.latency)
    bws = [self.inter_node.bandwidth] + [
      n.nic_bandwidth for n in (self.node(da.node), self.node(db.node)) if n.nic_bandwidth
    ]
    return Link(min(bws), self.inter_node.latency)

  def slowest_link(self, devices) -> Link:
    """The weakest link among a set of devices (a collective's bottleneck)."""
    # The weakest pair, found per node rather than per pair (specs have
    # thousands of devices): a node's intra link if it holds two of them,
    # and across nodes the inter-node link capped by the smallest NIC.
    per_node: dict[str, int] = {}
    for d in dict.fromkeys(devices):
      per_node[self.devices[d].node] = per_node.get(self.devices[d].node, 0) + 1
    links = [
      Link(self.node(n).intra_bandwidth or self.intra_node.bandwidth, self.intra_node.latency)
      for n, count in per_node.items()
      if count > 1
    ]
    if len(per_node) > 1:
      nics = [self.node(n).nic_bandwidth for n in per_node if self.node(n).nic_bandwidth]
      links.append(Link(min([self.inter_node.bandwidth] + nics), self.inter_node.latency))
    if not links:
      return Link(math.inf, 0.0)
    return min(links, key=lambda l: (l.bandwidth, -l.latency))

  def shared_cores(self, node: str) -> int | None:
    return self.node(node).shared_cores

  @property
  def heterogeneous(self) -> bool:
    return len(self.groups) > 1

  @property
  def local(self) -> bool:
    """Every group is this machine (`profile: local`): costs are measured here."""
    return all(g.local for g in self.groups.values())


def resize(cluster: Cluster, devices: int) -> Cluster:
  """The cluster with `devices` devices: its node repeated (or cut to part
  of one node) — for specs whose nodes are all alike, as a supercomputer's are.

  Raises:
    ConfigError('--gpus', ...) for a count the nodes cannot make.
  """
  first = cluster.nodes[0]
  if any(
    n.devices != first.devices or dataclasses.replace(n, name=first.name) != first
    for n in cluster.nodes
  ):
    raise ConfigError(
      '--gpus', f'{cluster.path}: its nodes differ, so it cannot be resized; leave --gpus out'
    )
  per = sum(first.devices.values())
  base = first.name.rsplit('-', 1)[0] if len(cluster.nodes) > 1 else first.name
  if devices < 1 or (devices > per and devices % per):
    raise ConfigError(
      '--gpus',
      f'want a positive multiple of {per} (the devices of one {base} node) or at most '
      f'{per}, got {devices}',
    )
  if devices < per:
    if len(first.devices) > 1:
      raise ConfigError('--gpus', f'part of a mixed node; use a multiple of {per}')
    nodes = (dataclasses.replace(first, devices={next(iter(first.devices)): devices}),)
  else:
    nodes = tuple(dataclasses.replace(first, name=f'{base}-{k}') for k in range(devices // per))
  counts = {g: sum(n.devices.get(g, 0) for n in nodes) for g in cluster.groups}
  groups = {
    g: dataclasses.replace(group, count=counts[g])
    for g, group in cluster.groups.items()
    if counts[g]
  }
  out = []
  for node in nodes:
    for g, count in node.devices.items():
      first_index = len(out)
      out.extend(Device(first_index + k, g, node.name) for k in range(count))
  return dataclasses.replace(cluster, groups=groups, nodes=nodes, devices=tuple(out))


def load(path: str) -> Cluster:
  """Reads and validates a cluster spec.

  Raises:
    ConfigError: key '--cluster', message '<path>: <problem and fix>'.
  """
  import yaml  # only the planner needs YAML

  if not os.path.isfile(path):
    raise ConfigError(
      '--cluster',
      f'{path}: no such file; ship specs under '
      'experiments/clusters/ (e.g. experiments/clusters/h100_8x_nvlink.yaml)',
    )
  try:
    with open(path) as f:
      raw = yaml.safe_load(f)
  except yaml.YAMLError as e:
    first = str(e).strip().splitlines()[0]
    raise ConfigError('--cluster', f'{path}: not valid YAML ({first})') from None
  return parse(raw, path)


def parse(raw: Any, path: str = '<spec>') -> Cluster:
  """Validates an already-parsed spec (a dict); see `load`."""

  def bad(message: str):
    return ConfigError('--cluster', f'{path}: {message}')

  if not isinstance(raw, dict):
    raise bad('want a mapping with name, groups, nodes and links at the top')
  unknown = set(raw) - {'name', 'description', 'groups', 'nodes', 'links'}
  if unknown:
    raise bad(
      f'unknown top-level key(s) {", ".join(sorted(unknown))}; allowed: '
      'name, description, groups, nodes, links'
    )
  for key in ('name', 'groups', 'nodes', 'links'):
    if key not in raw:
      raise bad(f'missing top-level key {key!r}')

  groups = {}
  if not isinstance(raw['groups'], list) or not raw['groups']:
    raise bad('groups: want a non-empty list of device groups')
  for i, g in enumerate(raw['groups']):
    group = _group(g, f'groups[{i}]', bad)
    if group.name in groups:
      raise bad(f'groups[{i}]: duplicate group name {group.name!r}')
    groups[group.name] = group

  if not isinstance(raw['nodes'], list) or not raw['nodes']:
    raise bad('nodes: want a non-empty list of nodes, each with name and devices')
  nodes, placed, names = [], {name: 0 for name in groups}, set()
  for i, n in enumerate(raw['nodes']):
    node, copies = _node(n, f'nodes[{i}]', groups, bad)
    if node.name in names:
      raise bad(f'nodes[{i}]: duplicate node name {node.name!r}')
    names.add(node.name)
    for k in range(copies):
      copy = node if copies == 1 else dataclasses.replace(node, name=f'{node.name}-{k}')
      for g, count in node.devices.items():
        placed[g] += count
      nodes.append(copy)
  for name, group in groups.items():
    if placed[name] != group.count:
      raise bad(
        f'group {name!r} has count {group.count} but the nodes place '
        f'{placed[name]}; make them agree'
      )

  links = raw['links']
  if not isinstance(links, dict) or set(links) != {'intra_node', 'inter_node'}:
    raise bad('links: want exactly intra_node and inter_node, each {bandwidth, latency}')
  intra = _link(links['intra_node'], 'links.intra_node', bad)
  inter = _link(links['inter_node'], 'links.inter_node', bad)

  devices = []
  for node in nodes:
    for g, count in node.devices.items():
      for _ in range(count):
        devices.append(Device(len(devices), g, node.name))
  return Cluster(
    name=str(raw['name']),
    description=str(raw.get('description', '')),
    path=path,
    groups=groups,
    nodes=tuple(nodes),
    intra_node=intra,
    inter_node=inter,
    devices=tuple(devices),
  )


def _group(g: Any, where: str, bad) -> Group:
  allowed = {
    'name',
    'type',
    'count',
    'peak_flops',
    'memory',
    'memory_bandwidth',
    'profile',
    'efficiency',
    'overhead_per_layer',
    'matmul_efficiency',
    'host_bandwidth',
    'ragged_dot',
  }
  if not isinstance(g, dict):
    raise bad(f'{where}: want a mapping')
  unknown = set(g) - allowed
  if unknown:
    raise bad(
      f'{where}: unknown key(s) {", ".join(sorted(unknown))}; allowed: {", ".join(sorted(allowed))}'
    )
  for key in ('name', 'type', 'count', 'peak_flops', 'memory', 'memory_bandwidth'):
    if key not in g:
      raise bad(f'{where}: missing {key!r}')
  matmul_efficiency = g.get('matmul_efficiency')
  if matmul_efficiency is not None and not (
    isinstance(matmul_efficiency, (int, float))
    and not isinstance(matmul_efficiency, bool)
    and 0 < matmul_efficiency <= 1
  ):
    raise bad(f'{where}.matmul_efficiency: want a fraction in (0, 1], got {matmul_efficiency!r}')
  ragged_dot = g.get('ragged_dot', RAGGED_DOT[0])
  if ragged_dot not in RAGGED_DOT:
    raise bad(f'{where}.ragged_dot: want one of {", ".join(RAGGED_DOT)}, got {ragged_dot!r}')
  local = g.get('profile') == 'local'
  if 'profile' in g and not local:
    raise bad(f"{where}.profile: only 'local' is known (this machine, measured)")
  count = g['count']
  if not isinstance(count, int) or isinstance(count, bool) or count < 1:
    raise bad(f'{where}.count: want a positive integer, got {count!r}')
  peaks = g['peak_flops']
  if not isinstance(peaks, dict) or 'bfloat16' not in peaks or 'float32' not in peaks:
    raise bad(
      f'{where}.peak_flops: want a mapping with at least bfloat16 and float32, '
      "e.g. {bfloat16: '312 TFLOP/s', float32: '156 TFLOP/s'}"
    )
  peak_flops = {}
  for dtype, value in peaks.items():
    if dtype not in PEAK_KEYS:
      raise bad(f'{where}.peak_flops: unknown dtype {dtype!r}; use {", ".join(PEAK_KEYS)}')
    peak_flops[dtype] = _maybe_measured(value, 'flops', f'{where}.peak_flops.{dtype}', local, bad)
  efficiency = g.get('efficiency')
  if efficiency is not None and not (isinstance(efficiency, (int, float)) and 0 < efficiency <= 1):
    raise bad(f'{where}.efficiency: want a fraction in (0, 1], got {efficiency!r}')
  overhead = _quantity(
    g.get('overhead_per_layer', 0), 'seconds', f'{where}.overhead_per_layer', bad, allow_zero=True
  )
  return Group(
    name=str(g['name']),
    type=str(g['type']),
    count=count,
    peak_flops=peak_flops,
    memory=_quantity(g['memory'], 'bytes', f'{where}.memory', bad),
    memory_bandwidth=_maybe_measured(
      g['memory_bandwidth'], 'bandwidth', f'{where}.memory_bandwidth', local, bad
    ),
    local=local,
    efficiency=efficiency,
    overhead_per_layer=overhead,
    matmul_efficiency=matmul_efficiency,
    host_bandwidth=(
      None
      if g.get('host_bandwidth') is None
      else _quantity(g['host_bandwidth'], 'bandwidth', f'{where}.host_bandwidth', bad)
    ),
    ragged_dot=ragged_dot,
  )


def _node(n: Any, where: str, groups: dict, bad) -> tuple[Node, int]:
  allowed = {'name', 'devices', 'nic_bandwidth', 'intra_bandwidth', 'shared_cores', 'count'}
  if not isinstance(n, dict) or 'name' not in n or 'devices' not in n:
    raise bad(f'{where}: want a mapping with name and devices ({{group: count}})')
  unknown = set(n) - allowed
  if unknown:
    raise bad(
      f'{where}: unknown key(s) {", ".join(sorted(unknown))}; allowed: {", ".join(sorted(allowed))}'
    )
  devices = n['devices']
  if not isinstance(devices, dict) or not devices:
    raise bad(f'{where}.devices: want a non-empty mapping {{group: count}}')
  for g, count in devices.items():
    if g not in groups:
      raise bad(f'{where}.devices: unknown group {g!r}; known: {", ".join(groups)}')
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
      raise bad(f'{where}.devices.{g}: want a positive integer, got {count!r}')
  cores = n.get('shared_cores')
  if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool) or cores < 1):
    raise bad(
      f'{where}.shared_cores: want a positive integer (physical cores the '
      f'devices share), got {cores!r}'
    )
  copies = n.get('count', 1)
  if not isinstance(copies, int) or isinstance(copies, bool) or copies < 1:
    raise bad(f'{where}.count: want a positive integer (how many such nodes), got {copies!r}')
  optional = {
    key: _quantity(n[key], 'bandwidth', f'{where}.{key}', bad)
    for key in ('nic_bandwidth', 'intra_bandwidth')
    if key in n
  }
  node = Node(name=str(n['name']), devices=dict(devices), shared_cores=cores, **optional)
  return node, copies


def _link(raw: Any, where: str, bad) -> Link:
  if not isinstance(raw, dict) or set(raw) != {'bandwidth', 'latency'}:
    raise bad(f'{where}: want {{bandwidth: ..., latency: ...}}')
  return Link(
    _quantity(raw['bandwidth'], 'bandwidth', f'{where}.bandwidth', bad),
    _quantity(raw['latency'], 'seconds', f'{where}.latency', bad, allow_zero=True),
  )


def _maybe_measured(value: Any, kind: str, where: str, local: bool, bad) -> float | None:
  if value == MEASURED:
    if not local:
      raise bad(
        f"{where}: 'measured' needs profile: local on the group (only this machine can be measured)"
      )
    return None
  return _quantity(value, kind, where, bad)


def _quantity(value: Any, kind: str, where: str, bad, allow_zero: bool = False) -> float:
  """A number, or a string '<number> <unit>' of the given kind, in base units."""
  if isinstance(value, bool):
    raise bad(f'{where}: want a number or e.g. {_EXAMPLE[kind]}, got {value!r}')
  if isinstance(value, (int, float)):
    number = float(value)
  elif isinstance(value, str):
    m = re.fullmatch(r'\s*([0-9.eE+-]+)\s*([A-Za-z/]+)?\s*', value)
    units = _UNITS[kind]
    if not m:
      raise bad(f'{where}: cannot read {value!r}; write e.g. {_EXAMPLE[kind]}')
    try:
      number = float(m.group(1))
    except ValueError:
      raise bad(f'{where}: cannot read {value!r}; write e.g. {_EXAMPLE[kind]}') from None
    unit = m.group(2)
    if unit is not None:
      if unit not in units:
        raise bad(f'{where}: unknown unit {unit!r} in {value!r}; use one of {", ".join(units)}')
      number *= units[unit]
  else:
    raise bad(f'{where}: want a number or e.g. {_EXAMPLE[kind]}, got {value!r}')
  if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
    raise bad(f'{where}: must be {"non-negative" if allow_zero else "positive"}, got {value!r}')
  return number
