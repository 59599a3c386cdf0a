"""The optimizer of a run: its transformations over the parameter tree.

train.optimizer picks one of OPTIMIZERS (training/checks.py), all from optax:
adamw (the default), muon, lion, adafactor, schedule_free_adamw; each is
preceded by global-norm clipping (train.grad_clip_norm).

What a leaf is, read from its logical axes (model.logical_axes(), in the
pipeline's layout: 'stage' and 'virtual' before 'layers'), never from its name:

- Its *stacked* axes hold copies of one weight, not features of it: 'stage',
  'virtual', 'layers' (the scanned layer stack), 'experts' (E matrices) and
  'positions' (GPT-2's learned positions: one vector per position, added to
  the residual, never multiplied).
- Its other axes are features, in order; a heads axis ('heads',
  'kv_heads') and the head width 'kv' right after it are one feature
  (heads x head_dim is one projection's width, as HF stores q_proj).
- A *matrix* has two features or more: wq [L, embed, heads, kv] is an
  embed x (heads*kv) matrix per layer, w_up [L, E, embed, mlp] E of them, the
  router [L, embed, E] one; a norm scale [L, embed], a q/k norm [L, kv], a
  q/k/v bias [L, heads, kv] and a scalar are not.

Weight decay follows that rule (nanoGPT's): matrices decay; biases, norms
and scalars do not. The token table ('vocab' x 'embed') is a matrix and
decays, as it always has here and in nanoGPT; learned positions do not
(stacked vectors), as before, so the default's runs are unchanged.

Muon orthogonalises the matrices without a 'vocab' axis (the hidden ones;
train.muon_exclude names leaves it leaves out too) with the first feature
as the reduction axis and the rest as the output axis (weights are stored
[in, out]); stacked axes are batch axes (each layer's, each expert's matrix
on its own). Embeddings, the head, norms and biases take AdamW, as Muon's
authors and Moonlight do. Its update is scaled by train.muon_rms_scale x
sqrt(max(fan_in, fan_out)) (Moonlight's RMS matching: it then shares AdamW's
learning rate and decay); 0 takes Keller Jordan's sqrt(max(1, out / in)).

Adafactor's block-RMS steps (update clipping, the parameter-scaled step)
take one block per layer matrix (the feature axes), not the whole stacked
leaf, so a layer's step does not depend on the others' or on how a layout
stacks them; its second moment is optax's, factored over a leaf's two
largest dimensions when both reach 128 (feature ones in every family).

A leaf named `BALANCED` (DeepSeek's expert bias, model/moe.py) is trained
by no optimizer: its "gradient" is minus its experts' load
(moe.balance_term), and `moe.with_bias_update` moves it towards balance;
it is left out of the clipping norm, of weight decay and of the logged norm
(the optimizer sees a zero gradient for it, and its update is replaced).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import contrib

from triax.errors import ConfigError
from triax.model import moe, registry

# The leaves trained by load, not gradient (loss-free balancing).
BALANCED = moe.BIAS
# Axes that stack copies of a weight (see the module docstring).
STACKED = ('stage', 'virtual', 'layers', 'experts', 'positions')
# Heads axes: with the head width ('kv') right after, one feature.
HEADS = ('heads', 'kv_heads')


def _is_balanced(path) -> bool:
  return getattr(path[-1], 'key', None) == BALANCED


def balances(model_cfg) -> bool:
  """Whether the model has balanced leaves (a family that reads model.bias_update_rate)."""
  return registry.reads(model_cfg.family, 'bias_update_rate')


def features(axes: tuple) -> tuple[tuple[int, ...], ...]:
  """A leaf's feature dimensions by its logical `axes`, grouped: a heads
  axis and the 'kv' after it form one group; stacked axes are in none.

  Counted from the end (-1 the last): the checkpoint's layout ([L, ...])
  drops the pipeline's leading stage and virtual dimensions, not these."""
  groups: list[tuple[int, ...]] = []
  for i, name in enumerate(axes):
    if name in STACKED:
      continue
    if name == 'kv' and i > 0 and axes[i - 1] in HEADS:
      groups[-1] += (i - len(axes),)
    else:
      groups.append((i - len(axes),))
  return tuple(groups)


def is_matrix(axes: tuple) -> bool:
  """Whether a leaf of logical `axes` is a matrix (or a stack of them)."""
  return len(features(axes)) >= 2


def takes_muon(axes: tuple, name: str, exclude=()) -> bool:
  """Whether Muon trains the leaf: a hidden matrix (no 'vocab' axis), not excluded by name."""
  return is_matrix(axes) and 'vocab' not in axes and name not in exclude and name != BALANCED


