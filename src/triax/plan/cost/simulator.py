"""Predicts a `Plan`'s step time and memory on a cluster: `simulate_plan` -> `Estimate`.

A plan fixes the degrees (data, context, tensor, pipe, expert), the schedule, micro-batches,
virtual stages, remat, the state sharding, which devices form each pipeline stage and how
many layers each holds. `action_costs` prices every action per chunk from the profile (the
embedding runs inside chunk 0's actions, the head's loss and gradient inside the last
chunk's forward) and the cluster's links (plan/cost/comm.py). The schedule is then timed
two ways from the same costs:

- lockstep (the default, what triax's executor runs): `simulate.simulate_lockstep` over
  the lowered program, with this plan's `PlanTickCosts` (neighbour ppermutes every tick,
  BPipe's residual moves, devices that share cores);
- asynchronous (the papers' model): `simulate.simulate_async` of the schedule as built,
  one `Costs` per stage, floored by the same core-sharing bound.

Both then add the tail: the edge gradients' psum over `pipe`, the data-parallel gradient
reduction (once per step; Options.dp_allreduce='per_microbatch' charges it in every
backward), the state sharding's gathers and the optimizer update. Memory is
plan/cost/memory.py's; Plan, Options and Estimate live in plan/candidate.py.

How state sharding, context, sequence and expert parallelism enter the costs:
docs/design/time_model.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from triax.pipeline import schedule as sched
from triax.pipeline import simulate
from triax.pipeline.executor import edge_rows
from triax.pipeline.schedule import Action
from triax.plan.candidate import Estimate, Options, Plan
from triax.plan.cluster import Cluster
from triax.plan.cost import experts as experts_lib
from triax.plan.cost import host as host_lib
from triax.plan.cost import memory as memory_lib
from triax.plan.cost import profile as profile_lib
from triax.plan.cost import roofline
from triax.plan.cost.comm import Comm
from triax.plan.cost.profile import Profile

# Share of a backward that its B (input gradient) and W (weight gradient)
# each take where the profile has not measured them: the two halves of the
# backward GEMMs. Every lockstep program runs its backwards as B then W.
SPLIT_BACKWARD_SHARE = 0.5
# Bytes the optimizer reads and writes per parameter byte: params, grads and
# both Adam moments read, params and moments written, grads read again by
# the global-norm clip.
OPTIMIZER_TRAFFIC = 8.0


@dataclasses.dataclass(frozen=True)
class ActionCosts:
  """Seconds per chunk action and per transfer, for one plan.

  chunk[c][kind] is the duration of `kind` for chunk c on its stage as the
  lockstep program runs it: F, and every backward as B then W (lower.py
  splits a fused one too). fused[c] is chunk c's backward as one action,
  what a schedule built fused runs in the asynchronous model (None: its B
  plus W). share[c][kind] is the seconds of a shared node's capacity one
  of the stage's devices takes to run it (0 where devices do not share
  cores; see roofline.node_share). transfer[s] is one activation (or
  gradient) ppermute out of stage s; evict[s] one chunk's residual set
  moved to or from stage s's partner; tick_transfer what the executor's
  neighbour ppermutes cost in every tick, whatever they carry; host[s] one
  residual set copied between stage s and its host's memory, one way (an
  offloaded stash, plan/cost/host.py; () without one); gather[s] the part
  of transfer[s] that is not the ppermute but the receiving tensor group's
  all-gather of a message sent split (Megatron's scatter/gather; 0 without
  it), which the action that reads the message runs.
  """

  chunk: tuple[dict[str, float], ...]
  transfer: tuple[float, ...]
  evict: tuple[float, ...]
  tick_transfer: float
  share: tuple[dict[str, float], ...] | None = None
  fused: tuple[float, ...] | None = None
  host: tuple[float, ...] = ()
  gather: tuple[float, ...] = ()

  def of(self, a: Action) -> float:
    return self.chunk[a.chunk][a.kind]

  def share_of(self, a: Action) -> float:
    return self.share[a.chunk][a.kind] if self.share else 0.0

  def fused_backward(self, chunk: int) -> float:
    if self.fused is not None:
      return self.fused[chunk]
    return self.chunk[chunk][sched.BACKWARD] + self.chunk[chunk][sched.WEIGHT]


@dataclasses.dataclass(frozen=True, order=True)
class Work:
  """Seconds of one piece of work two ways: `alone`, on a device that has its
  cores to itself; `at_once`, the seconds of a shared node's capacity it takes
  when every device of the node runs (roofline.node_share; 0 where devices
  do not share cores). Also a pair of factors that scale each (`*`)."""

  alone: float = 0.0
  at_once: float = 0.0

  def __add__(self, other: Work) -> Work:
    return Work(self.alone + other.alone, self.at_once + other.at_once)

  def __sub__(self, other: Work) -> Work:
    return Work(self.alone - other.alone, self.at_once - other.at_once)

  def __mul__(self, k: Work | float) -> Work:
    if isinstance(k, Work):
      return Work(self.alone * k.alone, self.at_once * k.at_once)
    return Work(self.alone * k, self.at_once * k)

  def __truediv__(self, k: float) -> Work:
    return Work(self.alone / k, self.at_once / k)


@dataclasses.dataclass(frozen=True)
class StageCosts:
  """One layer's costs on a stage's slowest device, and its edges'.

  fwd, bwd: a layer's forward and backward (`alone` with its collectives,
  tp_fwd and tp_bwd, which a chunk's length does not scale; `at_once` its
  compute only); recompute: what remat adds to the backward (the forward it
  reruns); embed, head: the edges' functions; dp, edge_dp: the per-micro-batch
  gradient all-reduce of a layer and of the edges (Options.dp_allreduce);
  fsdp_fwd, fsdp_bwd: what FSDP per layer adds to each layer's forward and
  backward beyond the first, fsdp_fwd_once, fsdp_bwd_once: the chunk's first
  gather and last reduce-scatter (all 0 without FSDP per layer); FSDP's are
  per stack entry, which holds `entry` layers (ModelSpec.layers_per_entry).
  """

  fwd: Work
  bwd: Work
  recompute: Work
  tp_fwd: float
  tp_bwd: float
  embed: Work
  head: Work
  dp: float = 0.0
  edge_dp: float = 0.0
  fsdp_fwd: float = 0.0
  fsdp_bwd: float = 0.0
  fsdp_fwd_once: float = 0.0
  fsdp_bwd_once: float = 0.0
  entry: int = 1


def action_costs(
  plan: Plan, profile: Profile, cluster: Cluster, options: Options = Options()
) -> ActionCosts:
  """Per-chunk F/B/W durations on each stage's slowest device (`stage_costs`:
  with the tensor-parallel all-reduces, 2 per layer forward, 2 backward,
  Megatron; with sequence parallelism each a reduce-scatter and an
  all-gather of the same bytes, the same time; context parallelism's K/V
  collectives, `context_seconds`; and, per micro-batch, the data-parallel
  gradient all-reduce), run as the executor runs a chunk (`chunk_work`), and
  the transfers (`transfers`). A device computes `plan.compute_batch`
  sequences' worth."""
  comm = Comm(cluster, profile)
  stages = [stage_costs(plan, profile, cluster, options, comm, s) for s in range(plan.pipe)]
  ratios = ExecutorRatios(profile.ratios if cluster.local else {}, plan.remat)
  chunks, shares, fused = [], [], []
  after = edges_after_loop(plan, profile, options)
  for c, n in enumerate(plan.chunk_layers):
    f, b, w, whole = chunk_work(plan, stages[plan.placement[c]], c, n, ratios, after)
    chunks.append({sched.FORWARD: f.alone, sched.BACKWARD: b.alone, sched.WEIGHT: w.alone})
    shares.append({sched.FORWARD: f.at_once, sched.BACKWARD: b.at_once, sched.WEIGHT: w.at_once})
    fused.append(whole)
  transfer, evict, tick_transfer, gather = transfers(plan, profile, options, comm)
  return ActionCosts(
    chunk=tuple(chunks),
    transfer=tuple(transfer),
    evict=tuple(evict),
    tick_transfer=tick_transfer,
    gather=tuple(gather),
    share=tuple(shares),
    fused=tuple(fused),
    host=host_lib.stash_seconds(plan, profile, cluster, options),
  )


