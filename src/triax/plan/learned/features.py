"""The learned planner's inputs by name, and the schema a policy is saved with.

Every input column has a name (`Schema`): the graph's layer, device-group,
link and global features, a decision's context and a candidate's features.
Some columns serve several decisions (`log2_value` is t for a tensor
decision, p for a pipe one: the context says which decision it is). The
choices themselves are one-hot columns named `schedule=NAME`,
`remat=NAME`, `sharding=NAME`, built from the decision space (`Space`):
the schedules, remat policies and state shardings the policy chooses from.

A policy file holds the schema it was trained with. At load (`check`) its
columns are matched to this code's by name (`Adapter`): a column it has
and this code does not compute is read as 0.0 when it is a one-hot of a
choice that no longer exists or a padding column (`unused_*`), and is
refused otherwise; a column this code computes and it never saw is not
given to it. Its decision space is its own: a schedule or remat policy
added after it was trained is not offered to it (it never learned to
score one), so it makes the decisions it made before.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from triax.errors import ConfigError
from triax.pipeline import schedule as sched
from triax.plan.candidate import STATE_SHARDINGS
from triax.plan.search.evaluate import REMATS

# The schema format; a file of another one is refused.
VERSION = 1
# Padded sizes, so that one compiled network serves every cluster: layer
# nodes (embedding, layer groups, head), device-group nodes, candidates of
# a decision. Feature widths are the schema's.
LAYER_NODES = 12
DEVICE_NODES = 8
MAX_CANDIDATES = 16
KINDS = ('tensor', 'pipe', 'microbatches', 'schedule', 'remat', 'sharding', 'stage')
# What a decision's context says of the remat policy and state sharding
# chosen: how much each recomputes, how much of the state each splits
# (properties of the choice, not its place in a list).
RECOMPUTE = {'none': 0.0, 'attention': 0.25, 'dots': 0.5, 'full': 1.0}
STATE_SPLIT = {'replicated': 0.0, 'zero1': 0.5, 'fsdp': 1.0}
# One-hot columns of a choice: PREFIX=NAME.
CHOICES = ('schedule', 'remat', 'sharding')
# The schema's groups of columns: the graph's four, a decision's context, a candidate's.
GROUPS = ('layer', 'device', 'edge', 'glob', 'context', 'candidate')

LAYER = (
  'is_embed',
  'is_layers',
  'is_head',
  'log_flops',
  'log_param_bytes',
  'log_stash_bytes',
  'layer_share',
  'position',
)
DEVICE = (
  'log_peak_flops',
  'log_memory',
  'log_memory_bandwidth',
  'log2_count',
  'count_share',
  'log_intra_bandwidth',
  'log_nic_per_device',
  'log2_per_node',
  'log_slowdown',
  'log_state_over_memory',
  'overhead_per_layer',
  'present',
)
EDGE = ('log_link_bandwidth', 'same_node', 'self')
GLOBAL = (
  'log2_devices',
  'log2_batch',
  'log2_layers',
  'log_state_over_min_memory',
  'log_state_over_max_memory',
  'group_share',
)
CONTEXT = (
  *(f'deciding_{k}' for k in KINDS),
  'log2_tensor',
  'log2_pipe',
  'log2_data',
  'log2_microbatches',
  'log2_virtual',
  'remat_recompute',
  'state_split',
  'stage_position',
  'first_stage',
  'last_stage',
  'stage_fraction',
  'log2_devices',
  'log2_batch',
  'log2_layers',
  'log_state_over_max_memory',
)
# A candidate's own features, before its one-hots.
CANDIDATE = (
  'log2_value',  # t, p, m (/6), or the schedule's v (/2)
  'log2_data_left',  # devices / t (tensor), devices / (t p) (pipe)
  'tensor_in_node|pipe_inverse',  # t fits a node (tensor); 1/p (pipe)
  'log_state_over_max_memory',  # tensor, pipe
  'log_state_over_min_memory',  # tensor, pipe, sharding
  'bubble',  # microbatches: (p-1)/(m+p-1)
  'log2_microbatch_size',
  'log_stash_over_min_memory',  # microbatches, remat
  'group_devices_left',  # stage: the group's devices left, in stages
  'group_fills_stage',
  'log_group_slowdown',
  'log_group_memory_over_stage_state',
  'present',
)


@dataclasses.dataclass(frozen=True)
class Space:
  """What the policy chooses among: schedules, remat policies, state shardings."""

  schedules: tuple[str, ...]
  remats: tuple[str, ...]
  shardings: tuple[str, ...]

  @classmethod
  def current(cls) -> Space:
    return cls(tuple(sched.SCHEDULES), REMATS, STATE_SHARDINGS)

  def one_hots(self) -> tuple[str, ...]:
    return tuple(
      f'{prefix}={name}'
      for prefix, names in zip(CHOICES, (self.schedules, self.remats, self.shardings))
      for name in names
    )


@dataclasses.dataclass(frozen=True)
class Schema:
  """Every input column's name, in the order the network reads them, and the decision space."""

  layer: tuple[str, ...]
  device: tuple[str, ...]
  edge: tuple[str, ...]
  glob: tuple[str, ...]
  context: tuple[str, ...]
  candidate: tuple[str, ...]
  space: Space

  @classmethod
  def current(cls) -> Schema:
    """What this code computes, for its own decision space."""
    space = Space.current()
    return cls(LAYER, DEVICE, EDGE, GLOBAL, CONTEXT, CANDIDATE + space.one_hots(), space)

  def to_dict(self) -> dict:
    out = {g: list(getattr(self, g)) for g in GROUPS}
    out.update(version=VERSION, **{k: list(v) for k, v in dataclasses.asdict(self.space).items()})
    return out

  @classmethod
  def from_dict(cls, raw: dict, path: str) -> Schema:
    if raw.get('version') != VERSION:
      raise ConfigError(
        '--policy',
        f'{path}: its feature schema is version {raw.get("version")!r} and this triax reads '
        f'{VERSION}; train a new policy (--policy=NEW.msgpack trains one)',
      )
    try:
      names = lambda key: tuple(str(x) for x in raw[key])
      space = Space(*(names(k) for k in ('schedules', 'remats', 'shardings')))
      return cls(*(names(g) for g in GROUPS), space)
    except (KeyError, TypeError) as e:
      raise ConfigError('--policy', f'{path}: its feature schema lacks {e}') from None


