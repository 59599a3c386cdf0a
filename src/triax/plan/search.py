"""The strategy maker: enumerate layouts, balance layers, simulate, rank.

For a model config and a cluster it tries every

  data x context x tensor x pipe  whose product is the device count (tensor
                        must divide heads, d_ff and vocabulary; context c
                        needs seq_len % 2c == 0, the load-balanced split,
                        the xla attention path, and gives each rank at
                        least MIN_CONTEXT_POSITIONS positions),
  sequence parallelism  off, and on where tensor > 1 and seq_len splits
                        over context x tensor,
  micro-batches m       dividing the per-replica batch (size = B / (d m)),
  virtual stages v,     schedule (every entry of schedule.SCHEDULES the
                        config validator accepts for those sizes),
  assignment            of devices to pipeline stages: by speed, fastest
                        first or last, or in node order,
  layer partition       the even split and the dynamic program's
                        (partition.balance) under each stage's memory,
  remat                 'none', or 'selective' / 'full' only where 'none'
                        runs out of memory (on paper recomputation never
                        speeds up); all three where they were measured on
                        this machine (on XLA:CPU full remat can be faster),
  state sharding        with data > 1: replicated, ZeRO-1 (moments over
                        data) and FSDP (parameters too; d_model must
                        divide by data): candidate.STATE_SHARDINGS,

simulates each (ranking by the lockstep model, the executor's, unless
asked otherwise) and keeps the fastest plans that fit in memory and that
triax's config validator accepts. Of plans predicted equally fast, the one
without context parallelism, then without sequence parallelism ranks first
(the simpler mesh; plans without them read as they did). Baselines, always
reported beside the winner: the same degrees, schedule and sequence
splitting with an even layer split; data parallel only
(replicated state); ZeRO-3 (data parallel only with FSDP, tensor = pipe =
1); and the best plan found when every device is assumed to be the slowest
type, evaluated on the real cluster.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

from triax import config as config_lib
from triax.errors import ConfigError
from triax.pipeline import schedule as sched
from triax.plan import memory as memory_lib
from triax.plan import partition, roofline
from triax.plan import profile as profile_lib
from triax.plan.candidate import STATE_SHARDINGS, Estimate, Options, Plan
from triax.plan.cluster import Cluster, Group
from triax.plan.simulator import simulate_plan

REMATS = ('none', 'selective', 'full')
# Largest micro-batch count tried: beyond it, ticks cost more than bubbles save.
MAX_MICROBATCHES = 64
MAX_VIRTUAL_STAGES = 4
# Fewest positions a context rank is given: below it a ring pass outlasts the
# block's attention it hides behind and the rank's matmuls thin, while data
# or tensor parallelism would split the work as well (Llama 3 gives each of
# 16 ranks 8k of 128k). It keeps CP off short sequences, where the search
# would only multiply its candidates.
MIN_CONTEXT_POSITIONS = 1024
BASELINES = ('even_split', 'data_parallel', 'zero3', 'homogeneous_slowest')


@dataclasses.dataclass(frozen=True)
class Layout:
  """Degrees and schedule sizes, before devices and layers are placed."""

  data: int
  tensor: int
  pipe: int
  schedule: str
  microbatches: int
  virtual_stages: int
  context: int = 1
  sequence_parallel: bool = False
  context_attention: str = 'allgather'


@dataclasses.dataclass(frozen=True)
class SearchResult:
  """The ranked plans, the baselines and what the search cost.

  Attributes:
    top: best plans first (no OOM), at most `top_k`.
    baselines: 'even_split' (the winner's degrees and schedule, even
      layers), 'data_parallel' (replicated state), 'zero3' (data parallel
      with FSDP), 'homogeneous_slowest' (the plan chosen as if
      every device were the slowest type, timed on this cluster); None when
      there is no such plan that fits.
    evaluated: candidate plans simulated.
    search_s: seconds spent searching (profiling excluded).
    profile: the profile used (None: nothing searched, no layout suits).
    cluster: the cluster planned for.
  """

  top: tuple[Estimate, ...]
  baselines: dict[str, Estimate | None]
  evaluated: int
  search_s: float
  profile: profile_lib.Profile | None
  cluster: Cluster

  def speedup(self, baseline: str) -> float | None:
    base = self.baselines.get(baseline)
    if base is None or not self.top:
      return None
    return base.step_time / self.top[0].step_time


def no_layout(cfg, cluster: Cluster) -> ConfigError:
  """The error for a cluster none of whose layouts suits the model."""
  return ConfigError(
    '--cluster',
    f'{cluster.path}: no data x tensor x pipe layout of {cluster.num_devices} devices suits '
    f'this model (heads {cfg.model.num_heads}, layers {cfg.model.num_layers}, batch '
    f'{cfg.train.global_batch_size}); use --gpus to size the cluster, or another batch',
  )


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def _sequence_splits(model, c: int, t: int) -> list[tuple[bool, str]]:
  """(sequence_parallel, context_attention) pairs for context c and tensor t
  that config.validate accepts; [] when c does not suit the model.

  The context attention kind is the config's (model.context_attention):
  trying both would double every context-parallel candidate, and the
  simulator prices either (`simulator.context_seconds`)."""
  if c > 1 and (
    model.seq_len % (2 * c) or model.seq_len < c * MIN_CONTEXT_POSITIONS or model.attention != 'xla'
  ):
    return []
  sp = (False, True) if t > 1 and model.seq_len % (c * t) == 0 else (False,)
  return [(x, model.context_attention) for x in sp]


def _degrees(cfg, num_devices: int) -> Iterator[tuple[int, int, int, int, bool, str]]:
  """(d, c, t, p, sequence_parallel, context_attention) the model allows."""
  model = cfg.model
  batch = cfg.train.global_batch_size
  for d in _divisors(num_devices):
    for c in _divisors(num_devices // d):
      for t in _divisors(num_devices // (d * c)):
        p = num_devices // (d * c * t)
        if model.num_heads % t or model.d_ff % t or model.vocab_size % t:
          continue
        # Grouped-query K/V heads split over tensor when there are enough, else
        # replicate; as many or more that do not divide, validation refuses.
        kv = model.get('num_kv_heads') or model.num_heads
        if kv >= t and kv % t:
          continue
        if p > model.num_layers or batch % d:
          continue
        for sp, kind in _sequence_splits(model, c, t):
          yield d, c, t, p, sp, kind


def layouts(cfg, num_devices: int) -> Iterator[Layout]:
  """Every (d, c, t, p, SP, context attention, schedule, m, v) the config
  validator accepts."""
  model = cfg.model
  batch = cfg.train.global_batch_size
  for d, c, t, p, sp, kind in _degrees(cfg, num_devices):
    for m in _divisors(batch // d):
      if m > MAX_MICROBATCHES or (p == 1 and m > 1 and m not in (2, 4, 8)):
        continue
      # One micro-batch or one stage: every schedule runs the same ticks.
      names = ('1f1b',) if p == 1 or m == 1 else tuple(sched.SCHEDULES)
      for name in names:
        for v in (1, 2, 4, 8):
          if v > MAX_VIRTUAL_STAGES or p * v > model.num_layers or (p == 1 and v > 1):
            continue
          if name == 'interleaved_1f1b' and v == 1:
            continue  # the builder returns 1f1b itself
          if name == 'interleaved_zb' and v == 1:
            continue  # the same orders as zb_h1: one plan shown twice
          if _buildable(name, p, m, v):
            yield Layout(d, t, p, name, m, v, c, sp, kind)


def profile_sizes(cfg, candidates: Sequence[Layout]) -> tuple[list[int], list[int]]:
  """The tensor degrees and per-replica micro-batch sizes a search over
  `candidates` needs profiled (what `search` asks `profile.measure` for)."""
  batch = cfg.train.global_batch_size
  tensors = sorted({l.tensor for l in candidates})
  sizes = sorted({batch // (l.data * l.microbatches) for l in candidates})
  return tensors, sizes


_BUILDABLE: dict = {}


def _buildable(name: str, p: int, m: int, v: int) -> bool:
  key = (name, p, m, v)
  if key not in _BUILDABLE:
    try:
      sched.lower(sched.build(name, p, m, v))
      _BUILDABLE[key] = True
    except (ConfigError, NotImplementedError, sched.ScheduleDeadlock, ValueError):
      _BUILDABLE[key] = False
  return _BUILDABLE[key]


def _speed(profile: profile_lib.Profile, group: Group, b: int, t: int) -> float:
  """Seconds of one layer's forward + backward: lower is faster."""
  return roofline.seconds(profile, group, 'layer_fwd', b, t) + roofline.seconds(
    profile, group, 'layer_bwd', b, t
  )


