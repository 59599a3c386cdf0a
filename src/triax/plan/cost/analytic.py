"""The analytic device model: a plan's costs from shapes and data sheets, nothing run here.

`build(model_cfg, tensors)` returns the same `Profile` the local profiler measures, with an
`Analytic` cost model attached that `roofline.seconds` and `roofline.layer_seconds` ask
instead of the fits, so the search, simulator, memory model and reports run unchanged on a
model or device type this machine cannot run (`triax plan --profile=analytic`).

A layer shard (tensor degree t) is a list of `Kernel`s per micro-batch: the GEMMs of the
family's own parameter shapes (`jax.eval_shape`, no compute; routed experts by their active
FLOPs), the attention core (or one fused cuDNN kernel) and the bandwidth-bound norms,
residual adds, activations and softmax. On a device group a kernel takes

  max(flops / (peak * matmul_efficiency), bytes / memory_bandwidth)

plus the group's `overhead_per_layer` per layer action. peak is the compute dtype's; under
model.fp8 the weight GEMMs' (blocks.fp8_gemms) is the group's float8 peak, or the compute
dtype's on a group without FP8 tensor cores (the report says so). `matmul_efficiency` is
the group's one calibration constant (`check_cluster` requires the data-sheet figures).
Residual bytes
follow Korthikanti et al. (2022) per remat policy; a grouped entry (model.moe_every = n) is
priced as its average block.

The kernel list, the recomputation per remat policy and the memory formulas:
docs/design/planner_costs.md."""

from __future__ import annotations

import dataclasses
import functools
import math

from triax.errors import ConfigError
from triax.model import window as window_lib
from triax.plan.cluster import Cluster, Group, Link
from triax.plan.cost import blocks
from triax.plan.cost import profile as profile_lib
from triax.plan.cost.blocks import Kernel
from triax.plan.cost.profile import LAYER_CHECKPOINTED

# Bytes a bandwidth-bound op moves per element of its [s, d] input, forward:
# an RMSNorm reads x and writes y (2), a residual add reads two and writes
# one (3); two adds per layer, and the family's norms of the stream
# (ModelSpec.stream_norms: Gemma's four).
_NORM_ELEMENT_IO = 2
_ADD_ELEMENT_IO = 3
# The MLP's activation reads and writes [s, d_ff/t] (a gated one reads two).
_ACT_ELEMENT_IO = 2
# A bandwidth-bound op's backward reads its output gradient and saved input
# and writes the input gradient: about twice its forward's bytes.
_BACKWARD_IO = 2.0
# [s, d] activations per layer inside the tensor-parallel matmuls, split over
# tensor (Korthikanti et al. 2022's 24/t at 2 bytes: Q, K, V, the attention
# output, the MLP's two 4h-wide ones); profile.SEQUENCE_STASH counts the rest.
_TENSOR_STASH = 12
# The head's fp32 logits are written, read by the softmax, its gradient
# written and read by the two backward GEMMs: 4 passes of 4 bytes.
_LOGIT_PASSES = 4


@dataclasses.dataclass(frozen=True)
class ShardKernels:
  """The kernels of one layer shard and of its embedding and head.

  attention: the attention core's forward kernels (what remat=dots reruns);
  scores: those of them up to its probabilities (what remat=attention
  reruns: its backward needs them, not their product with V), none for a
  flash kernel, which keeps no scores.
  """

  layer_fwd: tuple[Kernel, ...]
  layer_bwd: tuple[Kernel, ...]
  attention: tuple[Kernel, ...]
  scores: tuple[Kernel, ...]
  embed: tuple[Kernel, ...]
  head: tuple[Kernel, ...]


