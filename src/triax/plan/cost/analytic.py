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

plus the group's `overhead_per_layer` per layer action; `matmul_efficiency` is the group's
one calibration constant (`check_cluster` requires the data-sheet figures). Residual bytes
follow Korthikanti et al. (2022) per remat policy; a grouped entry (model.moe_every = n) is
priced as its average block.

The kernel list, the recomputation per remat policy and the memory formulas:
docs/design/planner_costs.md."""

from __future__ import annotations

import dataclasses
import functools
import math

from triax.errors import ConfigError
from triax.plan.cluster import Cluster, Group, Link
from triax.plan.cost import profile as profile_lib

# Bytes a bandwidth-bound op moves per element of its [s, d] input, forward:
# an RMSNorm reads x and writes y (2), a residual add reads two and writes
# one (3); two of each per layer.
_NORM_ELEMENT_IO = 2
_ADD_ELEMENT_IO = 3
# The MLP's activation reads and writes [s, d_ff/t] (a gated one reads two).
_ACT_ELEMENT_IO = 2
# Softmax over the scores: reads them and writes the probabilities.
_SOFTMAX_ELEMENT_IO = 2
# A bandwidth-bound op's backward reads its output gradient and saved input
# and writes the input gradient: about twice its forward's bytes.
_BACKWARD_IO = 2.0
# The fused (cuDNN / flash) attention backward costs 2.5x its forward's
# FLOPs (it recomputes the scores), and a causal kernel skips half the square.
_FLASH_BACKWARD = 2.5
_FLASH_CAUSAL = 0.5
# [s, d] activations per layer inside the tensor-parallel matmuls, split over
# tensor (Korthikanti et al. 2022's 24/t at 2 bytes: Q, K, V, the attention
# output, the MLP's two 4h-wide ones); profile.SEQUENCE_STASH counts the rest.
_TENSOR_STASH = 12
# The head's fp32 logits are written, read by the softmax, its gradient
# written and read by the two backward GEMMs: 4 passes of 4 bytes.
_LOGIT_PASSES = 4


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of a layer shard, per sequence (b = 1), with a fixed part.

  flops and bytes scale with the micro-batch size b; fixed_bytes (weights
  read) do not.
  """

  name: str
  flops: float
  bytes: float
  fixed_bytes: float = 0.0

  def seconds(self, b: int, peak: float, bandwidth: float) -> float:
    return max(b * self.flops / peak, (self.fixed_bytes + b * self.bytes) / bandwidth)


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

  def _rates(self, group: Group) -> tuple[float, float]:
    return group.peak(self.dtype) * group.matmul_efficiency, group.memory_bandwidth

  def _sum(self, kernels, group: Group, b: int) -> float:
    peak, bandwidth = self._rates(group)
    return sum(k.seconds(b, peak, bandwidth) for k in kernels)

  def seconds(self, group: Group, function: str, b: int, t: int) -> float:
    """Time of a profile function ('layer_fwd', 'layer_bwd', 'embed', 'head')
    on b sequences at degree t; a remat variant's name is its plain one's."""
    base = function.split('/')[0]
    k = self.kernels[t]
    overhead = group.overhead_per_layer if base in profile_lib.LAYER_FUNCTIONS else 0.0
    return overhead + self._sum(getattr(k, base), group, b)

  def layer_seconds(self, group: Group, b: int, t: int, remat: str) -> tuple[float, float]:
    """(forward, backward) of one layer under a remat policy: the backward
    reruns the forward (full), the attention core (dots) or its scores
    (attention)."""
    fwd = self.seconds(group, 'layer_fwd', b, t)
    bwd = self.seconds(group, 'layer_bwd', b, t)
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


def _shapes(spec, t: int):
  """One stack entry's parameter shapes (a layer's, or a group's blocks'),
  the edge parameters' bytes, and the shard spec: from the family's own
  modules, abstractly (no memory, no compute)."""
  import jax

  from triax.model import registry

  shard = dataclasses.replace(spec.tensor_shard(t), num_layers=spec.layers_per_entry)
  # Tracing init runs the block once, abstractly; the attention kernel
  # changes no parameter shape, and cuDNN's refuses to trace off a GPU.
  model = registry.build(dataclasses.replace(shard, attention='xla'))
  params = jax.eval_shape(model.init, jax.random.key(0))
  is_tuple = lambda x: isinstance(x, tuple)
  layer = jax.tree.leaves(jax.tree.map(lambda a: a.shape[1:], params['layers']), is_leaf=is_tuple)
  axes = jax.tree.leaves(model.logical_axes()['layers'], is_leaf=is_tuple)
  # A routed expert's weight ('experts' axis first, [E, ...]): a token runs k of the E.
  routed = ['experts' in a for a in axes]
  # A weight whose first axis (after the stack's) is the model width reads the residual stream.
  reads_stream = [len(a) > 2 and a[1] == 'embed' for a in axes]
  embed, head = model.edge_params(params)
  return shard, list(zip(layer, routed, reads_stream)), embed, head