def muon_dims(axes: tuple) -> contrib.MuonDimensionNumbers:
  """The leaf's matrix for Newton-Schulz: the first feature in, the rest out."""
  groups = features(axes)
  return contrib.MuonDimensionNumbers(reduction_axis=groups[0], output_axis=sum(groups[1:], ()))


class Leaves:
  """The rules above applied to one parameter tree's leaves, by key path.

  `axes` is the tree of logical axes tuples of the parameters the optimizer
  updates. The functions it makes take a tree of the same keys (params, or
  a part of them where optax masks the rest) and map over its leaves.
  """

  def __init__(self, axes):
    flat = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda a: isinstance(a, tuple))[0]
    self.axes = {jax.tree_util.keystr(path): a for path, a in flat}
    self.names = {jax.tree_util.keystr(path): path[-1].key for path, _ in flat}

  def map(self, fn, *trees):
    """fn(axes, name, *leaves) over the trees' leaves (optax's MaskedNodes kept)."""
    return jax.tree_util.tree_map_with_path(
      lambda path, *x: fn(self.axes[jax.tree_util.keystr(path)], path[-1].key, *x), *trees
    )

  def decay_mask(self, params):
    return self.map(lambda axes, name, _: is_matrix(axes) and name != BALANCED, params)

  def muon_labels(self, exclude):
    return lambda params: self.map(
      lambda axes, name, _: 'muon' if takes_muon(axes, name, exclude) else 'adam', params
    )

  def muon_dims(self, updates):
    return self.map(lambda axes, name, _: muon_dims(axes), updates)

  def block_rms(self, tree):
    """Per leaf, the RMS over its feature dimensions (one figure per layer matrix)."""
    return self.map(lambda axes, _, x: _rms(x, sum(features(axes), ())), tree)

  def muon_names(self, exclude=()) -> list[str]:
    """The names of the leaves Muon trains, sorted."""
    return sorted({n for k, n in self.names.items() if takes_muon(self.axes[k], n, exclude)})


def _rms(x, dims):
  return jnp.sqrt(jnp.mean(jnp.square(x), axis=dims, keepdims=True))


def make_optimizer(
  train_cfg, model_cfg, schedule: optax.Schedule, axes
) -> optax.GradientTransformation:
  """train.optimizer with global-norm clipping at learning rate `schedule`,
  for parameters of logical `axes` (their tree). With balanced leaves,
  those are updated by moe.with_bias_update(.., model.bias_update_rate) instead.

  Raises:
    ConfigError: Muon with no matrix to orthogonalise (train.muon_exclude).
  """
  leaves = Leaves(axes)
  parts = []
  if train_cfg.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(train_cfg.grad_clip_norm))
  parts.append(_BUILDERS[train_cfg.optimizer](train_cfg, schedule, leaves))
  trained = optax.chain(*parts)
  if not balances(model_cfg):
    return trained
  return moe.with_bias_update(trained, model_cfg.bias_update_rate)


def _adamw(t, schedule, leaves: Leaves) -> optax.GradientTransformation:
  return optax.adamw(
    schedule, b1=t.adam_b1, b2=t.adam_b2, weight_decay=t.weight_decay, mask=leaves.decay_mask
  )


def _muon(t, schedule, leaves: Leaves) -> optax.GradientTransformation:
  """Muon on the hidden matrices, AdamW (train.adam_*) on the rest, both
  decayed by the rule at one learning rate (Moonlight's RMS matching)."""
  exclude = tuple(t.muon_exclude)
  if not leaves.muon_names(exclude):
    raise ConfigError(
      'train.muon_exclude',
      f"leaves Muon no matrix to orthogonalise (the model's hidden matrices: "
      f'{", ".join(leaves.muon_names())}); exclude fewer, or set train.optimizer=adamw',
    )
  muon = optax.chain(
    contrib.scale_by_muon(
      ns_steps=t.muon_ns_steps, beta=t.muon_beta, weight_dimension_numbers=leaves.muon_dims
    ),
    _scale_by_shape(leaves, t.muon_rms_scale),
    optax.add_decayed_weights(t.weight_decay, leaves.decay_mask),
    optax.scale_by_learning_rate(schedule),
  )
  return optax.partition(
    {'muon': muon, 'adam': _adamw(t, schedule, leaves)}, leaves.muon_labels(exclude)
  )


