"""What every model family shares: the spec's common fields, parameter and
norm helpers, remat policies, and `DecoderModel`, the pure functions over a
parameter tree that the trainer, the pipeline executor and the sampler call.

A family (gpt.py, llama.py) supplies three flax modules (embedding, one
block, head), its spec class and its FLOPs; `DecoderModel` turns them into
init / logical_axes / embed / layers / head_loss / loss / logits, so the
family files hold only what differs between families.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from triax.model import context as context_lib
from triax.model import fp8 as fp8_lib
from triax.model import fp8_delayed, fp8_metrics
from triax.model import loss as loss_lib
from triax.sharding import active_spec, constrain, vary_like

Params = Any

# Activation recomputation (model.remat): each policy's jax.checkpoint policy
# for a whole layer, None where the layer runs without one.
REMAT_POLICIES = {
  'none': None,
  # Megatron's selective recomputation (Korthikanti et al. 2022, Sec. 5): the
  # layer keeps what it keeps without remat but the attention core's scores
  # and probabilities, which its backward recomputes from Q, K and V
  # (`recomputes_attention_core`: the core's own checkpoint, not the layer's).
  'attention': None,
  # Every weight matmul's output kept (Q, K, V, the attention's output
  # projection, the MLP's), the rest of the layer recomputed: the attention
  # core (its matmuls have batch dimensions), norms, activations, residual adds.
  'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  'full': jax.checkpoint_policies.nothing_saveable,
}


def layer_checkpointed(remat: str) -> bool:
  """Whether a layer runs under jax.checkpoint with the policy `remat` names."""
  return REMAT_POLICIES[remat] is not None


def recomputes_attention_core(remat: str) -> bool:
  """Whether XLA's attention core runs under its own checkpoint (remat=attention)."""
  return remat == 'attention'


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The hyper-parameters every family reads; a family subclasses it with its own.

  Each field not marked otherwise is the config key `model.<field>`, so a
  family's config keys are its spec's fields (registry.py rejects the others).
  `head_dim` 0 is resolved to d_model / num_heads on construction.
  """

  family: str
  num_layers: int
  d_model: int
  num_heads: int
  d_ff: int
  vocab_size: int
  seq_len: int
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  remat: str = 'none'
  # False: the layer stack runs unrolled, not as a loop (MaxText's scan_layers).
  scan_layers: bool = True
  attention: str = 'xla'
  # splash only: the kernel through Pallas's interpreter, on any backend (tests; slow).
  splash_interpret: bool = False
  # Sequence positions per cross-entropy chunk (model/loss.py); 0 = all at once.
  loss_chunk: int = 0
  # Ids from this one on are vocabulary padding (Megatron's): masked out of the
  # loss and of sampling (loss.mask_padding); 0 = all vocab_size ids are used.
  vocab_used: int = 0
  # With context > 1: allgather or ring (model/context.py).
  context_attention: str = 'allgather'
  # Weight matmuls' operands: none (dtype), or FP8 scaled tensorwise, rowwise (model/fp8.py)
  # or delayed (model/fp8_delayed.py).
  fp8: str = 'none'
  # The FP8 backward's cotangent format: e5m2 (range) or e4m3 (precision); fp8.GRAD_FORMATS.
  fp8_grad: str = 'e5m2'
  # Steps of amax each delayed-scaling history keeps (model.fp8=delayed).
  fp8_amax_history: int = 1024
  # Log the FP8 matmuls' amax, scales and overflow (model/fp8_metrics.py).
  fp8_metrics: bool = False
  # Width of each attention head; 0 = d_model / num_heads. Qwen3's and Gemma's
  # are wider (heads x head_dim > d_model); a tensor shard keeps it (fewer heads).
  head_dim: int = 0
  # Not a config key: the context ranks (mesh.context) the trainer splits the
  # sequence over; with more than one, its slots hold load-balanced positions
  # (context.positions) and attention meets the other ranks' keys.
  context: int = dataclasses.field(default=1, metadata={'config': False})
  # Not a config key: how ring attention moves its K/V blocks between context
  # ranks (context.TRANSPORTS); the trainer picks it for the devices.
  ring_transport: str = dataclasses.field(default='ppermute', metadata={'config': False})

  # Keys of the model-shape record a checkpoint is checked against
  # (training/checkpoint.py): what decides the parameter tree's shapes.
  SHAPE_KEYS: ClassVar[tuple[str, ...]] = (
    'family',
    'num_layers',
    'd_model',
    'num_heads',
    'd_ff',
    'vocab_size',
    'seq_len',
    'param_dtype',
    'head_dim',
  )

  def __post_init__(self):
    if not self.head_dim:
      object.__setattr__(self, 'head_dim', self.d_model // self.num_heads)

  @classmethod
  def config_fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get('config', True))

  @classmethod
  def from_config(cls, model_cfg) -> ModelSpec:
    return cls(**{k: model_cfg[k] for k in cls.config_fields()})

  @property
  def kv_heads(self) -> int:
    """Heads of K and V (what a K/V cache holds); a family with grouped-query attention has fewer."""
    return self.num_heads

  @property
  def stream_norms(self) -> int:
    """RMSNorms a block runs over the [s, d] residual stream, which the
    planner prices as memory traffic (plan/cost/analytic.py): the pre-norms
    before attention and the MLP; Gemma's post-norms add two."""
    return 2

  @property
  def layers_per_entry(self) -> int:
    """Blocks one entry of the stacked 'layers' axis holds: one, or a MoE
    family's group of dense blocks and a MoE block (mixtral.Group). The
    scan, the pipeline's chunks and the checkpoints count entries."""
    return 1

  @property
  def stacked_layers(self) -> int:
    """Blocks of the stacked 'layers' axis: all num_layers, but a family's
    own blocks outside it (DeepSeek's first dense ones, in the embedding)."""
    return self.num_layers

  @property
  def stack_depth(self) -> int:
    """Entries of the stacked 'layers' axis."""
    return self.stacked_layers // self.layers_per_entry

  def positions(self, length: int) -> jax.Array:
    """The position each of a training window's `length` slots holds: 0..length-1,
    or the load-balanced order when the sequence is split over context ranks."""
    return context_lib.positions(length, self.context)

  def split_sequence(self, length: int) -> tuple:
    """causal_attention's (positions, context kind, ring transport) for a
    training window of `length` slots; () when the sequence is whole on each
    device."""
    if self.context == 1:
      return ()
    return (self.positions(length), self.context_attention, self.ring_transport)

  def local_layers(self) -> tuple[bool, ...] | None:
    """Whether each stack entry's attention is local (a sliding window);
    None: the family has no local layers."""
    return None

  @property
  def fp8_recipe(self) -> fp8_lib.Recipe:
    """What the weight matmuls run on (`matmul`'s `fp8`): model.fp8 and model.fp8_grad."""
    return fp8_lib.Recipe(self.fp8, self.fp8_grad)

  def executor_refusal(self) -> str:
    """Why the pipeline executor cannot train this model ('' when it can)."""
    return ''

  def tensor_shard(self, t: int) -> ModelSpec:
    """The spec of one of t tensor ranks' shards (Megatron's split: heads,
    MLP columns and vocabulary divided by t), for the planner's profiler."""
    if t == 1:
      return self
    return dataclasses.replace(
      self,
      num_heads=self.num_heads // t,
      d_ff=self.d_ff // t,
      vocab_size=self.vocab_size // t,
      vocab_used=0,  # a shard's ids are not global ids; masking is elementwise, cost-free
    )


