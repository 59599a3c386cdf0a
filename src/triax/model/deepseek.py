"""The DeepSeek family (DeepSeek-V2 and V3): multi-head latent attention (MLA),
DeepSeekMoE (fine-grained routed experts beside always-on shared ones, sigmoid
affinities, group-limited top-k, auxiliary-loss-free balancing), the first
model.first_k_dense blocks dense, and model.mtp_depth multi-token prediction
modules beside the head.

Parameter tree: mixtral.py's with MLA's projections for Llama's, and

  'embed': {'tokens': [V, d], 'dense_0' .. 'dense_{k-1}': one dense block each}
  'layers': {'attn_norm', 'mlp_norm': [L, d],
             'wq': [L, d, n, qk]  or  'wq_a': [L, d, qr], 'q_a_norm': [L, qr],
                                      'wq_b': [L, qr, n, qk],
             'wkv_a': [L, d, r], 'wk_rope': [L, d, rope], 'kv_a_norm': [L, r],
             'wk_b': [L, r, n, nope], 'wv_b': [L, r, n, v], 'wo': [L, n, v, d],
             'router': [L, d, E], 'router_bias': [L, E] (both fp32),
             'w_gate', 'w_up': [L, E, d, f], 'w_down': [L, E, f, d]
             (+ 'shared_gate', 'shared_up': [L, d, S*f], 'shared_down': [L, S*f, d])}
  'head': {'norm': [d], 'out': [d, V]
           (+ 'mtp': {'depth_i': {'enorm', 'hnorm', 'norm': [d], 'proj': [2d, d],
                                  'block': one MoE block}})}

with L = num_layers - first_k_dense, qk = qk_nope_head_dim + qk_rope_head_dim,
r = kv_lora_rank, f = moe_d_ff. The dense blocks run inside the embedding (so
the layer stack stays one kind of block, and a pipeline's first stage runs
them); the MTP modules inside the head (its last stage). RoPE rotates the
last qk_rope_head_dim of each query head and one key shared by all heads, in
rotate_half's layout (convert/ permutes DeepSeek's interleaved pairs), scaled
by model.rope_scaling (YaRN's, with its softmax factor, as DeepSeek-V3's).

MLA caches for decoding what a token's keys and values are made from: its
normalised latent [r] and its rotated key [rope], never a head's keys or
values, and decodes with the up-projections absorbed into the query and the
output (DeepSeek-V2, Sec. 2.1.2). The reasoning: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from triax import checks
from triax.errors import ConfigError
from triax.model import llama, mixtral, moe
from triax.model import loss as loss_lib
from triax.model.common import (
  REMAT_POLICIES,
  RESIDUAL,
  Decode,
  causal_attention,
  head_norm,
  layer_checkpointed,
  matmul,
  param,
  project,
  rms_norm,
)
from triax.sharding import constrain

# transformers' DeepseekV3RMSNorm default: the latents' norms do not read rms_norm_eps.
LATENT_EPS = 1e-6


def _unused(default):
  """A field of llama's or mixtral's spec that DeepSeek's blocks do not read:
  not a config key of this family (registry.validate refuses it when set)."""
  return dataclasses.field(default=default, metadata={'config': False})


@dataclasses.dataclass(frozen=True)
class DeepSeekSpec(mixtral.MixtralSpec):
  q_lora_rank: int = 0
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  moe_d_ff: int = 0
  first_k_dense: int = 0
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  bias_update_rate: float = 0.001
  mtp_depth: int = 0
  mtp_loss_weight: float = 0.3
  num_kv_heads: int = _unused(0)
  qkv_bias: bool = _unused(False)
  qk_norm: bool = _unused(False)
  head_dim: int = _unused(0)
  tie_embeddings: bool = _unused(False)
  shared_expert_gate: bool = _unused(False)
  moe_every: int = _unused(1)

  SHAPE_KEYS: ClassVar[tuple[str, ...]] = mixtral.MixtralSpec.SHAPE_KEYS + (
    'q_lora_rank',
    'kv_lora_rank',
    'qk_nope_head_dim',
    'qk_rope_head_dim',
    'v_head_dim',
    'moe_d_ff',
    'first_k_dense',
    'n_group',
    'mtp_depth',
  )

  def __post_init__(self):
    # A query's and a key's width; ModelSpec's d_model / num_heads means nothing here.
    object.__setattr__(self, 'head_dim', self.qk_nope_head_dim + self.qk_rope_head_dim)

  @property
  def rope_dim(self) -> int:
    return self.qk_rope_head_dim

  @property
  def expert_d_ff(self) -> int:
    """A routed (and shared) expert's width: model.moe_d_ff, or d_ff when 0."""
    return self.moe_d_ff or self.d_ff

  @property
  def stacked_layers(self) -> int:
    return self.num_layers - self.first_k_dense

  @property
  def moe_layers(self) -> int:
    return self.num_layers - self.first_k_dense

  def tensor_shard(self, t: int) -> DeepSeekSpec:
    if t == 1:
      return self
    return dataclasses.replace(super().tensor_shard(t), moe_d_ff=self.expert_d_ff // t)


class MlaWeights(NamedTuple):
  """One block's MLA projections; `q` is (wq,) or (wq_a, q_a_norm, wq_b)."""

  q: tuple
  wkv_a: jax.Array
  wk_rope: jax.Array
  kv_a_norm: jax.Array
  wk_b: jax.Array
  wv_b: jax.Array
  wo: jax.Array


class DenseBlock(llama.Block):
  """MLA, then Llama's SwiGLU of width d_ff: DeepSeek's first_k_dense blocks."""

  spec: DeepSeekSpec

  def attention_weights(self) -> MlaWeights:
    s = self.spec
    pdt = jnp.dtype(s.param_dtype)
    n, d, r = s.num_heads, s.d_model, s.kv_lora_rank
    w = lambda name, shape, axes, std=0.02: param(self, name, shape, axes, std, pdt)  # noqa: E731
    if s.q_lora_rank:
      q = (
        w('wq_a', (d, s.q_lora_rank), ('embed', None)),
        w('q_a_norm', (s.q_lora_rank,), (None,), 0),
        w('wq_b', (s.q_lora_rank, n, s.head_dim), (None, 'heads', 'kv')),
      )
    else:
      q = (w('wq', (d, n, s.head_dim), ('embed', 'heads', 'kv')),)
    # The down-projections are replicated over `tensor` (Megatron's MLA):
    # every rank needs the whole latent to make its heads' keys and values.
    return MlaWeights(
      q,
      w('wkv_a', (d, r), ('embed', None)),
      w('wk_rope', (d, s.qk_rope_head_dim), ('embed', None)),
      w('kv_a_norm', (r,), (None,), 0),
      w('wk_b', (r, n, s.qk_nope_head_dim), (None, 'heads', 'kv')),
      w('wv_b', (r, n, s.v_head_dim), (None, 'heads', 'kv')),
      w('wo', (n, s.v_head_dim, d), ('heads', 'kv', 'embed'), llama.out_std(s)),
    )

  def attention(self, h, w: MlaWeights, decode: Decode | None, segments, local=False):
    del local  # no block is local: deepseek.validate refuses model.sliding_window
    s = self.spec
    dt = jnp.dtype(s.dtype)
    cos, sin = llama.rope_tables(s, s.positions(h.shape[1]) if decode is None else decode.positions)
    if s.q_lora_rank:
      wq_a, q_a_norm, wq_b = w.q
      q_latent, latent, k_rope = project(
        h, (wq_a, w.wkv_a, w.wk_rope), 'bsd,dr->bsr', dt, s.remat, s.fp8_recipe
      )
      q_latent = head_norm(q_latent, q_a_norm, LATENT_EPS)
      q = matmul('bsr,rnk->bsnk', q_latent, wq_b, dt, s.remat, s.fp8_recipe)
    else:
      (q,) = project(h, w.q, 'bsd,dnk->bsnk', dt, s.remat, s.fp8_recipe)
      latent, k_rope = project(h, (w.wkv_a, w.wk_rope), 'bsd,dr->bsr', dt, s.remat, s.fp8_recipe)
    latent = head_norm(latent, w.kv_a_norm, LATENT_EPS)
    if s.rope_scaling.softmax_factor != 1.0:
      # YaRN's factor on the softmax scale, put on the queries: every core
      # and kernel, and absorbed decoding, then scales alike.
      q = q * s.rope_scaling.softmax_factor
    nope = s.qk_nope_head_dim
    q_nope, q_rope = q[..., :nope], llama.apply_rope(q[..., nope:], cos, sin)
    k_rope = llama.apply_rope(k_rope[:, :, None, :], cos, sin)  # one key for every head
    if decode is not None:
      return self.absorbed_attention(q_nope, q_rope, latent, k_rope[:, :, 0], w, decode)
    k_nope = matmul('bsr,rnk->bsnk', latent, w.wk_b, dt, s.remat, s.fp8_recipe)
    v = matmul('bsr,rnk->bsnk', latent, w.wv_b, dt, s.remat, s.fp8_recipe)
    q = constrain(jnp.concatenate([q_nope, q_rope], -1), ('batch', 'seq', 'heads', 'kv'))
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:3] + k_rope.shape[3:])], -1)
    k, v = (constrain(t, ('batch', 'seq', 'heads', 'kv')) for t in (k, v))
    a = self._core(q, k, v, segments)
    return matmul('bsnk,nkd->bsd', a, w.wo, dt, s.remat, s.fp8_recipe)

  def _core(self, q, k, v, segments):
    """Causal attention of q, k [b, s, n, qk] over v [b, s, n, v_head_dim].
    XLA's unsplit core takes v as it is; the kernels and the context-parallel
    kinds take one head width, so v is padded with zeros to qk's and the
    output cut back (the value products' FLOPs, and a ring's v bytes, grow
    by qk / v_head_dim)."""
    s = self.spec
    where = s.split_sequence(q.shape[1])
    run = lambda v: causal_attention(  # noqa: E731
      q, k, v, s.attention, None, segments, s.splash_interpret, *where, remat=s.remat
    )
    pad = q.shape[-1] - v.shape[-1]
    if (s.attention == 'xla' and not where) or not pad:
      return run(v)
    return run(jnp.pad(v, ((0, 0),) * 3 + ((0, pad),)))[..., : v.shape[-1]]

  def absorbed_attention(self, q_nope, q_rope, latent, k_rope, w: MlaWeights, decode: Decode):
    """Decoding against the latent cache: decode.k [b, S, r] holds the
    normalised latents, decode.v [b, S, rope] the rotated keys. wk_b is
    absorbed into the queries and wv_b applied after the weighted sum, so
    no head's keys or values are ever made for the cached slots."""
    s = self.spec
    dt = jnp.dtype(s.dtype)
    c = jax.lax.dynamic_update_slice_in_dim(
      decode.k, latent.astype(decode.k.dtype), decode.index, 1
    )
    r = jax.lax.dynamic_update_slice_in_dim(
      decode.v, k_rope.astype(decode.v.dtype), decode.index, 1
    )
    q_latent = jnp.einsum('btnk,rnk->btnr', q_nope, w.wk_b.astype(dt))
    f32 = jnp.float32
    logits = jnp.einsum('btnr,bsr->bnts', q_latent, c.astype(dt), preferred_element_type=f32)
    logits += jnp.einsum('btnk,bsk->bnts', q_rope, r.astype(dt), preferred_element_type=f32)
    slots = jnp.arange(c.shape[1])
    query = decode.index + jnp.arange(q_nope.shape[1])
    mask = (slots[None, None, :] <= query[None, :, None]) & (
      slots[None, None, :] >= decode.start[:, None, None]
    )
    logits = jnp.where(mask[:, None], logits * s.head_dim**-0.5, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    out_latent = jnp.einsum('bnts,bsr->btnr', probs, c.astype(dt))
    a = jnp.einsum('btnr,rnk->btnk', out_latent, w.wv_b.astype(dt))
    return matmul('bsnk,nkd->bsd', a, w.wo, dt, s.remat, s.fp8_recipe), (c, r)


class Block(DenseBlock):
  """MLA, then DeepSeekMoE: routed experts chosen on biased sigmoid
  affinities (moe.route_biased), beside model.shared_experts always-on ones."""

  def mlp(self, h):
    s = self.spec
    pdt = jnp.dtype(s.param_dtype)
    e, d, f = s.num_experts, s.d_model, s.expert_d_ff
    # In fp32 whatever param_dtype says, as transformers keeps DeepSeek-V3's router.
    router = param(self, 'router', (d, e), ('embed', None), 0.02, jnp.float32)
    bias = self.param(
      moe.BIAS, nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (e,), jnp.float32
    )
    w_gate = param(self, 'w_gate', (e, d, f), ('experts', 'embed', 'mlp'), 0.02, pdt)
    w_up = param(self, 'w_up', (e, d, f), ('experts', 'embed', 'mlp'), 0.02, pdt)
    w_down = param(self, 'w_down', (e, f, d), ('experts', 'mlp', 'embed'), llama.out_std(s), pdt)
    routing = moe.route_biased(
      h,
      router,
      bias,
      s.experts_per_token,
      s.n_group,
      s.topk_group,
      s.norm_topk_prob,
      s.routed_scaling_factor,
    )
    if s.moe_dispatch == 'capacity':
      out, dropped = moe.capacity(h, routing, w_gate, w_up, w_down, s.capacity_factor, s.fp8_recipe)
    else:
      out, dropped = moe.dropless(h, routing, w_gate, w_up, w_down, s.fp8_recipe), 0
    stats = moe.layer_stats(routing, dropped)
    self.sow('intermediates', 'router', stats)
    # The load reaches the bias as its gradient (loss-free balancing).
    out = moe.with_gradient_of(out, moe.balance_term(stats.assigned, bias))
    if s.shared_experts:
      out = out + self.swiglu(h, 'shared_', s.shared_experts * f)
    return out


class Embed(nn.Module):
  """The token embedding, then the first_k_dense dense blocks (under the
  layers' remat policy). With `decode`, their caches ([k, ...] each) go in
  and come out: (x, (latent caches, rope-key caches))."""

  spec: DeepSeekSpec

  @nn.compact
  def __call__(self, tokens, positions=None, segments=None, decode: Decode | None = None):
    del positions  # the blocks rotate by them
    s, pdt = self.spec, jnp.dtype(self.spec.param_dtype)
    table = param(self, 'tokens', (s.vocab_size, s.d_model), ('vocab', 'embed'), 0.02, pdt)
    x = constrain(jnp.take(table, tokens, axis=0).astype(s.dtype), RESIDUAL)
    block = DenseBlock
    if decode is None and layer_checkpointed(s.remat):
      block = nn.remat(DenseBlock, policy=REMAT_POLICIES[s.remat], static_argnums=(2,))
    caches = []
    for i in range(s.first_k_dense):
      if decode is None:
        x = block(s, name=f'dense_{i}')(x, None, segments)
        continue
      x, cache = block(s, name=f'dense_{i}')(x, decode.replace(k=decode.k[i], v=decode.v[i]))
      caches.append(cache)
    if decode is None:
      return x
    return x, tuple(jnp.stack(c) for c in zip(*caches))


class MtpDepth(nn.Module):
  """One multi-token prediction module: the previous depth's hidden state and
  the next token's embedding, each RMS-normalised, concatenated ([embedding;
  hidden], DeepSeek-V3's order) and projected to d, then one MoE block; its
  own final norm. Returns (the block's output, its normalised output)."""

  spec: DeepSeekSpec

  @nn.compact
  def __call__(self, h, embedded):
    s = self.spec
    pdt, dt = jnp.dtype(s.param_dtype), jnp.dtype(s.dtype)
    d = s.d_model
    enorm, hnorm = (param(self, n, (d,), ('embed',), 0, pdt) for n in ('enorm', 'hnorm'))
    proj = param(self, 'proj', (2 * d, d), (None, 'embed'), 0.02, pdt)
    norm = param(self, 'norm', (d,), ('embed',), 0, pdt)
    joined = jnp.concatenate(
      [rms_norm(embedded, enorm, s.norm_eps), rms_norm(h, hnorm, s.norm_eps)], -1
    )
    h = constrain(matmul('bse,ed->bsd', joined, proj, dt, s.remat, s.fp8_recipe), RESIDUAL)
    h = Block(s, name='block')(h)
    return h, rms_norm(h, norm, s.norm_eps)


class Mtp(nn.Module):
  """model.mtp_depth MTP modules in sequence. Depth i (from 0) reads the
  embedding of the token at position t + i + 1 (targets[t + i]) and predicts
  the one at t + i + 2 (targets[t + i + 1]); a row's last i + 1 positions
  have no such target and count for nothing. Returns each depth's summed
  cross-entropy [mtp_depth] (fp32), its logits made model.loss_chunk
  positions at a time as the head's are."""

  spec: DeepSeekSpec

  @nn.compact
  def __call__(self, x, targets, table, out):
    s = self.spec
    length = targets.shape[1]

    def logits(h):
      products = jnp.einsum('bsd,dv->bsv', h, out.astype(s.dtype)).astype(jnp.float32)
      return constrain(products, ('batch', 'seq', 'vocab'))

    sums = []
    for i in range(s.mtp_depth):
      shifted = lambda a, n: jnp.pad(a[:, n:], ((0, 0), (0, n)))  # noqa: E731
      embedded = jnp.take(table, shifted(targets, i), axis=0).astype(s.dtype)
      x, normed = MtpDepth(s, name=f'depth_{i}')(x, embedded)
      counted = jnp.broadcast_to(jnp.arange(length) < length - i - 1, targets.shape)
      sums.append(
        loss_lib.cross_entropy_sum(
          logits, normed, shifted(targets, i + 1), s.loss_chunk, s.vocab_used, counted
        )
      )
    return jnp.stack(sums)


# The head's own weights (its parameters besides 'mtp' and the table it borrows).
_HEAD = ('norm', 'out')


class DeepSeek(mixtral.Mixtral):
  embed_module = Embed
  block_module = Block
  head_module = llama.Head
  embed_takes_segments = True

  def __init__(self, spec: DeepSeekSpec):
    super().__init__(spec)
    self._mtp = Mtp(spec)

  def _head_init(self, key, x):
    s = self.spec
    k_head, k_mtp = jax.random.split(key)
    head = self._head.init(k_head if s.mtp_depth else key, x)
    if not s.mtp_depth:
      return head
    table = jnp.zeros((s.vocab_size, s.d_model), s.param_dtype)
    targets = jnp.zeros(x.shape[:2], jnp.int32)
    out = jnp.zeros((s.d_model, s.vocab_size), s.param_dtype)
    mtp = self._mtp.init(k_mtp, x, targets, table, out)
    return {'params': {**head['params'], 'mtp': mtp['params']}}

  def edge_params(self, params):
    if not self.spec.mtp_depth:
      return params['embed'], params['head']
    # MTP embeds the next tokens with the model's table: its gradient adds into 'embed'.
    return params['embed'], {**params['head'], 'tokens': params['embed']['tokens']}

  def head_logits(self, head_params, x):
    return self._head.apply({'params': {k: head_params[k] for k in _HEAD}}, x)

  def mtp_losses(self, head_params, x, targets) -> jax.Array:
    """Each MTP depth's summed cross-entropy [mtp_depth] from the last block's output x."""
    p = head_params
    return self._mtp.apply({'params': p['mtp']}, x, targets, p['tokens'], p['out'])

  def objective(self, params, inputs, targets, segments=None):
    s = self.spec
    embed_params, head_params = self.edge_params(params)
    x = self.embed(embed_params, inputs, segments)
    x, sown = self.layers_and_sown(params['layers'], x, segments)
    own = {k: head_params[k] for k in _HEAD}
    lm = self._head_loss_differentiated_forward(own, x, targets) / targets.size
    per_layer = s.router_aux_loss_scope == 'microbatch'
    total, metrics = self._with_router_losses(
      lm, moe.losses(mixtral._router_stats(sown), per_layer=per_layer)
    )
    if not s.mtp_depth:
      return total, metrics
    mtp = jnp.mean(self.mtp_losses(head_params, x, targets)) / targets.size
    return total + s.mtp_loss_weight * mtp, {**metrics, 'mtp_loss': mtp}

  @property
  def head_loss_terms(self) -> int:
    """The cross-entropy, and with MTP the MTP modules' mean loss apart."""
    return 2 if self.spec.mtp_depth else 1

  def head_loss_and_grad(self, edges, x, targets, acc, scale: float, input_grad: bool = True):
    """The pipeline's last stage: llama's, and with MTP [its loss, scale x
    the MTP modules' mean summed cross-entropy], the gradients those of the
    objective's weighted sum (w.r.t. the head, the table MTP reads and x)."""
    loss, acc, dx = super().head_loss_and_grad(edges, x, targets, acc, scale, input_grad)
    s = self.spec
    if not s.mtp_depth:
      return loss, acc, dx
    used = {'tokens': edges['embed']['tokens'], 'head': edges['head']}

    def mtp(used, h):
      head = {**used['head'], 'tokens': used['tokens']}
      return scale * jnp.mean(self.mtp_losses(head, h, targets))

    held = None if acc is None else {'tokens': acc['embed']['tokens'], 'head': acc['head']}
    value, held, gx = loss_lib.partial_vjp(mtp, used, x, held, input_grad, s.mtp_loss_weight)
    if held is not None:
      embed = {**acc['embed'], 'tokens': held['tokens']}
      acc = {**acc, 'embed': embed, 'head': held['head']}
    return jnp.stack([loss, value]), acc, (dx + gx if input_grad else None)

  def stage_objective(self, lm_loss, shares: dict, maxima: dict):
    if not self.spec.mtp_depth:
      return super().stage_objective(lm_loss, shares, maxima)
    lm, mtp = lm_loss[0], lm_loss[1]
    total, metrics = super().stage_objective(lm, shares, maxima)
    return total + self.spec.mtp_loss_weight * mtp, {**metrics, 'mtp_loss': mtp}

  def init_cache(self, batch: int) -> tuple[jax.Array, jax.Array]:
    """Empty MLA caches for `batch` rows: latents [layers, batch, seq_len,
    kv_lora_rank] and rotated keys [layers, batch, seq_len, qk_rope_head_dim]."""
    s = self.spec
    shape = (s.num_layers, batch, s.seq_len)
    return (
      jnp.zeros(shape + (s.kv_lora_rank,), s.dtype),
      jnp.zeros(shape + (s.qk_rope_head_dim,), s.dtype),
    )

  def active_parameters(self, total: int) -> int:
    s = self.spec
    unused = s.num_experts - s.experts_per_token
    return total - s.moe_layers * unused * 3 * s.d_model * s.expert_d_ff

  def forward_flops(self) -> dict[str, float]:
    """Forward FLOPs of one sequence (model/flops.py), per layer averaged over
    the dense and MoE blocks; MTP's modules are not counted (a training
    extra, as Megatron's MFU leaves them out)."""
    s = self.spec
    t, d, n = s.seq_len, s.d_model, s.num_heads
    qk, r, rope = s.head_dim, s.kv_lora_rank, s.qk_rope_head_dim
    q = d * s.q_lora_rank + s.q_lora_rank * n * qk if s.q_lora_rank else d * n * qk
    kv = d * (r + rope) + r * n * (s.qk_nope_head_dim + s.v_head_dim)
    attention = 2.0 * t * (q + kv + n * s.v_head_dim * d)
    dense = 2.0 * t * 3 * d * s.d_ff
    experts = s.experts_per_token + s.shared_experts
    routed = 2.0 * t * (experts * 3 * d * s.expert_d_ff + d * s.num_experts)
    mlp = (s.first_k_dense * dense + s.moe_layers * routed) / s.num_layers
    return {
      'layer_matmul': attention + mlp,
      'layer_attention': 2.0 * t * t * n * (qk + s.v_head_dim),
      'head': 2.0 * t * d * s.vocab_size,
    }


def validate(model_cfg, mesh_cfg, rules: tuple) -> None:
  """Mixtral's checks, then MLA's widths, the groups, the balancing and MTP keys."""
  m = model_cfg
  mixtral.validate(m, mesh_cfg, rules)
  mixtral.count(m, 'q_lora_rank', 0)
  for key in ('kv_lora_rank', 'qk_nope_head_dim', 'v_head_dim'):
    mixtral.count(m, key, 1)
  if mixtral.count(m, 'qk_rope_head_dim', 2) % 2:
    raise ConfigError('model.qk_rope_head_dim', f'{m.qk_rope_head_dim} must be even (rotary pairs)')
  mixtral.count(m, 'moe_d_ff', 0)
  if mixtral.count(m, 'first_k_dense', 0) >= m.num_layers:
    raise ConfigError(
      'model.first_k_dense',
      f'{m.first_k_dense} leaves no MoE block of model.num_layers={m.num_layers}; use fewer '
      '(or the llama family for a dense model)',
    )
  _check_groups(m)
  checks.non_negative_number('model.routed_scaling_factor', m.routed_scaling_factor)
  if not m.routed_scaling_factor > 0:
    raise ConfigError(
      'model.routed_scaling_factor', f'must be > 0, got {m.routed_scaling_factor!r}'
    )
  checks.non_negative_number('model.bias_update_rate', m.bias_update_rate)
  mixtral.count(m, 'mtp_depth', 0)
  checks.non_negative_number('model.mtp_loss_weight', m.mtp_loss_weight)
  if m.fp8 == 'delayed' and (m.first_k_dense or m.mtp_depth):
    # Their FP8 matmuls run outside the layer stack, which alone keeps amax histories.
    raise ConfigError(
      'model.fp8',
      'delayed keeps amax histories for the layer stack only; model.first_k_dense and '
      'model.mtp_depth blocks run outside it: set both to 0, or use model.fp8=tensorwise',
    )
  if m.mtp_depth and mesh_cfg.get('context', 1) > 1:
    raise ConfigError(
      'model.mtp_depth',
      f'MTP shifts each row by whole positions, which mesh.context={mesh_cfg.context} splits '
      'over ranks; set mesh.context=1 or model.mtp_depth=0',
    )


def _check_groups(m) -> None:
  """Group-limited routing: n_group equal groups of experts, topk_group of them kept."""
  groups, kept = mixtral.count(m, 'n_group', 1), mixtral.count(m, 'topk_group', 1)
  if m.num_experts % groups:
    raise ConfigError(
      'model.n_group', f'{groups} groups cannot split model.num_experts={m.num_experts} evenly'
    )
  if groups > 1 and m.num_experts // groups < 2:
    raise ConfigError(
      'model.n_group',
      f'a group is scored by its two best experts; {m.num_experts} experts in {groups} groups '
      'leave fewer; use fewer groups',
    )
  if kept > groups:
    raise ConfigError('model.topk_group', f'{kept} exceeds model.n_group={groups}')
  if m.experts_per_token > kept * (m.num_experts // groups):
    raise ConfigError(
      'model.topk_group',
      f'{kept} of {groups} groups hold {kept * (m.num_experts // groups)} experts, fewer than '
      f'model.experts_per_token={m.experts_per_token}',
    )


def axis_rules(model_cfg, mesh_cfg, rules: tuple) -> tuple:
  """Mixtral's rules (the expert axis placed)."""
  return mixtral.axis_rules(model_cfg, mesh_cfg, rules)


Spec = DeepSeekSpec
Model = DeepSeek
