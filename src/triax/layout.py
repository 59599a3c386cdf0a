"""The parallel layout of a run as data, the config keys that set it, and `--config.*` flags.

A `Layout` is data x context x tensor x pipe (their product the device
count; mesh.expert carved from data), sequence parallelism, the context
attention kind, and the pipeline schedule with its micro-batches m and
virtual stages v: what the planner searches, emits and re-plans. Each field
names its config key; `Layout.from_config` reads them and
`Layout.overrides` writes them, so config -> Layout -> overrides -> config
is the same layout. How a plan places it on devices, splits the layers and
the training state is the planner's (`plan/candidate.Plan`, which composes
a Layout). `flags` writes overrides as the `--config.KEY=VALUE` flags the
CLI reads back exactly. Plain Python, no JAX: the planner and the CLI use
it before a device exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# How context-parallel ranks' queries meet the other ranks' keys (model.context_attention):
# K/V all-gathered each layer, or passed around the ring beside the attention work.
CONTEXT_ATTENTION = ('allgather', 'ring')


def _key(key: str, default, size: bool = False):
  """A field set by config key `key`; a size (a degree or m) is stated in every
  `overrides`, whatever the base holds."""
  return dataclasses.field(default=default, metadata={'key': key, 'size': size})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
  """Degrees and schedule sizes, before devices and layers are placed.

  The defaults are one device's: Layout(data=8) is plain data parallelism.
  Fields are in the order `overrides` writes their keys (a restart's flags).
  Invariants (ValueError otherwise): context >= 1, context_attention in
  CONTEXT_ATTENTION (it matters only with context > 1), sequence
  parallelism only with tensor > 1, and expert dividing data.
  """

  data: int = _key('mesh.data', 1, size=True)
  context: int = _key('mesh.context', 1, size=True)
  tensor: int = _key('mesh.tensor', 1, size=True)
  pipe: int = _key('mesh.pipe', 1, size=True)
  # A key of schedule.SCHEDULES, or a name candidate.given_schedule gave a schedule.
  schedule: str = _key('pipeline.schedule', '1f1b')
  microbatches: int = _key('pipeline.microbatches', 1, size=True)
  virtual_stages: int = _key('pipeline.virtual_stages', 1)
  # Megatron's: the activations outside the tensor-parallel matmuls split over `tensor` too.
  sequence_parallel: bool = _key('mesh.sequence_parallel', False)
  context_attention: str = _key('model.context_attention', 'allgather')
  # A MoE model's experts split this many ways over the inner part of `data`.
  expert: int = _key('mesh.expert', 1)

  def __post_init__(self):
    if self.context < 1 or self.context_attention not in CONTEXT_ATTENTION:
      raise ValueError(
        f'context must be >= 1 and context_attention one of {CONTEXT_ATTENTION}: '
        f'{self.context}, {self.context_attention!r}'
      )
    if self.sequence_parallel and self.tensor == 1:
      raise ValueError('sequence_parallel splits over tensor, which is 1')
    if self.expert < 1 or self.data % self.expert:
      raise ValueError(f'expert={self.expert} must divide data={self.data}')

  @classmethod
  def from_config(cls, cfg) -> Layout:
    """The layout of a config (validated, so mesh.data is resolved; a schedule
    file's schedule is the caller's: this reads pipeline.schedule's name)."""
    return cls(**{f.name: _get(cfg, f.metadata['key']) for f in dataclasses.fields(cls)})

  def overrides(self, base=None) -> dict[str, Any]:
    """The dotted config keys that set this layout, with their values, in field order.

    base: the config they will be applied to; given, a key whose value base
    holds already is left out, unless it is a size (data, context, tensor,
    pipe, micro-batches: the device count and batch split always stated).
    """
    held = None if base is None else Layout.from_config(base)
    return {
      f.metadata['key']: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if held is None or f.metadata['size'] or getattr(held, f.name) != getattr(self, f.name)
    }


FIELDS = frozenset(f.name for f in dataclasses.fields(Layout))


def _get(cfg, key: str):
  for part in key.split('.'):
    cfg = cfg[part]
  return cfg


def flag_value(value) -> str:
  """`value` as the text of a --config.KEY=TEXT flag that the CLI's parser
  (ml_collections' config flags, by the key's type) reads back as `value`:
  booleans as absl writes them ('true'), floats by repr (every digit),
  ints and strings as they are, tuples as Python literals without spaces
  (their strings quoted: the parser reads a tuple with ast.literal_eval).

  Raises:
    TypeError: a value of another type (None, a dict, an object).
  """
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, (tuple, list)):
    return _literal(tuple(value))
  if isinstance(value, float):
    return repr(float(value))  # numpy's float64 repr names its type
  if isinstance(value, (int, str)):
    return str(value)
  raise TypeError(f'no --config flag text for a {type(value).__name__}: {value!r}')


def _literal(value) -> str:
  """A tuple element as ast.literal_eval reads it: Python's spelling, no spaces."""
  if isinstance(value, tuple):
    inner = ','.join(map(_literal, value))
    return f'({inner},)' if len(value) == 1 else f'({inner})'
  if isinstance(value, float):
    return repr(float(value))
  if isinstance(value, (bool, str)):
    return repr(value)
  if isinstance(value, int):
    return str(value)
  raise TypeError(f'no --config flag text for a {type(value).__name__} in a tuple: {value!r}')


def flags(values: Mapping[str, Any]) -> list[str]:
  """`--config.KEY=VALUE` flags of dotted config keys and values (`flag_value`)."""
  return [f'--config.{key}={flag_value(value)}' for key, value in values.items()]