class Analytic:
  """Costs of the functions the simulator asks for, on any group with data-sheet figures."""

  def __init__(self, dtype: str, kernels: dict[int, ShardKernels]):
    self.dtype = dtype
    self.kernels = kernels
    # (kernel tuple's id, b, expert, rates) -> seconds: a search asks the
    # same sums for every device of every stage of every candidate.
    self._sums = {}

  def _rates(self, group: Group) -> tuple[float, float, float]:
    """(sustained FLOP/s at the compute dtype, at FP8, bytes/s): a group
    without FP8 tensor cores runs FP8 GEMMs no faster than the compute dtype's."""
    peak = group.peak(self.dtype)
    fp8 = group.fp8_peak() or peak
    return peak * group.matmul_efficiency, fp8 * group.matmul_efficiency, group.memory_bandwidth

  def _sum(self, kernels: tuple[Kernel, ...], group: Group, b: int, expert: int = 1) -> float:
    peak, fp8, bandwidth = self._rates(group)
    key = (id(kernels), b, expert, peak, fp8, bandwidth)
    if key not in self._sums:
      self._sums[key] = sum(k.seconds(b, peak, bandwidth, expert, fp8) for k in kernels)
    return self._sums[key]

  def seconds(self, group: Group, function: str, b: int, t: int, expert: int = 1) -> float:
    """Time of a profile function ('layer_fwd', 'layer_bwd', 'embed', 'head')
    on b sequences at degree t, the routed experts split `expert` ways; a
    remat variant's name is its plain one's."""
    base = function.split('/')[0]
    k = self.kernels[t]
    overhead = group.overhead_per_layer if base in profile_lib.LAYER_FUNCTIONS else 0.0
    return overhead + self._sum(getattr(k, base), group, b, expert)

  def layer_seconds(
    self, group: Group, b: int, t: int, remat: str, expert: int = 1
  ) -> tuple[float, float]:
    """(forward, backward) of one layer under a remat policy: the backward
    reruns the forward (full), the attention core (dots) or its scores
    (attention)."""
    fwd = self.seconds(group, 'layer_fwd', b, t, expert)
    bwd = self.seconds(group, 'layer_bwd', b, t, expert)
    if remat == 'full':
      bwd += fwd
    elif remat == 'dots':
      bwd += self._sum(self.kernels[t].attention, group, b)
    elif remat == 'attention':
      bwd += self._sum(self.kernels[t].scores, group, b)
    return fwd, bwd


def check_cluster(cluster: Cluster) -> None:
  """Every group needs data-sheet figures and its calibration constant.

  Raises:
    ConfigError('--profile', ...) naming the group and the missing field.
  """
  for name, g in cluster.groups.items():
    if g.local or g.memory_bandwidth is None or any(v is None for v in g.peak_flops.values()):
      raise ConfigError(
        '--profile',
        f'{cluster.path}: group {name!r} is measured (profile: local), it has no data-sheet '
        'peak_flops / memory_bandwidth for the analytic model; use --profile=local',
      )
    if g.matmul_efficiency is None:
      raise ConfigError(
        '--profile',
        f'{cluster.path}: group {name!r} has no matmul_efficiency (the fraction of peak_flops '
        "a large matmul sustains, the analytic model's calibration constant); add it to the "
        'spec or use --profile=local',
      )


def build(model_cfg, tensors, dropout: bool = False) -> profile_lib.Profile:
  """The analytic Profile of config.model for the given tensor degrees.

  dropout: add the kernels and masks of dropout on the attention
  probabilities and after both sublayers, as Megatron-LM's GPT runs it
  (triax's models have no dropout; scripts/bench_megatron_table1.py models
  Megatron's runs).
  """
  from triax.model import registry

  spec = registry.spec_from_config(model_cfg)
  # t = 1 always: the search ranks device types by their unsharded layer.
  degrees = tuple(sorted(set(tensors) | {1}))
  return _build(dataclasses.replace(spec, remat='none'), degrees, dropout)


