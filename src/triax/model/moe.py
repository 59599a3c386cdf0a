"""Mixture-of-experts routing and dispatch (mixtral.py's MLP), and the router's losses.

Routing is Mixtral's: softmax over the router's fp32 logits, the top k experts, their k
probabilities renormalised to sum to one (unless model.norm_topk_prob is false).

Dispatch, two ways:
  dropless  each device sorts its own tokens' assignments by expert and runs one
            `jax.lax.ragged_dot` per expert weight (inside a `shard_map` over the
            automatic axes); nothing is dropped or padded.
  capacity  each batch row is one group; expert e takes at most
            C = ceil(capacity_factor * s * k / E) of the row's assignments, slot 0 of
            every token first; the rest are dropped (output 0) and counted.

Expert parallelism (mesh.expert > 1, carved from data): each device holds E/ep experts;
dropless exchanges assignments by two all-to-alls over `expert` with fixed buffers with
room for every assignment (still nothing dropped), capacity each row's [E, C] buffers.
Each expert's hidden units split over `tensor` as Llama's MLP, one psum after the down
projection. Each layer reports `LayerStats`, from which the model's load-balancing loss
(Switch's E * sum_e f_e P_e) and router z-loss (ST-MoE's) are made.
Under model.fp8 the experts' matmuls are FP8 (`ExpertGemms`: fp8.einsum
for capacity's, fp8.ragged_dot for dropless's); the router is not.
The reasoning: docs/design/moe.md."""

from __future__ import annotations

import dataclasses
import functools
import math

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from triax import sharding
from triax.model import fp8 as fp8_lib
from triax.model import fp8_metrics, per_device
from triax.model.common import einsum_of, recast

# Logical axes of a token tensor inside the MLP, of the experts' matrices.
TOKENS = ('batch', 'seq', None)
IN_AXES = ('experts', None, 'mlp')  # w_gate, w_up [E, d, f]
OUT_AXES = ('experts', 'mlp', None)  # w_down [E, f, d]
# capacity's buffers [b, E, C, d]: each device's rows, every expert's slots.
BUFFERS = ('batch', None, None, None)
# capacity's expert einsums: buffers [b, E, C, d] in, hidden [b, E, C, f] out.
EXPERTS_IN = 'becd,edf->becf'
EXPERTS_OUT = 'becf,efd->becd'
# dropless's grouped matmuls as model.fp8_metrics names them (fp8_metrics.record).
GROUPED_IN = 'td,edf->tf'
GROUPED_OUT = 'tf,efd->td'


@flax.struct.dataclass
class Routing:
  """A layer's routing of tokens [b, s]: logits [b, s, E] (fp32), the k chosen
  experts [b, s, k] (int32), their weights [b, s, k] (fp32) and each
  expert's share of the token's affinity [b, s, E] (fp32, summing to 1:
  the softmax, or the normalised sigmoid scores; the balancing loss's P)."""

  logits: jax.Array
  experts: jax.Array
  weights: jax.Array
  probabilities: jax.Array


def route(h: jax.Array, router: jax.Array, k: int, normalize: bool = True) -> Routing:
  """Mixtral's top-k routing of h [b, s, d] by router [d, E]: the k largest
  softmax probabilities, renormalised to sum to 1 unless `normalize` is false
  (Qwen2-MoE's norm_topk_prob=false)."""
  logits = jnp.einsum('bsd,de->bse', h, router.astype(h.dtype)).astype(jnp.float32)
  probabilities = jax.nn.softmax(logits, axis=-1)
  top, experts = jax.lax.top_k(probabilities, k)
  weights = top / jnp.sum(top, -1, keepdims=True) if normalize else top
  return Routing(logits, experts.astype(jnp.int32), weights, probabilities)


