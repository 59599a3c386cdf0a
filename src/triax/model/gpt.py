"""The GPT family: token + learned position embedding, pre-norm blocks with
full multi-head attention and a GELU MLP, untied output layer.

Every parameter and the key activations carry logical axis names only
('embed', 'heads', 'mlp', 'vocab', 'batch', ...). Which mesh axis each maps
to is decided by the rules in the config (see triax.sharding); with the
default rules this is Megatron tensor parallelism: Q/K/V and the first MLP
matmul are column-parallel, the attention output and second MLP matmul
row-parallel, heads split across `tensor`, embedding and output layer
vocabulary-parallel.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax.numpy as jnp

from triax.model.common import (
  RESIDUAL,
  Decode,
  DecoderModel,
  ModelSpec,
  causal_attention,
  gelu,
  matmul,
  param,
  project,
  rms_norm,
)
from triax.sharding import constrain

# The RMSNorm epsilon GPT has always used (not a config key: checkpoints rely on it).
_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class GPTSpec(ModelSpec):
  """GPT reads only the common keys."""


class Embed(nn.Module):
  """Vocabulary-parallel token embedding plus learned positions."""

  spec: GPTSpec

  @nn.compact
  def __call__(self, tokens, positions=None):
    s, pdt = self.spec, jnp.dtype(self.spec.param_dtype)
    table = param(self, 'tokens', (s.vocab_size, s.d_model), ('vocab', 'embed'), 0.02, pdt)
    pos = param(self, 'positions', (s.seq_len, s.d_model), ('positions', 'embed'), 0.01, pdt)
    # Training embeds whole windows (positions 0..s-1, load-balanced over context ranks);
    # a K/V-cache decoder its new tokens'.
    if positions is None and s.context == 1:
      pos = pos[: tokens.shape[-1]]
    else:
      where = s.positions(tokens.shape[-1]) if positions is None else positions
      pos = jnp.take(pos, where, axis=0)
    x = jnp.take(table, tokens, axis=0) + pos
    return constrain(x.astype(s.dtype), RESIDUAL)


class Block(nn.Module):
  """One pre-norm transformer block: causal self-attention then an MLP."""

  spec: GPTSpec

  @nn.compact
  def __call__(self, x, decode: Decode | None = None, segments=None):
    s = self.spec
    pdt, dt = jnp.dtype(s.param_dtype), jnp.dtype(s.dtype)
    out_std = 0.02 / math.sqrt(2 * s.num_layers)  # GPT-2: keep the residual stream's variance flat
    n, hd, d = s.num_heads, s.head_dim, s.d_model
    norm1 = param(self, 'attn_norm', (d,), ('embed',), 0, pdt)
    wq = param(self, 'wq', (d, n, hd), ('embed', 'heads', 'kv'), 0.02, pdt)
    wk = param(self, 'wk', (d, n, hd), ('embed', 'heads', 'kv'), 0.02, pdt)
    wv = param(self, 'wv', (d, n, hd), ('embed', 'heads', 'kv'), 0.02, pdt)
    wo = param(self, 'wo', (n, hd, d), ('heads', 'kv', 'embed'), out_std, pdt)
    norm2 = param(self, 'mlp_norm', (d,), ('embed',), 0, pdt)
    w1 = param(self, 'w1', (d, s.d_ff), ('embed', 'mlp'), 0.02, pdt)
    w2 = param(self, 'w2', (s.d_ff, d), ('mlp', 'embed'), out_std, pdt)

    h = rms_norm(x, norm1, _NORM_EPS)
    qkv = project(h, (wq, wk, wv), 'bsd,dnk->bsnk', dt, s.remat, s.fp8_recipe)
    q, k, v = (constrain(t, ('batch', 'seq', 'heads', 'kv')) for t in qkv)
    where = () if decode is not None else s.split_sequence(x.shape[1])
    a = causal_attention(
      q, k, v, s.attention, decode, segments, s.splash_interpret, *where, remat=s.remat
    )
    if decode is not None:
      a, cache = a
    x = x + constrain(matmul('bsnk,nkd->bsd', a, wo, dt, s.remat, s.fp8_recipe), RESIDUAL)

    h = rms_norm(x, norm2, _NORM_EPS)
    (u,) = project(h, (w1,), 'bsd,df->bsf', dt, s.remat, s.fp8_recipe)
    u = constrain(u, ('batch', 'seq', 'mlp'))
    u = gelu(u)
    x = x + constrain(matmul('bsf,fd->bsd', u, w2, dt, s.remat, s.fp8_recipe), RESIDUAL)
    return x if decode is None else (x, cache)


class Head(nn.Module):
  """Final norm and vocabulary-parallel output layer; returns fp32 logits."""

  spec: GPTSpec

  @nn.compact
  def __call__(self, x):
    s = self.spec
    pdt = jnp.dtype(s.param_dtype)
    norm = param(self, 'norm', (s.d_model,), ('embed',), 0, pdt)
    out = param(self, 'out', (s.d_model, s.vocab_size), ('embed', 'vocab'), 0.02, pdt)
    logits = jnp.einsum('bsd,dv->bsv', rms_norm(x, norm, _NORM_EPS), out.astype(s.dtype))
    return constrain(logits, ('batch', 'seq', 'vocab')).astype(jnp.float32)


class GPT(DecoderModel):
  embed_module = Embed
  block_module = Block
  head_module = Head

  def forward_flops(self) -> dict[str, float]:
    """Forward FLOPs of one sequence (convention in model/flops.py)."""
    s = self.spec
    t, d, nh = s.seq_len, s.d_model, s.num_heads * s.head_dim
    return {
      # Q, K, V and the output projection, then the MLP's two matmuls.
      'layer_matmul': 2.0 * t * (4 * d * nh + 2 * d * s.d_ff),
      # Q K^T and the attention-weighted V over the full t x t square.
      'layer_attention': 4.0 * t * t * nh,
      'head': 2.0 * t * d * s.vocab_size,
    }


def validate(model_cfg, mesh_cfg, rules: tuple) -> None:
  """GPT has no keys of its own: config.validate's common checks are all it needs."""
  del model_cfg, mesh_cfg, rules


def axis_rules(model_cfg, mesh_cfg, rules: tuple) -> tuple:
  """GPT adds no rule."""
  del model_cfg, mesh_cfg
  return rules


Spec = GPTSpec
Model = GPT
