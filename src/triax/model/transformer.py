"""A decoder-only GPT: token + position embedding, pre-norm blocks, output layer.

Every parameter and the key activations carry logical axis names only
('embed', 'heads', 'mlp', 'vocab', 'batch', ...). Which mesh axis each maps
to is decided by the rules in the config (see triax.sharding); with the
default rules this is Megatron tensor parallelism: Q/K/V and the first MLP
matmul are column-parallel, the attention output and second MLP matmul
row-parallel, heads split across `tensor`, embedding and output layer
vocabulary-parallel.

The model knows nothing of pipelines: it exposes embed / layer stack / head
as separate pure functions, which the single-device path composes directly
and the pipeline executor places on stages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from triax.sharding import constrain

Params = Any

_REMAT_POLICIES = {
  'none': None,
  'full': jax.checkpoint_policies.nothing_saveable,
  # Megatron's "selective" idea: keep the weight matmuls' outputs, recompute
  # the attention core (its score tensors are batch-dim dots, not saved).
  'selective': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The hyper-parameters the model needs; built from config.model."""

  num_layers: int
  d_model: int
  num_heads: int
  d_ff: int
  vocab_size: int
  seq_len: int
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  remat: str = 'none'
  attention: str = 'xla'

  @classmethod
  def from_config(cls, model_cfg) -> ModelSpec:
    return cls(**{f.name: model_cfg[f.name] for f in dataclasses.fields(cls)})

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def _param(module: nn.Module, name: str, shape, axes, stddev: float, dtype):
  init = nn.initializers.normal(stddev) if stddev else nn.initializers.ones
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


class Embed(nn.Module):
  """Vocabulary-parallel token embedding plus learned positions."""

  spec: ModelSpec

  @nn.compact
  def __call__(self, tokens):
    s, pdt = self.spec, jnp.dtype(self.spec.param_dtype)
    table = _param(self, 'tokens', (s.vocab_size, s.d_model), ('vocab', 'embed'), 0.02, pdt)
    pos = _param(self, 'positions', (s.seq_len, s.d_model), ('seq', 'embed'), 0.01, pdt)
    x = jnp.take(table, tokens, axis=0) + pos[: tokens.shape[-1]]
    return constrain(x.astype(s.dtype), ('batch', 'seq', 'embed'))


class Block(nn.Module):
  """One pre-norm transformer block: causal self-attention then an MLP."""

  spec: ModelSpec

  @nn.compact
  def __call__(self, x):
    s = self.spec
    pdt, dt = jnp.dtype(s.param_dtype), jnp.dtype(s.dtype)
    out_std = 0.02 / math.sqrt(2 * s.num_layers)  # GPT-2: keep the residual stream's variance flat
    n, hd, d = s.num_heads, s.head_dim, s.d_model
    norm1 = _param(self, 'attn_norm', (d,), ('embed',), 0, pdt)
    wq = _param(self, 'wq', (d, n, hd), ('embed', 'heads', 'kv'), 0.02, pdt)
    wk = _param(self, 'wk', (d, n, hd), ('embed', 'heads', 'kv'), 0.02, pdt)
    wv = _param(self, 'wv', (d, n, hd), ('embed', 'heads', 'kv'), 0.02, pdt)
    wo = _param(self, 'wo', (n, hd, d), ('heads', 'kv', 'embed'), out_std, pdt)
    norm2 = _param(self, 'mlp_norm', (d,), ('embed',), 0, pdt)
    w1 = _param(self, 'w1', (d, s.d_ff), ('embed', 'mlp'), 0.02, pdt)
    w2 = _param(self, 'w2', (s.d_ff, d), ('mlp', 'embed'), out_std, pdt)

    h = _rms_norm(x, norm1)
    q = jnp.einsum('bsd,dnk->bsnk', h, wq.astype(dt))
    k = jnp.einsum('bsd,dnk->bsnk', h, wk.astype(dt))
    v = jnp.einsum('bsd,dnk->bsnk', h, wv.astype(dt))
    q, k, v = (constrain(t, ('batch', 'seq', 'heads', 'kv')) for t in (q, k, v))
    impl = 'cudnn' if s.attention == 'cudnn' else 'xla'
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    x = x + constrain(jnp.einsum('bsnk,nkd->bsd', a, wo.astype(dt)), ('batch', 'seq', 'embed'))

    h = _rms_norm(x, norm2)
    u = constrain(jnp.einsum('bsd,df->bsf', h, w1.astype(dt)), ('batch', 'seq', 'mlp'))
    u = jax.nn.gelu(u)
    x = x + constrain(jnp.einsum('bsf,fd->bsd', u, w2.astype(dt)), ('batch', 'seq', 'embed'))
    return x


