"""The Gemma 3 family (text): llama's grouped-query attention with q/k norms, and
  - the embedding scaled by sqrt(d_model), in the activations' dtype;
  - RMSNorms that multiply by (1 + weight) in fp32 (their weights start at zero);
  - pre- and post-norms around both attention and the MLP;
  - a GeGLU MLP (GELU's tanh form, transformers' gelu_pytorch_tanh);
  - scores q.k / sqrt(model.query_pre_attn_scalar);
  - local layers (model.sliding_window; every model.sliding_window_pattern-th
    layer global) rotating with their own unscaled base (model.rope_local_theta),
    the global ones with model.rope_theta and model.rope_scaling;
  - tied embeddings, no logit soft-capping (Gemma 3 has none).

Conventions follow transformers' Gemma3ForCausalLM, so its checkpoints map onto this tree
by transposes and reshapes only (convert/hf_gemma.py). llama's tree, tied, plus
'post_attn_norm' and 'post_mlp_norm' [L, d]; every norm weight is HF's (w, not 1 + w).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax.numpy as jnp

from triax import checks
from triax.errors import ConfigError
from triax.model import llama
from triax.model.common import RESIDUAL, Decode, geglu, head_norm, matmul, param, project, rms_norm
from triax.sharding import constrain


def _config_off(default):
  """A llama spec field that Gemma 3 fixes: not a config key of this family
  (registry.validate refuses it when set)."""
  return dataclasses.field(default=default, metadata={'config': False})


@dataclasses.dataclass(frozen=True)
class GemmaSpec(llama.LlamaSpec):
  rope_local_theta: float = 10000.0
  # 0: head_dim.
  query_pre_attn_scalar: float = 0.0
  tie_embeddings: bool = _config_off(True)
  qkv_bias: bool = _config_off(False)
  qk_norm: bool = _config_off(True)

  @property
  def query_factor(self) -> float:
    """What q is multiplied by so that attention's own 1/sqrt(head_dim) makes
    the scores q.k / sqrt(query_pre_attn_scalar)."""
    if not self.query_pre_attn_scalar:
      return 1.0
    return math.sqrt(self.head_dim / self.query_pre_attn_scalar)

  @property
  def stream_norms(self) -> int:
    """Pre- and post-norms around attention and the MLP."""
    return 4

  def local_rope(self) -> GemmaSpec:
    """The spec whose RoPE tables a local layer uses: its own base, no scaling."""
    return dataclasses.replace(
      self, rope_theta=self.rope_local_theta, rope_scaling=llama.RopeScaling()
    )


def _norm_weight(module: nn.Module, name: str, size: int, axes: tuple):
  """A (1 + weight) norm's weight, zero at init (transformers' Gemma3RMSNorm)."""
  init = nn.with_logical_partitioning(nn.initializers.zeros, axes)
  return module.param(name, init, (size,), jnp.dtype(module.spec.param_dtype))


def _one_plus(weight):
  """The scale of a Gemma norm: 1 + weight, in fp32 (as transformers adds it)."""
  return 1.0 + weight.astype(jnp.float32)


class Embed(nn.Module):
  """llama's embedding times sqrt(d_model), rounded to the activations' dtype
  (transformers' Gemma3TextScaledWordEmbedding rounds it to the table's)."""

  spec: GemmaSpec

  @nn.compact
  def __call__(self, tokens, positions=None):
    del positions  # the block rotates by them
    s, pdt = self.spec, jnp.dtype(self.spec.param_dtype)
    table = param(self, 'tokens', (s.vocab_size, s.d_model), ('vocab', 'embed'), 0.02, pdt)
    x = jnp.take(table, tokens, axis=0).astype(s.dtype)
    return constrain(x * jnp.asarray(math.sqrt(s.d_model), s.dtype), RESIDUAL)


class Block(llama.Block):
  """Gemma 3's block: norm, attention, norm, residual add; norm, GeGLU, norm, residual add."""

  spec: GemmaSpec

  @nn.compact
  def __call__(self, x, decode: Decode | None = None, segments=None, local=False):
    """`local`: whether this block's attention is windowed, a bool or a traced
    one (the layer scan's flag); it picks the window and the RoPE base."""
    s = self.spec
    norms = {
      name: _norm_weight(self, name, s.d_model, ('embed',))
      for name in ('attn_norm', 'post_attn_norm', 'mlp_norm', 'post_mlp_norm')
    }
    norm = lambda h, name: rms_norm(h, _one_plus(norms[name]), s.norm_eps)  # noqa: E731
    weights = self.attention_weights()
    a = self.attention(norm(x, 'attn_norm'), weights, decode, segments, local)
    if decode is not None:
      a, cache = a
    x = x + norm(constrain(a, RESIDUAL), 'post_attn_norm')
    x = x + norm(constrain(self.mlp(norm(x, 'mlp_norm')), RESIDUAL), 'post_mlp_norm')
    return x if decode is None else (x, cache)

  def rotary(self, positions, local):
    """cos and sin of the local base (unscaled) on a local block, of the
    global one (scaled) on a global block; a traced flag picks elementwise."""
    s = self.spec
    if local is True:
      return llama.rope_tables(s.local_rope(), positions)
    whole = llama.rope_tables(s, positions)
    if local is False:
      return whole
    near = llama.rope_tables(s.local_rope(), positions)
    return tuple(jnp.where(local, a, b) for a, b in zip(near, whole))

  def qk_norms(self, q, k):
    """Each head's q and k through a (1 + weight) norm; q then scaled for
    query_pre_attn_scalar (before the rotation, which is linear)."""
    s = self.spec
    q_norm, k_norm = (
      _norm_weight(self, name, s.head_dim, ('kv',)) for name in ('q_norm', 'k_norm')
    )
    q = head_norm(q, _one_plus(q_norm), s.norm_eps)
    k = head_norm(k, _one_plus(k_norm), s.norm_eps)
    if s.query_factor != 1.0:
      q = q * jnp.asarray(s.query_factor, q.dtype)
    return q, k

  def mlp(self, h):
    """A GeGLU MLP (tanh GELU) of normalised h [b, s, d], llama's weights."""
    s = self.spec
    pdt, dt = jnp.dtype(s.param_dtype), jnp.dtype(s.dtype)
    d, f = s.d_model, s.d_ff
    w_gate = param(self, 'w_gate', (d, f), ('embed', 'mlp'), 0.02, pdt)
    w_up = param(self, 'w_up', (d, f), ('embed', 'mlp'), 0.02, pdt)
    w_down = param(self, 'w_down', (f, d), ('mlp', 'embed'), llama.out_std(s), pdt)
    gate, up = project(h, (w_gate, w_up), 'bsd,df->bsf', dt, s.remat, s.fp8_recipe)
    gate, up = (constrain(t, ('batch', 'seq', 'mlp')) for t in (gate, up))
    return matmul('bsf,fd->bsd', geglu(gate, up), w_down, dt, s.remat, s.fp8_recipe)