def param(module: nn.Module, name: str, shape, axes, stddev: float, dtype):
  """A parameter with logical axis names; stddev 0 initialises to ones (norm scales)."""
  init = nn.initializers.normal(stddev) if stddev else nn.initializers.ones
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


# The residual stream's logical axes: between the tensor-parallel regions,
# split along the sequence over `context` (and `tensor` with mesh.sequence_parallel).
RESIDUAL = ('batch', 'residual_seq', 'embed')


def rms_norm(x, scale, eps: float):
  """RMSNorm of x [b, s, d], where the residual stream lives: pinned there,
  GSPMD gathers its output for the next column-parallel matmul (and
  reduce-scatters the gradient back), rather than gathering the stream
  before the norm and all-reducing the norm's gradient whole."""
  return constrain(_rms_norm(x, scale, eps), RESIDUAL)


def head_norm(x, scale, eps: float):
  """RMSNorm over the last axis of per-head values [..., head_dim] (Qwen3's
  and Gemma 3's q/k norms), with `_rms_norm`'s lean backward."""
  return _rms_norm(x, scale, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, scale, eps: float):
  """x / rms(x) * scale in fp32, cast back to x's dtype.

  Its own backward keeps x (in its dtype) and the [b, s, 1] reciprocal rms
  only, as Megatron's fused norm does: autodiff of the fp32 arithmetic kept
  x's fp32 cast and the normalised x too, two fp32 [b, s, d] residuals per
  norm (4x a bf16 input's bytes), the largest per-layer item after the MLP
  and the attention probabilities in a bf16 run."""
  return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps: float):
  x32 = x.astype(jnp.float32)
  r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * r * scale.astype(jnp.float32)).astype(x.dtype), (x, scale, r)