def _slowest(plan: Plan, cluster: Cluster, stage: int, costs, key=None):
  """costs(group, shared_cores) on the stage's slowest device type."""
  found = {
    (cluster.devices[d].group, cluster.shared_cores(cluster.devices[d].node))
    for d in plan.stages[stage]
  }
  return max((costs(cluster.groups[g], cores) for g, cores in found), key=key)


def _layer_work(plan: Plan, profile: Profile, cluster: Cluster, stage: int):
  """A layer's forward, backward and recompute Work on the stage's slowest device."""
  b, t, e = plan.compute_batch, plan.tensor, plan.expert

  def layer(group, cores):
    fwd, bwd = roofline.layer_seconds(profile, group, b, t, plan.remat, e)
    remat = plan.remat
    if not (group.local and profile_lib.variant('layer_bwd', remat) in profile.fits):
      # A policy not measured here shares the node as its plain layer does.
      remat = 'none'
    base = roofline.layer_seconds(profile, group, b, t, remat, e)
    ratio = [
      roofline.node_share(profile, group, profile_lib.variant(f, remat), b, t, cores)
      / max(x, 1e-30)
      for f, x in zip(profile_lib.LAYER_FUNCTIONS, base)
    ]
    # What remat adds to the backward: the forward it reruns.
    recompute = max(bwd - roofline.layer_seconds(profile, group, b, t, 'none', e)[1], 0.0)
    return (
      Work(fwd, fwd * ratio[0]),
      Work(bwd, bwd * ratio[1]),
      Work(recompute, recompute * ratio[1]),
    )

  # The slowest by its time alone: forward, then backward, then their shares.
  order = lambda w: (w[0].alone, w[1].alone, w[0].at_once, w[1].at_once, w[2].alone, w[2].at_once)
  return _slowest(plan, cluster, stage, layer, key=order)