def _averaged(kernels: list[Kernel], n: int) -> list[Kernel]:
  """An entry's kernels over its n blocks, the average block's (a kernel's
  time is linear in its FLOPs and bytes together)."""
  if n == 1:
    return kernels
  return [
    dataclasses.replace(k, flops=k.flops / n, bytes=k.bytes / n, fixed_bytes=k.fixed_bytes / n)
    for k in kernels
  ]


def _shard(spec, t: int, dropout: bool = False) -> tuple[profile_lib.Shard, ShardKernels]:
  import numpy as np

  shard, weights, embed_params, head_params = _shapes(spec, t)
  e = np.dtype(spec.dtype).itemsize
  s, d = spec.seq_len, spec.d_model
  # Flash kernels (cuDNN's on GPU, Pallas's splash on TPU) keep no [s, s] scores.
  fused = spec.attention in ('cudnn', 'splash')
  dense = _dense_kernels(spec, shard, weights)
  attention, attention_bwd, rescored, core_kept = _attention(
    s, shard.num_heads, shard.head_dim, e, fused, dropout
  )
  elementwise = (
    (2 * _NORM_ELEMENT_IO + 2 * _ADD_ELEMENT_IO) * s * d + _ACT_ELEMENT_IO * s * shard.d_ff
  ) * e
  # Megatron's two hidden dropouts (fused into the residual adds) write a
  # 1-byte mask each, which the backward reads: on [s, d], whole on every
  # tensor rank without sequence parallelism.
  hidden_masks = 2 * s * d if dropout else 0
  elementwise += hidden_masks
  fwd = [*dense.fwd, *attention, Kernel('norms, adds, activation', 0.0, elementwise)]
  bwd = [
    *dense.bwd,
    *attention_bwd,
    Kernel('norms, adds, activation bwd', 0.0, _BACKWARD_IO * elementwise),
  ]
  head, embed, live_logits = _edge_kernels(spec, shard, embed_params, head_params)
  act = float(s * d * e)
  stash, sequence = _stash(spec, dense, t, act, hidden_masks, core_kept)

  def work(kernels):
    return profile_lib.Work(
      flops_per_seq=sum(k.flops for k in kernels),
      bytes_fixed=sum(k.fixed_bytes for k in kernels),
      bytes_per_seq=sum(k.bytes for k in kernels),
    )

  kernels = ShardKernels(
    layer_fwd=tuple(fwd),
    layer_bwd=tuple(bwd),
    attention=attention,
    scores=rescored,
    embed=embed,
    head=head,
  )
  attn_flops = sum(k.flops for k in attention)
  out = profile_lib.Shard(
    tensor=t,
    work={
      'layer_fwd': work(kernels.layer_fwd),
      'layer_bwd': work(kernels.layer_bwd),
      'embed': work(embed),
      'head': work(head),
    },
    layer_param_bytes=dense.layer_params,
    edge_param_bytes=_nbytes(embed_params, head_params),
    stash_per_seq=stash,
    stash_fixed_per_seq=act,
    act_per_seq=act,
    logits_per_seq=float(live_logits),
    attention_fraction=attn_flops / max(sum(k.flops for k in fwd), 1.0),
    kv_per_seq=profile_lib.kv_per_seq(spec, t),
    experts=profile_lib.experts_of(shard, sum(k.flops for k in fwd)),
    cut_per_seq=s * dense.cut_kept * e / dense.every,
    sequence_stash_per_seq={'none': sequence, 'attention': sequence},
  )
  return out, kernels


@dataclasses.dataclass(frozen=True)
class _Dense:
  """A stack entry's dense (and routed) weight matmuls, averaged over its blocks."""

  fwd: list  # Kernel per block: the forward GEMMs
  bwd: list  # and the input- and weight-gradient GEMMs
  layer_params: float  # bytes of one block's parameters
  every: int  # blocks of the stack entry (spec.layers_per_entry)
  # Elements a position keeps under the dots policy beyond SEQUENCE_STASH's:
  # the outputs of the dense matmuls that read the normed stream (see _stash).
  dots_kept: int
  # Dense weights reading the stream into the MLP's hidden width: GPT's fc1,
  # a gated MLP's gate and up (whose product is one more hidden-wide value kept).
  mlp_inputs: int
  # Elements a position's B/W cut keeps (pipeline/split_backward.py): every
  # dense weight matmul's output cotangent and its input, the two normed
  # streams (attention's, MLP's) once each however many weights read them.
  cut_kept: int