@functools.lru_cache(maxsize=16)
def _build(spec, tensors: tuple[int, ...], dropout: bool = False) -> profile_lib.Profile:
  shards, kernels = {}, {}
  for t in tensors:
    shards[t], kernels[t] = _shard(spec, t, dropout)
  inf = Link(math.inf, 0.0)
  machine = profile_lib.Machine(
    backend='analytic',
    device_kind='analytic (cluster spec data sheets)',
    num_devices=0,
    matmul_flops=0.0,
    memory_bandwidth=0.0,
    node_bandwidth=0.0,
    effective_cores=1.0,
    p2p=inf,
    allreduce=inf,
  )
  return profile_lib.Profile(
    seq_len=spec.seq_len,
    d_model=spec.d_model,
    num_layers=spec.num_layers,
    dtype=spec.dtype,
    shards=shards,
    fits={f: profile_lib.Fit(0.0, 1.0) for f in profile_lib.FUNCTIONS},
    machine=machine,
    analytic=Analytic(spec.dtype, kernels),
    layers_per_entry=spec.layers_per_entry,
  )


def _nbytes(*trees) -> float:
  """Bytes of the arrays of `trees`, each counted once: a tied embedding
  table is both the embedding's and the head's, one buffer."""
  import jax

  unique = {id(a): a for a in jax.tree.leaves(trees)}.values()
  return float(sum(math.prod(a.shape) * a.dtype.itemsize for a in unique))


def _elementwise(spec, shard, dropout: bool) -> float:
  """Bytes a block's norms, residual adds and activation move per sequence,
  forward (with Megatron's two hidden dropouts' 1-byte masks on [s, d],
  whole on every tensor rank without sequence parallelism)."""
  import numpy as np

  s, d = spec.seq_len, spec.d_model
  e = np.dtype(spec.dtype).itemsize
  norms = spec.stream_norms * _NORM_ELEMENT_IO
  io = (norms + 2 * _ADD_ELEMENT_IO) * s * d + _ACT_ELEMENT_IO * s * shard.d_ff
  return io * e + (2 * s * d if dropout else 0)


def _flash_share(spec) -> float:
  """The share of the score square a flash kernel computes, over the layers:
  the causal half of a global layer's, a local layer's window's (model/window.py).
  XLA's masked core computes the whole square either way."""
  local = spec.local_layers() or ()
  windowed = window_lib.attended_share(spec.seq_len, spec.sliding_window) if local else 0.5
  share = sum(local) / len(local) if local else 0.0
  return share * windowed + (1 - share) * blocks.FLASH_CAUSAL


def _shard(spec, t: int, dropout: bool = False) -> tuple[profile_lib.Shard, ShardKernels]:
  import numpy as np

  shapes = blocks.shapes(spec, t)
  shard = shapes.shard
  e = np.dtype(spec.dtype).itemsize
  s, d = spec.seq_len, spec.d_model
  # Flash kernels (cuDNN's on GPU, Pallas's splash on TPU) keep no [s, s] scores.
  fused = spec.attention in ('cudnn', 'splash')
  dense = blocks.gemms(spec, shard, shapes.layer, spec.layers_per_entry)
  attention, attention_bwd, rescored, core_kept = blocks.attention(
    s, shard.num_heads, shard.head_dim, shapes.value_dim, e, fused, dropout, _flash_share(spec)
  )
  elementwise = _elementwise(spec, shard, dropout)
  hidden_masks = 2 * s * d if dropout else 0
  fwd = [*dense.fwd, *attention, Kernel('norms, adds, activation', 0.0, elementwise)]
  bwd = [
    *dense.bwd,
    *attention_bwd,
    Kernel('norms, adds, activation bwd', 0.0, _BACKWARD_IO * elementwise),
  ]
  edges = _edges(spec, shapes, t, dropout)
  act = float(s * d * e)
  stash, sequence = _stash(spec, dense, t, act, hidden_masks, core_kept)

  def work(kernels):
    return profile_lib.Work(
      flops_per_seq=sum(k.flops for k in kernels),
      bytes_fixed=sum(k.fixed_bytes + k.expert_bytes for k in kernels),
      bytes_per_seq=sum(k.bytes for k in kernels),
    )

  kernels = ShardKernels(
    layer_fwd=tuple(fwd),
    layer_bwd=tuple(bwd),
    attention=attention,
    scores=rescored,
    embed=edges.embed,
    head=edges.head,
  )
  attn_flops = sum(k.flops for k in attention)
  out = profile_lib.Shard(
    tensor=t,
    work={
      'layer_fwd': work(kernels.layer_fwd),
      'layer_bwd': work(kernels.layer_bwd),
      'embed': work(edges.embed),
      'head': work(edges.head),
    },
    layer_param_bytes=dense.params,
    edge_param_bytes=_nbytes(shapes.embed, shapes.head),
    stash_per_seq=stash,
    stash_fixed_per_seq=act,
    act_per_seq=act,
    logits_per_seq=float(edges.live_logits),
    attention_fraction=attn_flops / max(sum(k.flops for k in fwd), 1.0),
    kv_per_seq=profile_lib.kv_per_seq(spec, t),
    window=profile_lib.window_of(spec),
    experts=profile_lib.experts_of(shard, sum(k.flops for k in fwd)),
    cut_per_seq=s * dense.cut_kept * e / dense.every,
    sequence_stash_per_seq={'none': sequence, 'attention': sequence},
    table_bytes=shapes.table,
    edge_blocks=(shapes.embed_attentions, shapes.head_attentions),
    edge_expert_param_bytes=edges.expert_params,
    edge_work_per_seq=edges.work_per_seq,
  )
  return out, kernels


