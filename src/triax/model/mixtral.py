"""The Mixtral family: Llama's block (RMSNorm, RoPE, grouped-query attention) with a mixture
of SwiGLU experts for its MLP (model/moe.py routes and dispatches), optionally beside
always-on shared experts (DeepSeek's, Qwen's).

Parameter tree: llama.py's, the MLP's weights replaced by

  'router': [L, d, E], 'w_gate': [L, E, d, f], 'w_up': [L, E, d, f],
  'w_down': [L, E, f, d]  (+ 'shared_gate', 'shared_up': [L, d, S*f],
  'shared_down': [L, S*f, d] with S = model.shared_experts, and
  'shared_expert_gate': [L, d, 1] with model.shared_expert_gate)

so that transformers' Mixtral and Qwen2-MoE checkpoints map onto it by transposes
(convert/hf_llama.py). The experts' leading axis has the logical name 'experts'.

Training minimises cross-entropy plus router_aux_loss_coef x the load-balancing loss and
router_z_loss_coef x the z-loss (`objective`); `loss` is the cross-entropy alone. Only
model.router_aux_loss_scope='microbatch' runs under the pipeline executor. With
model.moe_every = n > 1 one entry of the layer stack is a `Group` of n blocks
({'dense_0', ..., 'moe'}, stacked [L/n, ...]), pipeline chunks are cut at group boundaries
and remat applies to a whole entry. The reasoning: docs/design/moe.md."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from triax.config import EXPERT_AXIS
from triax.errors import ConfigError
from triax.model import llama, moe
from triax.model.common import Decode, param

DISPATCHES = ('dropless', 'capacity')
AUX_LOSS_SCOPES = ('batch', 'microbatch')


@dataclasses.dataclass(frozen=True)
class MixtralSpec(llama.LlamaSpec):
  num_experts: int = 8
  experts_per_token: int = 2
  shared_experts: int = 0
  shared_expert_gate: bool = False
  norm_topk_prob: bool = True
  moe_every: int = 1
  moe_dispatch: str = 'dropless'
  capacity_factor: float = 1.25
  router_aux_loss_coef: float = 0.01
  router_aux_loss_scope: str = 'batch'
  router_z_loss_coef: float = 0.001
  router_seq_aux_loss_coef: float = 0.0

  SHAPE_KEYS: ClassVar[tuple[str, ...]] = llama.LlamaSpec.SHAPE_KEYS + (
    'num_experts',
    'shared_experts',
    'shared_expert_gate',
    'moe_every',
  )

  @property
  def layers_per_entry(self) -> int:
    return self.moe_every

  @property
  def moe_layers(self) -> int:
    return self.num_layers // self.moe_every

  def executor_refusal(self) -> str:
    if self.router_aux_loss_scope == 'microbatch' or not self.router_aux_loss_coef:
      return super().executor_refusal()  # off, the scope changes nothing
    return (
      "model.router_aux_loss_scope='batch' balances every layer over the whole batch at "
      "once, which no pipeline stage sees; set it to microbatch (Megatron's: each layer over "
      'each micro-batch) to pipeline a mixtral, or use mesh.pipe=1 and pipeline.microbatches=1'
    )


class Block(llama.Block):
  """Llama's block, its MLP a mixture of experts."""

  spec: MixtralSpec

  def mlp(self, h):
    s = self.spec
    pdt = jnp.dtype(s.param_dtype)
    e, d, f = s.num_experts, s.d_model, s.d_ff
    router = param(self, 'router', (d, e), ('embed', None), 0.02, pdt)
    w_gate = param(self, 'w_gate', (e, d, f), ('experts', 'embed', 'mlp'), 0.02, pdt)
    w_up = param(self, 'w_up', (e, d, f), ('experts', 'embed', 'mlp'), 0.02, pdt)
    w_down = param(self, 'w_down', (e, f, d), ('experts', 'mlp', 'embed'), llama.out_std(s), pdt)
    routing = moe.route(h, router, s.experts_per_token, s.norm_topk_prob)
    if s.moe_dispatch == 'capacity':
      out, dropped = moe.capacity(h, routing, w_gate, w_up, w_down, s.capacity_factor, s.fp8_recipe)
    else:
      out, dropped = moe.dropless(h, routing, w_gate, w_up, w_down, s.fp8_recipe), 0
    # Kept only when the caller asks for 'intermediates' (Mixtral.objective).
    self.sow('intermediates', 'router', moe.layer_stats(routing, dropped))
    if s.shared_experts:
      shared = self.swiglu(h, 'shared_', s.shared_experts * s.d_ff)
      if s.shared_expert_gate:  # Qwen2-MoE's: a sigmoid of one learnt projection of the token
        gate = param(self, 'shared_expert_gate', (d, 1), ('embed', None), 0.02, pdt)
        shared = shared * jax.nn.sigmoid(jnp.einsum('bsd,do->bso', h, gate.astype(h.dtype)))
      out = out + shared
    return out