def _scale_by_shape(leaves: Leaves, rms_scale: float) -> optax.GradientTransformation:
  """Muon's update scaled by its matrix's shape: rms_scale x sqrt(max(in, out))
  (Moonlight), or with 0, sqrt(max(1, out / in)) (Keller Jordan's)."""

  def scale(axes, _, u):
    dims = muon_dims(axes)
    fan_in = math.prod(u.shape[i] for i in dims.reduction_axis)
    fan_out = math.prod(u.shape[i] for i in dims.output_axis)
    if rms_scale:
      return u * (rms_scale * math.sqrt(max(fan_in, fan_out)))
    return u * math.sqrt(max(1.0, fan_out / fan_in))

  return optax.stateless(lambda updates, _: leaves.map(scale, updates))


def _lion(t, schedule, leaves: Leaves) -> optax.GradientTransformation:
  return optax.lion(
    schedule, b1=t.lion_b1, b2=t.lion_b2, weight_decay=t.weight_decay, mask=leaves.decay_mask
  )


def _adafactor(t, schedule, leaves: Leaves) -> optax.GradientTransformation:
  """optax.adafactor's steps with per-layer blocks (module docstring) and
  decoupled decay scaled by the learning rate, as AdamW's is."""
  parts = [_scale_by_factored_rms(leaves, t.adafactor_decay_rate)]
  if t.adafactor_clipping_threshold > 0:
    threshold = t.adafactor_clipping_threshold
    parts.append(
      optax.stateless(
        lambda u, _: jax.tree.map(
          lambda x, r: x / jnp.maximum(1.0, r / threshold), u, leaves.block_rms(u)
        )
      )
    )
  # The relative step: an update in units of its matrix's RMS (at least 1e-3).
  parts.append(
    optax.stateless(
      lambda u, p: jax.tree.map(lambda x, r: x * jnp.maximum(r, 1e-3), u, leaves.block_rms(p))
    )
  )
  parts.append(optax.add_decayed_weights(t.weight_decay, leaves.decay_mask))
  parts.append(optax.scale_by_learning_rate(schedule))
  return optax.chain(*parts)


class FactoredState(NamedTuple):
  """Adafactor's second moment, each leaf's of its parameter's rank (a size-1
  dimension where it is reduced): v_row and v_col of a factored leaf (v then
  holds nothing), or v of one that is not (v_row and v_col then hold nothing),
  so each keeps the parameter's stacked dimensions (checkpoint relayouts)."""

  count: jax.Array
  v_row: Any
  v_col: Any
  v: Any


def factored_dims(axes: tuple, shape: tuple[int, ...], least: int = 128):
  """(d0, d1): a leaf's two largest feature dimensions, d1 the larger,
  when both reach `least` (optax's rule, over features only); else None."""
  dims = sorted(sum(features(axes), ()), key=lambda i: shape[i])
  if len(dims) < 2 or shape[dims[-2]] < least:
    return None
  return dims[-2], dims[-1]


def _ones_at(shape, dims) -> tuple[int, ...]:
  """`shape` with size 1 at `dims` (counted from the end)."""
  return tuple(1 if i - len(shape) in dims else n for i, n in enumerate(shape))


def _scale_by_factored_rms(leaves: Leaves, rate: float) -> optax.GradientTransformation:
  """optax.scale_by_factored_rms (decay 1 - (k+1)^-rate at count k), each
  layer matrix factored over its own two largest feature dimensions."""

  def init(params):
    def zeros(axes, _, p):
      fd = factored_dims(axes, p.shape)
      if fd is None:
        flat = _ones_at(p.shape, sum(features(axes), ()))
        return jnp.zeros(flat), jnp.zeros(flat), jnp.zeros(p.shape)
      return tuple(jnp.zeros(_ones_at(p.shape, d)) for d in ((fd[1],), (fd[0],), fd))

    return FactoredState(jnp.zeros([], jnp.int32), *_unzip(leaves.map(zeros, params), 3))

  def update(updates, state, params=None):
    del params
    decay = 1.0 - (state.count + 1.0) ** -rate

    def one(axes, _, g, v_row, v_col, v):
      g2 = jnp.square(g) + 1e-30
      fd = factored_dims(axes, g.shape)
      if fd is None:
        v = decay * v + (1 - decay) * g2
        return g * jax.lax.rsqrt(v), v_row, v_col, v
      d0, d1 = fd
      v_row = decay * v_row + (1 - decay) * jnp.mean(g2, axis=d1, keepdims=True)
      v_col = decay * v_col + (1 - decay) * jnp.mean(g2, axis=d0, keepdims=True)
      row = v_row / jnp.mean(v_row, axis=d0, keepdims=True)
      return g * jax.lax.rsqrt(row) * jax.lax.rsqrt(v_col), v_row, v_col, v

    out = _unzip(leaves.map(one, updates, state.v_row, state.v_col, state.v), 4)
    return out[0], FactoredState(optax.safe_increment(state.count), *out[1:])

  return optax.GradientTransformation(init, update)


