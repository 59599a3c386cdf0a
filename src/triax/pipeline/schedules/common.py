"""What the schedule builders share: size checks and the Schedule constructor."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from triax.errors import ConfigError
from triax.pipeline.ir import Action, Schedule


def check_sizes(stages: int, microbatches: int, virtual_stages: int) -> tuple[int, int, int]:
  """Returns the sizes as plain ints, or raises ConfigError naming the key."""
  for key, value, what in (
    ('mesh.pipe', stages, 'pipeline stages'),
    ('pipeline.microbatches', microbatches, 'micro-batches'),
    ('pipeline.virtual_stages', virtual_stages, 'model chunks per stage'),
  ):
    # bool is an int subclass; True stages is a config mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ConfigError(key, f'{what} must be an integer; got {value!r}')
    if value < 1:
      raise ConfigError(key, f'{what} must be at least 1; got {value}')
  return int(stages), int(microbatches), int(virtual_stages)


def one_chunk_only(name: str, virtual_stages: int) -> None:
  if virtual_stages != 1:
    raise ConfigError(
      'pipeline.virtual_stages',
      f'{name} runs one model chunk per stage; got {virtual_stages} '
      '(use interleaved_1f1b or interleaved_zb for virtual stages)',
    )


def schedule(
  name: str,
  stages: int,
  microbatches: int,
  virtual_stages: int,
  orders: Sequence[Sequence[Action]],
  **extra,
) -> Schedule:
  return Schedule(
    name, stages, microbatches, virtual_stages, tuple(tuple(order) for order in orders), **extra
  )