def stage_costs(
  plan: Plan, profile: Profile, cluster: Cluster, options: Options, comm: Comm, s: int
) -> StageCosts:
  """Stage s's StageCosts (see `action_costs`; with sequence parallelism the
  backward also gathers the normed stream again, `sequence_parallel_regathers`)."""
  shard = profile.shards[plan.tensor]
  # The [b, s/c, h] activation a tensor group all-reduces (or, with SP,
  # reduce-scatters and all-gathers).
  act = shard.act_per_seq * plan.microbatch_size * memory_lib.token_share(plan)
  # With the experts split, every device waits for the busiest expert's
  # (or, where the grouped matmuls run dense, computes every expert's rows).
  dense = experts_lib.runs_dense(plan, shard, cluster, s)
  slowest = experts_lib.compute_scale(plan, shard, options.moe_imbalance, dense)
  # With a window, the attention blocks out of reach are skipped (context_compute_share).
  scale = slowest * context_compute_share(plan, shard)
  fwd, bwd, recompute = (w * scale for w in _layer_work(plan, profile, cluster, s))
  tp = max(comm.allreduce(g, act) for g in plan.tensor_groups(s))
  cp_fwd, cp_bwd = context_seconds(plan, shard, comm, s, fwd.alone)
  ep_fwd, ep_bwd = experts_lib.seconds(plan, shard, comm, s)
  # Full remat's rerun forward runs its two all-reduces again.
  tp_fwd = 2 * tp + cp_fwd + ep_fwd
  tp_bwd = 2 * tp + (2 * tp if plan.remat == 'full' else 0.0) + cp_bwd + ep_bwd
  tp_bwd += sequence_parallel_regathers(plan, comm, s, act)

  fsdp = _fsdp_per_layer(
    plan, shard, comm, options, s, fwd.alone, bwd.alone, tp, profile.layers_per_entry
  )
  dp = edge_dp = 0.0
  # Charged inside every backward only for a replicated state (see the docstring).
  if options.dp_allreduce == 'per_microbatch' and plan.state_sharding == 'replicated':
    grads = plan.gradient_groups(s)
    dp = max(comm.allreduce(g, experts_lib.layer_params(plan, shard)) for g in grads)
    edge_dp = max(comm.allreduce(g, shard.edge_param_bytes / 2) for g in grads)
  # The edges' own blocks all-reduce over tensor as a layer does, 2 forward
  # and 2 backward each (the embedding's forward twice: its vjp in the
  # executor's B reruns them); an MTP module's MoE block exchanges its tokens.
  embed_blocks, head_blocks = shard.edge_blocks
  embed_comm = embed_blocks * 6 * tp
  head_comm = head_blocks * (4 * tp + experts_lib.block_seconds(plan, shard, comm, s))
  return StageCosts(
    fwd=Work(fwd.alone + tp_fwd, fwd.at_once),
    bwd=Work(bwd.alone + tp_bwd, bwd.at_once),
    recompute=recompute,
    tp_fwd=tp_fwd,
    tp_bwd=tp_bwd,
    embed=_edge_work(plan, profile, cluster, s, 'embed') + Work(embed_comm),
    head=_edge_work(plan, profile, cluster, s, 'head') + Work(head_comm),
    dp=dp,
    edge_dp=edge_dp,
    entry=profile.layers_per_entry,
    **fsdp,
  )


def _edge_work(plan: Plan, profile: Profile, cluster: Cluster, s: int, function: str) -> Work:
  """The embedding's or the head's work (`function`) on stage s's slowest device."""
  b, t = plan.compute_batch, plan.tensor
  return _slowest(
    plan,
    cluster,
    s,
    lambda group, cores: Work(
      roofline.seconds(profile, group, function, b, t, plan.expert),
      roofline.node_share(profile, group, function, b, t, cores),
    ),
  )


def edges_after_loop(plan: Plan, profile: Profile, options: Options) -> bool:
  """Whether the executor makes the edges' weight gradients after its tick
  loop (options.edge_grads; memory_lib.edge_grads_after asks the executor's
  rule)."""
  return plan.uses_executor and memory_lib.edge_grads_after(plan, profile, options)[0] > 0


def edge_seconds_after_loop(plan: Plan, profile: Profile, cluster: Cluster) -> float:
  """Seconds of the edges' weight gradients after the tick loop: each stage
  makes ceil(m/p) micro-batches' (the head's forward again and its weight
  gradient, two thirds of its work; the embedding's backward), the slowest
  stage's time."""
  rows = edge_rows(plan.microbatches, plan.pipe)
  return max(
    rows
    * (
      _edge_work(plan, profile, cluster, s, 'head') * EDGE_SHARE
      + _edge_work(plan, profile, cluster, s, 'embed') * EDGE_SHARE
    ).alone
    for s in range(plan.pipe)
  )