class Head(nn.Module):
  """The final (1 + weight) norm and the embedding table as the output layer; fp32 logits."""

  spec: GemmaSpec

  @nn.compact
  def __call__(self, x, table):
    s = self.spec
    norm = _norm_weight(self, 'norm', s.d_model, ('embed',))
    h = rms_norm(x, _one_plus(norm), s.norm_eps)
    logits = jnp.einsum('bsd,vd->bsv', h, table.astype(s.dtype))
    return constrain(logits, ('batch', 'seq', 'vocab')).astype(jnp.float32)


class Gemma(llama.Llama):
  """llama's model (tied edges, GQA FLOPs: GeGLU has SwiGLU's three matrices) with Gemma's modules."""

  embed_module = Embed
  block_module = Block
  head_module = Head


def validate(model_cfg, mesh_cfg, rules: tuple) -> None:
  """llama's attention keys, and Gemma's own: a window every local layer
  has (at most seq_len), the pattern, the local base and the score scalar."""
  m = model_cfg
  llama.check_attention(m, mesh_cfg, rules)
  window, n = m.sliding_window, m.sliding_window_pattern
  if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= m.seq_len:
    raise ConfigError(
      'model.sliding_window',
      f'must be 1..model.seq_len={m.seq_len} (Gemma 3 has local layers; a window of seq_len '
      f'spans the sequence, its layers keep their own RoPE base), got {window!r}',
    )
  checks.non_negative_int('model.sliding_window_pattern', n, 'every layer local')
  if n == 1:
    raise ConfigError(
      'model.sliding_window_pattern',
      'makes every layer global; Gemma 3 has local layers: use 2 or more (Gemma 3: 6), or 0 '
      '(every layer local)',
    )
  if not llama.positive_number(m.rope_local_theta):
    raise ConfigError(
      'model.rope_local_theta', f'must be a positive number, got {m.rope_local_theta!r}'
    )
  checks.non_negative_number('model.query_pre_attn_scalar', m.query_pre_attn_scalar, 'head_dim')


axis_rules = llama.axis_rules
Spec = GemmaSpec
Model = Gemma
