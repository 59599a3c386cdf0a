"""Logical axis names -> mesh PartitionSpecs, by the rules in the config.

The model names axes by meaning ('batch', 'heads', 'mlp', 'vocab', ...); the
config's `sharding.logical_axis_rules` says which mesh axis, if any, each one
is split over, and `resolve_rules` adds what the mesh's flags and the model's
family imply; the config is stored as given. Changing a layout is a config
change, not a model change.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from triax.errors import ConfigError
from triax.model import registry

Rules = Sequence[tuple[str, str | None]]
_ACTIVE_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar(
  'triax_axis_rules', default=None
)


def resolve_rules(cfg, mesh_cfg=None) -> tuple:
  """The logical axis rules a validated `cfg` shards by on its mesh (or on
  `mesh_cfg`, a mesh group of another shape): its own, then mesh.fsdp's
  (parameters' 'embed' over data; activations name 'batch' first and a mesh
  axis is used once per array, so they stay split by batch only), then
  mesh.sequence_parallel's (the residual stream's positions over tensor as
  well as context, context-major), then the family's (`registry.axis_rules`)."""
  mesh_cfg = cfg.mesh if mesh_cfg is None else mesh_cfg
  rules = tuple(tuple(r) for r in cfg.sharding.logical_axis_rules)
  if mesh_cfg.fsdp:
    rules = tuple(r for r in rules if r[0] != 'embed') + (('embed', 'data'),)
  if mesh_cfg.sequence_parallel:
    rules = tuple(r for r in rules if r[0] != 'residual_seq') + (
      ('residual_seq', ('context', 'tensor')),
    )
  return registry.axis_rules(cfg.model, mesh_cfg, rules)


def per_device_bytes(shapes: Any, shardings: Any) -> int:
  """Bytes one device holds of a tree of arrays laid out by `shardings`."""
  leaves = zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True)
  return sum(math.prod(sh.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize for a, sh in leaves)


def logical_to_spec(axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
  """PartitionSpec for one array whose dimensions carry the logical `axes`.

  A rule maps a logical axis to a mesh axis, a tuple of them (split over
  their product, the first major) or None. A mesh axis is used at most once
  per array: a later dimension that maps to an axis already taken leaves it
  out (as in flax and MaxText).
  """
  mapping = dict(rules)
  used, spec = set(), []
  for axis in axes:
    if axis is None:
      spec.append(None)
      continue
    if axis not in mapping:
      raise ConfigError(
        'sharding.logical_axis_rules',
        f'no rule for logical axis {axis!r}; add ({axis!r}, MESH_AXIS_OR_None)',
      )
    target = mapping[axis]
    names = tuple(target) if isinstance(target, (tuple, list)) else (target,)
    names = tuple(n for n in names if n is not None and n not in used)
    used.update(names)
    spec.append(names[0] if len(names) == 1 else (names or None))
  return PartitionSpec(*spec)


def _is_axes(x: Any) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_specs(logical_tree: Any, rules: Rules) -> Any:
  """Maps a tree of logical-axis tuples to a tree of PartitionSpecs."""
  return jax.tree.map(lambda axes: logical_to_spec(axes, rules), logical_tree, is_leaf=_is_axes)


def tree_shardings(logical_tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """Maps a tree of logical-axis tuples to a tree of NamedShardings on `mesh`."""
  return jax.tree.map(
    lambda spec: NamedSharding(mesh, spec),
    tree_specs(logical_tree, rules),
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


@contextlib.contextmanager
def axis_rules(rules: Rules | None) -> Iterator[None]:
  """Makes `rules` the ones `constrain` uses while tracing inside this block."""
  token = _ACTIVE_RULES.set(tuple(tuple(r) for r in rules) if rules is not None else None)
  try:
    yield
  finally:
    _ACTIVE_RULES.reset(token)


def active_spec(axes: Sequence[str | None]) -> PartitionSpec | None:
  """The PartitionSpec the active rules give `axes`; None outside `axis_rules`."""
  rules = _ACTIVE_RULES.get()
  return None if rules is None else logical_to_spec(axes, rules)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Pins an activation's sharding by logical axes; a no-op without active rules.

  Used at the few points where GSPMD would otherwise guess (the residual
  stream after a row-parallel matmul, the logits), so tensor parallelism
  compiles to Megatron's all-reduces rather than to gathers.
  """
  rules = _ACTIVE_RULES.get()
  if rules is None:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, rules))


def varying_axes(x) -> tuple:
  """The manual mesh axes over which x holds different values per device."""
  aval = jax.typeof(x)
  varying = getattr(aval, 'vma', None)
  if varying is None and hasattr(aval, 'manual_axis_type'):
    varying = aval.manual_axis_type.varying
  return tuple(varying or ())


def vary_like(x, like):
  """x typed as varying over every manual axis `like` varies over (a
  shard_map's carries and branch outputs must match in type)."""
  missing = tuple(a for a in varying_axes(like) if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to='varying') if missing else x