def _fsdp_per_layer(
  plan: Plan,
  shard,
  comm: Comm,
  options: Options,
  s: int,
  fwd: float,
  bwd: float,
  tp: float,
  entry: int,
) -> dict:
  """StageCosts' FSDP fields for FSDP per layer (no executor; {} otherwise):
  fwd and bwd are a layer's compute, tp one tensor all-reduce; the layer
  scan gathers one stack entry (`entry` layers) at a time."""
  if not plan.fsdp_per_layer:
    return {}
  layer_bytes = experts_lib.layer_params(plan, shard) * entry
  gather = max(comm.allgather(g, layer_bytes) for g in plan.data_groups(s))
  scatter = max(comm.reduce_scatter(g, layer_bytes) for g in plan.data_groups(s))
  # Context ranks then sum their 1/data shards of the gradient.
  scatter += max(comm.allreduce(g, layer_bytes / plan.data) for g in plan.context_groups(s))
  layer_fwd = (fwd + 2 * tp) * entry
  layer_bwd = (bwd + (4 if plan.remat == 'full' else 2) * tp) * entry
  once = {'fsdp_fwd_once': gather, 'fsdp_bwd_once': gather + scatter}
  if not options.fsdp_overlap:
    return {'fsdp_fwd': gather, 'fsdp_bwd': gather + scatter, **once}
  # Overlapped, n layers take g + (n-1) max(c, g) + c: each gather but the
  # first runs beside the previous layer's compute (in the backward, the next
  # layer's gather and the previous one's reduce-scatter beside it). Not
  # overlapped: n (c + g).
  return {
    'fsdp_fwd': max(0.0, gather - layer_fwd),
    'fsdp_bwd': max(0.0, gather + scatter - layer_bwd),
    **once,
  }


class ExecutorRatios:
  """The executor's own variants of a layer, measured on this machine
  (profile.EXECUTOR_RATIOS: each an (alone, at once) pair over the plain
  layer's, the plan's remat policy's own where measured); elsewhere the
  defaults: a backward splits in halves, a layer under cond costs a plain
  one, a skipped one nothing, a layer in any stack what it does in two."""

  def __init__(self, measured: dict, remat: str):
    self.measured, self.remat = measured, remat
    # Every lockstep program runs its backwards as B then W (lower.py), a
    # fused schedule's too: each part is charged, whatever the schedule built.
    self.split_b = self.of('split_b', SPLIT_BACKWARD_SHARE)
    self.split_w = self.of('split_w', 1 - SPLIT_BACKWARD_SHARE)

  def of(self, name: str, default: float) -> Work:
    for key in (f'{name}/{self.remat}', name):
      if key in self.measured:
        return Work(*self.measured[key])
    return Work(default, default)

  def stack(self, part: str, layers: int) -> Work:
    """A layer in a chunk of `layers` stack entries over one in the
    profile's 2-entry chunk (stackN_*), linear between the lengths measured."""
    one, four = self.of(f'stack1_{part}', 1.0), self.of(f'stack4_{part}', 1.0)
    if layers <= 1:
      return one
    if layers >= 4:
      return four
    between = lambda x: 1.0 + (x - 1.0) * (layers - 2) / 2
    return Work(between(four.alone), between(four.at_once))


# Two of the three equal matmuls of the head's loss and gradient (logits,
# their input gradient, the weight's), or the embedding's backward share of
# its work (its lookup the third).
EDGE_SHARE = 2 / 3


def chunk_work(
  plan: Plan, s: StageCosts, c: int, n: int, ratios: ExecutorRatios, edges_after: bool = False
):
  """Chunk c's (n layers on a stage costing `s`) F, B and W as Work, and its
  backward as one action's seconds (a fused schedule's, asynchronous model).
  edges_after: the edges' weight gradients are made after the loop
  (`edge_seconds_after_loop`), so the last chunk's F makes the head's loss
  and input gradient only, and chunk 0's B no embedding gradient."""
  first, final = c == 0, c == len(plan.chunk_layers) - 1
  widest = max(plan.chunk_layers)
  # The chunk's layers run as one scan over its stack's entries (padded to
  # the widest when the split is uneven; the whole model without the executor).
  scanned = (n if plan.even else widest) // s.entry
  sf, sb = ratios.stack('fwd', scanned), ratios.stack('bwd', scanned)
  fwd = Work((s.fwd.alone - s.tp_fwd) * sf.alone + s.tp_fwd, s.fwd.at_once * sf.at_once)
  bwd = Work((s.bwd.alone - s.tp_bwd) * sb.alone + s.tp_bwd, s.bwd.at_once * sb.at_once)
  # An uneven split runs every chunk's padded stack under cond (see
  # model.layers): n layers that compute, widest - n that are skipped.
  active = Work(1.0, 1.0) if plan.even else ratios.of('cond_active', 1.0)
  layers = active * n + ratios.of('cond_skipped', 0.0) * (0 if plan.even else widest - n)
  # FSDP's per-layer collectives beyond what the layers' compute hides: the
  # gathers in F, the backward's gathers and the reduce-scatters in W.
  entries = n // s.entry
  fsdp_f = (entries - 1) * s.fsdp_fwd + s.fsdp_fwd_once
  fsdp_w = (entries - 1) * s.fsdp_bwd + s.fsdp_bwd_once
  embed = s.embed if first else Work()
  f = layers * fwd + Work(fsdp_f) + embed / 3
  if final:
    f = f + (s.head * (EDGE_SHARE if edges_after else 1.0) + Work(s.edge_dp))
  # B reruns what remat dropped (once: W gets what it needs in the cut) and
  # runs the embedding's backward in chunk 0 (it needs the input gradient);
  # a per-micro-batch gradient all-reduce follows the weight gradients, in
  # W. The rest of the backward splits by the executor's B/W shares.
  rerun = layers * (s.recompute * sb)
  rest = layers * bwd - rerun
  edge_b = (Work() if edges_after else embed * EDGE_SHARE) + Work(s.edge_dp if first else 0.0)
  dp = n * s.dp
  if plan.uses_executor:
    b = rest * ratios.split_b + rerun + edge_b
    w = rest * ratios.split_w + Work(dp) + Work(fsdp_w)
  else:  # One value_and_grad: the backward runs fused (its B tick holds it all).
    b, w = rest + rerun + edge_b + Work(dp + fsdp_w), Work()
  return f, b, w, rest.alone + rerun.alone + edge_b.alone + dp + fsdp_w