def assignments(
  cluster: Cluster, profile: profile_lib.Profile, layout: Layout, b: int
) -> list[tuple[tuple[int, ...], ...]]:
  """Ways to form the pipeline stages from the cluster's devices.

  Devices are sorted (fastest first, slowest first, or left in node order)
  and cut into consecutive groups of data*context*tensor: a stage gets
  devices of one speed where it can (it runs at its slowest), and
  consecutive devices mostly share a node (tensor groups, then context
  rings, want the fast intra-node links: Plan.stages is tensor-minor).
  """
  size = layout.data * layout.context * layout.tensor
  speed = {name: _speed(profile, g, b, layout.tensor) for name, g in cluster.groups.items()}
  node_order = [d.index for d in cluster.devices]
  fast_first = sorted(node_order, key=lambda i: (speed[cluster.devices[i].group], i))
  slow_first = sorted(node_order, key=lambda i: (-speed[cluster.devices[i].group], i))
  out = []
  for order in (fast_first, node_order, slow_first):
    stages = tuple(tuple(order[k * size : (k + 1) * size]) for k in range(layout.pipe))
    if stages not in out:
      out.append(stages)
  return out


def state_shardings(cfg, data: int) -> tuple[str, ...]:
  """The state shardings a layout with `data` replicas can use: all of
  STATE_SHARDINGS with data > 1, FSDP only where d_model divides by data."""
  if data == 1:
    return ('replicated',)
  return tuple(k for k in STATE_SHARDINGS if k != 'fsdp' or cfg.model.d_model % data == 0)