def route_biased(
  h, router, bias, k: int, groups: int, topk_groups: int, normalize: bool, scale: float
) -> Routing:
  """DeepSeek-V3's routing of h [b, s, d] by router [d, E]: sigmoid
  affinities; the top k chosen on affinity + `bias` [E] (loss-free
  balancing: the bias steers the choice, never the weights) among the
  `topk_groups` of `groups` expert groups whose two best biased affinities
  sum highest (group-limited routing; groups 1 = all experts); the chosen
  affinities renormalised to sum to 1 when `normalize`, then times `scale`
  (routed_scaling_factor)."""
  logits = jnp.einsum('bsd,de->bse', h, router.astype(h.dtype)).astype(jnp.float32)
  scores = jax.nn.sigmoid(logits)
  choice = scores + bias.astype(jnp.float32)
  if groups > 1:
    b, s, e = choice.shape
    by_group = choice.reshape(b, s, groups, e // groups)
    group_scores = jnp.sum(jax.lax.top_k(by_group, 2)[0], -1)  # [b, s, groups]
    kept = jnp.sum(jax.nn.one_hot(jax.lax.top_k(group_scores, topk_groups)[1], groups), -2) > 0
    choice = jnp.where(jnp.repeat(kept, e // groups, -1), choice, -jnp.inf)
  experts = jax.lax.top_k(choice, k)[1]
  weights = jnp.take_along_axis(scores, experts, -1)
  if normalize:
    weights = weights / (jnp.sum(weights, -1, keepdims=True) + 1e-20)
  probabilities = scores / jnp.sum(scores, -1, keepdims=True)
  return Routing(logits, experts.astype(jnp.int32), weights * scale, probabilities)


@dataclasses.dataclass(frozen=True)
class ExpertGemms:
  """How the routed experts' matmuls run: `fp8`, model.fp8's recipe (off:
  in the compute dtype, weights cast where used) and, for an FP8 amax that
  spans them, the manual mesh axes (inside a shard_map) splitting the rows
  (tokens, or capacity's buffer rows), the experts and their hidden columns
  (f), so that every layout quantizes as one device does (fp8.einsum's `split`)."""

  fp8: fp8_lib.Recipe = fp8_lib.NONE
  rows: tuple = ()
  experts: tuple = ()
  hidden: tuple = ()

  def local(self, rows: tuple, experts: tuple, hidden: tuple) -> ExpertGemms:
    return dataclasses.replace(self, rows=rows, experts=experts, hidden=hidden)


def _swiglu_grouped(xs, sizes, w_gate, w_up, w_down, gemms: ExpertGemms):
  """Rows xs [n, d] sorted by expert, `sizes` [E] rows each: each group through
  its expert (weights cast to xs's dtype where used, `_grouped`; with
  gemms.fp8, FP8 grouped matmuls, fp8.ragged_dot)."""
  if not gemms.fp8.on:
    gate = _grouped(xs, w_gate, sizes)
    up = _grouped(xs, w_up, sizes)
    return _grouped(jax.nn.silu(gate) * up, w_down, sizes)
  common = (('n', gemms.rows), ('e', gemms.experts))
  split_in, split_out = common + (('o', gemms.hidden),), common + (('k', gemms.hidden),)
  # The figures' einsum labels: t the rows (a device's are its experts'), d and f the widths.
  labelled = (('t', gemms.rows + gemms.experts), ('e', gemms.experts), ('f', gemms.hidden))
  scaling, grad = gemms.fp8.scaling, gemms.fp8.grad
  for w in (w_gate, w_up):
    fp8_metrics.record(GROUPED_IN, xs, w, scaling, labelled)
  gate = fp8_lib.ragged_dot(xs, w_gate, sizes, xs.dtype, scaling, split_in, grad)
  up = fp8_lib.ragged_dot(xs, w_up, sizes, xs.dtype, scaling, split_in, grad)
  hidden = jax.nn.silu(gate) * up
  fp8_metrics.record(GROUPED_OUT, hidden, w_down, scaling, labelled)
  return fp8_lib.ragged_dot(hidden, w_down, sizes, xs.dtype, scaling, split_out, grad)


def _grouped(x, w, sizes):
  """ragged_dot(x, w cast to x's dtype, sizes), whose backward casts w again
  rather than keep the cast: kept, it would be a copy of every expert's
  weights in each micro-batch a pipeline stashes. No remat policy saves a
  grouped matmul, so nothing else changes."""
  return recast(jax.lax.ragged_dot, x, w, x.dtype, sizes)


def _dropless_local(h, experts, weights, w_gate, w_up, w_down, psum_axes, gemms=ExpertGemms()):
  """dropless on one device's tokens h [b, s, d] and its share of each expert's columns."""
  b, s, d = h.shape
  k, num_experts = experts.shape[-1], w_gate.shape[0]
  flat = experts.reshape(-1)  # assignment a = token * k + slot
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  y = _swiglu_grouped(_rows(h.reshape(b * s, d), order // k), sizes, w_gate, w_up, w_down, gemms)
  # Back to (token, slot) order by the inverse permutation: a gather, not a scatter-add.
  return _combine(_rows(y, jnp.argsort(order)), weights, psum_axes, h.shape)


def _rows(x, index):
  """x[index] for indices known to be in range: unsigned, so jnp adds no
  negative-index fix-up. Its zeros, one array CSE'd across two micro-batches
  in a fused pipeline tick, made XLA:GPU fuse their gathers into one kernel,
  which tied the two micro-batches' all-to-alls together."""
  return x[index.astype(jnp.uint32)]


def _combine(y, weights, psum_axes, shape):
  """Assignments' outputs y [b*s*k, d] in (token, slot) order, weighted into tokens [b, s, d]."""
  b, s, d = shape
  y = y.reshape(b * s, -1, d)
  out = jnp.einsum('tkd,tk->td', y, weights.reshape(b * s, -1).astype(y.dtype))
  if psum_axes:
    out = jax.lax.psum(out, psum_axes)
  return out.reshape(b, s, d)


def _dropless_exchanged(
  h, experts, weights, w_gate, w_up, w_down, psum_axes, axis, gemms=ExpertGemms()
):
  """dropless with the experts split over mesh `axis` (this device holds w_* [E/ep, ...]).

  Each device sends every assignment to the device of its expert and gets
  the result back: two all-to-alls over `axis`. A fixed-size exchange keeps
  it dropless: each destination's buffer has room for all n of the sender's
  assignments (rows past its count are zeros, computed as no expert's), so
  no routing can overflow it; ep x the assignments' bytes is the price.
  """
  b, s, d = h.shape
  k, local = experts.shape[-1], w_gate.shape[0]
  ep, n = jax.lax.axis_size(axis), b * s * k
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # by expert, so by destination device
  expert_sorted = _rows(flat, order)
  counts = jnp.bincount(expert_sorted // local, length=ep)
  starts = jnp.cumsum(counts) - counts
  rank = jnp.arange(n)
  valid = rank[None, :] < counts[:, None]  # [ep, n]: row r of destination j is real
  pick = jnp.where(valid, starts[:, None] + rank[None, :], 0)
  send = jnp.where(valid[..., None], _rows(_rows(h.reshape(b * s, d), order // k), pick), 0)
  send_expert = jnp.where(valid, _rows(expert_sorted, pick) % local, local)  # `local` = padding
  recv = jax.lax.all_to_all(send, axis, 0, 0)  # [ep, n, d]: recv[i] came from device i
  recv_expert = jax.lax.all_to_all(send_expert, axis, 0, 0).reshape(ep * n)
  regroup = jnp.argsort(recv_expert, stable=True)  # padding rows last: no group, output 0
  sizes = jnp.bincount(recv_expert, length=local + 1)[:local].astype(jnp.int32)
  rows = _rows(recv.reshape(ep * n, d), regroup)
  y = _swiglu_grouped(rows, sizes, w_gate, w_up, w_down, gemms)
  y = _rows(y, jnp.argsort(regroup)).reshape(ep, n, d)
  back = jax.lax.all_to_all(y, axis, 0, 0)  # back[j]: what device j computed of ours
  dest = expert_sorted // local
  y = back[dest.astype(jnp.uint32), (rank - _rows(starts, dest)).astype(jnp.uint32)]  # [n, d]
  return _combine(_rows(y, jnp.argsort(order)), weights, psum_axes, h.shape)


def _splits(mesh, *specs) -> bool:
  """Whether any of `specs` splits over an automatic mesh axis of more than one device."""
  named = {a for spec in specs for entry in spec for a in _axes(entry)}
  return any(mesh.shape[a] > 1 for a in named - set(mesh.manual_axes))


def _axes(entry) -> tuple:
  """A PartitionSpec entry's mesh axes as a tuple."""
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def dropless(
  h, routing: Routing, w_gate, w_up, w_down, fp8: fp8_lib.Recipe = fp8_lib.NONE
) -> jax.Array:
  """The experts' output [b, s, d] of h [b, s, d]: every assignment computed;
  with `fp8` on (ModelSpec.fp8_recipe), each grouped matmul in FP8 (fp8.ragged_dot)."""
  # In their own dtype: each grouped matmul casts its weight (`_grouped`).
  ws = (w_gate, w_up, w_down)
  mesh = jax.sharding.get_abstract_mesh()
  in_spec = sharding.active_spec(IN_AXES)
  gemms = ExpertGemms(fp8)
  if mesh.empty or in_spec is None:
    return _dropless_local(h, routing.experts, routing.weights, *ws, (), gemms)
  token_spec, out_spec = sharding.active_spec(TOKENS), sharding.active_spec(OUT_AXES)
  if not _splits(mesh, token_spec, in_spec, out_spec):
    # Nothing split over an automatic axis (a pipeline stage's one replica
    # of rows): the whole is this device's, and no shard_map nests in the
    # executor's (whose split backward cannot rebind a checked one).
    return _dropless_local(h, routing.experts, routing.weights, *ws, (), gemms)
  psum_axes = _axes(in_spec[2])
  axis = in_spec[0]
  # The rows a device holds: its tokens' (batch and sequence axes), less the
  # expert axis that the exchange gathers them over.
  token_axes = tuple(a for entry in token_spec[:2] for a in _axes(entry) if a != axis)
  gemms = gemms.local(_automatic(mesh, token_axes), _axes(axis), _automatic(mesh, psum_axes))
  if mesh.manual_axes:
    specs = (token_spec, in_spec, out_spec)
    return _dropless_in_stage(h, routing, ws, specs, psum_axes, axis, gemms)
  # model.fp8_metrics' figures leave the shard_map whole (fp8_metrics.with_figures).
  local = jax.shard_map(
    fp8_metrics.with_figures(_dropless_body(axis, psum_axes, gemms)),
    mesh=mesh,
    in_specs=(token_spec, token_spec, token_spec, in_spec, in_spec, out_spec),
    out_specs=(token_spec, P()),
    axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
    # Tokens whole on each expert rank (sampling's one prompt): every rank
    # exchanges the same tokens and gets the same output, which the check
    # cannot see through the all-to-alls.
    check_vma=axis is None or axis in {a for e in token_spec for a in _axes(e)},
  )
  out, figures = local(h, routing.experts, routing.weights, *ws)
  fp8_metrics.merge(figures)
  return out


def _automatic(mesh, axes: tuple) -> tuple:
  """`axes` less the mesh's manual ones (a pipeline stage's: not split inside its shard_map)."""
  return tuple(a for a in axes if a not in mesh.manual_axes)


def _dropless_body(axis, psum_axes, gemms: ExpertGemms):
  """dropless on one device's tokens: its own experts, or with the experts
  split over mesh `axis`, theirs by all-to-all; `psum_axes` add the partial sums."""
  if axis is None:
    return functools.partial(_dropless_local, psum_axes=psum_axes, gemms=gemms)
  return functools.partial(_dropless_exchanged, psum_axes=psum_axes, axis=axis, gemms=gemms)


def _dropless_in_stage(h, routing: Routing, ws, specs, psum_axes, axis, gemms: ExpertGemms):
  """dropless inside the pipeline executor's shard_map: per device by
  model/per_device.py (an unchecked shard_map with its own backward, which
  reruns the dispatch; the executor's split backward cannot rebind a checked
  one). With the experts' columns split over `tensor`, no psum inside
  (unchecked, its transpose would not be Megatron's): the tokens and their
  routing weights enter as one copy per tensor rank and the ranks' partial
  outputs leave stacked on a leading axis split over `tensor`; GSPMD adds
  the partial outputs, and in the backward the copies' partial gradients."""
  token_spec, in_spec, out_spec = specs
  body = _dropless_body(axis, (), gemms)
  mesh = jax.sharding.get_abstract_mesh()
  ranks = math.prod(mesh.shape[a] for a in psum_axes)
  copies = lambda x: jnp.broadcast_to(x[None], (ranks,) + x.shape)  # noqa: E731
  stacked = P(psum_axes or None, *token_spec)

  def local(h, weights, w_gate, w_up, w_down, experts):
    out = body(h[0], experts, weights[0], w_gate, w_up, w_down)
    return out[None]

  args = (copies(h), copies(routing.weights), *ws, routing.experts)
  specs = (stacked, stacked, in_spec, in_spec, out_spec, token_spec)
  return jnp.sum(per_device.apply(local, args, specs, stacked, diff=5), 0)


def capacity_of(seq_len: int, k: int, num_experts: int, factor: float) -> int:
  """Assignments one expert takes from one batch row (GShard's group)."""
  return max(1, math.ceil(factor * seq_len * k / num_experts))


def capacity(
  h, routing: Routing, w_gate, w_up, w_down, factor: float, fp8: fp8_lib.Recipe = fp8_lib.NONE
):
  """(the experts' output [b, s, d], assignments dropped) with capacity-bounded
  buffers; with `fp8` on (ModelSpec.fp8_recipe), the experts' einsums in FP8
  (fp8.einsum, the expert axis a batch label: one GEMM per expert)."""
  b, s, _ = h.shape
  num_experts, k = w_gate.shape[0], routing.experts.shape[-1]
  c = capacity_of(s, k, num_experts, factor)
  dt = h.dtype
  # [b, k, s, E]: slot-major, so cumsum ranks every token's first choice before any second.
  onehot = jax.nn.one_hot(jnp.swapaxes(routing.experts, 1, 2), num_experts, dtype=jnp.int32)
  rank = jnp.cumsum(onehot.reshape(b, k * s, num_experts), axis=1).reshape(onehot.shape) - 1
  position = jnp.sum(rank * onehot, axis=-1)  # [b, k, s]: the assignment's place in its expert
  kept = position < c
  slots = jax.nn.one_hot(jnp.where(kept, position, c), c, dtype=dt)  # dropped: all zeros
  dispatch = jnp.einsum('bkse,bksc->bsec', onehot.astype(dt), slots)
  combine = jnp.einsum(
    'bkse,bksc,bks->bsec', onehot.astype(dt), slots, jnp.swapaxes(routing.weights, 1, 2).astype(dt)
  )
  x = jnp.einsum('bsec,bsd->becd', dispatch, h)
  y = _buffers_through_experts(x, w_gate, w_up, w_down, ExpertGemms(fp8))
  return jnp.einsum('bsec,becd->bsd', combine, y), jnp.sum(~kept)


def _swiglu_buffers(x, w_gate, w_up, w_down, gemms: ExpertGemms):
  """Buffers x [b, E, C, d] through their experts (w_* [E, ...], cast to x's
  dtype where used and again in the backward: `recast`; with gemms.fp8, FP8
  einsums, fp8.einsum)."""
  if not gemms.fp8.on:
    gate = recast(einsum_of(EXPERTS_IN), x, w_gate, x.dtype)
    up = recast(einsum_of(EXPERTS_IN), x, w_up, x.dtype)
    return recast(einsum_of(EXPERTS_OUT), jax.nn.silu(gate) * up, w_down, x.dtype)
  split = (('b', gemms.rows), ('e', gemms.experts), ('f', gemms.hidden))
  scaling, grad = gemms.fp8.scaling, gemms.fp8.grad
  for w in (w_gate, w_up):
    fp8_metrics.record(EXPERTS_IN, x, w, scaling, split)
  gate = fp8_lib.einsum(EXPERTS_IN, x, w_gate, x.dtype, scaling, split=split, grad=grad)
  up = fp8_lib.einsum(EXPERTS_IN, x, w_up, x.dtype, scaling, split=split, grad=grad)
  hidden = jax.nn.silu(gate) * up
  fp8_metrics.record(EXPERTS_OUT, hidden, w_down, scaling, split)
  return fp8_lib.einsum(EXPERTS_OUT, hidden, w_down, x.dtype, scaling, split=split, grad=grad)


def _buffers_through_experts(x, w_gate, w_up, w_down, gemms: ExpertGemms):
  """capacity's expert step. With the experts split over a mesh axis, GShard's:
  each device's rows' buffers go to their experts' devices by one all-to-all
  over that axis and come back by another; otherwise dense einsums left to GSPMD."""
  mesh = jax.sharding.get_abstract_mesh()
  in_spec = sharding.active_spec(IN_AXES)
  if mesh.empty or in_spec is None or in_spec[0] is None:
    return _swiglu_buffers(x, w_gate, w_up, w_down, gemms)
  axis, psum_axes = in_spec[0], _axes(in_spec[2])
  buffer_spec = sharding.active_spec(BUFFERS)
  # After the exchange a device's buffer rows are its expert group's: split over the batch's axes but `axis`.
  rows = tuple(a for a in _axes(buffer_spec[0]) if a != axis)
  gemms = gemms.local(_automatic(mesh, rows), _axes(axis), _automatic(mesh, psum_axes))

  @fp8_metrics.with_figures
  def exchanged(x, w_gate, w_up, w_down):
    # [b, E, C, d] -> [ep * b, E/ep, C, d]: every group member's rows, this device's experts.
    x = jax.lax.all_to_all(x, axis, 1, 0, tiled=True)
    y = _swiglu_buffers(x, w_gate, w_up, w_down, gemms)
    if psum_axes:
      y = jax.lax.psum(y, psum_axes)
    return jax.lax.all_to_all(y, axis, 0, 1, tiled=True)

  y, figures = jax.shard_map(
    exchanged,
    mesh=mesh,
    in_specs=(buffer_spec, in_spec, in_spec, sharding.active_spec(OUT_AXES)),
    out_specs=(buffer_spec, P()),
    axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
  )(x, w_gate, w_up, w_down)
  fp8_metrics.merge(figures)  # model.fp8_metrics' (fp8_metrics.with_figures)
  return y


@flax.struct.dataclass
class LayerStats:
  """One MoE layer's router statistics over its tokens (sums, so layers and
  batches add): assignments per expert [E], router probability per expert
  [E], sum of logsumexp(logits)^2, tokens, assignments dropped, and over
  its rows (sequences) the sum of each row's balance (`_row_balance`) and
  the rows."""

  assigned: jax.Array
  probability: jax.Array
  z_squared: jax.Array
  tokens: jax.Array
  dropped: jax.Array
  row_balance: jax.Array
  rows: jax.Array


def layer_stats(routing: Routing, dropped) -> LayerStats:
  num_experts = routing.logits.shape[-1]
  counts = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32)
  probs = routing.probabilities
  lse = jax.nn.logsumexp(routing.logits, axis=-1)
  b, s = routing.logits.shape[:2]
  return LayerStats(
    assigned=jnp.sum(counts, axis=(0, 1, 2)),
    probability=jnp.sum(probs, axis=(0, 1)),
    z_squared=jnp.sum(lse * lse),
    tokens=jnp.asarray(b * s, jnp.float32),
    dropped=jnp.asarray(dropped, jnp.float32),
    row_balance=jnp.sum(_row_balance(counts, probs)),
    rows=jnp.asarray(b, jnp.float32),
  )


def _row_balance(counts, probs):
  """DeepSeek-V3's sequence-wise balance of each row [b] (its Eq. 17-20):
  sum_e f_e P_e with f_e = E / (k s) x the row's assignments to e and P_e
  the row's mean share of e; 1 at a perfect balance, E when one expert
  takes every token with all the affinity. counts [b, s, k, E] (one-hot),
  probs [b, s, E]."""
  _, s, k, e = counts.shape
  f = jnp.sum(counts, axis=(1, 2)) * e / (k * s)
  return jnp.sum(jax.lax.stop_gradient(f) * jnp.mean(probs, axis=1), axis=-1)


def _balance(assigned, probability, rows):
  """Switch's load-balancing loss E * sum_e f_e P_e from summed assignments and
  probabilities [..., E] over `rows` tokens."""
  return assigned.shape[-1] * jnp.sum((assigned / rows) * (probability / rows), axis=-1)


def losses(stats: LayerStats, per_layer: bool = False) -> dict[str, jax.Array]:
  """The router's losses and load figures from stats stacked over layers ([L, ...]).

  router_aux_loss: transformers' load_balancing_loss_func over every layer's
  rows (k at perfect balance; E when one expert takes every token with all
  the probability; below k when the k-th choices go where probability is
  low); with `per_layer` (model.router_aux_loss_scope=microbatch, the stats
  of one micro-batch) Megatron's instead: each layer's own, averaged over
  the layers. router_z_loss: the mean over rows of logsumexp^2;
  moe_load_max: the busiest expert's assignments over the mean, worst layer
  (1 = balanced); moe_dropped_fraction: assignments dropped (capacity dispatch);
  router_seq_aux_loss: the rows' sequence-wise balance (`_row_balance`),
  averaged over rows and layers.
  """
  rows = jnp.sum(stats.tokens)
  if per_layer:
    aux = jnp.mean(_balance(stats.assigned, stats.probability, stats.tokens[:, None]))
  else:
    aux = _balance(jnp.sum(stats.assigned, 0), jnp.sum(stats.probability, 0), rows)
  per_layer_load = jnp.max(stats.assigned, axis=-1) / jnp.mean(stats.assigned, axis=-1)
  return {
    'router_aux_loss': aux,
    'router_z_loss': jnp.sum(stats.z_squared) / rows,
    'moe_load_max': jnp.max(per_layer_load),
    'moe_dropped_fraction': jnp.sum(stats.dropped) / jnp.sum(stats.assigned),
    'router_seq_aux_loss': jnp.sum(stats.row_balance) / jnp.sum(stats.rows),
  }


# The pipeline executor's view (model.router_aux_loss_scope=microbatch): a
# stage runs some layers of one micro-batch and never sees the objective
# whole, so each MoE layer adds its share of the router losses to the
# gradient itself (`with_gradient_of`, Megatron's MoEAuxLossAutoScaler) and
# reports its share of the logged figures.


@jax.custom_vjp
def with_gradient_of(x, term):
  """x, whose backward also differentiates the scalar `term` as if it were
  added to the objective: term's cotangent is 1, whatever x's is."""
  del term
  return x


def _with_gradient_of_fwd(x, term):
  return x, term


def _with_gradient_of_bwd(term, g):
  # 1 typed like term (its varying mesh axes), as a cotangent must be.
  return g, jnp.zeros_like(term) + 1


with_gradient_of.defvjp(_with_gradient_of_fwd, _with_gradient_of_bwd)


def layer_share(stats: LayerStats, coefs: tuple[float, float], parts: int, axes: tuple):
  """One layer's share of one micro-batch's router losses: (a term whose
  gradient is that of its share of the objective, {figure: share} summed
  over layers, micro-batches and replicas to give `losses(..., per_layer=True)`'s
  averages, {figure: value} whose maximum gives moe_load_max).

  coefs: (router_aux_loss_coef, router_z_loss_coef,
  router_seq_aux_loss_coef); parts: MoE layers x
  micro-batches, the terms averaged; axes: manual mesh axes the micro-batch's
  rows are split over. Every replica balances the whole micro-batch: the
  assignment counts and token count are summed over `axes` (they carry no
  gradient), and each replica differentiates its own rows' probabilities
  against them, E * sum_e f_e P_e being linear in P. The term is built from
  this replica's values only, so its gradient needs no collective.
  """
  counts = (stats.assigned, stats.tokens, stats.rows)
  if axes:
    counts = jax.lax.psum(counts, axes)
  assigned, rows, sequences = jax.lax.stop_gradient(counts)
  probability = jax.lax.psum(stats.probability, axes) if axes else stats.probability
  replicas = jax.lax.psum(1, axes) if axes else 1
  aux = _balance(assigned, probability, rows) / parts
  z = stats.z_squared / rows / parts  # this replica's rows; the replicas' add up
  seq = stats.row_balance / sequences / parts  # so too
  term = coefs[0] * _balance(assigned, stats.probability, rows) / parts + coefs[1] * z
  term = term + coefs[2] * seq
  dropped = jax.lax.psum(stats.dropped, axes) if axes else stats.dropped
  shares = {
    'router_aux_loss': aux / replicas,
    'router_z_loss': z,
    'router_seq_aux_loss': seq,
    'moe_assigned': jnp.sum(assigned) / replicas,
    'moe_dropped': dropped / replicas,
  }
  return term, shares, {'moe_load_max': jnp.max(assigned) / jnp.mean(assigned)}


def figures(shares: dict, maxima: dict) -> dict[str, jax.Array]:
  """The logged figures from every layer's and micro-batch's summed shares and maxima."""
  return {
    'router_aux_loss': shares['router_aux_loss'],
    'router_z_loss': shares['router_z_loss'],
    'router_seq_aux_loss': shares['router_seq_aux_loss'],
    'moe_load_max': maxima['moe_load_max'],
    'moe_dropped_fraction': shares['moe_dropped'] / shares['moe_assigned'],
  }


# Auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024): each MoE
# layer's router adds a per-expert bias to its affinities when it chooses
# (never to the weights), and the bias moves after each step towards the
# experts that got fewer tokens. The load reaches the optimizer as the
# bias's gradient (`balance_term`), so every layout sums it over
# micro-batches, replicas and stages as it sums any gradient.

# The parameter name of a layer's expert bias [E].
BIAS = 'router_bias'


def balance_term(assigned: jax.Array, bias: jax.Array) -> jax.Array:
  """A scalar whose gradient w.r.t. `bias` [E] is minus the load `assigned`
  [E] (assignments per expert), for with_gradient_of: the objective's value
  is unchanged, the bias's gradient is -load whatever the loss's scale."""
  return -jnp.sum(jax.lax.stop_gradient(assigned) * bias)


def with_bias_update(inner: optax.GradientTransformation, rate: float):
  """`inner` for every parameter but the balancing biases (leaves named
  BIAS), which move by rate x sign(mean load - load) per layer instead, the
  load being minus their gradient (`balance_term`). `inner` sees zeros for
  their gradients (nothing in its clipping norm; its moments for them stay
  0) and its updates for them are replaced, weight decay's included. Its
  state keeps the parameters' structure, so it shards as theirs does. The
  sign makes the step independent of the gradient's scale (micro-batches,
  replicas, the loss's normalisation)."""

  def balanced(path) -> bool:
    return getattr(path[-1], 'key', None) == BIAS

  def step(g):
    load = -g.astype(jnp.float32)
    return (rate * jnp.sign(jnp.mean(load, -1, keepdims=True) - load)).astype(g.dtype)

  def update(grads, state, params=None):
    zeroed = jax.tree_util.tree_map_with_path(
      lambda path, g: jnp.zeros_like(g) if balanced(path) else g, grads
    )
    updates, state = inner.update(zeroed, state, params)
    updates = jax.tree_util.tree_map_with_path(
      lambda path, u, g: step(g) if balanced(path) else u, updates, grads
    )
    return updates, state

  return optax.GradientTransformation(inner.init, update)