def _rms_norm_bwd(eps: float, residuals, g):
  del eps
  x, scale, r = residuals
  xhat = x.astype(jnp.float32) * r
  g = g.astype(jnp.float32)
  d_scale = jnp.sum(g * xhat, axis=tuple(range(g.ndim - 1)))
  d_xhat = g * scale.astype(jnp.float32)
  d_x = r * (d_xhat - xhat * jnp.mean(d_xhat * xhat, axis=-1, keepdims=True))
  return d_x.astype(x.dtype), d_scale.astype(scale.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def matmul(equation: str, x, w, dtype, remat: str, fp8: fp8_lib.Recipe = fp8_lib.NONE):
  """einsum(equation, x, w cast to `dtype`), a layer's weight w; with `fp8`
  on (model.fp8 and fp8_grad, `ModelSpec.fp8_recipe`), on FP8 operands
  (model/fp8.py), under every remat.

  Without remat the backward casts w again instead of keeping its cast: kept,
  the cast is a residual, a copy of the layer's weights in every micro-batch
  a pipeline stashes and in the layer scan's residuals. Under a layer's checkpoint it
  is not kept anyway, and the einsum stays plain: a custom_vjp would hide its
  product from `dots`'s policy (config.py refuses fp8 with dots for that reason).
  Under model.fp8_metrics its figures go on the open tape (fp8_metrics.py);
  under delayed it reads its site's history (fp8_delayed.py)."""
  if fp8.on:
    history = _fp8_history(equation, fp8)
    fp8_metrics.record(equation, x, w, fp8.scaling, history=history)
    return _fp8_einsum(equation, x, w, dtype, fp8, history)
  if layer_checkpointed(remat):
    return jnp.einsum(equation, x, w.astype(dtype))
  return recast(einsum_of(equation), x, w, dtype)


def _fp8_history(equation: str, fp8: fp8_lib.Recipe):
  return fp8_delayed.history(equation) if fp8.scaling == 'delayed' else None


def _fp8_einsum(equation: str, x, w, dtype, fp8: fp8_lib.Recipe, history=None):
  probe = fp8_metrics.probe()
  return fp8_lib.einsum(equation, x, w, dtype, fp8.scaling, probe, history=history, grad=fp8.grad)


@functools.cache
def einsum_of(equation: str):
  """(x, w) -> einsum(equation, x, w): one function per equation, for `recast`."""
  return functools.partial(jnp.einsum, equation)


def recast(op, x, w, dtype, *args):
  """op(x, w cast to `dtype`, *args), whose backward casts w again rather
  than keep the cast: `matmul`'s einsum, and moe.py's grouped and batched
  expert matmuls, which no remat policy saves, under every policy. `args`
  (ragged_dot's group sizes) get no gradient."""
  return _recast(op, jnp.dtype(dtype), x, w, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _recast(op, dtype, x, w, *args):
  return op(x, w.astype(dtype), *args)


def _recast_fwd(op, dtype, x, w, *args):
  return _recast(op, dtype, x, w, *args), (x, w, args)


def _recast_bwd(op, dtype, residuals, g):
  x, w, args = residuals
  _, pull = jax.vjp(lambda x, c: op(x, c, *args), x, w.astype(dtype))
  dx, dc = pull(g)
  return (dx, dc.astype(w.dtype), *(None for _ in args))


_recast.defvjp(_recast_fwd, _recast_bwd)


def project(h, weights, equation: str, dtype, remat: str, fp8: fp8_lib.Recipe = fp8_lib.NONE):
  """h times each weight (cast to `dtype`; `matmul`'s `fp8`), keeping h as
  it arrives for the backward.

  Under sequence parallelism h arrives split along the sequence (rms_norm
  pins it there) and GSPMD gathers it for these column-parallel matmuls;
  autodiff would keep the gathered [b, s, d], t times the split one. The
  gather is redone in the backward instead, as Megatron's SP all-gathers
  the input again for the weight gradient: 2sbh/t bytes, the paper's count.
  Not without SP (h is whole: nothing to save) nor under full remat (no
  layer keeps residuals past its own backward), where the extra remat
  region only costs memory under XLA:TPU."""

  def run(h, *ws):
    return tuple(matmul(equation, h, w, dtype, remat, fp8) for w in ws)

  if remat == 'full' or not _sequence_split_over_tensor():
    return run(h, *weights)
  if fp8.on:
    # A checkpoint's values leave it only as outputs: the figures are taken
    # here, and each site's history goes in as an argument.
    histories = [_fp8_history(equation, fp8) for _ in weights]
    for w, history in zip(weights, histories):
      fp8_metrics.record(equation, h, w, fp8.scaling, history=history)

    def run(h, histories, *ws):
      return tuple(_fp8_einsum(equation, h, w, dtype, fp8, hist) for w, hist in zip(ws, histories))

    checkpointed = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)
    return checkpointed(h, histories, *weights)
  return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)(h, *weights)


def _sequence_split_over_tensor() -> bool:
  """Whether the active rules split the residual stream's positions over `tensor` (SP)."""
  spec = active_spec(RESIDUAL)
  seq = spec[1] if spec is not None and len(spec) > 1 else None
  return 'tensor' in (seq if isinstance(seq, tuple) else (seq,))


@jax.custom_vjp
def swiglu(gate, up):
  """silu(gate) * up (Llama's MLP) whose backward keeps gate and up only.

  Autodiff keeps silu's three internals and the product beside them: six
  [b, s, d_ff] residuals per layer where these two (and the down
  projection's input) do."""
  return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
  return jax.nn.silu(gate) * up, (gate, up)


def _swiglu_bwd(residuals, g):
  # In the activations' dtype, as autodiff's was: an fp32 [b, s, d_ff] cotangent
  # would be a buffer of its own (XLA:TPU kept one).
  gate, up = residuals
  sig = jax.nn.sigmoid(gate)
  return g * up * sig * (1 + gate * (1 - sig)), g * gate * sig


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def gelu(u):
  """GELU (tanh form, jax.nn.gelu's default) whose backward keeps u only.

  Autodiff keeps u and the tanh beside it, and XLA another elementwise
  product: [b, s, d_ff] each, the largest per-layer residuals; Korthikanti
  et al.'s count (and Megatron's fused bias-GELU) keeps the input alone."""
  return jax.nn.gelu(u)


def _gelu_fwd(u):
  return jax.nn.gelu(u), u


def _gelu_bwd(u, g):
  return (g * _gelu_derivative(u),)


def _gelu_derivative(u):
  """d gelu(u) / du of the tanh form, in u's dtype, as autodiff's was (an fp32
  cotangent would be a buffer of its own)."""
  c = math.sqrt(2 / math.pi)
  t = jnp.tanh(c * (u + 0.044715 * u**3))
  return 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * c * (1 + 3 * 0.044715 * u * u)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


@jax.custom_vjp
def geglu(gate, up):
  """gelu(gate) * up, GELU's tanh form (Gemma's MLP: gelu_pytorch_tanh), whose
  backward keeps gate and up only, as `swiglu`'s does."""
  return jax.nn.gelu(gate) * up