class Group(nn.Module):
  """model.moe_every blocks as one entry of the layer stack: moe_every - 1 of
  Llama's, then one with experts. A decode's caches arrive as the group's
  blocks' [n, ...] and leave so."""

  spec: MixtralSpec

  @nn.compact
  def __call__(self, x, decode: Decode | None = None, segments=None):
    n = self.spec.moe_every
    caches = []
    for i in range(n):
      block = (
        Block(self.spec, name='moe') if i == n - 1 else llama.Block(self.spec, name=f'dense_{i}')
      )
      if decode is None:
        x = block(x, None, segments)
        continue
      x, cache = block(x, decode.replace(k=decode.k[i], v=decode.v[i]), segments)
      caches.append(cache)
    return x if decode is None else (x, tuple(jnp.stack(c) for c in zip(*caches)))


def _router_stats(sown) -> moe.LayerStats:
  """The MoE block's sown statistics, from a block's or a Group's intermediates."""
  return (sown['moe'] if 'moe' in sown else sown)['router'][0]


class Mixtral(llama.Llama):
  block_module = Block

  def __init__(self, spec: MixtralSpec):
    super().__init__(spec)
    if spec.moe_every > 1:
      # The stack's entry (what the scan, init and the pipeline's chunks run) is a group.
      self._block = Group(spec)

  def objective(self, params, inputs, targets, segments=None):
    embed_params, head_params = self.edge_params(params)
    x = self.embed(embed_params, inputs, segments)
    x, sown = self.layers_and_sown(params['layers'], x, segments)
    lm = self._head_loss_differentiated_forward(head_params, x, targets) / targets.size
    stats = _router_stats(sown)
    per_layer = self.spec.router_aux_loss_scope == 'microbatch'
    return self._with_router_losses(lm, moe.losses(stats, per_layer=per_layer))

  def _with_router_losses(self, lm, metrics: dict):
    """(the objective: the cross-entropy plus the weighted router losses, the logged figures)."""
    s = self.spec
    total = (
      lm
      + s.router_aux_loss_coef * metrics['router_aux_loss']
      + s.router_z_loss_coef * metrics['router_z_loss']
      + s.router_seq_aux_loss_coef * metrics['router_seq_aux_loss']
    )
    return total, {'lm_loss': lm, **metrics}

  def stage_chunk(self, microbatches: int, replica_axes: tuple[str, ...]):
    """`layers`, each MoE layer adding its share of the router losses to the
    gradient (moe.with_gradient_of) and reporting its share of the figures."""
    s = self.spec
    coefs = (s.router_aux_loss_coef, s.router_z_loss_coef, s.router_seq_aux_loss_coef)
    parts = s.moe_layers * microbatches
    # A padded layer's figures (uneven splits): zeros shaped as a real layer's.
    zeros = jax.eval_shape(lambda: moe.layer_share(_one_token_stats(s), coefs, parts, ())[1:])

    def chunk(stacked_params, x, num_active=None, segments=None):
      sowing = self._sowing_layer(segments)

      def layer(p, h):
        out, sown = sowing(p, h)
        term, shares, maxima = moe.layer_share(_router_stats(sown), coefs, parts, replica_axes)
        return moe.with_gradient_of(out, term), (shares, maxima)

      skipped = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), zeros)
      y, (shares, maxima) = self._scan_layers(layer, stacked_params, x, num_active, skipped)
      return y, (jax.tree.map(jnp.sum, shares), jax.tree.map(jnp.max, maxima))

    return chunk

  def stage_objective(self, lm_loss, shares: dict, maxima: dict):
    return self._with_router_losses(lm_loss, moe.figures(shares, maxima))

  def active_parameters(self, total: int) -> int:
    s = self.spec
    unused = s.num_experts - s.experts_per_token
    return total - s.moe_layers * unused * 3 * s.d_model * s.d_ff

  def forward_flops(self) -> dict[str, float]:
    """Forward FLOPs of one sequence, the chosen experts' only (model/flops.py);
    per layer, averaged over a group's dense blocks and its MoE block."""
    s = self.spec
    t, d = s.seq_len, s.d_model
    dense = super().forward_flops()
    experts = s.experts_per_token + s.shared_experts
    # Llama's count has one SwiGLU of d_ff; a MoE token runs k routed and S shared ones.
    mlp = 2.0 * t * 3 * d * s.d_ff
    router = 2.0 * t * d * s.num_experts
    extra = ((experts - 1) * mlp + router) / s.moe_every
    return {**dense, 'layer_matmul': dense['layer_matmul'] + extra}