@dataclasses.dataclass(frozen=True)
class _Edges:
  """The embedding's and the head's kernels (with the blocks each runs
  itself), and what they hold: see `_edges`."""

  embed: tuple[Kernel, ...]
  head: tuple[Kernel, ...]
  live_logits: float  # bytes of the fp32 logits alive at once per sequence
  expert_params: float  # bytes of the edges' routed experts' parameters
  # remat policy -> bytes per sequence the edges' blocks hold for their backward
  work_per_seq: dict[str, float]


def _edges(spec, shapes: blocks.Shapes, t: int, dropout: bool) -> _Edges:
  """The edges' kernels. The head: its GEMM, gradients and cross-entropy,
  once and again for each block it runs (an MTP module: its block and
  projection forward and backward, then the shared head on its output, whose
  fp32 logits it makes whole, not loss_chunk at a time). The embedding: its
  rows, and its own blocks' forward, then forward and backward again (the
  executor's B takes the embedding's vjp, which reruns it)."""
  import numpy as np

  shard = shapes.shard
  e = np.dtype(spec.dtype).itemsize
  pe = np.dtype(spec.param_dtype).itemsize
  s, d, vocab = spec.seq_len, spec.d_model, shard.vocab_size
  logits = s * vocab * 4
  # model.loss_chunk: the cross-entropy's fp32 logits exist that many positions at a time.
  live_logits = min(spec.loss_chunk or s, s) * vocab * 4
  head_flops = 2.0 * s * d * vocab
  head = (
    Kernel('head gemm', head_flops, (s * d + s * vocab) * e, d * vocab * e),
    Kernel('head dgrad+wgrad', 2 * head_flops, 2 * (s * d + s * vocab) * e, 3 * d * vocab * pe),
    Kernel('cross-entropy', 0.0, _LOGIT_PASSES * logits),
  )
  # Gather rows forward; backward scatters the rows' gradients into the table's.
  embed = (Kernel('embedding', 0.0, 3 * s * d * e, shapes.table),)
  own = {}
  for edge, weights, count in (
    ('embed', shapes.embed_blocks, shapes.embed_attentions),
    ('head', shapes.head_blocks, shapes.head_attentions),
  ):
    own[edge] = _edge_blocks(spec, shard, t, weights, count, shapes.value_dim, dropout)
  (embed_fwd, embed_bwd, embed_kept), (head_fwd, head_bwd, head_kept) = own['embed'], own['head']
  mtp = shapes.head_attentions
  # The embedding's blocks run under the layers' remat policy: one that
  # checkpoints a block keeps the blocks' inputs and, in the backward, one
  # block's residuals at a time. The head's (MTP's) run without remat.
  embed_blocks = max(shapes.embed_attentions, 1)
  held = {
    r: embed_kept[r] + (embed_kept['none'] / embed_blocks if r in LAYER_CHECKPOINTED else 0.0)
    for r in profile_lib.REMATS
  }
  routed = sum(math.prod(w.shape) for w in (*shapes.embed_blocks, *shapes.head_blocks) if w.routed)
  return _Edges(
    embed=embed + 2 * embed_fwd + embed_bwd,
    head=head * (1 + mtp) + head_fwd + head_bwd,
    live_logits=live_logits,
    expert_params=float(routed * pe),
    work_per_seq={r: max(held[r], head_kept['none'] + mtp * logits) for r in held},
  )


