"""Checks of one config value each, raising ConfigError with its key and the fix.

Each group's validation (config.py, data/checks.py, training/checks.py, the
families') speaks through these, so a kind of value is refused alike everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from triax.errors import ConfigError


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def boolean(key: str, value) -> None:
  if not isinstance(value, bool):
    raise ConfigError(key, f'must be true or false, got {value!r}')


def positive_int(key: str, value) -> None:
  if not _is_int(value) or value <= 0:
    raise ConfigError(key, f'must be a positive integer, got {value!r}')


def non_negative_int(key: str, value, zero: str = '') -> None:
  """An integer >= 0; `zero` says what 0 means (e.g. 'off')."""
  if not _is_int(value) or value < 0:
    meaning = f' (0 = {zero})' if zero else ''
    raise ConfigError(key, f'must be an integer >= 0{meaning}, got {value!r}')


def non_negative_number(key: str, value, zero: str = '') -> None:
  """A finite number >= 0; `zero` says what 0 means."""
  if not _is_number(value) or not 0 <= value < math.inf:
    meaning = f' (0 = {zero})' if zero else ''
    raise ConfigError(key, f'must be a number >= 0{meaning}, got {value!r}')


def one_of(key: str, value, choices: Sequence, what: str = 'value') -> None:
  if value not in choices:
    raise ConfigError(key, f'unknown {what} {value!r}; choose one of {", ".join(choices)}')
