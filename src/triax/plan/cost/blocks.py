"""A model's blocks as the analytic device model prices them: weights read from the family's
own parameter tree, and the kernels one block shard runs.

`shapes` traces the family's init abstractly (no memory, no compute) at tensor degree t and
returns one stack entry's weights and the blocks the edges run themselves: the sub-modules
of the embedding's and the head's parameters (DeepSeek's first dense blocks, its MTP
modules), apart from their own tables and norms. Every weight is read by its logical axes,
not its name: a weight whose last axis is the stream ('embed') writes it and contracts all
its other axes (an output projection), any other contracts its first axis (a projection
from the stream, a latent or the MLP's hidden units); an 'experts' axis makes it a routed
expert's, which a token runs k of; an attention's output projection is the weight of axes
('heads', 'kv', 'embed'), whose 'kv' is the value width. `gemms` turns weights into GEMM
kernels (under model.fp8, a weight's on FP8 operands, the routed experts' too: `fp8_gemms`), `attention` prices
the attention core. Why: docs/design/planner_costs.md."""

from __future__ import annotations

import dataclasses
import math

# The attention core's backward and causal shares (cuDNN's / splash's fused kernels).
FLASH_BACKWARD = 2.5
FLASH_CAUSAL = 0.5
# Softmax over the scores: reads them and writes the probabilities.
SOFTMAX_ELEMENT_IO = 2
# An attention's output projection: its axes, heads and the value width to the stream.
OUTPUT_AXES = ('heads', 'kv', 'embed')
# Dense weights the families multiply by a plain einsum rather than
# common.matmul, so in the compute dtype under model.fp8 too: a MoE's router
# (its logits feed the top-k) and Qwen2-MoE's shared-expert gate. By name:
# DeepSeek's router and its rope key's projection share their axes and width.
# Every other weight of a block is FP8, the routed experts' included
# (fp8.ragged_dot for dropless, fp8.einsum for capacity's batched einsums).
PLAIN_EINSUM = ('router', 'shared_expert_gate')


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of a layer shard, per sequence (b = 1), with a fixed part.

  flops and bytes scale with the micro-batch size b; fixed_bytes (weights
  read) do not, nor do expert_bytes (routed experts' weights read), which
  mesh.expert splits: a device's grouped matmul reads its own experts'.
  fp8: a GEMM on FP8 operands (model.fp8), its FLOPs at the FP8 peak.
  """

  name: str
  flops: float
  bytes: float
  fixed_bytes: float = 0.0
  expert_bytes: float = 0.0
  fp8: bool = False

  def seconds(
    self, b: int, peak: float, bandwidth: float, expert: int = 1, fp8_peak: float | None = None
  ) -> float:
    """max(FLOPs / peak, bytes / bandwidth) on b sequences; an fp8 kernel's
    FLOPs at fp8_peak where given (the caller decides what a device without
    FP8 tensor cores runs them at)."""
    rate = fp8_peak if self.fp8 and fp8_peak else peak
    weights = self.fixed_bytes + self.expert_bytes / expert
    return max(b * self.flops / rate, (weights + b * self.bytes) / bandwidth)


@dataclasses.dataclass(frozen=True)
class Weight:
  """One block's weight: its shape and logical axes, without the stack's axis,
  and its parameter's name (the last key of its path)."""

  shape: tuple[int, ...]
  axes: tuple
  name: str = ''

  @property
  def routed(self) -> bool:
    """A routed expert's ([E, ...], 'experts' first): a token runs k of the E."""
    return 'experts' in self.axes

  @property
  def reads_stream(self) -> bool:
    """Whether its input is the (normed) residual stream: its first axis is the model width."""
    return len(self.axes) > 1 and self.axes[0] == 'embed'

  def matmul(self) -> tuple[int, int]:
    """(k, n): the contracted and the output elements of one token's GEMM
    (one expert's, for a routed weight): see the module docstring."""
    shape, axes = (self.shape[1:], self.axes[1:]) if self.routed else (self.shape, self.axes)
    if axes[-1] == 'embed':
      return math.prod(shape[:-1]), shape[-1]
    return shape[0], math.prod(shape[1:])


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What `shapes` reads of a family at one tensor degree.

  shard: the family's spec of one tensor rank (ModelSpec.tensor_shard), its
    stack one entry long; layer: that entry's weights (of its
    layers_per_entry blocks); embed_blocks, head_blocks: the weights of the
    blocks the embedding and the head run themselves; embed_attentions,
    head_attentions: how many attentions those blocks hold (one block
    each); embed, head: the edges' parameter trees as the stages take them
    (ModelSpec.edge_params: a table both use is one buffer); table: the
    bytes of the embedding's own parameters (its table, GPT's positions
    too); value_dim: an attention's value width.
  """

  shard: object
  layer: tuple[Weight, ...]
  embed_blocks: tuple[Weight, ...]
  head_blocks: tuple[Weight, ...]
  embed_attentions: int
  head_attentions: int
  embed: object
  head: object
  table: float
  value_dim: int


def shapes(spec, t: int) -> Shapes:
  """The family's weights at tensor degree t (see `Shapes`)."""
  import jax

  from triax.model import registry

  # The stack one entry long; the blocks the embedding runs itself beside it.
  own = spec.num_layers - spec.stacked_layers
  shard = dataclasses.replace(spec.tensor_shard(t), num_layers=spec.layers_per_entry + own)
  # Tracing init runs the block once, abstractly; the attention kernel
  # changes no parameter shape, and cuDNN's refuses to trace off a GPU.
  model = registry.build(dataclasses.replace(shard, attention='xla'))
  params = jax.eval_shape(model.init, jax.random.key(0))
  axes = model.logical_axes()
  layer = _weights(params['layers'], axes['layers'], stacked=True)
  edges = {edge: _weights(params[edge], axes[edge], nested=True) for edge in ('embed', 'head')}
  value_dim = [w.shape[1] for w in layer if w.axes == OUTPUT_AXES] or [shard.head_dim]
  # The embedding's own arrays (its table; GPT's positions), not its blocks'.
  own_arrays = [a for a in params['embed'].values() if not isinstance(a, dict)]
  embed, head = model.edge_params(params)
  return Shapes(
    shard=shard,
    layer=layer,
    embed_blocks=edges['embed'],
    head_blocks=edges['head'],
    embed_attentions=attentions(edges['embed']),
    head_attentions=attentions(edges['head']),
    embed=embed,
    head=head,
    table=float(sum(math.prod(a.shape) * a.dtype.itemsize for a in own_arrays)),
    value_dim=value_dim[0],
  )


