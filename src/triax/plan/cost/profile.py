"""What a plan is made of: the model's cost figures per tensor shard and the time model.

A `Profile` holds, for each tensor degree t the planner considers, a `Shard` of one layer
(what one device of a t-way tensor-parallel group computes: num_heads/t heads, d_ff/t MLP
columns, vocab_size/t vocabulary rows): its FLOPs and bytes per function, its parameter,
residual and activation bytes, and how long each function takes. Two sources fill it:
plan/cost/profiler.py measures the model here (times at the sizes measured, interpolated
by `Profile.local_seconds`, and fits time = c0 + k * max(flops / peak, bytes / bandwidth)
that the roofline carries to other devices); plan/cost/analytic.py prices every kernel
from shapes and data sheets (`Profile.analytic`). `synthetic` makes one up for tests.

Invariant: figures are per block. A model whose stack entry holds n blocks
(model.moe_every = n) is profiled as one entry and every per-layer figure is the entry's
over n, the average block; the pipeline cuts chunks between entries, so a stage's blocks
times the average is their exact sum. Costs paid once per entry say so
(`Profile.layers_per_entry`), and the experts' all-to-alls count 1/n per layer
(`Experts.every`). Plain data and arithmetic: no JAX. Why: docs/design/planner_costs.md."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from triax.model import window as window_lib
from triax.plan.cluster import Link

# Residual policies the model knows (config.REMAT_POLICIES, a test holds them equal), in
# order of more recompute: none; attention (Megatron's selective: the attention
# core's scores); dots (all but the weight matmuls' outputs); full (all but
# the layer's input).
REMATS = ('none', 'attention', 'dots', 'full')
# The policies whose layer runs under one checkpoint (model.common.layer_checkpointed),
# so that its backward reruns the forward's collectives with the rest: K/V's
# gathers, the experts' all-to-alls. `attention`'s checkpoint holds the
# attention core alone.
LAYER_CHECKPOINTED = ('dots', 'full')
# Functions whose time is fitted: chunk forward and backward per layer, the
# embedding's forward+backward, the head's loss+gradient.
FUNCTIONS = ('layer_fwd', 'layer_bwd', 'embed', 'head')
# The layer functions, whose fits are per remat policy (see `variant`).
LAYER_FUNCTIONS = ('layer_fwd', 'layer_bwd')
# Per remat policy, how many [s, d] activations of a layer's residuals lie
# outside the tensor-parallel matmuls, so every tensor rank holds them whole
# (Korthikanti et al. 2022, Sec. 4.2.2, without dropout: the two norms'
# inputs and the two matmul inputs they produce, which `attention` keeps
# too; dots keeps the layer's input and the attention's output projection,
# from which the rest is recomputed (plan/cost/analytic.py); full remat
# keeps only the layer's input). Sequence parallelism splits them over
# `tensor`.
SEQUENCE_STASH = {'none': 4, 'attention': 4, 'dots': 2, 'full': 1}


def variant(function: str, remat: str) -> str:
  """The fits key of `function` under a remat policy: 'layer_bwd/full';
  remat 'none' and the embedding and head keep their plain names."""
  if remat == 'none' or function not in LAYER_FUNCTIONS:
    return function
  return f'{function}/{remat}'


# Executor variants of a layer, timed once (largest size, smallest degree,
# no remat) as ratios to its plain forward+backward:
#   split_b / split_w: the executor's B (input gradient and cut) and W
#     (weight gradients from the cut), each run on its own as its branch
#     runs it, over the pair's backward part;
#   cond_active / cond_skipped: a layer of an uneven split's padded stack,
#     run under `cond` (forward+backward), and a padding layer it skips;
#   stackN_fwd / stackN_bwd (N in STACK_LENGTHS): a layer's forward and
#     backward in a chunk of N layers over its time in the profile's
#     2-layer one. XLA:CPU runs a 1-layer chunk without a loop, and faster
#     than a scanned layer, which a profile of
#     scanned layers overcharges every 1-layer chunk for (pipe = 8 of 8
#     layers, or v = 2 of 4 per stage).
#   Split and chunk-length ratios are measured again per remat policy,
#   named NAME/POLICY ('split_b/full'): under remat, B reruns the forward
#   and hands W what it rematerialised, so the halves are not remat none's.
STACK_LENGTHS = (1, 4)
EXECUTOR_RATIOS = ('split_b', 'split_w', 'cond_active', 'cond_skipped') + tuple(
  f'stack{n}_{part}' for n in STACK_LENGTHS for part in ('fwd', 'bwd')
)


@dataclasses.dataclass(frozen=True)
class Work:
  """FLOPs and bytes of one function on a micro-batch of b sequences.

  XLA's counts are linear in b at a fixed shard: flops = b * flops_per_seq,
  bytes = bytes_fixed (weights) + b * bytes_per_seq (activations).
  """

  flops_per_seq: float
  bytes_fixed: float
  bytes_per_seq: float

  def flops(self, b: int) -> float:
    return b * self.flops_per_seq

  def bytes(self, b: int) -> float:
    return self.bytes_fixed + b * self.bytes_per_seq


@dataclasses.dataclass(frozen=True)
class Experts:
  """A mixture-of-experts layer's routed experts on one tensor shard
  (model/mixtral.py, model/moe.py): what expert parallelism splits and what
  its all-to-alls move (plan/cost/experts.py prices them). None on a Shard:
  a dense layer.

  Attributes:
    num_experts: E, routed experts per layer.
    per_token: k, the experts each token runs.
    dispatch: model.moe_dispatch, 'dropless' or 'capacity'.
    capacity_factor: model.capacity_factor (capacity dispatch's buffers).
    seq_len, d_model: positions per sequence and the token width the
      all-to-alls carry (whole on every tensor rank: moe.TOKENS).
    hidden: one expert's hidden units on this shard (`expert_width` / t).
    dtype_bytes: bytes of an activation element.
    param_bytes: the routed experts' parameter bytes of one layer shard
      (3 E d hidden weights; over `every` of an average block), what
      mesh.expert splits.
    fraction: share of the shard's layer forward FLOPs in the k routed
      experts' matmuls (the part expert load imbalance slows).
    every: model.moe_every, one layer in `every` a MoE layer: the figures
      above are of the average layer, and a layer runs 1/every of a MoE
      layer's all-to-alls and exchanged rows (plan/cost/experts.py).
  """

  num_experts: int
  per_token: int
  dispatch: str
  capacity_factor: float
  seq_len: int
  d_model: int
  hidden: int
  dtype_bytes: int
  param_bytes: float
  fraction: float
  every: int = 1


def experts_of(shard_spec, layer_flops: float) -> Experts | None:
  """The Experts of a tensor shard's spec (ModelSpec.tensor_shard), None for
  a family without them; layer_flops: the shard's layer forward FLOPs per
  sequence, active experts only (the family's forward_flops: with
  model.moe_every = n, of the average block, as the routed ones here)."""
  if 'num_experts' not in type(shard_spec).config_fields():
    return None
  s, d, f = shard_spec.seq_len, shard_spec.d_model, expert_width(shard_spec)
  k, e = shard_spec.experts_per_token, shard_spec.num_experts
  every = shard_spec.moe_every
  # A SwiGLU expert is three d x f matmuls a token runs through, k of them.
  routed = 2.0 * s * 3 * d * f * k / every
  return Experts(
    num_experts=e,
    per_token=k,
    dispatch=shard_spec.moe_dispatch,
    capacity_factor=float(shard_spec.capacity_factor),
    seq_len=s,
    d_model=d,
    hidden=f,
    dtype_bytes=np.dtype(shard_spec.dtype).itemsize,
    param_bytes=float(3 * e * d * f * np.dtype(shard_spec.param_dtype).itemsize) / every,
    fraction=min(routed / layer_flops, 1.0) if layer_flops > 0 else 0.0,
    every=every,
  )


def expert_width(spec) -> int:
  """A routed expert's hidden units on a shard of `spec`: model.moe_d_ff
  where the family reads it (DeepSeek's fine-grained experts; 0 means
  d_ff), else d_ff (Mixtral's experts are its MLP's width)."""
  if 'moe_d_ff' in type(spec).config_fields():
    return spec.moe_d_ff or spec.d_ff
  return spec.d_ff


@dataclasses.dataclass(frozen=True)
class Shard:
  """Cost figures of one tensor shard (degree `tensor`).

  Attributes:
    tensor: the tensor-parallel degree t.
    work: function name (FUNCTIONS) -> Work; layer_* are per layer.
    layer_param_bytes: parameters of one layer's shard.
    edge_param_bytes: embedding + head parameters' shard (every pipeline stage
      holds them: the executor replicates them over `pipe`).
    stash_per_seq: remat policy -> residual bytes per layer per sequence.
    stash_fixed_per_seq: residual bytes per chunk per sequence not tied to a
      layer (the chunk's input).
    act_per_seq: bytes of one activation [s, d] (a pipeline transfer, a
      Megatron all-reduce, an act/grad buffer slot), per sequence.
    logits_per_seq: bytes of one sequence's fp32 logits shard that live at
      once: [s, V/t], or [loss_chunk, V/t] with model.loss_chunk.
    attention_fraction: share of a layer's forward FLOPs in the attention
      core, which the dots policy recomputes in the backward (attention
      its scores, half of them).
    kv_per_seq: bytes of one layer's K and V per sequence on this shard
      (2 s kv_heads/t head_dim e; every K/V head where they are fewer than
      t): what context parallelism gathers or passes around its ring.
    experts: a MoE layer's routed experts (`Experts`), None for a dense one.
    cut_per_seq: bytes per layer per sequence of every weight matmul's input
      and output cotangent (what a B/W cut keeps for W, memory.chunk_cut); 0:
      estimated from the dots stash (a measured profile's).
    sequence_stash_per_seq: remat policy -> the bytes of stash_per_seq every
      tensor rank holds whole, which sequence parallelism splits; a policy
      not in it: SEQUENCE_STASH's activations (see `sequence_stash`).
    table_bytes: the embedding's own parameters' shard (its vocabulary
      table, the head's weight's shape; GPT's positions too), not its
      blocks'; 0: not known (a measured profile's, see memory.head_weight).
    edge_blocks: (the embedding's, the head's) blocks of their own: the
      first stage runs DeepSeek's first dense blocks in its embedding, the
      last its MTP modules in its head. Their work is in `work['embed']`
      and `work['head']`, their parameters in edge_param_bytes; the
      simulator adds their collectives (a layer's each).
    edge_expert_param_bytes: of edge_param_bytes, the routed experts' (an
      MTP module's MoE block): split over mesh.expert as the layers' are.
    edge_work_per_seq: remat policy -> bytes per sequence the edges' own
      blocks hold while their backward runs (their residuals, and an MTP
      module's whole fp32 logits), the larger edge's; {}: none.
  """

  tensor: int
  work: dict[str, Work]
  layer_param_bytes: float
  edge_param_bytes: float
  stash_per_seq: dict[str, float]
  stash_fixed_per_seq: float
  act_per_seq: float
  logits_per_seq: float
  attention_fraction: float
  kv_per_seq: float = 0.0
  experts: Experts | None = None
  cut_per_seq: float = 0.0
  sequence_stash_per_seq: dict[str, float] = dataclasses.field(default_factory=dict)
  table_bytes: float = 0.0
  edge_blocks: tuple[int, int] = (0, 0)
  edge_expert_param_bytes: float = 0.0
  edge_work_per_seq: dict[str, float] = dataclasses.field(default_factory=dict)
  window: Window | None = None

  def sequence_stash(self, remat: str) -> float:
    """The part of stash_per_seq[remat] every tensor rank holds whole
    (sequence_stash_per_seq's, else the SEQUENCE_STASH activations), bounded
    by the stash itself."""
    whole = self.sequence_stash_per_seq.get(remat, SEQUENCE_STASH[remat] * self.act_per_seq)
    return min(self.stash_per_seq[remat], whole)


@dataclasses.dataclass(frozen=True)
class Window:
  """A model's sliding window (model.sliding_window) as the planner prices it.

  Attributes:
    seq_len: the sequence's positions.
    size: the window's positions.
    local_share: the share of the layers that are local (the rest global).
  """

  seq_len: int
  size: int
  local_share: float

  def steps(self, context: int) -> int:
    """K/V blocks (its own included) a local layer's context rank meets: the
    ring steps the window reaches (model/window.py)."""
    return len(window_lib.ring_steps(context, self.seq_len // context, self.size))


def window_of(spec) -> Window | None:
  """The spec's Window (a model.common.ModelSpec), None without local layers."""
  local = spec.local_layers()
  if local is None:
    return None
  return Window(spec.seq_len, spec.sliding_window, sum(local) / len(local))


def kv_per_seq(spec, t: int) -> float:
  """Shard.kv_per_seq of a model spec (model.common.ModelSpec) at degree t:
  K and V of one layer, one sequence, a tensor rank's K/V heads (all of
  them where there are fewer than t: each rank then computes them whole).
  MLA's too: context parallelism moves every head's keys and values made
  from the latent (kv_heads = num_heads, head_dim the query's width, to
  which the values are padded), never the latent itself."""
  kv = spec.kv_heads // t if spec.kv_heads >= t else spec.kv_heads
  return float(2 * spec.seq_len * kv * spec.head_dim * np.dtype(spec.dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class Fit:
  """time = c0 + k * roofline_time; 1/k is the roofline efficiency.

  cores: devices' worth of this function that run at once when every local
  device runs it (N * solo time / all-N time, at most N); None when not
  measured (one local device, or a synthetic profile).
  """

  c0: float
  k: float
  cores: float | None = None

  @property
  def efficiency(self) -> float:
    return 1.0 / self.k


@dataclasses.dataclass(frozen=True)
class Machine:
  """The local backend as measured.

  Attributes:
    backend: jax.default_backend().
    device_kind: jax.devices()[0].device_kind.
    num_devices: local devices.
    matmul_flops: FLOP/s of a large dense matmul at the model dtype.
    memory_bandwidth: bytes/s one device reads plus writes in a large
      elementwise op (64 MiB, past the caches) into a fresh output.
    node_bandwidth: the same, summed over all local devices doing it at once:
      equal to memory_bandwidth when devices share one memory system (forced
      CPU devices), N times it when each has its own.
    effective_cores: devices' worth of in-cache compute when all local
      devices compute at once (N * solo time / together time); a reference
      figure: the simulator uses each function's own (Fit.cores).
    p2p: ppermute fit on the local mesh.
    allreduce: ring all-reduce fit on the local mesh (latency per step,
      bus bandwidth), see `allreduce_time`.
  """

  backend: str
  device_kind: str
  num_devices: int
  matmul_flops: float
  memory_bandwidth: float
  node_bandwidth: float
  effective_cores: float
  p2p: Link
  allreduce: Link


@dataclasses.dataclass(frozen=True)
class Point:
  """One measurement and what the fitted model says for it.

  function is a fits key (`variant`); seconds solo, concurrent with every
  local device running the same function at once (0 if one device).
  """

  function: str
  microbatch: int
  tensor: int
  seconds: float
  fitted: float
  flops: float
  concurrent: float = 0.0


@dataclasses.dataclass(frozen=True)
class Profile:
  """Everything the simulator needs to know about the model and this machine.

  Plain data: tests build synthetic ones, and it prints as JSON.

  Attributes:
    seq_len, d_model, num_layers, dtype_bytes: from the model config.
    shards: tensor degree -> Shard.
    fits: function -> Fit (local time model); the layer functions also under
      each remat policy measured (keys from `variant`).
    machine: the local backend.
    points: the measurements behind the fits.
    wall_s: seconds the profiling took (0 if from the cache).
    layers_per_entry: blocks one entry of the model's layer stack holds
      (ModelSpec.layers_per_entry): the per-layer figures are the average of
      an entry's blocks (see the module docstring).
  """

  seq_len: int
  d_model: int
  num_layers: int
  dtype: str
  shards: dict[int, Shard]
  fits: dict[str, Fit]
  machine: Machine
  points: tuple[Point, ...] = ()
  wall_s: float = 0.0
  # What the executor does beyond plain layers, as ratios to one layer's
  # forward+backward measured alongside (alone, all devices at once); see
  # EXECUTOR_RATIOS. Empty: not measured (synthetic profiles).
  ratios: dict = dataclasses.field(default_factory=dict)
  # The analytic device model (plan/cost/analytic.py) when the profile was built
  # from shapes and data sheets instead of measured: roofline asks it for
  # every time. None: measured here.
  analytic: Any = None
  layers_per_entry: int = 1

  def fitted_seconds(self, function: str, b: int, t: int) -> float:
    """The fit's time of `function` (a fits key) on b sequences at degree t;
    a remat variant's roofline is its plain function's."""
    w = self.shards[t].work[function.split('/')[0]]
    fit = self.fits[function]
    return fit.c0 + fit.k * max(
      w.flops(b) / self.machine.matmul_flops, w.bytes(b) / self.machine.memory_bandwidth
    )

  def local_seconds(self, function: str, b: int, t: int, *, concurrent: bool = False) -> float:
    """Time of `function` (a fits key) on b sequences at degree t on this
    machine: alone, or (concurrent) while every local device runs it too.

    Where that degree was measured, the measurements are interpolated
    linearly in b (extrapolated along the nearest two sizes; one size:
    scaled as the fit scales). A degree measured at fewer sizes than the
    smallest one borrows that degree's curve: its own ratio to it,
    interpolated between its sizes, times the smallest degree's time at b.
    Elsewhere: the fit, slowed by the function's measured core sharing when
    concurrent.
    """

    def curve(t_):
      found = sorted(
        (pt.microbatch, pt.concurrent if concurrent else pt.seconds)
        for pt in self.points
        if pt.function == function and pt.tensor == t_
      )
      return [(x, y) for x, y in found if y > 0]

    def line(points, b):
      xs = [x for x, _ in points]
      i = min(max(np.searchsorted(xs, b) - 1, 0), len(points) - 2)
      (b0, y0), (b1, y1) = points[i], points[i + 1]
      return max(y0 + (y1 - y0) * (b - b0) / (b1 - b0), 0.1 * min(y0, y1))

    measured = curve(t)
    fit = self.fitted_seconds(function, b, t)
    if not measured:
      cores = self.fits[function].cores
      n = self.machine.num_devices
      return fit * n / cores if concurrent and cores else fit
    if len(measured) == 1:
      ((b0, y0),) = measured
      return y0 * fit / self.fitted_seconds(function, b0, t)
    base = curve(min(pt.tensor for pt in self.points if pt.function == function))
    shape = dict(base)
    if len(base) > len(measured) and all(x in shape for x, _ in measured):
      return line([(x, y / shape[x]) for x, y in measured], b) * line(base, b)
    return line(measured, b)


def synthetic(
  *,
  layer_fwd: float = 1.0,
  layer_bwd: float = 2.0,
  embed: float = 0.0,
  head: float = 0.0,
  tensors: Sequence[int] = (1,),
  num_layers: int = 4,
  layer_param_bytes: float = 0.0,
  edge_param_bytes: float = 0.0,
  stash_per_seq: float = 0.0,
  act_per_seq: float = 0.0,
  kv_per_seq: float = 0.0,
  machine: Machine | None = None,
  experts: Experts | None = None,
) -> Profile:
  """A made-up profile for tests and what-ifs: each function takes the given
  seconds per sequence at t=1 (1/t of it at degree t) and its FLOPs are that
  many "FLOPs" on a machine of 1 FLOP/s; bytes are the given sizes (the
  parameters' and K/V's at t=1, 1/t of them at degree t; so are the experts'
  hidden units and parameters, `experts` being the t=1 shard's)."""
  machine = machine or Machine(
    backend='synthetic',
    device_kind='synthetic',
    num_devices=1,
    matmul_flops=1.0,
    memory_bandwidth=math.inf,
    node_bandwidth=math.inf,
    effective_cores=1.0,
    p2p=Link(math.inf, 0.0),
    allreduce=Link(math.inf, 0.0),
  )
  seconds = dict(layer_fwd=layer_fwd, layer_bwd=layer_bwd, embed=embed, head=head)
  shards = {
    t: Shard(
      tensor=t,
      work={
        f: Work(flops_per_seq=x / t * machine.matmul_flops, bytes_fixed=0.0, bytes_per_seq=0.0)
        for f, x in seconds.items()
      },
      layer_param_bytes=layer_param_bytes / t,
      edge_param_bytes=edge_param_bytes / t,
      stash_per_seq={r: stash_per_seq for r in REMATS},
      stash_fixed_per_seq=0.0,
      act_per_seq=act_per_seq,
      logits_per_seq=0.0,
      attention_fraction=0.0,
      kv_per_seq=kv_per_seq / t,
      experts=experts
      and dataclasses.replace(
        experts, hidden=experts.hidden // t, param_bytes=experts.param_bytes / t
      ),
    )
    for t in tensors
  }
  return Profile(
    seq_len=1,
    d_model=1,
    num_layers=num_layers,
    dtype='float32',
    shards=shards,
    fits={f: Fit(0.0, 1.0) for f in FUNCTIONS},
    machine=machine,
  )


def measure(
  model_cfg,
  tensors: Sequence[int],
  microbatches: Sequence[int],
  remats: Sequence[str] = REMATS,
  progress: Callable[[str], None] | None = None,
) -> Profile:
  """Profiles config.model on this machine (plan/cost/profiler.py, where JAX is
  imported); see `profiler.measure` for the arguments."""
  from triax.plan.cost import profiler

  return profiler.measure(model_cfg, tensors, microbatches, remats, progress)