def _unzip(tree, n: int) -> tuple:
  """A tree of n-tuples as n trees (optax's MaskedNodes, empty tuples, kept in each)."""
  is_leaf = lambda x: isinstance(x, tuple) and not isinstance(x, optax.MaskedNode)
  return tuple(jax.tree.map(lambda x, i=i: x[i], tree, is_leaf=is_leaf) for i in range(n))


def _schedule_free_adamw(t, schedule, leaves: Leaves) -> optax.GradientTransformation:
  """optax.contrib.schedule_free_adamw with the decay rule's mask (optax's
  decays every leaf): RMS scaling without momentum inside schedule-free
  averaging, at interpolation train.schedule_free_b1."""
  base = optax.chain(
    optax.scale_by_rms(decay=t.adam_b2, eps=1e-8, eps_in_sqrt=False, bias_correction=True),
    optax.add_decayed_weights(t.weight_decay, leaves.decay_mask),
    optax.scale_by_learning_rate(schedule),
  )
  return contrib.schedule_free(base, schedule, b1=t.schedule_free_b1)


_BUILDERS = {
  'adamw': _adamw,
  'muon': _muon,
  'lion': _lion,
  'adafactor': _adafactor,
  'schedule_free_adamw': _schedule_free_adamw,
}


def eval_params(opt_state, params):
  """The parameters to evaluate: `params` as trained, but schedule-free's
  average x = (y - (1 - b1) z) / b1 where the train state holds the
  interpolation y (the balanced leaves as they are: moe.with_bias_update
  moves them, not schedule-free's z)."""
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_schedule_free) if _is_schedule_free(s)]
  if not found:
    return params
  b1, z = found[0].b1, found[0].z
  return jax.tree_util.tree_map_with_path(
    lambda path, zi, y: y if _is_balanced(path) else (y - (1.0 - b1) * zi) / b1, z, params
  )


def _is_schedule_free(x) -> bool:
  return isinstance(x, contrib.ScheduleFreeState)


def at_step(opt_state, step):
  """A fresh `opt_state` whose learning-rate schedules resume at update
  `step` (a resume with a new optimizer: its moments start afresh, the
  run's schedule does not restart)."""

  def resume(x):
    if isinstance(x, optax.ScaleByScheduleState):
      return x._replace(count=jnp.asarray(step, x.count.dtype))
    if _is_schedule_free(x):
      return x._replace(step_count=jnp.asarray(step + 1, x.step_count.dtype))
    return x

  is_leaf = lambda x: isinstance(x, optax.ScaleByScheduleState) or _is_schedule_free(x)
  return jax.tree.map(resume, opt_state, is_leaf=is_leaf)


def state_per_param(cfg) -> tuple[float, float]:
  """Bytes of train.optimizer's state per parameter byte for cfg's model
  (validated), (its layers', its embedding's and head's), counted from the
  state's shapes (what the planner charges as 'moments'): AdamW 2 and 2;
  Lion 1 and 1; Muon 1 on its matrices, 2 (AdamW) on the rest; Adafactor's
  factored moments a row and a column per matrix; schedule-free z and v."""
  # Abstract init traces a block once; cuDNN's attention refuses to trace off a GPU
  # and changes no shape.
  spec = dataclasses.replace(registry.spec_from_config(cfg.model), attention='xla')
  model = registry.build(spec)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  # The model's own axes: features count from the end, so they fit its [L, ...] stacks.
  opt = make_optimizer(cfg.train, cfg.model, optax.constant_schedule(0.0), model.logical_axes())
  state = jax.eval_shape(opt.init, shapes)

  def bytes_by_part(tree) -> tuple[int, int]:
    out = [0, 0]
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      layered = any(getattr(k, 'key', None) == 'layers' for k in path)
      out[0 if layered else 1] += leaf.size * leaf.dtype.itemsize
    return out[0], out[1]

  (state_layers, state_edges), (layers, edges) = bytes_by_part(state), bytes_by_part(shapes)
  return state_layers / max(layers, 1), state_edges / max(edges, 1)


def gradient_norm(grads) -> jax.Array:
  """The global norm of the trained leaves' gradients (the logged grad_norm)."""
  trained = jax.tree_util.tree_map_with_path(
    lambda path, g: None if _is_balanced(path) else g, grads
  )
  return optax.tree.norm(trained)