def attentions(weights) -> int:
  """Attentions among `weights`: one output projection each."""
  return sum(w.axes == OUTPUT_AXES for w in weights)


def _weights(params, axes, stacked: bool = False, nested: bool = False) -> tuple[Weight, ...]:
  """The leaves of a parameter tree as Weights; `stacked`: the stack's axis
  dropped; `nested`: only those inside a sub-module (an edge's own blocks)."""
  import jax

  if nested:
    keep = [k for k, v in params.items() if isinstance(v, dict)]
    params, axes = {k: params[k] for k in keep}, {k: axes[k] for k in keep}
  cut = 1 if stacked else 0
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return tuple(
    Weight(tuple(a.shape[cut:]), tuple(n[cut:]), str(getattr(path[-1], 'key', path[-1])))
    for (path, a), n in zip(leaves, _leaves(axes))
  )


def _leaves(axes) -> list[tuple]:
  """The logical axis names of a tree's leaves, in jax.tree.leaves' order."""
  import jax

  return jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))


@dataclasses.dataclass(frozen=True)
class Gemms:
  """The weight matmuls of `every` blocks, as the average block's.

  fwd: Kernel per block: the forward GEMMs; bwd: the input- and
  weight-gradient GEMMs; params: bytes of one block's parameters; every:
  the blocks; dots_kept: elements a position's dense matmuls write, but
  those writing the stream (what the dots policy keeps: Q, K and V, MLA's
  latents, the MLP's gate and up, a router's logits);
  mlp_inputs: those dense weights reading the stream into the MLP's hidden
  width (GPT's fc1, a gated MLP's gate and up, whose product is one more
  hidden-wide value kept); cut_kept: elements a position's B/W cut keeps
  (pipeline/split_backward.py): every dense weight matmul's output
  cotangent and its input, the two normed streams (attention's, MLP's)
  once each however many weights read them.
  """

  fwd: list
  bwd: list
  params: float
  every: int
  dots_kept: int
  mlp_inputs: int
  cut_kept: int