def _geglu_fwd(gate, up):
  return jax.nn.gelu(gate) * up, (gate, up)


def _geglu_bwd(residuals, g):
  gate, up = residuals
  return g * up * _gelu_derivative(gate), g * jax.nn.gelu(gate)


geglu.defvjp(_geglu_fwd, _geglu_bwd)


@flax.struct.dataclass
class Decode:
  """What a block needs to decode with a K/V cache (one layer's).

  k, v: [b, S, kv_heads, head_dim], S = seq_len slots; the new tokens' keys
  and values are written at slots index .. index+t-1. Row r's prompt was
  left-padded to start at slot start[r]: its earlier slots are never
  attended to. positions [b, t]: the new tokens' positions in their rows.

  With `rolling` (a local layer's cache, bounded by its window), k and v
  hold W = model.sliding_window slots: slot j of the sequence lives at
  entry j mod W, and what the new tokens overwrite is out of every later
  query's window.
  """

  k: jax.Array
  v: jax.Array
  index: jax.Array
  start: jax.Array
  positions: jax.Array
  rolling: bool = flax.struct.field(pytree_node=False, default=False)


def _rolling_attention(q, k, v, decode: Decode, repeat):
  """Decoding attention over a rolling cache (`Decode.rolling`) and the new
  tokens' k, v [b, t, kv, hd]: (output, the cache's new k, v)."""
  w, t = decode.k.shape[1], q.shape[1]
  entries = jnp.arange(w)
  # The slot each entry holds: the latest before `index` congruent to it
  # (negative: none yet, below every row's start).
  held = decode.index - 1 - jnp.mod(decode.index - 1 - entries, w)
  key_slots = jnp.concatenate([held, decode.index + jnp.arange(t)])
  k_all, v_all = (
    jnp.concatenate([c, new.astype(c.dtype)], axis=1).astype(q.dtype)
    for c, new in ((decode.k, k), (decode.v, v))
  )
  query = decode.index + jnp.arange(t)
  gap = query[None, :, None] - key_slots[None, None, :]
  mask = (gap >= 0) & (gap < w) & (key_slots[None, None, :] >= decode.start[:, None, None])
  out = jax.nn.dot_product_attention(
    q, repeat(k_all), repeat(v_all), mask=mask[:, None], implementation='xla'
  )
  # Each entry's slot after the new tokens: from them if it is one of theirs.
  latest = decode.index + t - 1 - jnp.mod(decode.index + t - 1 - entries, w)
  fresh = (latest >= decode.index)[None, :, None, None]
  pick = jnp.clip(latest - decode.index, 0, t - 1)
  caches = tuple(
    jnp.where(fresh, jnp.take(new.astype(c.dtype), pick, axis=1), c)
    for c, new in ((decode.k, k), (decode.v, v))
  )
  return out, caches


def causal_attention(
  q,
  k,
  v,
  impl: str,
  decode: Decode | None = None,
  segments: jax.Array | None = None,
  interpret: bool = False,
  positions: jax.Array | None = None,
  context: str = '',
  ring_transport: str = 'ppermute',
  remat: str = 'none',
  window: int = 0,
  local=True,
):
  """Causal attention of q [b, t, n, hd] over k, v [b, t, kv, hd] (kv divides n).

  K/V head j serves query heads j*g .. j*g+g-1 (transformers' repeat_kv).
  Repeated to one per query head, they split over `tensor` as the queries do
  whether the K/V heads were split or replicated; the kernels' own GQA would
  pair a rank's query heads with K/V heads it may not hold. With `decode`,
  k and v go into the cache first and q attends to every cached slot of its
  row up to its own (a rolling cache, `Decode.rolling`: the window's latest
  slots only); returns (output, (k cache, v cache)) then. With
  `segments` [b, t] (the document number of each position of a packed row,
  data.mask_documents), a query attends only within its own document.
  `impl`: xla, cudnn or splash (the TPU kernel; `interpret` runs it through
  Pallas's interpreter on any backend). `positions` [t]: each slot's
  position (the causal mask compares them; 0..t-1 if None); `context`
  (allgather or ring) with the sequence split over context ranks, the
  ring's blocks moved by `ring_transport` (context.TRANSPORTS). `remat`,
  the layer's policy: with `attention` XLA's core (unsplit, or over gathered
  K/V) keeps Q, K and V only and recomputes its scores in the backward; the
  flash kernels and the ring keep no scores under any policy. `window`
  (model.sliding_window; 0 = none): a query sees the `window` latest
  positions, its own included, when `local` (a bool, or a traced one: a
  scanned layer's flag) holds.
  """
  recompute = recomputes_attention_core(remat)
  group = q.shape[2] // k.shape[2]
  repeat = lambda t: constrain(jnp.repeat(t, group, axis=2), ('batch', 'seq', 'heads', 'kv'))
  if local is False:
    window = 0
  reach = window if local is True or not window else jnp.where(local, window, 0)
  if decode is None and (impl != 'xla' or context):
    # A kernel's window, and a split sequence's, is static (what it skips is
    # decided when tracing): a traced flag picks one of two under cond.
    def attend(w: int):
      if not context:
        return _kernel_attention(q, repeat(k), repeat(v), impl, segments, interpret, w)
      kind = context_lib.ring_attention if context == 'ring' else context_lib.allgather_attention
      return kind(q, repeat(k), repeat(v), positions, segments, ring_transport, recompute, w)

    if local is True or not window:
      return attend(window)
    return jax.lax.cond(local, lambda: attend(window), lambda: attend(0))
  if decode is not None and decode.rolling:
    return _rolling_attention(q, k, v, decode, repeat)
  if decode is None:
    pos = jnp.arange(q.shape[1]) if positions is None else positions
    return context_lib.masked_attention(q, repeat(k), repeat(v), pos, segments, recompute, reach)
  k_cache = jax.lax.dynamic_update_slice_in_dim(decode.k, k.astype(decode.k.dtype), decode.index, 1)
  v_cache = jax.lax.dynamic_update_slice_in_dim(decode.v, v.astype(decode.v.dtype), decode.index, 1)
  slots = jnp.arange(k_cache.shape[1])
  query = decode.index + jnp.arange(q.shape[1])
  mask = (slots[None, None, :] <= query[None, :, None]) & (
    slots[None, None, :] >= decode.start[:, None, None]
  )
  if window:
    # Slots and positions differ by the row's start only: distances agree.
    mask = mask & context_lib.within(query[None, :, None] - slots[None, None, :], reach)
  out = jax.nn.dot_product_attention(
    q,
    repeat(k_cache.astype(q.dtype)),
    repeat(v_cache.astype(q.dtype)),
    mask=mask[:, None],
    implementation='xla',  # a mask and a length-1 query: the fused kernels take neither here
  )
  return out, (k_cache, v_cache)