def _edge_blocks(spec, shard, t: int, weights, count: int, value_dim: int, dropout: bool):
  """(forward kernels, backward kernels, remat policy -> bytes they keep for
  the backward per sequence) of an edge's `count` blocks of `weights`."""
  import numpy as np

  if not count:
    return (), (), {r: 0.0 for r in profile_lib.REMATS}
  e = np.dtype(spec.dtype).itemsize
  s, d = spec.seq_len, spec.d_model
  fused = spec.attention in ('cudnn', 'splash')
  dense = blocks.gemms(spec, shard, weights, count)
  core, core_bwd, _, core_kept = blocks.attention(
    s, shard.num_heads, shard.head_dim, value_dim, e, fused, dropout
  )
  elementwise = _elementwise(spec, shard, dropout)
  fwd = (*dense.fwd, *core, Kernel('norms, adds, activation', 0.0, elementwise))
  bwd = (
    *dense.bwd,
    *core_bwd,
    Kernel('norms, adds, activation bwd', 0.0, _BACKWARD_IO * elementwise),
  )
  hidden_masks = 2 * s * d if dropout else 0
  kept = _stash(spec, dense, t, float(s * d * e), hidden_masks, core_kept)[0]
  return fwd * count, bwd * count, {r: x * count for r, x in kept.items()}


def _stash(spec, dense: blocks.Gemms, t: int, act: float, hidden_masks: float, core_kept: float):
  """Bytes a sequence's layer keeps for its backward under each remat policy,
  and those held whole on every tensor rank (sequence parallelism splits them)."""
  whole = profile_lib.SEQUENCE_STASH
  every = dense.every
  # Without remat, a dense gated MLP (two of those weights) keeps its gate,
  # its up and their product: one hidden-wide value more than
  # _TENSOR_STASH's two. Over the entry's blocks, as every figure here.
  gated = (dense.mlp_inputs // 2) * spec.d_ff / spec.d_model / every
  # Post-norms (ModelSpec.stream_norms past the two pre-norms: Gemma's) keep
  # their inputs, attention's and the MLP's row-parallel outputs, whole on
  # every tensor rank; under dots attention's is kept anyway and the down
  # projection's now too (its norm reads it back): half of them more.
  post = spec.stream_norms - 2
  # Held whole on every tensor rank: the norms' inputs and outputs, the hidden dropout masks.
  sequence = act * (whole['none'] + post) + hidden_masks
  # model.remat=attention (Megatron's selective recomputation) keeps all but
  # the attention core's scores: Korthikanti et al.'s s h (10 + 24/t) with dropout.
  attention_kept = sequence + act * (_TENSOR_STASH + gated) / t
  # model.remat=dots (common.REMAT_POLICIES: every matmul output without
  # batch dimensions saveable) keeps the layer's input, the attention's output
  # projection (the second norm's input is recomputed from the two) and the
  # outputs of the matmuls reading the normed stream: Q, K and V (GQA-sized),
  # the MLP's gate and up (GPT's fc1), a MoE's router and shared experts; not
  # a routed expert's grouped matmul (ragged_dot is no dot_general), the down
  # projection (nothing reads it back) or dropout's masks (redrawn from their key).
  # docs/bench_tpu_compile.md compares these with what XLA:TPU allocates.
  import numpy as np

  e = np.dtype(spec.dtype).itemsize
  stash = {
    'none': attention_kept + core_kept,
    'attention': attention_kept,
    'dots': act * (whole['dots'] + post / 2) + spec.seq_len * dense.dots_kept * e / every,
    # Full remat keeps an entry's input only: the group's blocks are recomputed together.
    'full': act * whole['full'] / every,
  }
  return stash, sequence
