"""Layer-stack layouts: model order [L, ...] vs pipeline order [p, v, Lmax, ...].

Model chunk c lives on the stage the schedule's placement names, as that
stage's local chunk i (its rank among the stage's chunks in layer order):
with Megatron's interleaving, stage c mod p and local chunk c div p; with
ZB-V's V, stage c or 2p-1-c. Chunks hold `counts[c]`
consecutive layers; with an uneven split (pipeline.layers_per_stage, e.g.
from the planner for mixed devices) shorter chunks are padded to the longest
with zero layers that the model skips under `cond`, so they cost nothing.

Training state is kept in pipeline order so that no step moves weights
between devices; checkpoints are written in model order so that any
(data, tensor, pipe, v, split) layout can restore them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from triax.errors import ConfigError
from triax.pipeline.ir import interleaved_placement

LAYERS_KEY = 'layers'


@dataclasses.dataclass(frozen=True)
class StackLayout:
  """How the L layers are cut into p*v chunks and stored per stage."""

  stages: int
  virtual: int
  counts: tuple[int, ...]  # stack entries (layers) of each chunk, in chunk (= model) order
  placement: tuple[int, ...] | None = None  # stage of each chunk; None: c mod p

  def __post_init__(self):
    if self.placement is None:
      object.__setattr__(self, 'placement', interleaved_placement(self.stages, self.virtual))

  @classmethod
  def build(
    cls,
    num_layers: int,
    stages: int,
    virtual: int,
    layers_per_stage: Sequence[int] = (),
    placement: Sequence[int] | None = None,
    per_entry: int = 1,
    held_out: int = 0,
  ) -> StackLayout:
    """The layout of `num_layers` blocks stacked `per_entry` to an entry (a MoE
    family's model.moe_every): chunks are cut between entries and counted in them.
    `held_out`: the blocks of model.num_layers outside the stack (DeepSeek's
    model.first_k_dense, which the embedding runs), for the errors' wording."""
    layout = cls._build(num_layers, stages, virtual, layers_per_stage, per_entry, held_out)
    if placement is None:
      return layout
    return dataclasses.replace(layout, placement=tuple(placement))

  @classmethod
  def _build(
    cls,
    num_layers: int,
    stages: int,
    virtual: int,
    layers_per_stage: Sequence[int] = (),
    per_entry: int = 1,
    held_out: int = 0,
  ) -> StackLayout:
    chunks = stages * virtual
    groups = f' in groups of model.moe_every={per_entry}' if per_entry > 1 else ''
    # DeepSeek's dense blocks are in model.num_layers but not in the stack.
    outside = (
      f' (model.num_layers less its {held_out} model.first_k_dense blocks)' if held_out else ''
    )
    stacked = (
      f'the stack holds {num_layers}{outside}' if held_out else f'model.num_layers = {num_layers}'
    )
    if not layers_per_stage:
      if num_layers % (chunks * per_entry):
        raise ConfigError(
          'model.num_layers',
          f'{num_layers} layers{outside}{groups} cannot be cut into mesh.pipe*pipeline.'
          f'virtual_stages = {stages}*{virtual} equal chunks; use a multiple of '
          f'{chunks * per_entry} or set pipeline.layers_per_stage',
        )
      return cls(stages, virtual, (num_layers // chunks // per_entry,) * chunks)
    counts = tuple(layers_per_stage)
    if len(counts) != chunks:
      raise ConfigError(
        'pipeline.layers_per_stage',
        f'needs one count per model chunk (mesh.pipe*pipeline.virtual_stages = '
        f'{chunks}), got {len(counts)}',
      )
    if any(not isinstance(n, int) or n < 1 for n in counts):
      raise ConfigError('pipeline.layers_per_stage', f'counts must be integers >= 1, got {counts}')
    if sum(counts) != num_layers:
      raise ConfigError(
        'pipeline.layers_per_stage',
        f'counts sum to {sum(counts)} but {stacked}',
      )
    if any(n % per_entry for n in counts):
      raise ConfigError(
        'pipeline.layers_per_stage',
        f'counts must be multiples of model.moe_every={per_entry} (a chunk holds whole '
        f'groups of dense blocks and their MoE block), got {counts}',
      )
    return cls(stages, virtual, tuple(n // per_entry for n in counts))

  @property
  def even(self) -> bool:
    return len(set(self.counts)) == 1

  @property
  def interleaved(self) -> bool:
    """Megatron's placement (chunk c on stage c mod p): a reshape converts."""
    return self.placement == interleaved_placement(self.stages, self.virtual)

  def slot_of(self, chunk: int) -> tuple[int, int]:
    """(stage, local chunk) where chunk `chunk` is stored."""
    stage = self.placement[chunk]
    return stage, self.placement[:chunk].count(stage)

  @property
  def max_layers(self) -> int:
    return max(self.counts)

  @property
  def num_layers(self) -> int:
    return sum(self.counts)

  def _index(self) -> np.ndarray:
    """[p, v, Lmax] model layer of each stored slot; L (a zero row) for padding."""
    starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
    index = np.full((self.stages, self.virtual, self.max_layers), self.num_layers)
    for c, (start, n) in enumerate(zip(starts, self.counts)):
      index[self.slot_of(c) + (slice(0, n),)] = np.arange(start, start + n)
    return index

  def to_pipeline(self, stack: jax.Array) -> jax.Array:
    """[L, ...] in model order -> [p, v, Lmax, ...]."""
    p, v = self.stages, self.virtual
    if self.even and self.interleaved:
      x = stack.reshape((v, p, self.max_layers) + stack.shape[1:])  # chunk c = vi * p + d
      return jnp.swapaxes(x, 0, 1)
    padded = jnp.concatenate([stack, jnp.zeros_like(stack[:1])])
    return padded[self._index()]

  def to_model_order(self, stack: jax.Array) -> jax.Array:
    """[p, v, Lmax, ...] -> [L, ...] in model order; a host (numpy) array stays
    on the host, moved by numpy rather than by a device program."""
    xp = np if isinstance(stack, np.ndarray) else jnp
    if self.even and self.interleaved:
      return xp.swapaxes(stack, 0, 1).reshape((self.num_layers,) + stack.shape[3:])
    flat = stack.reshape((-1,) + stack.shape[3:])
    index = self._index().reshape(-1)
    where = np.argsort(index, kind='stable')[: self.num_layers]  # slot of each model layer
    return flat[where]

  def chunk_moves(self) -> dict[tuple[int, int], tuple[tuple[int, int], ...]] | None:
    """How chunks travel from model order split over the stages (stage d holds
    chunks d*v .. d*v+v-1) to their slots, grouped so that each group is one
    permutation of the stages: {(local index in model order, local slot):
    ((from stage, to stage), ...)}. None where model order does not split
    into whole chunks per stage (an uneven split)."""
    if not self.even:
      return None
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for c in range(len(self.counts)):
      stage, slot = self.slot_of(c)
      groups.setdefault((c % self.virtual, slot), []).append((c // self.virtual, stage))
    return {key: tuple(pairs) for key, pairs in groups.items()}

  def tree_to_pipeline(self, tree: Any) -> Any:
    """Applies `to_pipeline` to every leaf under a 'layers' key (params and Adam moments)."""
    return jax.tree_util.tree_map_with_path(
      lambda path, a: self.to_pipeline(a) if under_layers(path) else a, tree
    )

  def tree_to_model_order(self, tree: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
      lambda path, a: self.to_model_order(a) if under_layers(path) else a, tree
    )


def under_layers(path) -> bool:
  return any(getattr(k, 'key', None) == LAYERS_KEY for k in path)
