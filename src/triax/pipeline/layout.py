"""Layer-stack layouts: model order [L, ...] vs pipeline order [p, v, L/(p v), ...].

Model chunk c (layers c*Lc .. c*Lc+Lc-1) lives on stage c mod p as its
local chunk c div p (Megatron's interleaving: device d holds d, d+p, ...).
Training state is kept in pipeline order so that no step moves weights
between devices; checkpoints are written in model order so that any
(data, tensor, pipe, v) layout can restore them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

LAYERS_KEY = 'layers'


def to_pipeline(stack: jax.Array, stages: int, virtual: int) -> jax.Array:
  """[L, ...] in model order -> [p, v, L/(p v), ...]."""
  lc = stack.shape[0] // (stages * virtual)
  x = stack.reshape((virtual, stages, lc) + stack.shape[1:])   # chunk c = vi * p + d
  return jnp.swapaxes(x, 0, 1)


def to_model_order(stack: jax.Array) -> jax.Array:
  """[p, v, Lc, ...] -> [L, ...] in model order."""
  p, v, lc = stack.shape[:3]
  return jnp.swapaxes(stack, 0, 1).reshape((p * v * lc,) + stack.shape[3:])


def _under_layers(path) -> bool:
  return any(getattr(k, 'key', None) == LAYERS_KEY for k in path)


def tree_to_pipeline(tree: Any, stages: int, virtual: int) -> Any:
  """Applies `to_pipeline` to every leaf stored under a 'layers' key.

  Works for parameters and for optimizer states that mirror them (Adam's
  moments), whatever optax wraps around them.
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, a: to_pipeline(a, stages, virtual) if _under_layers(path) else a, tree)


def tree_to_model_order(tree: Any) -> Any:
  """Inverse of `tree_to_pipeline`."""
  return jax.tree_util.tree_map_with_path(
      lambda path, a: to_model_order(a) if _under_layers(path) else a, tree)