def _dense_kernels(spec, shard, weights) -> _Dense:
  import numpy as np

  e = np.dtype(spec.dtype).itemsize
  pe = np.dtype(spec.param_dtype).itemsize
  s, d = spec.seq_len, spec.d_model
  every = spec.layers_per_entry
  fwd, bwd, layer_params = [], [], 0.0
  dots_kept, mlp_inputs, cut_kept = 0, 0, 2 * d * every
  for shape, routed, reads_stream in weights:
    layer_params += math.prod(shape) * pe
    if reads_stream and not routed:
      dots_kept += math.prod(shape[1:])
      mlp_inputs += math.prod(shape[1:]) == shard.d_ff
    if len(shape) < 2:
      continue  # norm scales and biases: elementwise, counted with the norms
    # A routed expert's [E, k, n]: one grouped matmul over the E experts'
    # weights (each read once), each token's row through k of them.
    copies, rows = (shape[0], spec.experts_per_token) if routed else (1, 1)
    shape = shape[1:] if routed else shape
    if shape[0] == d:
      k, n = d, math.prod(shape[1:])
    else:
      k, n = math.prod(shape[:-1]), shape[-1]
    if not routed:
      cut_kept += n + (0 if reads_stream else k)
    flops = 2.0 * s * rows * k * n
    # Activations in and out per sequence; the weights read once a call.
    io = rows * (s * k + s * n) * e
    fwd.append(Kernel(f'gemm {k}x{n}', flops, io, copies * k * n * e))
    # Input gradient (reads the weight) and weight gradient (writes it).
    bwd.append(Kernel(f'dgrad {k}x{n}', flops, io, copies * k * n * e))
    bwd.append(Kernel(f'wgrad {k}x{n}', flops, io, 2 * copies * k * n * pe))
  return _Dense(
    _averaged(fwd, every),
    _averaged(bwd, every),
    layer_params / every,
    every,
    dots_kept,
    mlp_inputs,
    cut_kept,
  )


def _edge_kernels(spec, shard, embed_params, head_params):
  """The head's kernels, the embedding's, and the fp32 logits alive at once per sequence."""
  import numpy as np

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
  embed = (Kernel('embedding', 0.0, 3 * s * d * e, _nbytes(embed_params)),)
  return head, embed, live_logits


def _stash(spec, dense: _Dense, t: int, act: float, hidden_masks: float, core_kept: float):
  """Bytes a sequence's layer keeps for its backward under each remat policy,
  and those held whole on every tensor rank (sequence parallelism splits them)."""
  whole = profile_lib.SEQUENCE_STASH
  every = dense.every
  # Without remat, a dense gated MLP (two of those weights) keeps its gate,
  # its up and their product: one hidden-wide value more than
  # _TENSOR_STASH's two. Over the entry's blocks, as every figure here.
  gated = (dense.mlp_inputs // 2) * spec.d_ff / spec.d_model / every
  # Held whole on every tensor rank: the norms' inputs and outputs, the hidden dropout masks.
  sequence = act * whole['none'] + hidden_masks
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
    'dots': act * whole['dots'] + spec.seq_len * dense.dots_kept * e / every,
    # Full remat keeps an entry's input only: the group's blocks are recomputed together.
    'full': act * whole['full'] / every,
  }
  return stash, sequence


def _attention(s: int, heads: int, hd: int, e: int, fused: bool, dropout: bool):
  """The attention core of one sequence on a shard of `heads` heads: its
  forward and backward kernels, the forward's up to its probabilities
  (what remat=attention reruns) and the bytes it keeps for the backward
  (the probabilities; with Megatron's dropout its 1-byte mask and the
  dropped probabilities the P V matmul reads too). A flash kernel keeps
  and reruns none (it recomputes the scores in its own backward)."""
  scores = heads * s * s  # elements of one sequence's score square
  if fused:
    flops = 4.0 * s * s * heads * hd * _FLASH_CAUSAL
    io = 4 * s * heads * hd * e  # Q, K, V read, O written
    attention = (Kernel('flash attention', flops, io),)
    attention_bwd = (Kernel('flash attention bwd', _FLASH_BACKWARD * flops, 2.5 * io),)
    return attention, attention_bwd, (), 0.0
  qk = Kernel('q k^T', 2.0 * s * s * heads * hd, (2 * s * heads * hd + scores) * e)
  softmax = Kernel('softmax', 0.0, _SOFTMAX_ELEMENT_IO * scores * e)
  av = Kernel('p v', 2.0 * s * s * heads * hd, (scores + 2 * s * heads * hd) * e)
  # Each of the two GEMMs has two gradient GEMMs of its FLOPs; the softmax
  # backward reads the probabilities and their gradient, writes one.
  attention_bwd = (
    Kernel('dq dk', 2 * qk.flops, 2 * qk.bytes),
    Kernel('softmax bwd', 0.0, 3 * scores * e),
    Kernel('dp dv', 2 * av.flops, 2 * av.bytes),
  )
  if not dropout:
    return (qk, softmax, av), attention_bwd, (qk, softmax), float(scores * e)
  # Reads the probabilities, writes them dropped and a 1-byte mask; its
  # backward reads the gradient and the mask and writes one.
  drop = Kernel('attention dropout', 0.0, (2 * e + 1) * scores)
  attention_bwd = (*attention_bwd, Kernel('attention dropout bwd', 0.0, (2 * e + 1) * scores))
  # Kept: the probabilities, the mask and the dropped probabilities.
  return (qk, softmax, av, drop), attention_bwd, (qk, softmax, drop), float(scores * (1 + 2 * e))
