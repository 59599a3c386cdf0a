"""What every entry point shares: flag-error handling, exit codes, CPU devices.

Bad input ends with one line on stderr naming the key, flag or file and the
fix, and exit status 2; nothing on disk is touched first.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, NoReturn

from absl import flags

from triax.errors import ConfigError

EXIT_BAD_INPUT = 2


def fail(key: str, message: str) -> NoReturn:
  print(f'error: {key}: {message}', file=sys.stderr)
  sys.exit(EXIT_BAD_INPUT)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, but a bad flag or config override exits 2 with one line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    fail('flags', f'{first_line} (see --helpfull)')
  except ConfigError as e:
    fail(e.key, e.message)
  except (FileNotFoundError, IsADirectoryError, SyntaxError, ImportError, AttributeError,
          TypeError, ValueError, KeyError) as e:
    # config_flags executes the config file while parsing: report the file.
    fail('--config', f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}')


@contextlib.contextmanager
def config_errors_exit() -> Iterator[None]:
  try:
    yield
  except ConfigError as e:
    fail(e.key, e.message)


def force_cpu_devices(count: int | None) -> None:
  """Asks for `count` CPU devices; must run before JAX's backend starts."""
  if count is None:
    return
  if count < 1:
    fail('--cpu_devices', f'must be >= 1, got {count}')
  import jax
  jax.config.update('jax_num_cpu_devices', count)


def warn_if_accelerator(count: int | None) -> None:
  """Says so when --cpu_devices had no effect (call after distributed start-up)."""
  import jax
  if count is not None and jax.default_backend() != 'cpu':
    print(f'warning: --cpu_devices={count} ignored: running on {jax.default_backend()}',
          file=sys.stderr)