def columns(names) -> dict[str, int]:
  return {n: i for i, n in enumerate(names)}


# Column indices of this code's features (the decision one-hots are looked
# up by name where they are written).
COL = {g: columns(getattr(Schema.current(), g)) for g in GROUPS}


def _readable_as_zero(name: str) -> bool:
  """A saved column this code may feed 0.0: a padding column, or the
  one-hot of a choice this code no longer has (never offered, so 0)."""
  return name.startswith('unused_') or ('=' in name and name.split('=')[0] in CHOICES)


def check(saved: Schema, path: str) -> None:
  """Refuses (ConfigError on --policy, one line) a schema this code cannot feed."""
  current = Schema.current()
  for group in GROUPS:
    have = set(getattr(current, group))
    for name in getattr(saved, group):
      if name not in have and not _readable_as_zero(name):
        raise ConfigError(
          '--policy',
          f'{path}: its input {group}.{name} is not one this triax computes (trained by '
          'another version of plan/learned/features.py); train a new policy '
          '(--policy=NEW.msgpack trains one)',
        )
  mine = dataclasses.asdict(current.space)
  for key, names in dataclasses.asdict(saved.space).items():
    if not set(names) & set(mine[key]):
      raise ConfigError(
        '--policy', f'{path}: none of its {key} ({", ".join(names)}) exists in this triax'
      )


class Adapter:
  """This code's feature arrays in a saved schema's column order (by name;
  a column it cannot compute at 0.0, see `check`)."""

  def __init__(self, saved: Schema):
    current = Schema.current()
    self.identity = saved == current
    self.index = {}
    for group in GROUPS:
      mine = COL[group]
      zero = len(mine)  # a column of zeros appended at the end
      self.index[group] = np.array([mine.get(n, zero) for n in getattr(saved, group)], np.int32)

  def __call__(self, group: str, x: np.ndarray) -> np.ndarray:
    """x [..., this code's columns of `group`] -> [..., the saved schema's]."""
    if self.identity:
      return x
    padded = np.concatenate([x, np.zeros(x.shape[:-1] + (1,), x.dtype)], -1)
    return padded[..., self.index[group]]

  def graph(self, graph: dict) -> dict:
    keys = {'layer_x': 'layer', 'dev_x': 'device', 'edge': 'edge', 'glob': 'glob'}
    return {k: self(keys[k], v) if k in keys else v for k, v in graph.items()}


def log10(x: float, scale: float = 1.0) -> float:
  return math.log10(max(x, 1e-30)) / scale


def log2(x: float, scale: float = 1.0) -> float:
  return math.log2(max(x, 1e-30)) / scale


def vector(group: str, values: dict) -> np.ndarray:
  """One row of `group`'s columns, from {name: value} (the rest 0)."""
  cols = COL[group]
  out = np.zeros(len(cols), np.float32)
  for name, value in values.items():
    out[cols[name]] = value
  return out