def _partitions(
  layout: Layout, stages, profile, cluster, options, remat, num_layers, batch, sharding
) -> list[tuple[int, ...]]:
  """The even split (if any) and the balanced one for these stages."""
  p, v, t = layout.pipe, layout.virtual_stages, layout.tensor
  rows = batch // (layout.data * layout.microbatches)
  b = rows / layout.context  # what a device computes (Plan.compute_batch)
  out = []
  even = partition.even(num_layers, p, v)
  if even:
    out.append(even)
  if p == 1:
    return out or [(num_layers,)]
  groups = [[cluster.groups[cluster.devices[d].group] for d in stage] for stage in stages]
  per_layer = [max(_speed(profile, g, b, t) for g in gs) for gs in groups]
  edge = [0.0] * p
  edge[0] += max(roofline.seconds(profile, g, 'embed', b, t) for g in groups[0])
  edge[-1] += max(roofline.seconds(profile, g, 'head', b, t) for g in groups[-1])
  shard = profile.shards[t]
  fixed = shard.stash_fixed_per_seq * memory_lib.residual_share(layout)
  stash = rows * (memory_lib.layer_stash(layout, shard, remat) + fixed)
  capacity = [min(g.memory for g in gs) * options.memory_fraction for gs in groups]

  # Memory of a stage holding n layers, its stash slots taken as p (1F1B's
  # steady state): a screen only; the simulator checks the real program.
  state_copies = sum(memory_lib.copies(sharding, layout.data).values())

  def allowed(s, n):
    params = state_copies * (shard.layer_param_bytes * n + shard.edge_param_bytes)
    return params + p * stash * n / v <= capacity[s]

  balanced = partition.balance(
    num_layers, p, lambda s, n: edge[s] + n * per_layer[s], allowed, unit=v
  )
  if balanced and balanced[0] not in out:
    out.append(balanced[0])
  return out


def _plan_config_ok(cfg, plan: Plan, num_devices: int) -> bool:
  """Whether triax's config validator accepts the plan (sizes, schedule rules)."""
  try:
    config_lib.validate(with_plan(cfg, plan), num_devices)
    return True
  except (ConfigError, ValueError):
    return False


def with_plan(cfg, plan: Plan):
  """A copy of cfg with the plan's overrides applied."""
  import ml_collections

  from triax.plan import emit

  return emit.apply(ml_collections.ConfigDict(cfg.to_dict()), emit.overrides(plan, cfg=cfg))


def search(
  cfg,
  cluster: Cluster,
  top_k: int = 5,
  options: Options = Options(),
  profile: profile_lib.Profile | None = None,
) -> SearchResult:
  """Finds the fastest plans for `cfg` (a config) on `cluster`.

  Args:
    cfg: the experiment config (model, train.global_batch_size, ...).
    cluster: the cluster spec.
    top_k: how many plans to return.
    options: simulator options.
    profile: a profile to use; by default the model is profiled here for
      every tensor degree and micro-batch size the candidates need.

  Returns:
    A SearchResult; with no top plans and no baselines when no layout of
    the cluster's devices suits the model (`no_layout` says why).
  """
  n = cluster.num_devices
  all_layouts = list(layouts(cfg, n))
  if not all_layouts:
    # Not an error here: a benchmark over every shipped cluster meets specs
    # too large for its model (report.run turns it into one).
    return SearchResult(
      top=(),
      baselines=dict.fromkeys(BASELINES),
      evaluated=0,
      search_s=0.0,
      profile=profile,
      cluster=cluster,
    )
  if profile is None:
    profile = profile_lib.measure(cfg.model, *profile_sizes(cfg, all_layouts))
  else:  # a given profile bounds the tensor degrees
    all_layouts = [l for l in all_layouts if l.tensor in profile.shards]
  started = time.perf_counter()
  found = _evaluate(cfg, cluster, profile, options, all_layouts)
  evaluated = len(found)
  fitting = sorted((e for e in found if not e.oom), key=rank)
  top, seen = [], set()
  for e in fitting:
    if len(top) == top_k:
      break
    # Device orders that change nothing predicted (e.g. one stage) show once.
    key = (e.plan.describe(), round(e.step_time, 12))
    if key not in seen and _plan_config_ok(cfg, e.plan, n):
      seen.add(key)
      top.append(e)
  baselines = _baselines(cfg, cluster, profile, options, top, found, all_layouts)
  return SearchResult(
    top=tuple(top),
    baselines=baselines,
    evaluated=evaluated,
    search_s=time.perf_counter() - started,
    profile=profile,
    cluster=cluster,
  )


