"""The Llama family: RMSNorm, rotary position embeddings (with Llama 3's or YaRN's
long-context scaling), grouped-query attention, a SwiGLU MLP, no biases (but Qwen2's
optional q/k/v ones, model.qkv_bias), Qwen3's optional q/k norms (model.qk_norm, with its
wider heads: model.head_dim), optionally tied input and output embeddings.

Conventions follow transformers' LlamaForCausalLM, so that a Hugging Face checkpoint maps
onto this parameter tree by transposes and reshapes only (convert/hf_llama.py):

  {'embed': {'tokens': [V, d]},
   'layers': {'attn_norm': [L, d], 'wq': [L, d, n, hd], 'wk': [L, d, kv, hd],
              'wv': [L, d, kv, hd], 'wo': [L, n, hd, d], 'mlp_norm': [L, d],
              'w_gate': [L, d, f], 'w_up': [L, d, f], 'w_down': [L, f, d]},
   'head': {'norm': [d], 'out': [d, V]}}          ('out' absent when tied)

  (+ 'bq': [L, n, hd], 'bk', 'bv': [L, kv, hd] with model.qkv_bias;
     'q_norm', 'k_norm': [L, hd] with model.qk_norm)

The head dimension is in HF's stored order and rotary embeddings use HF's half-split
`rotate_half` (dimension i pairs with i + hd/2). Query heads split over `tensor`
('heads'); K/V heads ('kv_heads') split too when there are at least as many as tensor
ranks, else are replicated. Why: docs/design/models.md."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from triax import checks
from triax.config import head_dim
from triax.errors import ConfigError
from triax.model.common import (
  RESIDUAL,
  Decode,
  DecoderModel,
  ModelSpec,
  causal_attention,
  head_norm,
  matmul,
  param,
  project,
  rms_norm,
  swiglu,
)
from triax.sharding import constrain

# model.rope_scaling.rope_type -> the keys only that kind reads (factor is
# every kind's, original_max_position_embeddings llama3's and yarn's; linear,
# Gemma 3's, divides every frequency by the factor).
ROPE_TYPE_KEYS = {
  'linear': (),
  'llama3': ('low_freq_factor', 'high_freq_factor'),
  'yarn': ('beta_fast', 'beta_slow', 'mscale', 'mscale_all_dim'),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Long-context RoPE scaling as transformers computes it: rope_type 'llama3'
  (_compute_llama3_parameters), 'yarn' (_compute_yarn_parameters, its
  correction range truncated) or 'linear' (_compute_linear_scaling_rope_parameters);
  factor 0 = no scaling."""

  rope_type: str = 'llama3'
  factor: float = 0.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0

  @property
  def yarn(self) -> bool:
    return bool(self.factor) and self.rope_type == 'yarn'

  @property
  def attention_factor(self) -> float:
    """YaRN's factor on cos and sin (so on each rotated q.k product, squared); 1 otherwise."""
    if not self.yarn:
      return 1.0
    if self.mscale and self.mscale_all_dim:
      return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
    return _yarn_mscale(self.factor)

  @property
  def softmax_factor(self) -> float:
    """YaRN's factor on MLA's softmax scale, every q.k dimension (transformers'
    yarn_apply_mscale, which DeepSeek's attention alone applies); 1 otherwise."""
    if not (self.yarn and self.mscale_all_dim):
      return 1.0
    return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's Eq. 21 (transformers' yarn_get_mscale): 0.1 mscale ln(factor) + 1."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class LlamaSpec(ModelSpec):
  num_kv_heads: int = 0
  rope_theta: float = 500000.0
  rope_scaling: RopeScaling = RopeScaling()
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  sliding_window: int = 0
  sliding_window_pattern: int = 0

  SHAPE_KEYS: ClassVar[tuple[str, ...]] = ModelSpec.SHAPE_KEYS + (
    'num_kv_heads',
    'tie_embeddings',
    'qkv_bias',
    'qk_norm',
  )

  @classmethod
  def from_config(cls, model_cfg) -> LlamaSpec:
    fields = {k: model_cfg[k] for k in cls.config_fields()}
    fields['rope_scaling'] = RopeScaling(**dict(model_cfg.rope_scaling))
    return cls(**fields)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  def local_layers(self) -> tuple[bool, ...] | None:
    """Whether each block's attention is local (model.sliding_window): with
    model.sliding_window_pattern N, every Nth block is global (Gemma 3's
    layout: block i when (i + 1) % N == 0), else every block is local."""
    if not self.sliding_window:
      return None
    n = self.sliding_window_pattern
    return tuple(not n or (i + 1) % n != 0 for i in range(self.num_layers))

  @property
  def rope_dim(self) -> int:
    """Dimensions of a head that RoPE rotates: all of it (DeepSeek's MLA rotates a part)."""
    return self.head_dim

  def tensor_shard(self, t: int) -> LlamaSpec:
    if t == 1:
      return self
    # Replicated K/V heads (fewer than t): a rank's queries use one of them
    # (an approximation for the profiler: it still computes all their projections).
    kv = self.kv_heads // t if self.kv_heads >= t else 1
    return dataclasses.replace(super().tensor_shard(t), num_kv_heads=kv)