def graph(cfg, cluster, profile, groups, pools, speed, state) -> dict:
  """The problem's graph: layer nodes (embedding, up to LAYER_NODES - 2
  groups of consecutive layers, head) joined in sequence, and device-group
  nodes joined by their links; padded to LAYER_NODES and DEVICE_NODES."""
  layer_x, layer_mask, chain = _layer_nodes(cfg, profile, LAYER_NODES)
  dev_x = np.zeros((DEVICE_NODES, len(DEVICE)), np.float32)
  dev_mask = np.zeros(DEVICE_NODES, np.float32)
  edge = np.zeros((DEVICE_NODES, DEVICE_NODES, len(EDGE)), np.float32)
  for i, name in enumerate(groups):
    dev_x[i] = _device(cfg, cluster, name, pools, speed, state)
    dev_mask[i] = 1
    for j, other in enumerate(groups):
      a = pools[name][0]
      z = pools[other][0] if other != name else (pools[name] + [a])[1]
      link = cluster.link(a, z) if a != z else cluster.intra_node
      same = cluster.devices[a].node == cluster.devices[z].node
      edge[i, j] = vector(
        'edge',
        {'log_link_bandwidth': log10(link.bandwidth / 1e10), 'same_node': same, 'self': i == j},
      )
  memories = [g.memory for g in cluster.groups.values()]
  glob = vector(
    'glob',
    {
      'log2_devices': log2(cluster.num_devices, 8),
      'log2_batch': log2(cfg.train.global_batch_size, 10),
      'log2_layers': log2(cfg.model.num_layers, 6),
      'log_state_over_min_memory': log10(state / min(memories)),
      'log_state_over_max_memory': log10(state / max(memories)),
      'group_share': len(groups) / DEVICE_NODES,
    },
  )
  return {
    'layer_x': layer_x,
    'layer_mask': layer_mask,
    'chain': chain,
    'dev_x': dev_x,
    'dev_mask': dev_mask,
    'edge': edge,
    'glob': glob,
  }


def _layer_nodes(cfg, profile, nodes: int):
  """Layer-node features [nodes, LAYER], mask and chain adjacency: the
  embedding, groups of consecutive layers, the head."""
  shard, layers = profile.shards[1], cfg.model.num_layers
  work = shard.work
  groups = min(layers, nodes - 2)
  bounds = [round(k * layers / groups) for k in range(groups + 1)]

  def row(kind, flops, params, stash, count, position):
    return {
      f'is_{kind}': 1.0,
      'log_flops': log10(flops, 12),
      'log_param_bytes': log10(params, 10),
      'log_stash_bytes': log10(stash, 10),
      'layer_share': count / layers,
      'position': position,
    }

  layer_flops = work['layer_fwd'].flops_per_seq + work['layer_bwd'].flops_per_seq
  edge_flops = work['head'].flops_per_seq + work['embed'].flops_per_seq
  rows = [row('embed', work['embed'].flops_per_seq, shard.edge_param_bytes / 2, 0.0, 0, 0.0)]
  for k in range(groups):
    count = bounds[k + 1] - bounds[k]
    flops, params = layer_flops * count, shard.layer_param_bytes * count
    stash = shard.stash_per_seq['none'] * count
    rows.append(row('layers', flops, params, stash, count, (k + 0.5) / groups))
  rows.append(row('head', edge_flops, shard.edge_param_bytes / 2, shard.logits_per_seq, 0, 1.0))
  x = np.zeros((nodes, len(LAYER)), np.float32)
  mask = np.zeros(nodes, np.float32)
  x[: len(rows)] = [vector('layer', r) for r in rows]
  mask[: len(rows)] = 1
  chain = np.zeros((nodes, nodes), np.float32)
  for i in range(len(rows) - 1):
    chain[i, i + 1] = chain[i + 1, i] = 0.5
  return x, mask, chain


def _device(cfg, cluster, name: str, pools, speed, state) -> np.ndarray:
  """One device group's features: its data sheet, node and links, speed."""
  g = cluster.groups[name]
  nodes = {cluster.devices[d].node for d in pools[name]}
  per_node = max(cluster.node(x).devices.get(name, 0) for x in nodes)
  node = cluster.node(next(iter(sorted(nodes))))
  size = sum(node.devices.values())
  intra = node.intra_bandwidth or cluster.intra_node.bandwidth
  nic = min(cluster.inter_node.bandwidth * size, node.nic_bandwidth or 1e30)
  peak = (g.peak(cfg.model.dtype) or 0.0) * (g.matmul_efficiency or 1.0)
  return vector(
    'device',
    {
      'log_peak_flops': log10(peak / 1e14),
      'log_memory': log10(g.memory / 1e10),
      'log_memory_bandwidth': log10((g.memory_bandwidth or 1e12) / 1e12),
      'log2_count': log2(g.count, 8),
      'count_share': g.count / cluster.num_devices,
      'log_intra_bandwidth': log10(intra / 1e10),
      'log_nic_per_device': log10(nic / size / 1e10),
      'log2_per_node': log2(per_node, 4),
      'log_slowdown': log10(speed[name] / min(speed.values())),
      'log_state_over_memory': log10(state / g.memory),
      'overhead_per_layer': g.overhead_per_layer * 1e4,
      'present': 1.0,
    },
  )