def transfers(plan: Plan, profile: Profile, options: Options, comm: Comm):
  """Per stage, one activation (or gradient) ppermute out of it and one
  chunk's residual set moved to or from its BPipe partner; and what the
  executor's neighbour ppermutes cost in every tick."""
  p, t = plan.pipe, plan.tensor
  shard = profile.shards[t]
  act = shard.act_per_seq * plan.microbatch_size * memory_lib.token_share(plan)
  stash_set = memory_lib.chunk_stash(plan, profile, max(plan.chunk_layers))
  # Megatron's scatter/gather (the executor's default, pipeline.scatter_gather):
  # each of a stage's t tensor ranks sends 1/t of an activation to its
  # counterpart, and the receiving tensor group all-gathers it (half a ring
  # all-reduce's steps) over its own links. With sequence parallelism the
  # activation is already split over tensor where it is sent and received:
  # 1/t each, nothing to gather.
  split = (options.scatter_gather or plan.sequence_parallel) and t > 1
  sent = act / t if split else act
  transfer, evict, gathers = [], [], []
  for s in range(p):
    neighbours = [plan.stages[(s + 1) % p], plan.stages[(s - 1) % p]]
    gather = 0.0
    if split and not plan.sequence_parallel and p > 1:
      gather = max(comm.allreduce(g, act) for g in plan.tensor_groups(s)) / 2
    gathers.append(gather)
    transfer.append(
      max(comm.p2p(a, z, sent) for other in neighbours for a, z in zip(plan.stages[s], other))
      + gather
      if p > 1
      else 0.0
    )
    partner = plan.stages[p - 1 - s]
    evict.append(max(comm.p2p(a, z, stash_set) for a, z in zip(plan.stages[s], partner)))
  # One ppermute per stage offset the placement uses (+1 and -1 around the
  # ring: one at p = 2) runs in every tick, one after the other.
  program_ = plan.lowered
  offsets = [o for o in program_.offsets if o]
  return transfer, evict, len(offsets) * max(transfer) if p > 1 else 0.0, gathers


def sequence_parallel_regathers(plan: Plan, comm: Comm, stage: int, act: float) -> float:
  """Seconds the backward of one layer on `stage` adds under sequence
  parallelism: the all-gathers of the normed stream [b, s/c, h] (`act`
  bytes whole) before the weight gradients of the two column-parallel
  regions, attention's Q/K/V and the MLP's first matmuls. common.project
  keeps that stream split along the sequence and gathers it again in the
  backward, as Megatron's SP does; under full remat the rerun forward
  gathers it (priced with its all-reduces) and the backward keeps that."""
  if not plan.sequence_parallel or plan.tensor == 1 or plan.remat == 'full':
    return 0.0
  return 2 * max(comm.allgather(g, act) for g in plan.tensor_groups(stage))


def context_seconds(
  plan: Plan, shard: profile_lib.Shard, comm: Comm, stage: int, fwd: float
) -> tuple[float, float]:
  """Seconds context parallelism adds to one layer's forward and backward on
  `stage`, whose forward computes for fwd (0, 0 with context = 1).

  allgather: the forward all-gathers K and V over each context group (the
  whole sequence's, b kv_per_seq; each device receives (c-1)/c of it), the
  backward reduce-scatters their gradients; nothing overlaps them. ring: c-1
  passes of one K/V block (1/c of it) to the next rank, each beside the
  attention of the block in hand (the layer's attention_fraction of its
  compute, over c blocks): only max(0, pass - block) shows; the backward's
  passes carry K/V and their gradients beside twice the work (the
  attention core's backward: two gradient matmuls per forward one). A remat
  policy that checkpoints the layer (dots, full) reruns its forward's
  communication in the backward; attention's checkpoint holds the core
  alone, which the gathered K/V (or the ring's blocks, recomputed by its
  own backward) enter.
  """
  c = plan.context
  if c == 1:
    return 0.0, 0.0
  window = shard.window
  forward, backward = _context_kind(plan, shard, comm, stage, fwd, c)
  if window is not None and window.steps(c) < c:
    # Local layers meet only the blocks in reach (model/window.py), fetched
    # straight from their ranks by both kinds; global ones as above.
    near = _context_kind(plan, shard, comm, stage, fwd, window.steps(c), fetched=True)
    share = window.local_share
    forward = share * near[0] + (1 - share) * forward
    backward = share * near[1] + (1 - share) * backward
  rerun = forward if plan.remat in profile_lib.LAYER_CHECKPOINTED else 0.0
  return forward, backward + rerun