def rope_frequencies(spec: LlamaSpec) -> jax.Array:
  """Inverse frequencies [rope_dim/2] (fp32), scaled as model.rope_scaling says."""
  hd = spec.rope_dim
  inv_freq = 1.0 / (spec.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  r = spec.rope_scaling
  if not r.factor:
    return inv_freq
  if r.rope_type == 'yarn':
    return _yarn_frequencies(hd, spec.rope_theta, r)
  if r.rope_type == 'linear':
    return inv_freq / r.factor
  # transformers' _compute_llama3_parameters: long wavelengths are slowed by
  # `factor`, short ones kept, the band between interpolated smoothly.
  low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
  high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
  smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
    r.high_freq_factor - r.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def _yarn_frequencies(dim: int, theta: float, r: RopeScaling) -> jax.Array:
  """transformers' _compute_yarn_parameters, operation for operation: pairs
  turning more than beta_fast times over the original context keep their
  frequency, those turning fewer than beta_slow times are divided by factor,
  a linear ramp over the (truncated) pair indices between."""

  def pair(rotations: float) -> float:
    ctx = r.original_max_position_embeddings
    return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low = max(math.floor(pair(r.beta_fast)), 0)
  high = min(math.ceil(pair(r.beta_slow)), dim - 1)
  if low == high:
    high += 0.001  # transformers' guard against a ramp of no width
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  kept = 1 - ramp
  powers = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # theta^(2i/dim)
  return 1.0 / (r.factor * powers) * (1 - kept) + 1.0 / powers * kept


def rope_tables(spec: LlamaSpec, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin [..., hd] (fp32) for positions [...], in rotate_half's layout,
  times YaRN's attention factor when configured. Training passes 0..s-1; a
  decoder with a K/V cache its new tokens' [b, t]."""
  freqs = positions.astype(jnp.float32)[..., None] * rope_frequencies(spec)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  factor = spec.rope_scaling.attention_factor
  if factor == 1.0:
    return jnp.cos(emb), jnp.sin(emb)
  return jnp.cos(emb) * factor, jnp.sin(emb) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [b, s, heads, hd] rotated as transformers' apply_rotary_pos_emb does."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  # [..., t, hd] -> [..., t, 1, hd]: the same rotation for every head.
  cos, sin = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)
  return x * cos + rotated * sin


def out_std(spec: ModelSpec) -> float:
  """Init stddev of the matrices that write into the residual stream: GPT-2's
  scaled residual init, as gpt.py."""
  return 0.02 / math.sqrt(2 * spec.num_layers)


class Embed(nn.Module):
  """Vocabulary-parallel token embedding (positions enter as rotations in attention)."""

  spec: LlamaSpec

  @nn.compact
  def __call__(self, tokens, positions=None):
    del positions  # the block rotates by them
    s, pdt = self.spec, jnp.dtype(self.spec.param_dtype)
    table = param(self, 'tokens', (s.vocab_size, s.d_model), ('vocab', 'embed'), 0.02, pdt)
    return constrain(jnp.take(table, tokens, axis=0).astype(s.dtype), RESIDUAL)


class Block(nn.Module):
  """Pre-norm block: grouped-query attention with RoPE, then a SwiGLU MLP."""

  spec: LlamaSpec

  @nn.compact
  def __call__(self, x, decode: Decode | None = None, segments=None, local=False):
    """`local`: whether this block's attention is windowed (model.sliding_window),
    a bool or a traced one (the layer scan's per-block flag)."""
    s = self.spec
    pdt = jnp.dtype(s.param_dtype)
    attn_norm = param(self, 'attn_norm', (s.d_model,), ('embed',), 0, pdt)
    weights = self.attention_weights()
    mlp_norm = param(self, 'mlp_norm', (s.d_model,), ('embed',), 0, pdt)
    a = self.attention(rms_norm(x, attn_norm, s.norm_eps), weights, decode, segments, local)
    if decode is not None:
      a, cache = a
    x = x + constrain(a, RESIDUAL)
    x = x + constrain(self.mlp(rms_norm(x, mlp_norm, s.norm_eps)), RESIDUAL)
    return x if decode is None else (x, cache)

  def attention_weights(self) -> tuple:
    """The attention's projections (made between the two norms: the init
    order, so the init values, of the block before attention was a method)."""
    s = self.spec
    pdt = jnp.dtype(s.param_dtype)
    n, kv, hd, d = s.num_heads, s.kv_heads, s.head_dim, s.d_model
    wq = param(self, 'wq', (d, n, hd), ('embed', 'heads', 'kv'), 0.02, pdt)
    wk = param(self, 'wk', (d, kv, hd), ('embed', 'kv_heads', 'kv'), 0.02, pdt)
    wv = param(self, 'wv', (d, kv, hd), ('embed', 'kv_heads', 'kv'), 0.02, pdt)
    wo = param(self, 'wo', (n, hd, d), ('heads', 'kv', 'embed'), out_std(s), pdt)
    return wq, wk, wv, wo

  def attention(self, h, weights, decode: Decode | None, segments, local=False):
    """Grouped-query attention of normalised h [b, s, d], projected back to
    [b, s, d]; with `decode`, (that, the layer's new caches)."""
    s = self.spec
    pdt, dt = jnp.dtype(s.param_dtype), jnp.dtype(s.dtype)
    n, kv, hd = s.num_heads, s.kv_heads, s.head_dim
    wq, wk, wv, wo = weights
    cos, sin = self.rotary(s.positions(h.shape[1]) if decode is None else decode.positions, local)
    q, k, v = project(h, (wq, wk, wv), 'bsd,dnk->bsnk', dt, s.remat, s.fp8_recipe)
    if s.qkv_bias:  # made after the block's other weights: a model without keeps its init values
      zeros = lambda name, shape, axes: self.param(  # noqa: E731
        name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape, pdt
      )
      bq = zeros('bq', (n, hd), ('heads', 'kv'))
      bk, bv = (zeros(name, (kv, hd), ('kv_heads', 'kv')) for name in ('bk', 'bv'))
      q, k, v = (t + b.astype(dt) for t, b in ((q, bq), (k, bk), (v, bv)))
    if s.qk_norm:
      q, k = self.qk_norms(q, k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q = constrain(q, ('batch', 'seq', 'heads', 'kv'))
    k, v = (constrain(t, ('batch', 'seq', 'kv_heads', 'kv')) for t in (k, v))
    where = () if decode is not None else s.split_sequence(h.shape[1])
    a = causal_attention(
      q,
      k,
      v,
      s.attention,
      decode,
      segments,
      s.splash_interpret,
      *where,
      remat=s.remat,
      window=s.sliding_window,
      local=local,
    )
    cache = None
    if decode is not None:
      a, cache = a
    out = matmul('bsnk,nkd->bsd', a, wo, dt, s.remat, s.fp8_recipe)
    return out if decode is None else (out, cache)

  def rotary(self, positions, local):
    """RoPE's cos and sin (`rope_tables`) at `positions`; every block alike
    here (gemma.py's local blocks have a base of their own)."""
    del local
    return rope_tables(self.spec, positions)

  def qk_norms(self, q, k):
    """Qwen3's q/k norms: each head's q and k RMS-normalised before the rotation."""
    s = self.spec
    pdt = jnp.dtype(s.param_dtype)
    q_norm, k_norm = (
      param(self, name, (s.head_dim,), ('kv',), 0, pdt) for name in ('q_norm', 'k_norm')
    )
    return head_norm(q, q_norm, s.norm_eps), head_norm(k, k_norm, s.norm_eps)

  def mlp(self, h):
    """The MLP of normalised h [b, s, d]; mixtral.py's block replaces it with its experts."""
    return self.swiglu(h, 'w_', self.spec.d_ff)

  def swiglu(self, h, prefix: str, f: int):
    """A SwiGLU MLP of width f, its weights PREFIX{gate,up,down} made here,
    after the attention's (so the init order, and the init values, are those
    of the block before the MLP became a method)."""
    s = self.spec
    pdt, dt = jnp.dtype(s.param_dtype), jnp.dtype(s.dtype)
    d = s.d_model
    w_gate = param(self, prefix + 'gate', (d, f), ('embed', 'mlp'), 0.02, pdt)
    w_up = param(self, prefix + 'up', (d, f), ('embed', 'mlp'), 0.02, pdt)
    w_down = param(self, prefix + 'down', (f, d), ('mlp', 'embed'), out_std(s), pdt)
    gate, up = project(h, (w_gate, w_up), 'bsd,df->bsf', dt, s.remat, s.fp8_recipe)
    gate, up = (constrain(t, ('batch', 'seq', 'mlp')) for t in (gate, up))
    return matmul('bsf,fd->bsd', swiglu(gate, up), w_down, dt, s.remat, s.fp8_recipe)


class Head(nn.Module):
  """Final RMSNorm and the vocabulary-parallel output layer (or the embedding
  table, tied); returns fp32 logits."""

  spec: LlamaSpec

  @nn.compact
  def __call__(self, x, table=None):
    s = self.spec
    pdt = jnp.dtype(s.param_dtype)
    h = rms_norm(x, param(self, 'norm', (s.d_model,), ('embed',), 0, pdt), s.norm_eps)
    if s.tie_embeddings:
      logits = jnp.einsum('bsd,vd->bsv', h, table.astype(s.dtype))
    else:
      out = param(self, 'out', (s.d_model, s.vocab_size), ('embed', 'vocab'), 0.02, pdt)
      logits = jnp.einsum('bsd,dv->bsv', h, out.astype(s.dtype))
    return constrain(logits, ('batch', 'seq', 'vocab')).astype(jnp.float32)


class Llama(DecoderModel):
  embed_module = Embed
  block_module = Block
  head_module = Head

  def _head_extra_args(self) -> tuple:
    s = self.spec
    return (jnp.zeros((s.vocab_size, s.d_model), s.param_dtype),) if s.tie_embeddings else ()

  def edge_params(self, params):
    if not self.spec.tie_embeddings:
      return params['embed'], params['head']
    # The head reads the embedding table as its output layer; differentiated
    # through this, the table's gradient is the sum of both uses.
    return params['embed'], {**params['head'], 'tokens': params['embed']['tokens']}

  def head_logits(self, head_params, x):
    if not self.spec.tie_embeddings:
      return self._head.apply({'params': head_params}, x)
    own = {k: v for k, v in head_params.items() if k != 'tokens'}
    return self._head.apply({'params': own}, x, head_params['tokens'])

  def forward_flops(self) -> dict[str, float]:
    """Forward FLOPs of one sequence (convention in model/flops.py)."""
    s = self.spec
    t, d, hd = s.seq_len, s.d_model, s.head_dim
    q, kv = s.num_heads * hd, s.kv_heads * hd
    return {
      # Q and O over all heads, K and V over the K/V heads; gate, up and down.
      'layer_matmul': 2.0 * t * (2 * d * q + 2 * d * kv + 3 * d * s.d_ff),
      # Q K^T and the attention-weighted V over the full t x t square, per query head.
      'layer_attention': 4.0 * t * t * q,
      'head': 2.0 * t * d * s.vocab_size,
    }


def positive_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_flags(model_cfg, keys) -> None:
  """Raises ConfigError unless each model key of `keys` is true or false."""
  for key in keys:
    checks.boolean(f'model.{key}', model_cfg[key])


def validate(model_cfg, mesh_cfg, rules: tuple) -> None:
  """Llama's keys; K/V heads that split evenly over the axis `rules` give them
  (or 'heads'), or that are fewer than its devices (then replicated)."""
  check_attention(model_cfg, mesh_cfg, rules)
  check_flags(model_cfg, ('tie_embeddings', 'qkv_bias', 'qk_norm'))
  check_sliding_window(model_cfg)


def check_attention(model_cfg, mesh_cfg, rules: tuple) -> None:
  """The keys llama's attention and norms read (gemma.py's too): K/V heads,
  even heads, RoPE's base and scaling, the norms' epsilon."""
  m = model_cfg
  kv = m.num_kv_heads
  if not isinstance(kv, int) or isinstance(kv, bool) or kv < 0:
    raise ConfigError('model.num_kv_heads', f'must be an integer >= 0 (0 = num_heads), got {kv!r}')
  kv = kv or m.num_heads
  if m.num_heads % kv:
    raise ConfigError(
      'model.num_kv_heads', f'{kv} must divide model.num_heads={m.num_heads} (query groups)'
    )
  hd = head_dim(m)
  if hd % 2:
    raise ConfigError(
      'model.head_dim' if m.head_dim else 'model.num_heads',
      f'head_dim {hd} must be even (rotary pairs)',
    )
  if not positive_number(m.rope_theta):
    raise ConfigError('model.rope_theta', f'must be a positive number, got {m.rope_theta!r}')
  if not positive_number(m.norm_eps):
    raise ConfigError('model.norm_eps', f'must be a positive number, got {m.norm_eps!r}')
  check_rope_scaling(m.rope_scaling)
  axis, size = _kv_axis(mesh_cfg, rules)
  if kv >= size and kv % size:
    raise ConfigError(
      'model.num_kv_heads',
      f'{kv} K/V heads cannot be split evenly over mesh.{axis}={size}; use a multiple '
      f'of {size}, or fewer than {size} (then they are replicated)',
    )


def check_sliding_window(m) -> None:
  """model.sliding_window: shorter than the sequence (a longer one is
  global); model.sliding_window_pattern: with a window, leaving some layer
  local and some global."""
  window, n = m.sliding_window, m.sliding_window_pattern
  checks.non_negative_int('model.sliding_window', window, 'none: every layer global')
  checks.non_negative_int('model.sliding_window_pattern', n, 'every layer local')
  if window >= m.seq_len:
    raise ConfigError(
      'model.sliding_window',
      f'{window} positions reach back over the whole model.seq_len={m.seq_len}: such a layer is '
      'global; set 0 (every layer global), or a window shorter than seq_len',
    )
  if n and not window:
    raise ConfigError(
      'model.sliding_window_pattern',
      'makes every Nth layer global, and model.sliding_window=0 makes all of them so; '
      'set model.sliding_window, or remove the pattern',
    )
  if n == 1 or n > m.num_layers:
    raise ConfigError(
      'model.sliding_window_pattern',
      f'{n} leaves {"no layer local" if n == 1 else "no layer global"} of '
      f'model.num_layers={m.num_layers}; use 2..{m.num_layers}, or 0 (every layer local)',
    )


def check_rope_scaling(r) -> None:
  """model.rope_scaling: a known kind, no key of the other kind's set, and
  with a factor, that kind's values."""
  unknown = set(r) - {f.name for f in dataclasses.fields(RopeScaling)}
  if unknown:
    raise ConfigError(f'model.rope_scaling.{sorted(unknown)[0]}', 'unknown key')
  checks.one_of('model.rope_scaling.rope_type', r.rope_type, tuple(ROPE_TYPE_KEYS), 'rope type')
  default = RopeScaling()
  for kind, keys in ROPE_TYPE_KEYS.items():
    for key in keys:
      if kind != r.rope_type and r[key] != getattr(default, key):
        raise ConfigError(
          f'model.rope_scaling.{key}',
          f'a rope_type={kind} key, and rope_type is {r.rope_type}: leave it at its default '
          f'{getattr(default, key)!r}',
        )
  if not r.factor:
    return
  if not positive_number(r.factor) or r.factor < 1:
    raise ConfigError('model.rope_scaling.factor', f'must be >= 1 (0 = off), got {r.factor!r}')
  ctx = r.original_max_position_embeddings
  if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx <= 0:
    raise ConfigError(
      'model.rope_scaling.original_max_position_embeddings',
      f'must be a positive integer (the pre-scaling context), got {ctx!r}',
    )
  if r.rope_type != 'linear':
    (_check_yarn if r.rope_type == 'yarn' else _check_llama3)(r)


def _check_llama3(r) -> None:
  if not (positive_number(r.low_freq_factor) and positive_number(r.high_freq_factor)):
    raise ConfigError('model.rope_scaling.low_freq_factor', 'both frequency factors must be > 0')
  if r.high_freq_factor <= r.low_freq_factor:
    raise ConfigError(
      'model.rope_scaling.high_freq_factor',
      f'must exceed low_freq_factor={r.low_freq_factor}, got {r.high_freq_factor!r}',
    )


def _check_yarn(r) -> None:
  for key in ('beta_fast', 'beta_slow'):
    if not positive_number(r[key]):
      raise ConfigError(f'model.rope_scaling.{key}', f'must be a number > 0, got {r[key]!r}')
  if r.beta_fast < r.beta_slow:
    raise ConfigError(
      'model.rope_scaling.beta_fast',
      f'must be at least beta_slow={r.beta_slow} (more turns than it), got {r.beta_fast!r}',
    )
  for key in ('mscale', 'mscale_all_dim'):
    checks.non_negative_number(f'model.rope_scaling.{key}', r[key], 'unset')


def _kv_axis(mesh_cfg, rules: tuple) -> tuple[str | None, int]:
  """The mesh axis the rules give 'kv_heads' (else 'heads') and its size."""
  mapping = dict(rules)
  axis = mapping.get('kv_heads', mapping.get('heads'))
  return axis, mesh_cfg[axis] if axis else 1


def axis_rules(model_cfg, mesh_cfg, rules: tuple) -> tuple:
  """'kv_heads' over the axis 'heads' uses when the K/V heads divide over it,
  else replicated (Megatron's GQA rule)."""
  kv = model_cfg.num_kv_heads or model_cfg.num_heads
  axis, size = _kv_axis(mesh_cfg, rules)
  resolved = axis if kv % size == 0 else None
  return tuple(r for r in rules if r[0] != 'kv_heads') + (('kv_heads', resolved),)


Spec = LlamaSpec
Model = Llama