def _kernel_attention(q, k, v, impl: str, segments, interpret: bool, window: int):
  """A fused kernel's causal attention (impl splash or cudnn; K/V one per
  query head), seeing the `window` latest positions (0 = all)."""
  if impl == 'splash':
    # Imported here: Pallas's TPU modules are slow to import, a cost every
    # process start of a run that does not use them would pay.
    from triax.model import splash

    return splash.attention(q, k, v, segments, interpret=interpret, window=window)
  mask = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]
  # cuDNN's window (left, right): keys i - left .. i + right of query i.
  reach = (window - 1, 0) if window else None
  return jax.nn.dot_product_attention(
    q, k, v, mask=mask, is_causal=True, implementation=impl, local_window_size=reach
  )


def _per_layer(p: Params) -> Params:
  """One layer's weights, times a one XLA cannot fold (it depends on their own
  values: x == x is false for NaN, which would make the layer's output NaN
  anyway). Without it, XLA:TPU hoists the bf16 cast of every layer's weights
  out of the layer loop (and a pipeline's tick loop) and holds a bf16 copy of
  the whole stack for the step instead of one layer's while it runs. The product fuses into the cast."""
  lead = jax.tree.leaves(p)[0].ravel()[0]
  one = (lead == lead).astype(lead.dtype)
  return jax.tree.map(lambda w: w * one.astype(w.dtype), p)


def _axes_tree(boxed: Params) -> Params:
  """Logical axis tuples of flax's LogicallyPartitioned leaves."""
  return jax.tree.map(
    lambda b: tuple(b.names), boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
  )


