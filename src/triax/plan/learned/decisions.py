"""A plan as a sequence of decisions: the problem, its decisions' features, the plan they make.

`problem` encodes one model on one cluster (the graph of features.py,
the layouts the config validator accepts, the device groups fastest
first). A plan is decided in the order of features.KINDS: tensor degree t,
pipe degree p (data d = devices / (t p)), micro-batches m, schedule with
its virtual stages v, remat, state sharding, and then for each of the p
stages in pipeline order the device group it runs on (the stage takes
that group's next d*t devices in node order; where the group has fewer
left, the rest come from the fastest groups with devices left). Each
`Decision` is a choice among candidates with their named features.
`plan_of` prices complete decisions through the search's own API
(plan/search/evaluate.py: the even and the balanced layer split, the
better of the two; for a MoE, each expert degree the validator accepts,
the best of them).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from triax.layout import Layout
from triax.plan.candidate import Estimate, Options
from triax.plan.cluster import Cluster
from triax.plan.cost import profile as profile_lib
from triax.plan.learned import features as F
from triax.plan.search import evaluate
from triax.plan.search.layouts import layouts, stack_layers

# Pipelines longer than this are not offered (the padded decision count).
MAX_STAGES = 32
MAX_STEPS = len(F.KINDS) - 1 + MAX_STAGES
# Reward of a plan that runs out of memory: its -log(time) less this, less
# the log of how far it overflows.
OOM_PENALTY = 1.0
# Fraction of the state a device holds under each sharding, at `data` replicas.
STATE_SHARE = {
  'replicated': lambda d: 1.0,
  'zero1': lambda d: 0.5 + 0.5 / d,
  'fsdp': lambda d: 1 / d,
}


@dataclasses.dataclass
class Problem:
  """One model on one cluster, encoded for the policy.

  groups: device group names, fastest first; pools[g]: its devices in node
  order. layouts: what the config validator accepts (p <= MAX_STAGES), in
  the decision space `space`.
  """

  cfg: object
  cluster: Cluster
  profile: profile_lib.Profile
  options: Options
  space: F.Space
  layouts: list
  groups: list[str]
  pools: dict[str, list[int]]
  speed: dict[str, float]
  state_bytes: float
  stash_per_layer: float
  graph: dict
  cache: dict = dataclasses.field(default_factory=dict)

  @property
  def n(self) -> int:
    return self.cluster.num_devices


def problem(cfg, cluster: Cluster, profile, options: Options = Options(), space=None):
  """Encodes (cfg, cluster, profile) as the policy's graph, or None when no
  layout suits. space: the policy's decision space (this code's by default)."""
  space = space or F.Space.current()
  # The policy decides no context or sequence parallelism (its decisions and
  # trained weights predate them): it plans with both off.
  found = [
    l
    for l in layouts(cfg, cluster.num_devices)
    if l.tensor in profile.shards
    and l.pipe <= MAX_STAGES
    and l.context == 1
    and not l.sequence_parallel
    and l.schedule in space.schedules
  ]
  if not found:
    return None
  if len(cluster.groups) > F.DEVICE_NODES:
    raise ValueError(f'the learned planner handles at most {F.DEVICE_NODES} device groups')
  batch, layers = cfg.train.global_batch_size, stack_layers(cfg)
  b = max(1, batch // cluster.num_devices)
  speed = {name: evaluate.speed(profile, g, b, 1) for name, g in cluster.groups.items()}
  groups = sorted(cluster.groups, key=lambda g: (speed[g], g))
  pools = {g: [d.index for d in cluster.devices if d.group == g] for g in groups}
  shard = profile.shards[1]
  state = 4 * (shard.layer_param_bytes * layers + shard.edge_param_bytes)
  stash = shard.stash_per_seq['none']
  graph = F.graph(cfg, cluster, profile, groups, pools, speed, state)
  return Problem(
    cfg, cluster, profile, options, space, found, groups, pools, speed, state, stash, graph
  )


@dataclasses.dataclass
class Partial:
  """The decisions made so far for one plan."""

  choices: dict = dataclasses.field(default_factory=dict)
  stage_groups: list = dataclasses.field(default_factory=list)
  stages: list = dataclasses.field(default_factory=list)
  left: dict = dataclasses.field(default_factory=dict)

  def kind(self) -> str | None:
    for k in F.KINDS[:-1]:
      if k not in self.choices:
        return k
    return 'stage' if len(self.stages) < self.choices['pipe'] else None


@dataclasses.dataclass(frozen=True)
class Decision:
  """One step: its context, candidates (features, the group each names), values.

  ctx and cand are in this code's columns (features.Schema.current());
  a policy of another schema reads them through its features.Adapter."""

  ctx: np.ndarray
  cand: np.ndarray
  node: np.ndarray
  mask: np.ndarray
  values: tuple


@dataclasses.dataclass(frozen=True)
class _Sizes:
  """The degrees decided so far (1 where not yet)."""

  t: int
  p: int
  d: int
  m: int
  v: int


def _sizes(prob: Problem, c: dict) -> _Sizes:
  t, p = c.get('tensor', 1), c.get('pipe', 1)
  return _Sizes(t, p, prob.n // (t * p), c.get('microbatches', 1), c.get('schedule', (None, 1))[1])


def decision(prob: Problem, part: Partial) -> Decision | None:
  """The next decision of a partial plan (None: it is complete)."""
  kind = part.kind()
  if kind is None:
    return None
  z = _sizes(prob, part.choices)
  if kind == 'stage':
    rows, nodes, values = _stage_candidates(prob, part, z)
  else:
    values = _options(prob, part, kind, z)
    rows = [F.vector('candidate', _candidate(prob, part, kind, value, z)) for value in values]
    nodes = [-1] * len(values)
  if len(rows) > F.MAX_CANDIDATES:
    raise ValueError(f'{len(rows)} candidates for {kind}; the policy takes {F.MAX_CANDIDATES}')
  cand = np.zeros((F.MAX_CANDIDATES, len(F.COL['candidate'])), np.float32)
  node = -np.ones(F.MAX_CANDIDATES, np.int32)
  mask = np.zeros(F.MAX_CANDIDATES, bool)
  cand[: len(rows)] = rows
  node[: len(rows)] = nodes
  mask[: len(rows)] = True
  return Decision(_context(prob, part, kind, z), cand, node, mask, tuple(values))


def _context(prob: Problem, part: Partial, kind: str, z: _Sizes) -> np.ndarray:
  """What was chosen before this decision, and which decision it is."""
  c, glob = part.choices, prob.graph['glob']
  s = len(part.stages)
  ctx = {
    f'deciding_{kind}': 1.0,
    'log2_tensor': F.log2(z.t, 6),
    'log2_pipe': F.log2(z.p, 6),
    'log2_data': F.log2(z.d, 8) if 'pipe' in c else 0.0,
    'log2_microbatches': F.log2(z.m, 6),
    'log2_virtual': F.log2(z.v, 2),
    'remat_recompute': F.RECOMPUTE[c['remat']] if 'remat' in c else 0.0,
    'state_split': F.STATE_SPLIT[c['sharding']] if 'sharding' in c else 0.0,
  }
  if kind == 'stage':
    ctx.update(
      stage_position=s / max(z.p - 1, 1),
      first_stage=s == 0,
      last_stage=s == z.p - 1,
      stage_fraction=s / z.p,
    )
  for name in ('log2_devices', 'log2_batch', 'log2_layers', 'log_state_over_max_memory'):
    ctx[name] = glob[F.COL['glob'][name]]
  return F.vector('context', ctx)


def _options(prob: Problem, part: Partial, kind: str, z: _Sizes) -> list:
  """The values a (non-stage) decision may take, in a fixed order."""
  space = prob.space
  if kind == 'remat':
    return [r for r in space.remats if r in evaluate.REMATS]
  if kind == 'sharding':
    return [k for k in evaluate.state_shardings(prob.cfg, z.d) if k in space.shardings]
  c = part.choices
  keep = set()
  for l in prob.layouts:
    if 'tensor' in c and l.tensor != c['tensor']:
      continue
    if 'pipe' in c and l.pipe != c['pipe']:
      continue
    if 'microbatches' in c and l.microbatches != c['microbatches']:
      continue
    keep.add(_value(kind, l))
  order = lambda x: x if kind != 'schedule' else (space.schedules.index(x[0]), x[1])
  return sorted(keep, key=order)


def _value(kind: str, layout: Layout):
  """What decision `kind` (a Layout field's name) chose for `layout`; the
  schedule decision chooses its virtual stages too."""
  if kind == 'schedule':
    return (layout.schedule, layout.virtual_stages)
  return getattr(layout, kind)


def _clipped(x: float) -> float:
  """A log10 ratio squeezed into [-1, 1]."""
  return np.clip(F.log10(x), -3, 3) / 3


def _candidate(prob: Problem, part: Partial, kind: str, value, z: _Sizes) -> dict:
  """A (non-stage) candidate's named features."""
  n, layers = prob.n, stack_layers(prob.cfg)
  batch = prob.cfg.train.global_batch_size
  mems = [g.memory for g in prob.cluster.groups.values()]
  state = prob.state_bytes
  f = {'present': 1.0}
  if kind == 'tensor':
    per_node = min(max(node.devices.values()) for node in prob.cluster.nodes)
    f.update(
      {
        'log2_value': F.log2(value, 6),
        'log2_data_left': F.log2(n / value, 8),
        'tensor_in_node|pipe_inverse': value <= per_node,
        'log_state_over_max_memory': _clipped(state / value / max(mems)),
        'log_state_over_min_memory': _clipped(state / value / min(mems)),
      }
    )
  elif kind == 'pipe':
    f.update(
      {
        'log2_value': F.log2(value, 6),
        'log2_data_left': F.log2(n / (z.t * value), 8),
        'tensor_in_node|pipe_inverse': layers / value / layers,
        'log_state_over_max_memory': _clipped(state / (z.t * value) / max(mems)),
        'log_state_over_min_memory': _clipped(state / (z.t * value) / min(mems)),
      }
    )
  elif kind == 'microbatches':
    mb = batch // (z.d * value)
    stash = mb * min(z.p, value) * prob.stash_per_layer * layers / (z.p * z.t)
    f.update(
      {
        'log2_value': F.log2(value, 6),
        'bubble': (z.p - 1) / (value + z.p - 1),
        'log2_microbatch_size': F.log2(mb, 8),
        'log_stash_over_min_memory': _clipped(stash / min(mems)),
      }
    )
  elif kind == 'schedule':
    f.update({'log2_value': F.log2(value[1], 2), f'schedule={value[0]}': 1.0})
  elif kind == 'sharding':
    share = STATE_SHARE[value](z.d)
    f.update(
      {
        f'sharding={value}': 1.0,
        'log_state_over_min_memory': _clipped(state * share / (z.t * z.p) / min(mems)),
      }
    )
  else:  # remat
    mb = batch // (z.d * z.m)
    stash = mb * min(z.p, z.m) * prob.profile.shards[z.t].stash_per_seq[value] * layers / z.p
    f.update({f'remat={value}': 1.0, 'log_stash_over_min_memory': _clipped(stash / min(mems))})
  return f


def _stage_candidates(prob: Problem, part: Partial, z: _Sizes):
  """The device groups with devices left for the next stage."""
  size = z.d * z.t
  stage_state = prob.state_bytes / (z.t * z.p)
  rows, nodes, values = [], [], []
  for i, g in enumerate(prob.groups):
    left = part.left[g]
    if not left:
      continue
    f = {
      'group_devices_left': min(left / size, 4.0) / 4,
      'group_fills_stage': left >= size,
      'log_group_slowdown': F.log10(prob.speed[g] / min(prob.speed.values())),
      'log_group_memory_over_stage_state': F.log10(prob.cluster.groups[g].memory / stage_state),
      'present': 1.0,
    }
    rows.append(F.vector('candidate', f))
    nodes.append(i)
    values.append(g)
  return rows, nodes, values


def apply(prob: Problem, part: Partial, dec: Decision, index: int) -> None:
  """Makes choice `index` of decision `dec`: a stage takes d*t devices of
  its group in node order, the rest (if it has fewer left) from the
  fastest groups with devices left."""
  value = dec.values[index]
  kind = part.kind()
  if kind != 'stage':
    part.choices[kind] = value
    return
  size = prob.n // part.choices['pipe']
  taken = []
  for g in [value] + [x for x in prob.groups if x != value]:
    pool, used = prob.pools[g], len(prob.pools[g]) - part.left[g]
    k = min(size - len(taken), part.left[g])
    taken += pool[used : used + k]
    part.left[g] -= k
    if len(taken) == size:
      break
  part.stage_groups.append(value)
  part.stages.append(tuple(taken))


def start(prob: Problem) -> Partial:
  return Partial(left={g: len(prob.pools[g]) for g in prob.groups})


def plan_of(prob: Problem, part: Partial) -> Estimate:
  """The best-split plan of complete decisions, priced (cached per decision key)."""
  c = part.choices
  key = (c['tensor'], c['pipe'], c['microbatches'], c['schedule'], c['remat'], c['sharding'])
  key += (tuple(part.stages),)
  if key not in prob.cache:
    # always: when the memory screen refuses every split, the nearest to
    # even is priced (and runs out of memory: the penalty). A MoE's expert
    # degree is no decision (the policy's weights predate it): like the
    # split, the best of the layouts the decisions leave (one per degree
    # the validator accepts).
    found = [
      e
      for layout in _decided(prob, c)
      for e in evaluate.price(
        prob.cfg,
        prob.cluster,
        prob.profile,
        prob.options,
        layout,
        tuple(part.stages),
        c['remat'],
        c['sharding'],
        always=True,
      )
    ]
    prob.cache[key] = min(found, key=lambda e: (e.oom, e.step_time))
  return prob.cache[key]


def _decided(prob: Problem, choices: dict) -> list[Layout]:
  """The layouts of prob.layouts the choices name (data is what tensor and
  pipe leave): one per expert degree, one for a dense model."""
  kinds = ('tensor', 'pipe', 'microbatches', 'schedule')
  return [l for l in prob.layouts if all(_value(k, l) == choices[k] for k in kinds)]


def reward(e: Estimate) -> float:
  r = -math.log(e.step_time)
  if e.oom:
    over = max(x / c for x, c in zip(e.memory, e.capacity))
    r -= OOM_PENALTY + math.log(over)
  return r
