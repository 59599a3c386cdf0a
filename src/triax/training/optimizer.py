"""The optimizer of a run: its transformations over the parameter tree.

AdamW with global-norm clipping trains every parameter but the balanced
ones: a leaf named `BALANCED` (DeepSeek's expert bias, model/moe.py) is
not trained by its gradient. Its "gradient" is minus its experts' load
(moe.balance_term), and `moe.with_bias_update` moves it towards balance;
it is left out of the clipping norm, of weight decay and of the logged norm.
"""

from __future__ import annotations

import jax
import optax

from triax.model import moe, registry

# Parameter names (the last key of a leaf's path) AdamW does not decay.
_NO_DECAY = ('attn_norm', 'mlp_norm', 'norm', 'positions')
# The leaves trained by load, not gradient (loss-free balancing).
BALANCED = moe.BIAS


def _is_balanced(path) -> bool:
  return getattr(path[-1], 'key', None) == BALANCED


def balances(model_cfg) -> bool:
  """Whether the model has balanced leaves (a family that reads model.bias_update_rate)."""
  return registry.reads(model_cfg.family, 'bias_update_rate')


def make_optimizer(train_cfg, model_cfg, schedule: optax.Schedule) -> optax.GradientTransformation:
  """AdamW with global-norm clipping at learning rate `schedule`; norms and
  position embeddings are not decayed. With balanced leaves, they are
  updated by moe.with_bias_update(.., model.bias_update_rate) instead."""
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
    lambda path, _: getattr(path[-1], 'key', None) not in _NO_DECAY, params
  )
  parts = []
  if train_cfg.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(train_cfg.grad_clip_norm))
  parts.append(
    optax.adamw(
      schedule,
      b1=train_cfg.adam_b1,
      b2=train_cfg.adam_b2,
      weight_decay=train_cfg.weight_decay,
      mask=decay_mask,
    )
  )
  trained = optax.chain(*parts)
  if not balances(model_cfg):
    return trained
  return moe.with_bias_update(trained, model_cfg.bias_update_rate)


def gradient_norm(grads) -> jax.Array:
  """The global norm of the trained leaves' gradients (the logged grad_norm)."""
  trained = jax.tree_util.tree_map_with_path(
    lambda path, g: None if _is_balanced(path) else g, grads
  )
  return optax.tree.norm(trained)