class DecoderModel:
  """A decoder-only model as pure functions over a parameter tree.

  params = {'embed': ..., 'layers': <block params stacked on a leading
  'layers' axis>, 'head': ...}. The layer stack runs under `lax.scan`, so
  compile time does not grow with depth. A family sets `embed_module`,
  `block_module` and `head_module` (flax modules taking the spec); the head
  module returns the final hidden state's logits given its own params and,
  for tied embeddings, the embedding table (`edge_params`).
  """

  embed_module: ClassVar[type[nn.Module]]
  block_module: ClassVar[type[nn.Module]]
  head_module: ClassVar[type[nn.Module]]

  def __init__(self, spec: ModelSpec):
    self.spec = spec
    self._embed = self.embed_module(spec)
    self._block = self.block_module(spec)
    self._head = self.head_module(spec)

  def _dummy(self):
    s = self.spec
    return (jnp.zeros((1, s.seq_len), jnp.int32), jnp.zeros((1, s.seq_len, s.d_model), s.dtype))

  def _head_init(self, key, x):
    return self._head.init(key, x, *self._head_extra_args())

  def _head_extra_args(self) -> tuple:
    """Arguments besides x the head module's init needs (a tied table's stand-in)."""
    return ()

  def init(self, rng: jax.Array) -> Params:
    tokens, x = self._dummy()
    k_embed, k_layers, k_head = jax.random.split(rng, 3)
    layer_keys = jax.random.split(k_layers, self.spec.stack_depth)
    return {
      'embed': nn.unbox(self._embed.init(k_embed, tokens))['params'],
      'layers': jax.vmap(lambda k: nn.unbox(self._block.init(k, x))['params'])(layer_keys),
      'head': nn.unbox(self._head_init(k_head, x))['params'],
    }

  def logical_axes(self) -> Params:
    """Same tree as `init`, with a tuple of logical axis names per leaf (one
    tree per model: callers read it, never change it)."""
    if '_logical_axes' not in self.__dict__:  # a trainer asks five times; each traces init
      self._logical_axes = self._trace_logical_axes()
    return self._logical_axes

  def _trace_logical_axes(self) -> Params:
    tokens, x = self._dummy()
    key = jax.random.key(0)
    layer = _axes_tree(jax.eval_shape(self._block.init, key, x)['params'])
    return {
      'embed': _axes_tree(jax.eval_shape(self._embed.init, key, tokens)['params']),
      'layers': jax.tree.map(
        lambda a: ('layers',) + a, layer, is_leaf=lambda a: isinstance(a, tuple)
      ),
      'head': _axes_tree(jax.eval_shape(self._head_init, key, x)['params']),
    }

  def edge_params(self, params: Params) -> tuple[Params, Params]:
    """(the embedding's params, the head's params) as `embed` and `head_loss`
    take them. A family with tied embeddings hands the table to the head too;
    callers that differentiate through this (jax.vjp) get the tied gradient
    summed for free."""
    return params['embed'], params['head']

  # Whether the embedding module runs blocks of its own (DeepSeek's dense ones)
  # and so takes the rows' document ids.
  embed_takes_segments: ClassVar[bool] = False

  def embed(self, embed_params: Params, tokens: jax.Array, segments=None) -> jax.Array:
    """The first layer stack entry's input [b, s, d] of tokens [b, s]; `segments`
    for a family whose embedding runs blocks of its own (`embed_takes_segments`)."""
    if segments is None or not self.embed_takes_segments:
      return self._embed.apply({'params': embed_params}, tokens)
    return self._embed.apply({'params': embed_params}, tokens, segments=segments)

  def layer(self, layer_params: Params, x: jax.Array, segments=None, local=None) -> jax.Array:
    """One stack entry; `local` (`local_flags`'s) only for a model with local layers."""
    if local is None:
      return self._block.apply({'params': layer_params}, x, None, segments)
    return self._block.apply({'params': layer_params}, x, None, segments, local)

  def local_flags(self, first, depth: int):
    """Whether each of the `depth` stack entries from entry `first` (an int,
    or a traced one: a pipeline chunk's first entry) is local: None without
    local layers, a bool when all agree (the scan carries nothing), else a
    bool [depth] array to scan beside the weights. Entries past the stack
    (an uneven split's padding) are global; they do not run."""
    table = self.spec.local_layers()
    if table is None or len(set(table)) == 1:
      return None if table is None else table[0]
    padded = jnp.asarray(table + (False,) * depth)
    return jax.lax.dynamic_slice_in_dim(padded, first, depth)

  def layers(
    self,
    stacked_params: Params,
    x: jax.Array,
    num_active: jax.Array | None = None,
    segments: jax.Array | None = None,
    first=0,
  ) -> jax.Array:
    """Runs a stack of layers (leading axis) in order, with the configured remat.

    With `num_active`, only the first `num_active` layers run; the rest are
    padding (uneven pipeline splits) and are skipped under `cond`. With
    `segments` [b, s], attention stays inside each packed document. `first`:
    the model's entry the stack starts at (a pipeline chunk's), which says
    where in model.sliding_window_pattern its layers are.
    """
    depth = jax.tree.leaves(stacked_params)[0].shape[0]
    local = self.local_flags(first, depth)
    if not isinstance(local, jax.Array):
      layer = lambda p, h: (self.layer(p, h, segments, local), None)  # noqa: E731
      return self._scan_layers(layer, stacked_params, x, num_active, None)[0]
    # The flag scanned beside the weights: one scan however the pattern mixes.
    layer = lambda p, h: (self.layer(p[0], h, segments, p[1]), None)  # noqa: E731
    return self._scan_layers(layer, (stacked_params, local), x, num_active, None)[0]

  def _scan_layers(self, layer, stacked_params: Params, x, num_active, skipped):
    """(the stack's output, each layer's second output stacked): layer(p, h)
    -> (h, out) under the configured remat; a padded layer (index >=
    num_active) passes h through and gives `skipped` for its out. With an
    FP8 tape open (fp8_metrics.py), each layer's figures join it; with a
    delayed-scaling state open (fp8_delayed.py), each layer reads its own."""
    layer, stacked_params = fp8_delayed.scanned(layer, stacked_params)
    if not fp8_metrics.active():
      return self._scan(layer, stacked_params, x, num_active, skipped)
    # Not in a pipeline (config.py refuses fp8_metrics there): no padded layers.
    assert num_active is None
    h, (out, figures) = self._scan(fp8_metrics.taped(layer), stacked_params, x, None, None)
    fp8_metrics.add_layers(figures)
    return h, out

  def _scan(self, layer, stacked_params: Params, x, num_active, skipped):
    if layer_checkpointed(self.spec.remat):
      # Recomputed, the weights' product with _per_layer's one is no
      # residual (without remat it would be one: a copy of the weights in
      # every stashed micro-batch).
      layer = jax.checkpoint(
        lambda p, h, f=layer: f(_per_layer(p), h), policy=REMAT_POLICIES[self.spec.remat]
      )
    # Unrolled, a chunk is loop-free code: XLA may schedule one layer's
    # collectives under another's compute, and in a fused pipeline tick
    # under the other micro-batch's.
    unroll = self.spec.scan_layers is False
    if num_active is None:
      return jax.lax.scan(lambda h, p: layer(p, h), x, stacked_params, unroll=unroll)

    # cond's branches must match in type: both outputs varying over the manual
    # axes h does (in a pipeline stage, its figures differ per stage; a
    # constant figure, dropless dispatch's zero drops, varies over none).
    def run(p, h):
      h, out = layer(p, h)
      return h, jax.tree.map(lambda z: vary_like(z, h), out)

    def skip(p, h):
      return h, jax.tree.map(lambda z: vary_like(z, h), skipped)

    def step(h, args):
      p, i = args
      return jax.lax.cond(i < num_active, run, skip, p, h)

    depth = jax.tree.leaves(stacked_params)[0].shape[0]
    return jax.lax.scan(step, x, (stacked_params, jnp.arange(depth)), unroll=unroll)

  def layers_and_sown(self, stacked_params: Params, x: jax.Array, segments=None):
    """(layers' output, what each block sowed into flax's 'intermediates'
    (a MoE router's statistics), stacked over the layers). The stack runs
    whole (no padded layers: the pipeline executor calls `stage_chunk`'s)."""
    return self._scan_layers(self._sowing_layer(segments), stacked_params, x, None, None)

  def _sowing_layer(self, segments):
    def layer(p, h):
      out, sown = self._block.apply({'params': p}, h, None, segments, mutable=['intermediates'])
      return out, sown['intermediates']

    return layer

  def stage_chunk(self, microbatches: int, replica_axes: tuple[str, ...]):
    """The pipeline executor's chunk function: (chunk_params, x[, num_active][,
    segments=]) -> (y, (shares, maxima)), `layers` with what a chunk
    contributes to the logged figures (`stage_objective`), summed and
    maximised over chunks and micro-batches by the executor. A dense model
    contributes nothing; a MoE adds its router losses' gradients itself
    (model/moe.py). `replica_axes`: the manual mesh axes a micro-batch's
    rows are split over."""
    del microbatches, replica_axes

    def chunk(stacked_params, x, num_active=None, segments=None, first=0):
      return self.layers(stacked_params, x, num_active, segments, first), ({}, {})

    return chunk

  # Terms of the pipeline's head loss (StageFns.loss_terms), kept apart for
  # `stage_objective`: 1, the cross-entropy.
  head_loss_terms: ClassVar[int] = 1

  def stage_objective(self, lm_loss, shares: dict, maxima: dict):
    """(what training minimised, logged figures) of a pipelined step, from
    its mean cross-entropy and the chunks' summed `shares` and `maxima`."""
    del shares, maxima
    return lm_loss, {}

  def objective(self, params: Params, inputs, targets, segments=None):
    """(what training minimises, {name: scalar} logged beside it). A dense
    model's objective is its loss; a MoE adds its router's losses."""
    return self.loss(params, inputs, targets, segments), {}

  def active_parameters(self, total: int) -> int:
    """Parameters one token's forward uses, of `total` (a MoE's unchosen experts are not)."""
    return total

  def head_logits(self, head_params: Params, x: jax.Array) -> jax.Array:
    """fp32 logits [..., vocab] of hidden states x (vocabulary-parallel),
    padded ids included (the loss masks them itself)."""
    return self._head.apply({'params': head_params}, x)

  def head_loss(self, head_params: Params, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Sum (not mean) of next-token cross-entropies, in fp32.

    Sums compose across micro-batches and pipeline stages; the caller divides
    by the global token count once.
    """
    return loss_lib.cross_entropy_sum(
      lambda h: self.head_logits(head_params, h),
      x,
      targets,
      self.spec.loss_chunk,
      self.spec.vocab_used,
    )

  def head_loss_and_grad(
    self, edges: Params, x, targets, acc: Params | None, scale: float, input_grad: bool = True
  ):
    """The pipeline's last stage: (scale x head_loss, acc + its gradient
    w.r.t. `edges`, its gradient w.r.t. x). `edges` holds the model's 'embed'
    and 'head' params (a tied table's gradient lands in 'embed'); each loss
    chunk's gradient is added to `acc` as it is made (loss.cross_entropy_and_grad).
    `acc` None or `input_grad` False: that gradient is not made (None)."""
    return self._head_grad(
      lambda e: self.edge_params(e)[1], edges, x, targets, acc, scale, input_grad
    )

  def _head_grad(
    self, head_of, params: Params, x, targets, acc, scale: float, input_grad: bool = True
  ):
    return loss_lib.cross_entropy_and_grad(
      lambda p, h: self.head_logits(head_of(p), h),
      params,
      x,
      targets,
      acc,
      scale,
      self.spec.loss_chunk,
      self.spec.vocab_used,
      input_grad,
    )

  def init_cache(self, batch: int) -> tuple[jax.Array, ...]:
    """Empty K/V caches for `batch` rows: k, v [layers, batch, seq_len, kv_heads,
    head_dim]; with local layers, (k, v) of the local ones' rolling caches
    [local layers, batch, sliding_window, ...] and then of the global ones."""
    s = self.spec
    shape = (s.num_layers, batch, s.seq_len, s.kv_heads, s.head_dim)
    local = s.local_layers()
    if local is None:
      return jnp.zeros(shape, s.dtype), jnp.zeros(shape, s.dtype)
    rolling = (sum(local), batch, s.sliding_window) + shape[3:]
    whole = (len(local) - sum(local),) + shape[1:]
    return tuple(jnp.zeros(shape, s.dtype) for shape in (rolling, rolling, whole, whole))

  def decode(self, params: Params, tokens, cache, index, start):
    """Logits of `tokens` [b, t] written at cache slots index..index+t-1, and the new caches.

    start [b]: the slot where each row's (left-padded) prompt begins, so a
    token's position is its slot minus its row's start. A prefill passes the
    whole padded prompt at index 0; then one token a step. Padded ids
    (spec.vocab_used) have logit -1e30 (loss.mask_padding): never picked.
    """
    slots = index + jnp.arange(tokens.shape[1])
    positions = jnp.maximum(slots[None, :] - start[:, None], 0)
    embed_params, head_params = self.edge_params(params)
    # Blocks the embedding runs itself (DeepSeek's dense ones) take the first caches.
    own = self.spec.num_layers - self.spec.stacked_layers
    if own:
      decode = Decode(*(c[:own] for c in cache), index, start, positions)
      x, first = self._embed.apply({'params': embed_params}, tokens, positions, decode=decode)
      cache = tuple(c[own:] for c in cache)
    else:
      x = self._embed.apply({'params': embed_params}, tokens, positions)

    if self.spec.local_layers() is not None:
      x, cache = self._decode_windowed(
        params['layers'], x, cache, Decode(None, None, index, start, positions)
      )
      return loss_lib.mask_padding(self.head_logits(head_params, x), self.spec.vocab_used), cache

    def layer(x, args):
      p, k, v = args
      x, (k, v) = self._block.apply({'params': p}, x, Decode(k, v, index, start, positions))
      return x, (k, v)

    # The cache is per block; an entry of a grouped stack takes its blocks' [n, ...].
    n = self.spec.layers_per_entry
    grouped = tuple(c.reshape((-1, n) + c.shape[1:]) if n > 1 else c for c in cache)
    x, cache = jax.lax.scan(layer, x, (params['layers'], *grouped))
    cache = tuple(c.reshape((-1,) + c.shape[2:]) if n > 1 else c for c in cache)
    if own:
      cache = tuple(jnp.concatenate(pair) for pair in zip(first, cache))
    return loss_lib.mask_padding(self.head_logits(head_params, x), self.spec.vocab_used), cache

  def _decode_windowed(self, stacked_params: Params, x, cache, at: Decode):
    """`decode`'s layer stack with local layers (`init_cache`'s four caches),
    one scan: each layer's flag picks, under cond, its rolling cache or its
    whole one, carried and updated in place (`at`: the step's index, start
    and positions)."""
    local = self.spec.local_layers()
    # Each layer's entry in its kind's cache.
    entry = jnp.asarray([sum(1 for f in local[:i] if f == local[i]) for i in range(len(local))])

    def run(p, x, caches, j, rolling: bool):
      k, v = caches
      d = at.replace(k=k[j], v=v[j], rolling=rolling)
      x, (kj, vj) = self._block.apply({'params': p}, x, d, None, rolling)
      return x, (k.at[j].set(kj), v.at[j].set(vj))

    def layer(carry, args):
      x, rolling, whole = carry
      p, flag, j = args
      if all(local):  # Mistral's: no whole caches, no cond
        x, rolling = run(p, x, rolling, j, True)
        return (x, rolling, whole), None

      def on_rolling(x, rolling, whole):
        return (*run(p, x, rolling, j, True), whole)

      def on_whole(x, rolling, whole):
        x, whole = run(p, x, whole, j, False)
        return x, rolling, whole

      return jax.lax.cond(flag, on_rolling, on_whole, x, rolling, whole), None

    carry = (x, cache[:2], cache[2:])
    (x, rolling, whole), _ = jax.lax.scan(layer, carry, (stacked_params, jnp.asarray(local), entry))
    return x, (*rolling, *whole)

  def logits(self, params: Params, tokens: jax.Array, segments=None) -> jax.Array:
    """fp32 logits [b, s, vocab]; padded ids (spec.vocab_used) at -1e30 (loss.mask_padding)."""
    embed_params, head_params = self.edge_params(params)
    x = self.embed(embed_params, tokens, segments)
    x = self.layers(params['layers'], x, segments=segments)
    return loss_lib.mask_padding(self.head_logits(head_params, x), self.spec.vocab_used)

  def loss(self, params: Params, inputs: jax.Array, targets: jax.Array, segments=None) -> jax.Array:
    """Mean next-token cross-entropy of a batch on one program (no pipeline)."""
    embed_params, head_params = self.edge_params(params)
    x = self.layers(params['layers'], self.embed(embed_params, inputs, segments), segments=segments)
    return self._head_loss_differentiated_forward(head_params, x, targets) / targets.size

  def _head_loss_differentiated_forward(self, head_params: Params, x, targets) -> jax.Array:
    """head_loss, whose gradients are made with its value (one loss chunk's
    logits at a time, loss.cross_entropy_and_grad) and kept for the backward,
    which only scales them: the backward neither recomputes the logits nor
    reads the output layer again (with FSDP, no second gathered copy of a
    vocabulary-sized table), at the cost of holding the head's gradient
    from the forward on (it is made whole in the backward either way)."""

    # targets is an argument, not a closed-over value: a custom_vjp may not
    # close over a tracer of an enclosing transformation (a scan over
    # micro-batches, say), and integer ids take no cotangent (None).
    @jax.custom_vjp
    def head(head_params, x, targets):
      return self.head_loss(head_params, x, targets)

    def forward(head_params, x, targets):
      zeros = jax.tree.map(jnp.zeros_like, head_params)
      loss, g, dx = self._head_grad(lambda p: p, head_params, x, targets, zeros, 1.0)
      return loss, (g, dx)

    def backward(res, ct):
      g, dx = res
      scaled = jax.tree.map(lambda a: a * ct.astype(a.dtype), g)
      return scaled, (dx * ct).astype(dx.dtype), None

    head.defvjp(forward, backward)
    return head(head_params, x, targets)