def _one_token_stats(s: MixtralSpec) -> moe.LayerStats:
  """A layer's statistics over one token, for the shapes of its figures."""
  k, e = s.experts_per_token, s.num_experts
  routing = moe.Routing(
    jnp.zeros((1, 1, e)),
    jnp.zeros((1, 1, k), jnp.int32),
    jnp.zeros((1, 1, k)),
    jnp.zeros((1, 1, e)),
  )
  return moe.layer_stats(routing, 0)


def count(m, key: str, low: int) -> int:
  """model.`key`, refused (ConfigError) unless an integer >= `low`."""
  value = m[key]
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ConfigError(f'model.{key}', f'must be an integer >= {low}, got {value!r}')
  return value


def _coef(m, key: str) -> None:
  value = m[key]
  if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
    raise ConfigError(f'model.{key}', f'must be a number >= 0 (0 = off), got {value!r}')


def validate(model_cfg, mesh_cfg, rules: tuple) -> None:
  """Llama's checks, the MoE keys'; the experts split over mesh.expert (config.py
  checked that it divides the data-parallel devices), never by `rules`."""
  m = model_cfg
  if m.sliding_window:
    raise ConfigError(
      'model.sliding_window',
      f'model.family={m.family} runs no local layers (llama does: Mistral); set it to 0',
    )
  experts = count(m, 'num_experts', 1)
  k = count(m, 'experts_per_token', 1)
  if k > experts:
    raise ConfigError(
      'model.experts_per_token', f'{k} exceeds model.num_experts={experts}: at most all of them'
    )
  shared = count(m, 'shared_experts', 0)
  llama.check_flags(m, ('shared_expert_gate', 'norm_topk_prob'))
  if m.shared_expert_gate and not shared:
    raise ConfigError(
      'model.shared_expert_gate', 'gates the shared experts, and model.shared_experts is 0'
    )
  every = count(m, 'moe_every', 1)
  if m.num_layers % every:
    raise ConfigError(
      'model.moe_every',
      f'{every} does not divide model.num_layers={m.num_layers}: the stack is groups of '
      f'moe_every blocks, the last one a MoE; use a divisor',
    )
  if m.moe_dispatch not in DISPATCHES:
    raise ConfigError(
      'model.moe_dispatch',
      f'unknown value {m.moe_dispatch!r}; choose one of {", ".join(DISPATCHES)}',
    )
  factor = m.capacity_factor
  if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
    raise ConfigError('model.capacity_factor', f'must be a number > 0, got {factor!r}')
  _coef(m, 'router_aux_loss_coef')
  if m.router_aux_loss_scope not in AUX_LOSS_SCOPES:
    raise ConfigError(
      'model.router_aux_loss_scope',
      f'unknown value {m.router_aux_loss_scope!r}; choose one of {", ".join(AUX_LOSS_SCOPES)}',
    )
  _coef(m, 'router_z_loss_coef')
  _coef(m, 'router_seq_aux_loss_coef')
  degree = mesh_cfg.get('expert', 1)
  if experts % degree:
    raise ConfigError(
      'mesh.expert',
      f'model.num_experts={experts} cannot be split over mesh.expert={degree}; use a divisor',
    )
  mapping = dict(rules)
  if mapping.get('experts') is not None:
    raise ConfigError(
      'sharding.logical_axis_rules',
      f"('experts', {mapping['experts']!r}): experts are split by mesh.expert; map "
      "'experts' to None",
    )
  llama.validate(m, mesh_cfg, rules)


def axis_rules(model_cfg, mesh_cfg, rules: tuple) -> tuple:
  """Llama's rules, the expert axis placed (`_expert_rules`)."""
  return _expert_rules(llama.axis_rules(model_cfg, mesh_cfg, rules), mesh_cfg.get('expert', 1))


def _expert_rules(rules: tuple, degree: int) -> tuple:
  """With mesh.expert > 1 the experts' leading axis over `expert`; whatever else
  is split over `data` (the batch; with mesh.fsdp the parameters' 'embed')
  over ('data', 'expert'): the expert axis is carved from data
  (mesh.build_mesh), its devices data-parallel for all but the experts."""
  if degree == 1:
    return tuple(r for r in rules if r[0] != 'experts') + (('experts', None),)
  out = []
  for name, axis in rules:
    names = (axis,) if isinstance(axis, str) else tuple(axis or ())
    if 'data' in names:
      at = names.index('data') + 1
      axis = names[:at] + (EXPERT_AXIS,) + names[at:]
    if name != 'experts':
      out.append((name, axis))
  return tuple(out) + (('experts', EXPERT_AXIS),)


Spec = MixtralSpec
Model = Mixtral