def context_compute_share(plan: Plan, shard: profile_lib.Shard) -> float:
  """The share of a layer's compute a context rank runs: all of it, but with
  a sliding window the attention core's blocks out of every local query's
  reach, which both kinds skip (model/window.py's ring_steps); the core is
  the layer's attention_fraction, local layers window.local_share of them."""
  window, c = shard.window, plan.context
  if c == 1 or window is None:
    return 1.0
  skipped = 1.0 - window.steps(c) / c
  return 1.0 - shard.attention_fraction * window.local_share * skipped


def _context_kind(plan: Plan, shard, comm: Comm, stage: int, fwd: float, steps: int, fetched=False):
  """(forward, backward) seconds of one layer's context communication meeting
  `steps` K/V blocks (its own included): `context_seconds`'s kinds, or with
  `fetched` (a window's blocks) steps - 1 blocks moved one at a time, beside
  nothing for the all-gather kind and beside a block's work for the ring;
  the backward sends their gradients home."""
  c = plan.context
  kv = shard.kv_per_seq * plan.microbatch_size
  rings = plan.context_groups(stage)
  if plan.context_attention == 'allgather' and not fetched:
    return max(comm.allgather(g, kv) for g in rings), max(comm.reduce_scatter(g, kv) for g in rings)
  block = 0.0 if plan.context_attention == 'allgather' else fwd * shard.attention_fraction / c
  forward = (steps - 1) * max(0.0, max(comm.ring_step(g, kv / c) for g in rings) - block)
  backward = (steps - 1) * max(0.0, max(comm.ring_step(g, 2 * kv / c) for g in rings) - 2 * block)
  return forward, backward


@dataclasses.dataclass(frozen=True)
class Sharing:
  """Devices that share cores (and then one memory system).

  nodes: per sharing node, how many devices of each stage are on it. A
  phase on such a node lasts at least the sum, over its busy devices, of
  the node capacity each takes (ActionCosts.share).
  """

  nodes: tuple[tuple[int, ...], ...]

  def tick(self, work: Sequence[float], share: Sequence[float] | None = None) -> float:
    """Time of a phase in which stage s is busy work[s] seconds if it had its
    devices to itself, taking share[s] seconds of its node's capacity per
    device."""
    longest = max(work, default=0.0)
    if not share:
      return longest
    crowded = [sum(n * x for n, x in zip(per_stage, share)) for per_stage in self.nodes]
    return max([longest] + crowded)


def sharing(plan: Plan, cluster: Cluster) -> Sharing:
  """The plan's devices per stage on each node whose devices share cores."""
  nodes = []
  for node in cluster.nodes:
    if not node.shared_cores:
      continue
    per_stage = tuple(
      sum(cluster.devices[d].node == node.name for d in stage) for stage in plan.stages
    )
    if any(per_stage):
      nodes.append(per_stage)
  return Sharing(nodes=tuple(nodes))


class PlanTickCosts:
  """A plan's ActionCosts and core sharing as a lockstep cost model
  (`simulate.TickCosts`).

  A stage's action costs its chunk's time; a tick's compute lasts as long
  as the busiest stage, or longer where stages share cores (`Sharing.tick`);
  its send phase is `simulate.send_phase` with the executor's per-tick
  neighbour ppermutes (`tick_transfer`) as the floor, and a tick where
  residual sets move opens with `simulate.move_phase`. With the stash in
  host memory, every tick copies a set each way beside its compute, and
  lasts at least that copy (plan/cost/host.py).
  """

  def __init__(self, costs: ActionCosts, share: Sharing = Sharing(()), packed: bool = False):
    self.costs, self.share, self.packed = costs, share, packed

  def duration(self, stage: int, action: Action) -> float:
    # A packed program's send phase is its ppermutes; an action that reads a
    # message gathers it (all F but chunk 0's, and every B).
    reads = action.kind == sched.BACKWARD or (action.kind == sched.FORWARD and action.chunk > 0)
    gather = self.costs.gather[stage] if self.packed and reads and self.costs.gather else 0.0
    return self.costs.of(action) + gather

  def overlapped(self, stage: int, actions: Sequence[Action]) -> float:
    # The plan's costs hold each action's all-to-all inside its time, not
    # apart: a fused tick is charged their sum, with nothing hidden.
    return sum(self.costs.of(a) for a in actions)

  def tick_time(self, tick: simulate.Tick, work: Sequence[float]) -> float:
    shares = [
      sum(self.costs.share_of(a) for a in tick.actions(s)) for s in range(len(tick.compute))
    ]
    # An offloaded stash copies a set each way in every tick (a round's each).
    return max([self.share.tick(work, shares), *(h * tick.span for h in self.costs.host)])

  def transfer(self, tick: simulate.Tick) -> float:
    if not isinstance(tick, simulate.Round):
      return simulate.send_phase(tick, self.costs.transfer, self.costs.tick_transfer)
    # A packed round's send: one ppermute per offset its messages use (the
    # gathers are the reading actions').
    gather = self.costs.gather or (0.0,) * len(self.costs.transfer)
    ppermute = [x - g for x, g in zip(self.costs.transfer, gather)]
    return simulate.send_phase(tick, ppermute, max(ppermute, default=0.0) * len(tick.offsets))

  def move(self, tick: simulate.Tick) -> float:
    return simulate.move_phase(tick, self.costs.evict)

  def copy(self, stage: int, action: Action) -> float:
    return self.costs.evict[stage]