def gemms(spec, shard, weights, every: int) -> Gemms:
  """The GEMM kernels of `weights` (`every` blocks' together) on a shard of
  `spec`; under spec.fp8 a weight's (but PLAIN_EINSUM's) are `fp8_gemms`, a
  routed expert's as model/ runs it: one FP8 grouped GEMM over the experts."""
  import numpy as np

  e = np.dtype(spec.dtype).itemsize
  pe = np.dtype(spec.param_dtype).itemsize
  s, d = spec.seq_len, spec.d_model
  fp8 = spec.fp8 != 'none'
  fwd, bwd, params = [], [], 0.0
  dots_kept, mlp_inputs, cut_kept = 0, 0, 2 * d * every
  for w in weights:
    params += math.prod(w.shape) * pe
    if len(w.shape) < 2:
      continue  # norm scales and biases: elementwise, counted with the norms
    # A routed expert's [E, k, n]: one grouped matmul over the E experts'
    # weights (each read once), each token's row through k of them.
    copies, rows = (w.shape[0], spec.experts_per_token) if w.routed else (1, 1)
    k, n = w.matmul()
    if not w.routed:
      cut_kept += n + (0 if w.reads_stream else k)
      dots_kept += 0 if w.axes[-1] == 'embed' else n
      mlp_inputs += w.reads_stream and n == shard.d_ff
    if fp8 and w.name not in PLAIN_EINSUM:
      quantized = fp8_gemms(s, k, n, e, pe, rows, copies, w.routed)
      fwd += quantized[0]
      bwd += quantized[1]
      continue
    flops = 2.0 * s * rows * k * n
    # Activations in and out per sequence; the weights read once a call.
    io = rows * (s * k + s * n) * e
    read, write = copies * k * n * e, 2 * copies * k * n * pe
    # Input gradient (reads the weight) and weight gradient (writes it).
    for name, weights in ((f'gemm {k}x{n}', read), (f'dgrad {k}x{n}', read)):
      (fwd if name[0] == 'g' else bwd).append(_gemm(name, flops, io, weights, w.routed))
    bwd.append(_gemm(f'wgrad {k}x{n}', flops, io, write, w.routed))
  return Gemms(
    fwd=averaged(fwd, every),
    bwd=averaged(bwd, every),
    params=params / every,
    every=every,
    dots_kept=dots_kept,
    mlp_inputs=mlp_inputs,
    cut_kept=cut_kept,
  )


def fp8_gemms(
  s: int, k: int, n: int, e: int, pe: int, rows: int = 1, copies: int = 1, routed: bool = False
) -> tuple[list[Kernel], list[Kernel]]:
  """(forward, backward) kernels of a [k, n] weight's matmul on FP8 operands
  (model/fp8.py), per sequence of s: x w forward, g w^T and x^T g backward,
  each at the FP8 peak and reading its operands at a byte an element; and the
  casts that make those operands, each reading a tensor (an activation in the
  compute dtype, e bytes; the weight as it arrives, in param_dtype, pe) and
  writing it in FP8: x and w forward, x, w and g (once for both GEMMs)
  backward. A cast's amax pass may read its input once more where XLA does not
  fuse it into the producer; not counted. A routed expert's ([copies, k, n],
  `routed`): each token's `rows` assignments through one grouped GEMM over
  the copies, whose weight bytes mesh.expert splits (Kernel.expert_bytes)."""
  flops = 2.0 * s * rows * k * n
  # Elements of the input, the output's gradient, the weight.
  x, g, w = s * rows * k, s * rows * n, copies * k * n
  fwd = [
    _gemm(f'fp8 casts {k}x{n}', 0.0, x * (e + 1), w * (pe + 1), routed),
    _gemm(f'fp8 gemm {k}x{n}', flops, x + g * e, w, routed, fp8=True),
  ]
  bwd = [
    _gemm(f'fp8 casts bwd {k}x{n}', 0.0, (x + g) * (e + 1), w * (pe + 1), routed),
    _gemm(f'fp8 dgrad {k}x{n}', flops, g + x * e, w, routed, fp8=True),
    # The weight gradient written in param_dtype, as the plain wgrad's.
    _gemm(f'fp8 wgrad {k}x{n}', flops, x + g, 2 * w * pe, routed, fp8=True),
  ]
  return fwd, bwd