def rank(e: Estimate) -> tuple:
  """Sort key of plans: the predicted step time; of equals, the one without
  context parallelism, then without SP (see the module docstring)."""
  return (e.step_time, e.plan.context, e.plan.sequence_parallel)


def _evaluate(cfg, cluster, profile, options, all_layouts) -> list[Estimate]:
  found = []
  batch, layers = cfg.train.global_batch_size, cfg.model.num_layers
  for layout in all_layouts:
    b = batch // (layout.data * layout.microbatches) / layout.context
    for stages in assignments(cluster, profile, layout, b):
      for remat in REMATS:
        fits = False
        for sharding in state_shardings(cfg, layout.data):
          for split in _partitions(
            layout, stages, profile, cluster, options, remat, layers, batch, sharding
          ):
            plan = Plan(
              data=layout.data,
              tensor=layout.tensor,
              pipe=layout.pipe,
              schedule=layout.schedule,
              microbatches=layout.microbatches,
              virtual_stages=layout.virtual_stages,
              remat=remat,
              layers=split,
              stages=stages,
              global_batch=batch,
              state_sharding=sharding,
              context=layout.context,
              sequence_parallel=layout.sequence_parallel,
              context_attention=layout.context_attention,
            )
            estimate = simulate_plan(plan, profile, cluster, options)
            found.append(estimate)
            fits |= not estimate.oom
        if fits and not _remat_measured(profile, cluster):
          break  # on paper, more recomputation would only be slower
  return found


def _remat_measured(profile: profile_lib.Profile, cluster: Cluster) -> bool:
  """Whether every group's remat costs were measured (this machine with
  every policy profiled): then recomputation may be faster, and is tried."""
  return cluster.local and all(profile_lib.variant('layer_bwd', r) in profile.fits for r in REMATS)


def _baselines(cfg, cluster, profile, options, top, found, all_layouts) -> dict:
  out: dict[str, Estimate | None] = dict.fromkeys(BASELINES)
  n = cluster.num_devices
  if top:
    best = top[0].plan
    # The winner but for its layer split (and remat).
    shape = lambda p: {**dataclasses.asdict(p), 'remat': None, 'layers': None}  # noqa: E731
    even = [e for e in found if not e.oom and e.plan.even and shape(e.plan) == shape(best)]
    if even:
      out['even_split'] = min(even, key=rank)
  dp = [e for e in found if not e.oom and e.plan.data == n]
  replicated = [e for e in dp if e.plan.state_sharding == 'replicated']
  if replicated:
    out['data_parallel'] = min(replicated, key=rank)
  zero3 = [e for e in dp if e.plan.state_sharding == 'fsdp']
  if zero3:
    out['zero3'] = min(zero3, key=rank)
  slow = homogenized(cluster, profile, cfg)
  assumed = sorted(
    (e for e in _evaluate(cfg, slow, profile, options, all_layouts) if not e.oom), key=rank
  )
  for e in assumed:
    if _plan_config_ok(cfg, e.plan, n):
      real = simulate_plan(e.plan, profile, cluster, options)
      if not real.oom:
        out['homogeneous_slowest'] = real
        break
  return out


def homogenized(cluster: Cluster, profile: profile_lib.Profile, cfg) -> Cluster:
  """The cluster with every device replaced by its slowest type (same nodes
  and links): what a planner that ignores heterogeneity would see."""
  batch = cfg.train.global_batch_size
  slowest = max(
    cluster.groups.values(),
    key=lambda g: (_speed(profile, g, max(1, batch // cluster.num_devices), 1), -g.memory),
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
