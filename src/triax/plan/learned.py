"""The learned strategy maker (`--search=learned`): a policy trained against the simulator.

As HeteroG (Yi et al., CoNEXT'20) does, a graph network over the model's
layers and the cluster's device groups (plan/learned_policy.py) makes a
plan as a sequence of decisions, each a choice among candidates the config
validator allows (`search.layouts`):

  tensor degree t, pipe degree p (data d = devices / (t p)), micro-batches
  m, schedule with its virtual stages v, remat, and then for each of the p
  stages in pipeline order the device group it runs on (the stage takes
  that group's next d*t devices in node order; where the group has fewer
  left, the rest come from the fastest groups with devices left).

The layer split is the search's own (`search._partitions`: the even split
and the dynamic program's under each stage's memory), the better of the
two, and a plan is priced by the same simulator and memory model as the
search (`simulator.simulate_plan`). Training is REINFORCE: reward = -log
(predicted step time), minus a penalty when the plan runs out of memory;
baseline = a running mean of the reward per training problem; optax Adam.
It trains on random heterogeneous clusters (`random_cluster`), never on the
shipped specs, so planning those measures what it does on clusters it has
not seen. Inference: the greedy plan and the best of K samples.

A trained policy is saved as msgpack (flax.serialization) with what it was
trained for, and `--policy=FILE` loads it (training first when the file is
absent). Everything is deterministic given the seed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from triax.pipeline import schedule as sched
from triax.plan import cluster as cluster_lib
from triax.plan import learned_policy as net
from triax.plan import partition
from triax.plan import profile as profile_lib
from triax.plan import search as search_lib
from triax.plan.candidate import STATE_SHARDINGS, Estimate, Options, Plan
from triax.plan.cluster import Cluster
from triax.plan.simulator import simulate_plan

KINDS = ('tensor', 'pipe', 'microbatches', 'schedule', 'remat', 'sharding', 'stage')
REMATS = search_lib.REMATS
SCHEDULES = tuple(sched.SCHEDULES)
# Pipelines longer than this are not offered (the padded decision count).
MAX_STAGES = 32
MAX_STEPS = len(KINDS) - 1 + MAX_STAGES
# Reward of a plan that runs out of memory: its -log(time) less this, less
# the log of how far it overflows.
OOM_PENALTY = 1.0
# Layer nodes: at most this many groups of consecutive layers (+ embed, head).
LAYER_GROUPS = net.LAYER_NODES - 2


def _log(x: float, scale: float = 1.0) -> float:
  return math.log10(max(x, 1e-30)) / scale


def _log2(x: float, scale: float = 1.0) -> float:
  return math.log2(max(x, 1e-30)) / scale


@dataclasses.dataclass
class Problem:
  """One model on one cluster, encoded for the policy.

  groups: device group names, fastest first; pools[g]: its devices in node
  order. layouts: what the config validator accepts (p <= MAX_STAGES).
  """

  cfg: object
  cluster: Cluster
  profile: profile_lib.Profile
  options: Options
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


def problem(cfg, cluster: Cluster, profile: profile_lib.Profile, options: Options = Options()):
  """Encodes (cfg, cluster, profile) as the policy's graph, or None when no layout suits."""
  # The policy decides no context or sequence parallelism (its decisions and
  # trained weights predate them): it plans with both off.
  layouts = [
    l
    for l in search_lib.layouts(cfg, cluster.num_devices)
    if l.tensor in profile.shards
    and l.pipe <= MAX_STAGES
    and l.context == 1
    and not l.sequence_parallel
  ]
  if not layouts:
    return None
  if len(cluster.groups) > net.DEVICE_NODES:
    raise ValueError(f'the learned planner handles at most {net.DEVICE_NODES} device groups')
  batch, layers = cfg.train.global_batch_size, cfg.model.num_layers
  b = max(1, batch // cluster.num_devices)
  speed = {name: search_lib._speed(profile, g, b, 1) for name, g in cluster.groups.items()}
  groups = sorted(cluster.groups, key=lambda g: (speed[g], g))
  pools = {g: [d.index for d in cluster.devices if d.group == g] for g in groups}
  shard = profile.shards[1]
  state = 4 * (shard.layer_param_bytes * layers + shard.edge_param_bytes)
  stash = shard.stash_per_seq['none']
  graph = _graph(cfg, cluster, profile, groups, pools, speed, state)
  return Problem(cfg, cluster, profile, options, layouts, groups, pools, speed, state, stash, graph)


def _graph(cfg, cluster, profile, groups, pools, speed, state) -> dict:
  shard = profile.shards[1]
  layers = cfg.model.num_layers
  nl = min(layers, LAYER_GROUPS)
  bounds = [round(k * layers / nl) for k in range(nl + 1)]
  layer_x = np.zeros((net.LAYER_NODES, net.LAYER_FEATURES), np.float32)
  layer_mask = np.zeros(net.LAYER_NODES, np.float32)
  work = shard.work

  def row(kind, flops, params, stash, count, position):
    return [
      kind == 0,
      kind == 1,
      kind == 2,
      _log(flops, 12),
      _log(params, 10),
      _log(stash, 10),
      count / layers,
      position,
    ]

  layer_flops = work['layer_fwd'].flops_per_seq + work['layer_bwd'].flops_per_seq
  edge_flops = work['head'].flops_per_seq + work['embed'].flops_per_seq
  rows = [row(0, work['embed'].flops_per_seq, shard.edge_param_bytes / 2, 0.0, 0, 0.0)]
  for k in range(nl):
    count = bounds[k + 1] - bounds[k]
    rows.append(
      row(
        1,
        layer_flops * count,
        shard.layer_param_bytes * count,
        shard.stash_per_seq['none'] * count,
        count,
        (k + 0.5) / nl,
      )
    )
  rows.append(row(2, edge_flops, shard.edge_param_bytes / 2, shard.logits_per_seq, 0, 1.0))
  layer_x[: len(rows)] = rows
  layer_mask[: len(rows)] = 1
  chain = np.zeros((net.LAYER_NODES, net.LAYER_NODES), np.float32)
  for i in range(len(rows) - 1):
    chain[i, i + 1] = chain[i + 1, i] = 0.5

  n = cluster.num_devices
  fastest = min(speed.values())
  dev_x = np.zeros((net.DEVICE_NODES, net.DEVICE_FEATURES), np.float32)
  dev_mask = np.zeros(net.DEVICE_NODES, np.float32)
  edge = np.zeros((net.DEVICE_NODES, net.DEVICE_NODES, net.EDGE_FEATURES), np.float32)
  dtype = cfg.model.dtype
  for i, name in enumerate(groups):
    g = cluster.groups[name]
    nodes = {cluster.devices[d].node for d in pools[name]}
    per_node = max(cluster.node(x).devices.get(name, 0) for x in nodes)
    node = cluster.node(next(iter(sorted(nodes))))
    intra = node.intra_bandwidth or cluster.intra_node.bandwidth
    nic = min(cluster.inter_node.bandwidth * sum(node.devices.values()), node.nic_bandwidth or 1e30)
    peak = (g.peak(dtype) or 0.0) * (g.matmul_efficiency or 1.0)
    dev_x[i] = [
      _log(peak / 1e14),
      _log(g.memory / 1e10),
      _log((g.memory_bandwidth or 1e12) / 1e12),
      _log2(g.count, 8),
      g.count / n,
      _log(intra / 1e10),
      _log(nic / sum(node.devices.values()) / 1e10),
      _log2(per_node, 4),
      _log(speed[name] / fastest),
      _log(state / g.memory),
      g.overhead_per_layer * 1e4,
      1.0,
    ]
    dev_mask[i] = 1
    for j, other in enumerate(groups):
      a = pools[name][0]
      z = pools[other][0] if other != name else (pools[name] + [a])[1]
      link = cluster.link(a, z) if a != z else cluster.intra_node
      same = cluster.devices[a].node == cluster.devices[z].node
      edge[i, j] = [_log(link.bandwidth / 1e10), float(same), float(i == j)]
  glob = np.array(
    [
      _log2(n, 8),
      _log2(cfg.train.global_batch_size, 10),
      _log2(layers, 6),
      _log(state / min(g.memory for g in cluster.groups.values())),
      _log(state / max(g.memory for g in cluster.groups.values())),
      len(groups) / net.DEVICE_NODES,
    ],
    np.float32,
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


@dataclasses.dataclass
class Partial:
  """The decisions made so far for one plan."""

  choices: dict = dataclasses.field(default_factory=dict)
  stage_groups: list = dataclasses.field(default_factory=list)
  stages: list = dataclasses.field(default_factory=list)
  left: dict = dataclasses.field(default_factory=dict)

  def kind(self) -> str | None:
    for k in KINDS[:-1]:
      if k not in self.choices:
        return k
    return 'stage' if len(self.stages) < self.choices['pipe'] else None


@dataclasses.dataclass(frozen=True)
class Decision:
  """One step: its context, candidates (features, the group each names), values."""

  ctx: np.ndarray
  cand: np.ndarray
  node: np.ndarray
  mask: np.ndarray
  values: tuple


def _matching(prob: Problem, part: Partial) -> list:
  c = part.choices
  keep = []
  for l in prob.layouts:
    if 'tensor' in c and l.tensor != c['tensor']:
      continue
    if 'pipe' in c and l.pipe != c['pipe']:
      continue
    if 'microbatches' in c and l.microbatches != c['microbatches']:
      continue
    if 'schedule' in c and (l.schedule, l.virtual_stages) != c['schedule']:
      continue
    keep.append(l)
  return keep


def decision(prob: Problem, part: Partial) -> Decision | None:
  """The next decision of a partial plan (None: it is complete)."""
  kind = part.kind()
  if kind is None:
    return None
  c = part.choices
  n, batch, layers = prob.n, prob.cfg.train.global_batch_size, prob.cfg.model.num_layers
  mems = [g.memory for g in prob.cluster.groups.values()]
  t = c.get('tensor', 1)
  p = c.get('pipe', 1)
  d = n // (t * p)
  m = c.get('microbatches', 1)
  v = c.get('schedule', (None, 1))[1]
  ctx = np.zeros(net.CONTEXT_FEATURES, np.float32)
  ctx[KINDS.index(kind)] = 1
  ctx[7:14] = [
    _log2(t, 6),
    _log2(p, 6),
    _log2(d, 8) if 'pipe' in c else 0.0,
    _log2(m, 6),
    _log2(v, 2),
    REMATS.index(c['remat']) / 2 if 'remat' in c else 0.0,
    STATE_SHARDINGS.index(c['sharding']) / 2 if 'sharding' in c else 0.0,
  ]
  s = len(part.stages)
  if kind == 'stage':
    ctx[14:18] = [s / max(p - 1, 1), s == 0, s == p - 1, s / p]
  ctx[18:22] = prob.graph['glob'][[0, 1, 2, 4]]
  rows, nodes, values = [], [], []
  if kind == 'stage':
    size = d * t
    stage_state = prob.state_bytes / (t * p)
    for i, g in enumerate(prob.groups):
      left = part.left[g]
      if not left:
        continue
      f = np.zeros(net.CANDIDATE_FEATURES, np.float32)
      f[18:23] = [
        min(left / size, 4.0) / 4,
        left >= size,
        _log(prob.speed[g] / min(prob.speed.values())),
        _log(prob.cluster.groups[g].memory / stage_state),
        1.0,
      ]
      rows.append(f)
      nodes.append(i)
      values.append(g)
  else:
    if kind == 'remat':
      options = list(REMATS)
    elif kind == 'sharding':
      options = list(search_lib.state_shardings(prob.cfg, d))
    else:
      options = sorted({_value(kind, l) for l in _matching(prob, part)}, key=_order)
    for value in options:
      f = np.zeros(net.CANDIDATE_FEATURES, np.float32)
      f[22] = 1.0
      if kind == 'tensor':
        per_node = min(max(node.devices.values()) for node in prob.cluster.nodes)
        f[:5] = [
          _log2(value, 6),
          _log2(n / value, 8),
          value <= per_node,
          np.clip(_log(prob.state_bytes / value / max(mems)), -3, 3) / 3,
          np.clip(_log(prob.state_bytes / value / min(mems)), -3, 3) / 3,
        ]
      elif kind == 'pipe':
        f[:5] = [
          _log2(value, 6),
          _log2(n / (t * value), 8),
          layers / value / layers,
          np.clip(_log(prob.state_bytes / (t * value) / max(mems)), -3, 3) / 3,
          np.clip(_log(prob.state_bytes / (t * value) / min(mems)), -3, 3) / 3,
        ]
      elif kind == 'microbatches':
        mb = batch // (d * value)
        stash = mb * min(p, value) * prob.stash_per_layer * layers / (p * t)
        f[[0, 5, 6, 7]] = [
          _log2(value, 6),
          (p - 1) / (value + p - 1),
          _log2(mb, 8),
          np.clip(_log(stash / min(mems)), -3, 3) / 3,
        ]
      elif kind == 'schedule':
        name, vv = value
        f[0] = _log2(vv, 2)
        f[8 + SCHEDULES.index(name)] = 1
      elif kind == 'sharding':
        f[23 + STATE_SHARDINGS.index(value)] = 1
        share = {'replicated': 1.0, 'zero1': 0.5 + 0.5 / d, 'fsdp': 1.0 / d}[value]
        f[4] = np.clip(_log(prob.state_bytes * share / (t * p) / min(mems)), -3, 3) / 3
      else:  # remat
        f[15 + REMATS.index(value)] = 1
        mb = batch // (d * m)
        stash = mb * min(p, m) * prob.profile.shards[t].stash_per_seq[value] * layers / p
        f[7] = np.clip(_log(stash / min(mems)), -3, 3) / 3
      rows.append(f)
      nodes.append(-1)
      values.append(value)
  if len(rows) > net.MAX_CANDIDATES:
    raise ValueError(f'{len(rows)} candidates for {kind}; the policy takes {net.MAX_CANDIDATES}')
  cand = np.zeros((net.MAX_CANDIDATES, net.CANDIDATE_FEATURES), np.float32)
  node = -np.ones(net.MAX_CANDIDATES, np.int32)
  mask = np.zeros(net.MAX_CANDIDATES, bool)
  cand[: len(rows)] = rows
  node[: len(rows)] = nodes
  mask[: len(rows)] = True
  return Decision(ctx, cand, node, mask, tuple(values))


def _value(kind, layout):
  if kind == 'tensor':
    return layout.tensor
  if kind == 'pipe':
    return layout.pipe
  if kind == 'microbatches':
    return layout.microbatches
  return (layout.schedule, layout.virtual_stages)


def _order(value):
  return value if not isinstance(value, tuple) else (SCHEDULES.index(value[0]), value[1])


def apply(prob: Problem, part: Partial, dec: Decision, index: int) -> None:
  """Makes choice `index` of decision `dec`: a stage takes d*t devices of
  its group in node order, the rest (if it has fewer left) from the
  fastest groups with devices left."""
  value = dec.values[index]
  kind = part.kind()
  if kind != 'stage':
    part.choices[kind] = value
    return
  c = part.choices
  size = prob.n // c['pipe']
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
  if key in prob.cache:
    return prob.cache[key]
  t, p, m = c['tensor'], c['pipe'], c['microbatches']
  name, v = c['schedule']
  d = prob.n // (t * p)
  batch, layers = prob.cfg.train.global_batch_size, prob.cfg.model.num_layers
  layout = search_lib.Layout(d, t, p, name, m, v)
  stages = tuple(part.stages)
  best = None
  args = (layout, stages, prob.profile, prob.cluster, prob.options, c['remat'], layers, batch)
  args += (c['sharding'],)
  # Neither split when the memory screen refuses every balanced one: the
  # nearest to even is priced (and runs out of memory: the penalty).
  for split in search_lib._partitions(*args) or [_spread(layers, p, v)]:
    plan = Plan(d, t, p, name, m, v, c['remat'], split, stages, batch, c['sharding'])
    e = simulate_plan(plan, prob.profile, prob.cluster, prob.options)
    if best is None or (e.oom, e.step_time) < (best.oom, best.step_time):
      best = e
  prob.cache[key] = best
  return best


def _spread(layers: int, p: int, v: int) -> tuple[int, ...]:
  units, extra = divmod(layers // v, p)
  return tuple(v * (units + (s < extra)) for s in range(p))


def reward(e: Estimate) -> float:
  r = -math.log(e.step_time)
  if e.oom:
    over = max(x / c for x, c in zip(e.memory, e.capacity))
    r -= OOM_PENALTY + math.log(over)
  return r


@dataclasses.dataclass
class Policy:
  """A policy's network and parameters, with what it was trained for."""

  params: object
  hidden: int = 64
  rounds: int = 3
  meta: dict = dataclasses.field(default_factory=dict)

  @property
  def module(self) -> net.Policy:
    return net.Policy(hidden=self.hidden, rounds=self.rounds)


_JITTED: dict = {}


def _scores(policy: Policy):
  import jax

  key = (policy.hidden, policy.rounds)
  if key not in _JITTED:
    _JITTED[key] = jax.jit(policy.module.apply)
  return _JITTED[key]


# Rows of every network call (a rollout's plans, padded): one compiled shape.
ROWS = 16


def rollout(
  policy: Policy,
  prob: Problem,
  count: int,
  rng: np.random.Generator | None,
  greedy: int = 0,
  temperature: float = 1.0,
) -> list[tuple[Partial, list[tuple[Decision, int]]]]:
  """`count` plans decided together: the first `greedy` take every step's
  argmax (all of them when rng is None), the rest sample at `temperature`."""
  if count > ROWS:
    first = rollout(policy, prob, ROWS, rng, greedy, temperature)
    rest = rollout(policy, prob, count - ROWS, rng, max(0, greedy - ROWS), temperature)
    return first + rest
  parts = [start(prob) for _ in range(count)]
  trails = [[] for _ in range(count)]
  scores = _scores(policy)
  while True:
    decs = [decision(prob, part) if part.kind() else None for part in parts]
    live = [i for i, dec in enumerate(decs) if dec is not None]
    if not live:
      break
    rows = live + [live[0]] * (ROWS - len(live))
    ctx = np.stack([decs[i].ctx for i in rows])
    cand = np.stack([decs[i].cand for i in rows])
    node = np.stack([decs[i].node for i in rows])
    mask = np.stack([decs[i].mask for i in rows])
    logits = np.asarray(scores(policy.params, prob.graph, ctx, cand, node, mask), np.float64)
    for row, i in enumerate(live):
      z = logits[row]
      if rng is None or i < greedy:
        index = int(np.argmax(z))
      else:
        prob_ = np.exp((z - z.max()) / temperature) * decs[i].mask
        prob_ /= prob_.sum()
        index = int(rng.choice(len(z), p=prob_))
      apply(prob, parts[i], decs[i], index)
      trails[i].append((decs[i], index))
  return list(zip(parts, trails))


def _batch(trails) -> dict:
  """Padded arrays [K, MAX_STEPS, ...] of the decisions taken."""
  k = len(trails)
  out = {
    'ctx': np.zeros((k, MAX_STEPS, net.CONTEXT_FEATURES), np.float32),
    'cand': np.zeros((k, MAX_STEPS, net.MAX_CANDIDATES, net.CANDIDATE_FEATURES), np.float32),
    'node': -np.ones((k, MAX_STEPS, net.MAX_CANDIDATES), np.int32),
    'mask': np.zeros((k, MAX_STEPS, net.MAX_CANDIDATES), bool),
    'action': np.zeros((k, MAX_STEPS), np.int32),
    'live': np.zeros((k, MAX_STEPS), np.float32),
  }
  out['mask'][..., 0] = True  # padding steps: one candidate, no weight
  for i, trail in enumerate(trails):
    for j, (dec, index) in enumerate(trail):
      out['ctx'][i, j], out['cand'][i, j] = dec.ctx, dec.cand
      out['node'][i, j], out['mask'][i, j] = dec.node, dec.mask
      out['action'][i, j], out['live'][i, j] = index, 1.0
  return out


def _loss_fn(module: net.Policy, entropy_weight: float):
  import jax
  import jax.numpy as jnp

  def loss(params, graph, batch, advantage):
    k, s = batch['action'].shape
    flat = lambda x: x.reshape((k * s,) + x.shape[2:])
    logits = module.apply(
      params,
      graph,
      flat(batch['ctx']),
      flat(batch['cand']),
      flat(batch['node']),
      flat(batch['mask']),
    )
    logp = jax.nn.log_softmax(logits, -1)
    taken = jnp.take_along_axis(logp, flat(batch['action'])[:, None], -1)[:, 0].reshape(k, s)
    live = batch['live']
    probs = jnp.exp(logp) * flat(batch['mask'])
    entropy = -(probs * jnp.where(flat(batch['mask']), logp, 0.0)).sum(-1).reshape(k, s)
    per_plan = (taken * live).sum(-1)
    return -(advantage * per_plan).mean() - entropy_weight * (entropy * live).sum(-1).mean()

  return loss


@dataclasses.dataclass(frozen=True)
class TrainLog:
  """What training did: per step the problem's mean reward; seconds."""

  rewards: tuple[float, ...]
  problems: tuple[int, ...]
  seconds: float
  simulated: int


def train(
  problems: Sequence[Problem],
  steps: int = 300,
  samples: int = 16,
  learning_rate: float = 3e-3,
  entropy_weight: float = 5e-3,
  seed: int = 0,
  hidden: int = 64,
  rounds: int = 3,
  policy: Policy | None = None,
  progress: Callable[[str], None] | None = None,
) -> tuple[Policy, TrainLog]:
  """REINFORCE over `problems` (one per step, in turn): K sampled plans,
  reward -log(step time) (OOM penalised), baseline a running mean per problem."""
  import jax
  import optax

  started = time.perf_counter()
  policy = policy or Policy(net.init(net.Policy(hidden, rounds), seed), hidden, rounds)
  optimizer = optax.adam(learning_rate)
  opt_state = optimizer.init(policy.params)
  key = ('grad', policy.hidden, policy.rounds, entropy_weight)
  if key not in _JITTED:  # one compile per process, not per call
    _JITTED[key] = jax.jit(jax.grad(_loss_fn(policy.module, entropy_weight)))
  grad = _JITTED[key]
  rng = np.random.default_rng(seed)
  baseline: dict[int, float] = {}
  rewards, which = [], []
  params = policy.params
  for step in range(steps):
    i = step % len(problems)
    prob = problems[i]
    current = dataclasses.replace(policy, params=params)
    out = rollout(current, prob, samples, rng)
    r = np.array([reward(plan_of(prob, part)) for part, _ in out])
    base = baseline.get(i, float(r.mean()))
    advantage = (r - base).astype(np.float32)
    baseline[i] = 0.8 * base + 0.2 * float(r.mean())
    g = grad(params, prob.graph, _batch([trail for _, trail in out]), advantage)
    updates, opt_state = optimizer.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
    rewards.append(float(r.mean()))
    which.append(i)
    if progress and (step + 1) % 50 == 0:
      progress(f'learned: step {step + 1}/{steps}, mean reward {np.mean(rewards[-50:]):.3f}')
  simulated = sum(len(p.cache) for p in problems)
  return dataclasses.replace(policy, params=params), TrainLog(
    tuple(rewards), tuple(which), time.perf_counter() - started, simulated
  )


# Inference samples half its plans at the policy's own temperature and half
# flatter (more of the plans near the policy's choice get priced).
INFER_TEMPERATURES = (1.0, 2.0)


def infer(policy: Policy, prob: Problem, samples: int = 63, seed: int = 0) -> list[Estimate]:
  """The greedy plan and `samples` sampled ones, priced, fastest first (fitting ones first)."""
  rng = np.random.default_rng(seed)
  half = (1 + samples) // 2
  parts = rollout(policy, prob, half, rng, greedy=1, temperature=INFER_TEMPERATURES[0])
  parts += rollout(policy, prob, 1 + samples - half, rng, temperature=INFER_TEMPERATURES[1])
  found = [plan_of(prob, part) for part, _ in parts]
  unique = {id(e): e for e in found}
  return sorted(unique.values(), key=lambda e: (e.oom, e.step_time))


def save(policy: Policy, path: str) -> None:
  from flax import serialization

  blob = serialization.msgpack_serialize(
    {
      'params': serialization.to_state_dict(policy.params),
      'hidden': policy.hidden,
      'rounds': policy.rounds,
      'meta': policy.meta,
    }
  )
  folder = os.path.dirname(path) or '.'
  os.makedirs(folder, exist_ok=True)
  tmp = path + '.tmp'
  with open(tmp, 'wb') as f:
    f.write(blob)
  os.replace(tmp, path)


def load(path: str) -> Policy:
  import jax
  from flax import serialization

  with open(path, 'rb') as f:
    raw = serialization.msgpack_restore(f.read())
  hidden, rounds = int(raw['hidden']), int(raw['rounds'])
  template = jax.eval_shape(lambda: net.init(net.Policy(hidden, rounds), 0))
  params = serialization.from_state_dict(template, raw['params'])
  params = jax.tree.map(lambda a: np.asarray(a), params)
  return Policy(params, hidden, rounds, dict(raw.get('meta') or {}))


# Device types random training clusters draw from (data-sheet-like figures,
# each perturbed per cluster): bf16 TFLOP/s, GB, GB/s, matmul efficiency,
# intra-node GB/s, devices per node.
CATALOGUE = (
  ('h100', 989, 80, 3350, 0.7, 450, 8),
  ('a100_80', 312, 80, 2039, 0.65, 300, 8),
  ('a100_40', 312, 40, 1555, 0.65, 240, 8),
  ('v100_32', 15.7, 32, 900, 0.65, 120, 8),
  ('l40s', 362, 48, 864, 0.6, 25, 4),
  ('a10', 125, 24, 600, 0.6, 25, 4),
  ('l4', 121, 24, 300, 0.6, 25, 4),
  ('rtx4090', 165, 24, 1008, 0.6, 25, 4),
  ('mi250', 362, 64, 3200, 0.5, 200, 8),
)


def random_cluster(rng: np.random.Generator, devices: int | None = None) -> Cluster:
  """A random heterogeneous cluster: 1-3 device types in whole nodes,
  figures perturbed, links between nodes of 100-3200 Gb/s a node."""
  total = devices or int(rng.choice([8, 16, 32, 64, 128]))
  kinds = int(rng.choice([1, 2, 2, 3, 3]))
  unit = 8 if total >= 8 * kinds else 4
  units = total // unit
  kinds = min(kinds, units)
  cuts = sorted(rng.choice(np.arange(1, units), size=kinds - 1, replace=False)) if kinds > 1 else []
  sizes = np.diff([0, *cuts, units]) * unit
  chosen = rng.choice(len(CATALOGUE), size=kinds, replace=False)
  groups, nodes = [], []
  for idx, count in zip(chosen, sizes):
    name, tf, mem, bw, eff, intra, per = CATALOGUE[idx]
    count = int(count)
    per = per if count % per == 0 else 4
    scale = float(rng.uniform(0.7, 1.3))
    groups.append(
      {
        'name': name,
        'type': name,
        'count': count,
        'peak_flops': {'bfloat16': tf * 1e12 * scale, 'float32': tf * 0.5e12 * scale},
        'memory': mem * 1e9,
        'memory_bandwidth': bw * 1e9 * float(rng.uniform(0.8, 1.2)),
        'matmul_efficiency': eff,
        'overhead_per_layer': 40e-6,
      }
    )
    nodes.append(
      {
        'name': f'{name}-node',
        'devices': {name: per},
        'count': count // per,
        'nic_bandwidth': float(rng.choice([100, 200, 400, 1600, 3200])) * 1e9 / 8,
        'intra_bandwidth': intra * 1e9 * float(rng.uniform(0.7, 1.3)),
      }
    )
  raw = {
    'name': f'random_{total}_{"_".join(g["name"] for g in groups)}',
    'groups': groups,
    'nodes': nodes,
    'links': {
      'intra_node': {'bandwidth': 25e9, 'latency': 5e-6},
      'inter_node': {'bandwidth': float(rng.choice([100, 200, 400])) * 1e9 / 8, 'latency': 5e-6},
    },
  }
  return cluster_lib.parse(raw, raw['name'])


def training_problems(cfg, count: int = 24, seed: int = 0, options: Options = Options()):
  """`count` random clusters for cfg's model, with the analytic profile (every tensor degree)."""
  from triax.plan import analytic

  rng = np.random.default_rng(seed)
  out = []
  while len(out) < count:
    cluster = random_cluster(rng)
    layouts = list(search_lib.layouts(cfg, cluster.num_devices))
    if not layouts:
      continue
    prof = analytic.build(cfg.model, sorted({l.tensor for l in layouts}))
    prob = problem(cfg, cluster, prof, options)
    if prob is not None:
      out.append(prob)
  return out


def model_key(cfg) -> str:
  m = cfg.model
  return (
    f'{m.family} L{m.num_layers} d{m.d_model} h{m.num_heads} ff{m.d_ff} v{m.vocab_size} '
    f's{m.seq_len} {m.dtype} batch {cfg.train.global_batch_size}'
  )


def trained(
  cfg,
  path: str | None = None,
  steps: int = 240,
  clusters: int = 24,
  seed: int = 0,
  progress: Callable[[str], None] | None = None,
) -> Policy:
  """The policy at `path`, or one trained for cfg's model (saved to `path` if given)."""
  if path and os.path.isfile(path):
    policy = load(path)
    if progress:
      progress(f'learned: policy {path} (trained for {policy.meta.get("model", "?")})')
    return policy
  if progress:
    progress(f'learned: training on {clusters} random clusters, {steps} steps ...')
  problems = training_problems(cfg, clusters, seed)
  policy, log = train(problems, steps=steps, seed=seed, progress=progress)
  policy.meta.update(
    model=model_key(cfg), steps=steps, clusters=clusters, seed=seed, train_s=round(log.seconds, 1)
  )
  if progress:
    progress(f'learned: trained in {log.seconds:.1f} s')
  if path:
    save(policy, path)
  return policy


def search(
  cfg,
  cluster: Cluster,
  top_k: int = 5,
  options: Options = Options(),
  profile: profile_lib.Profile | None = None,
  policy: Policy | None = None,
  samples: int = 63,
  seed: int = 0,
) -> search_lib.SearchResult:
  """The learned planner's answer as a SearchResult (search.search's shape).

  Baselines: 'even_split' (its best plan's degrees and devices, even
  layers), 'data_parallel' and 'zero3' (the best d = devices layout with
  replicated and with FSDP state, as the search's) and
  'homogeneous_slowest' (the policy's plan for the cluster made of its
  slowest type, timed on the real one). search_s counts them too, as the
  search's does.
  """
  if profile is None:
    from triax.plan import analytic

    profile = analytic.build(
      cfg.model, sorted({l.tensor for l in search_lib.layouts(cfg, cluster.num_devices)})
    )
  policy = policy or trained(cfg)
  started = time.perf_counter()
  prob = problem(cfg, cluster, profile, options)
  empty = dict.fromkeys(
    getattr(search_lib, 'BASELINES', ('even_split', 'data_parallel', 'homogeneous_slowest'))
  )
  if prob is None:
    return search_lib.SearchResult((), empty, 0, 0.0, profile, cluster)
  found = infer(policy, prob, samples, seed)
  n = cluster.num_devices
  top, seen = [], set()
  for e in found:
    if e.oom or len(top) == top_k:
      continue
    key = (e.plan.describe(), round(e.step_time, 12))
    if key not in seen and search_lib._plan_config_ok(cfg, e.plan, n):
      seen.add(key)
      top.append(e)
  baselines = dict(empty)
  if top:
    best = top[0].plan
    even = partition.even(best.num_layers, best.pipe, best.virtual_stages)
    if even and not best.even:
      e = simulate_plan(dataclasses.replace(best, layers=even), profile, cluster, options)
      baselines['even_split'] = None if e.oom else e
    elif best.even:
      baselines['even_split'] = top[0]
  dp = [l for l in prob.layouts if l.data == n]
  fits = [e for e in search_lib._evaluate(cfg, cluster, profile, options, dp) if not e.oom]
  for key, sharding in (('data_parallel', 'replicated'), ('zero3', 'fsdp')):
    mine = [e for e in fits if getattr(e.plan, 'state_sharding', 'replicated') == sharding]
    if key in baselines and mine:
      baselines[key] = min(mine, key=lambda e: e.step_time)
  slow = problem(cfg, search_lib.homogenized(cluster, profile, cfg), profile, options)
  if slow is not None:
    for e in infer(policy, slow, samples, seed):
      if not e.oom and search_lib._plan_config_ok(cfg, e.plan, n):
        real = simulate_plan(e.plan, profile, cluster, options)
        if not real.oom:
          baselines['homogeneous_slowest'] = real
          break
  return search_lib.SearchResult(
    top=tuple(top),
    baselines=baselines,
    evaluated=len(prob.cache),
    search_s=time.perf_counter() - started,
    profile=profile,
    cluster=cluster,
  )