def _gemm(
  name: str, flops: float, io: float, weights: float, routed: bool, fp8: bool = False
) -> Kernel:
  if routed:
    return Kernel(name, flops, io, expert_bytes=weights, fp8=fp8)
  return Kernel(name, flops, io, weights, fp8=fp8)


def averaged(kernels: list[Kernel], n: int) -> list[Kernel]:
  """An entry's kernels over its n blocks, the average block's (a kernel's
  time is linear in its FLOPs and bytes together)."""
  if n == 1:
    return kernels
  return [
    dataclasses.replace(
      k,
      flops=k.flops / n,
      bytes=k.bytes / n,
      fixed_bytes=k.fixed_bytes / n,
      expert_bytes=k.expert_bytes / n,
    )
    for k in kernels
  ]


def attention(
  s: int, heads: int, qk: int, v: int, e: int, fused: bool, dropout: bool, share=FLASH_CAUSAL
):
  """The attention core of one sequence on a shard of `heads` heads, queries
  and keys `qk` wide, values `v`: its forward and backward kernels, the
  forward's up to its probabilities (what remat=attention reruns) and the
  bytes it keeps for the backward (the probabilities; with Megatron's
  dropout its 1-byte mask and the dropped probabilities the P V matmul
  reads too). A flash kernel keeps and reruns none (it recomputes the
  scores in its own backward); it takes one head width, so a narrower v
  is padded to qk (deepseek's DenseBlock._core: the value products' FLOPs
  grow by qk / v). `share`: the part of the s x s square a flash kernel
  computes (causal: half; a sliding window's less)."""
  scores = heads * s * s  # elements of one sequence's score square
  if fused:
    flops = 4.0 * s * s * heads * qk * share
    io = 4 * s * heads * qk * e  # Q, K, V read, O written
    forward = (Kernel('flash attention', flops, io),)
    backward = (Kernel('flash attention bwd', FLASH_BACKWARD * flops, 2.5 * io),)
    return forward, backward, (), 0.0
  qk_ = Kernel('q k^T', 2.0 * s * s * heads * qk, (2 * s * heads * qk + scores) * e)
  softmax = Kernel('softmax', 0.0, SOFTMAX_ELEMENT_IO * scores * e)
  av = Kernel('p v', 2.0 * s * s * heads * v, (scores + 2 * s * heads * v) * e)
  # Each of the two GEMMs has two gradient GEMMs of its FLOPs; the softmax
  # backward reads the probabilities and their gradient, writes one.
  backward = (
    Kernel('dq dk', 2 * qk_.flops, 2 * qk_.bytes),
    Kernel('softmax bwd', 0.0, 3 * scores * e),
    Kernel('dp dv', 2 * av.flops, 2 * av.bytes),
  )
  if not dropout:
    return (qk_, softmax, av), backward, (qk_, softmax), float(scores * e)
  # Reads the probabilities, writes them dropped and a 1-byte mask; its
  # backward reads the gradient and the mask and writes one.
  drop = Kernel('attention dropout', 0.0, (2 * e + 1) * scores)
  backward = (*backward, Kernel('attention dropout bwd', 0.0, (2 * e + 1) * scores))
  # Kept: the probabilities, the mask and the dropped probabilities.
  return (qk_, softmax, av, drop), backward, (qk_, softmax, drop), float(scores * (1 + 2 * e))