class Head(nn.Module):
  """Final norm and vocabulary-parallel output layer; returns fp32 logits."""

  spec: ModelSpec

  @nn.compact
  def __call__(self, x):
    s = self.spec
    pdt = jnp.dtype(s.param_dtype)
    norm = _param(self, 'norm', (s.d_model,), ('embed',), 0, pdt)
    out = _param(self, 'out', (s.d_model, s.vocab_size), ('embed', 'vocab'), 0.02, pdt)
    logits = jnp.einsum('bsd,dv->bsv', _rms_norm(x, norm), out.astype(s.dtype))
    return constrain(logits, ('batch', 'seq', 'vocab')).astype(jnp.float32)


def _axes_tree(boxed: Params) -> Params:
  """Logical axis tuples of flax's LogicallyPartitioned leaves."""
  return jax.tree.map(
    lambda b: tuple(b.names), boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
  )


class GPT:
  """The model as pure functions over a parameter tree.

  params = {'embed': ..., 'layers': <Block params stacked on a leading
  'layers' axis>, 'head': ...}. The layer stack runs under `lax.scan`, so
  compile time does not grow with depth.
  """

  def __init__(self, spec: ModelSpec):
    self.spec = spec
    self._embed, self._block, self._head = Embed(spec), Block(spec), Head(spec)

  def _dummy(self):
    s = self.spec
    return (jnp.zeros((1, s.seq_len), jnp.int32), jnp.zeros((1, s.seq_len, s.d_model), s.dtype))

  def init(self, rng: jax.Array) -> Params:
    tokens, x = self._dummy()
    k_embed, k_layers, k_head = jax.random.split(rng, 3)
    layer_keys = jax.random.split(k_layers, self.spec.num_layers)
    return {
      'embed': nn.unbox(self._embed.init(k_embed, tokens))['params'],
      'layers': jax.vmap(lambda k: nn.unbox(self._block.init(k, x))['params'])(layer_keys),
      'head': nn.unbox(self._head.init(k_head, x))['params'],
    }

  def logical_axes(self) -> Params:
    """Same tree as `init`, with a tuple of logical axis names per leaf."""
    tokens, x = self._dummy()
    key = jax.random.key(0)
    layer = _axes_tree(jax.eval_shape(self._block.init, key, x)['params'])
    return {
      'embed': _axes_tree(jax.eval_shape(self._embed.init, key, tokens)['params']),
      'layers': jax.tree.map(
        lambda a: ('layers',) + a, layer, is_leaf=lambda a: isinstance(a, tuple)
      ),
      'head': _axes_tree(jax.eval_shape(self._head.init, key, x)['params']),
    }

  def embed(self, embed_params: Params, tokens: jax.Array) -> jax.Array:
    return self._embed.apply({'params': embed_params}, tokens)

  def layer(self, layer_params: Params, x: jax.Array) -> jax.Array:
    return self._block.apply({'params': layer_params}, x)

  def layers(
    self, stacked_params: Params, x: jax.Array, num_active: jax.Array | None = None
  ) -> jax.Array:
    """Runs a stack of layers (leading axis) in order, with the configured remat.

    With `num_active`, only the first `num_active` layers run; the rest are
    padding (uneven pipeline splits) and are skipped under `cond`.
    """
    layer = self.layer
    policy = _REMAT_POLICIES[self.spec.remat]
    if self.spec.remat != 'none':
      layer = jax.checkpoint(layer, policy=policy)
    if num_active is None:
      x, _ = jax.lax.scan(lambda h, p: (layer(p, h), None), x, stacked_params)
      return x

    def step(h, args):
      p, i = args
      return jax.lax.cond(i < num_active, layer, lambda p, h: h, p, h), None

    depth = jax.tree.leaves(stacked_params)[0].shape[0]
    x, _ = jax.lax.scan(step, x, (stacked_params, jnp.arange(depth)))
    return x

  def head_loss(self, head_params: Params, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Sum (not mean) of next-token cross-entropies, in fp32.

    Sums compose across micro-batches and pipeline stages; the caller divides
    by the global token count once.
    """
    logits = self._head.apply({'params': head_params}, x)
    # A one-hot contraction, not a gather, picks the target logit: with the
    # vocabulary split over `tensor` it partitions into a local product and
    # an all-reduce (Megatron's vocab-parallel cross-entropy); XLA's SPMD
    # partitioner rejects a gather along the split axis inside the pipeline.
    target_logit = jnp.sum(
      logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1
    )
    return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - target_logit)

  def logits(self, params: Params, tokens: jax.Array) -> jax.Array:
    x = self.layers(params['layers'], self.embed(params['embed'], tokens))
    return self._head.apply({'params': params['head']}, x)

  def loss(self, params: Params, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of a batch on one program (no pipeline)."""
    x = self.layers(params['layers'], self.embed(params['embed'], inputs))
    return self.head_loss(params['head'], x, targets) / targets.size