def simulate_lockstep(
  program_: sched.Program, costs: ActionCosts, share: Sharing = Sharing(())
) -> simulate.Result:
  """Times the executor's lockstep ticks with this plan's costs: the one
  lockstep model (`simulate.simulate_lockstep`) over `PlanTickCosts`."""
  return simulate.simulate_lockstep(program_, PlanTickCosts(costs, share, program_.packed))


def simulate_async(plan: Plan, costs: ActionCosts, share: Sharing = Sharing(())) -> simulate.Result:
  """The papers' model: simulate.simulate_async of the schedule as built,
  with each stage's chunk costs summed (a fused schedule's B is the whole
  backward, `ActionCosts.fused`), floored by the core-sharing bound over the
  whole step."""
  p, v = plan.pipe, plan.virtual_stages
  schedule = plan.lowered.source  # a synthesised one too
  per = []
  for s in range(p):
    mine = schedule.chunks_of(s)
    if schedule.split_backward:
      backward = sum(costs.chunk[c][sched.BACKWARD] for c in mine)
      weight = sum(costs.chunk[c][sched.WEIGHT] for c in mine)
    else:
      backward, weight = sum(costs.fused_backward(c) for c in mine), 0.0
    per.append(
      simulate.Costs(
        t_forward=sum(costs.chunk[c][sched.FORWARD] for c in mine),
        t_backward=backward,
        t_weight=weight,
        t_transfer=costs.transfer[s],
        t_evict=costs.evict[s] * v,
      )
    )
  if costs.host:
    # Each chunk action copies one set over the host link beside it (F out, B
    # and W in); the stage's costs are its v chunks' (as t_evict).
    kinds = ('t_forward', 't_backward') + (('t_weight',) if schedule.split_backward else ())
    per = [
      dataclasses.replace(c, **{k: max(getattr(c, k), costs.host[s] * v) for k in kinds})
      for s, c in enumerate(per)
    ]
  result = simulate.simulate_async(schedule, per)
  if share.nodes:
    m = plan.microbatches
    work = [m * (c.t_forward + c.t_backward + c.t_weight) for c in per]
    shares = (
      [m * sum(sum(costs.share[c].values()) for c in schedule.chunks_of(s)) for s in range(p)]
      if costs.share
      else None
    )
    floor = share.tick(work, shares)
    if floor > result.total_time:
      result = dataclasses.replace(result, total_time=floor)
  return result


def simulate_plan(
  plan: Plan, profile: Profile, cluster: Cluster, options: Options = Options()
) -> Estimate:
  """Predicts step time (both models) and memory of `plan` on `cluster`."""
  p, m = plan.pipe, plan.microbatches
  uses_executor = plan.uses_executor
  prog = plan.lowered
  costs = action_costs(plan, profile, cluster, options)
  share = sharing(plan, cluster)
  lock = simulate_lockstep(prog, costs, share)
  asy = simulate_async(plan, costs, share)
  mem, cap, _, step_mem, state_mem, parts = memory_lib.memory(
    plan, profile, cluster, options, prog if uses_executor else None
  )
  tail, dp_total = _tail(plan, profile, cluster, options, share, prog if uses_executor else None)
  if edges_after_loop(plan, profile, options):
    tail += edge_seconds_after_loop(plan, profile, cluster)
  tail += host_lib.optimizer_seconds(plan, profile, cluster, options)
  if options.dp_allreduce == 'per_microbatch' and plan.state_sharding == 'replicated':
    comm = Comm(cluster, profile)
    shard = profile.shards[plan.tensor]
    dp_total = m * max(
      comm.allreduce(g, experts_lib.layer_params(plan, shard) * plan.layers[s])
      for s in range(p)
      for g in plan.gradient_groups(s)
    )
  chosen = lock if options.model == 'lockstep' else asy
  return Estimate(
    plan=plan,
    step_time=chosen.total_time + tail,
    model=options.model,
    lockstep_time=lock.total_time + tail,
    async_time=asy.total_time + tail,
    pipeline_time=chosen.total_time,
    bubble_fraction=chosen.bubble_fraction,
    tail_time=tail,
    dp_allreduce_time=dp_total,
    memory=mem,
    capacity=cap,
    oom=any(x > c for x, c in zip(mem, cap)),
    result=chosen,
    step_memory=step_mem,
    state_memory=state_mem,
    memory_parts=parts,
  )


def _tail(
  plan: Plan,
  profile: Profile,
  cluster: Cluster,
  options: Options,
  share: Sharing,
  program_: sched.Program | None,
) -> tuple[float, float]:
  """Seconds outside the pipeline's ticks, and the per-step DP collectives in them.

  The embedding/head gradient psum over `pipe`, the per-step DP collectives
  (`_data_collectives`), the optimizer update, and the executor's buffer traffic
  that the profiled functions do not include: its stash pool and ring
  buffers zeroed at the start of each step, and each forward's residual set
  copied into its stash slot. The last two move bytes only, which devices
  sharing a memory system do one at a time (the node's total bandwidth).
  """
  comm = Comm(cluster, profile)
  shard = profile.shards[plan.tensor]
  p = plan.pipe
  # The executor psums the embedding and head gradients over `pipe`.
  edge = 0.0
  if p > 1:
    ranks = len(plan.stages[0])
    edge = max(
      comm.allreduce([stage[r] for stage in plan.stages], shard.edge_param_bytes)
      for r in range(ranks)
    )
  dp = max(_data_collectives(plan, shard, comm, options, s) for s in range(p))
  widest = max(plan.chunk_layers)
  v = plan.virtual_stages
  # A sharded state's update runs on each replica's 1/data share.
  updated = 1.0 if plan.state_sharding == 'replicated' else 1.0 / plan.data
  moving, shares = [], []
  for s, stage in enumerate(plan.stages):
    held = widest * v if options.padded else plan.layers[s]
    layer = experts_lib.layer_params(plan, shard)
    nbytes = OPTIMIZER_TRAFFIC * updated * (layer * held + shard.edge_param_bytes)
    if program_ is not None:
      chunk = widest if options.padded else plan.layers[s] // v
      # Every pool zeroed once, and each F's residuals and each B's cut
      # written into their slots.
      nbytes += sum(memory_lib.pools(plan, profile, options, program_, s, chunk).values())
      nbytes += (
        plan.microbatches
        * v
        * (
          memory_lib.chunk_stash(plan, profile, chunk) + memory_lib.chunk_cut(plan, profile, chunk)
        )
      )
    groups = [cluster.groups[cluster.devices[d].group] for d in stage]
    moving.append(max(nbytes / roofline.bandwidth(profile, g) for g in groups))
    # On a node whose devices share one memory system, all of them together
    # move bytes at the node's bandwidth (measured here; the spec's otherwise).
    shares.append(
      max(
        nbytes / (profile.machine.node_bandwidth if g.local else g.memory_bandwidth) for g in groups
      )
    )
  memory_time = share.tick(moving, shares) if share.nodes else max(moving)
  return edge + dp + memory_time, dp


def _data_collectives(
  plan: Plan, shard: profile_lib.Shard, comm: Comm, options: Options, stage: int
) -> float:
  """Seconds of the per-step collectives of stage `stage` (see the module
  docstring): the gradient all-reduce of a replicated state over data x
  context (if modelled per step); for a sharded state, over each data
  group: ZeRO-1's reduction (a reduce-scatter, or the executor's
  all-reduce) and parameter all-gather; FSDP's gather before the
  executor's tick loop and its all-reduce after, or without the executor
  what its per-layer gathers and reduce-scatters leave exposed; and, with
  context > 1, the gradient's all-reduce over context first (context ranks
  hold the same share)."""
  whole = experts_lib.layer_params(plan, shard) * plan.layers[stage] + shard.edge_param_bytes
  kind = plan.state_sharding
  if kind == 'replicated':
    if options.dp_allreduce != 'per_step':
      return 0.0
    return max(comm.allreduce(g, whole) for g in plan.gradient_groups(stage))
  context = max(comm.allreduce(g, whole) for g in plan.context_groups(stage))
  if plan.fsdp_per_layer:
    # The layers' own are in their actions; only the edges' gradient is left.
    context = max(comm.allreduce(g, shard.edge_param_bytes) for g in plan.context_groups(stage))
  return context + max(_data_group(plan, shard, comm, g, whole) for g in plan.data_groups(stage))


def _data_group(plan: Plan, shard: profile_lib.Shard, comm: Comm, group, whole: float) -> float:
  """A sharded state's per-step collectives over one data group (`_data_collectives`)."""
  if plan.state_sharding == 'zero1':
    reduce = comm.allreduce if plan.uses_executor else comm.reduce_scatter
    return reduce(group, whole) + comm.allgather(group, whole)
  if plan.uses_executor:
    return comm.allgather(group, whole) + comm.allreduce(group, whole)
  # The layers' own are in their actions; the embedding's and head's weights
  # are gathered for the forward and the backward and their gradient
  # reduce-scattered, none of it hidden.
  edge = shard.edge_param_bytes
  return 2 * comm.allgather(group, edge) + comm.reduce_scatter(group, edge)
