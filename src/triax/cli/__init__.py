"""The entry points (`python -m triax COMMAND`, one module each here) and what
they share: start-up, flag-error handling, exit codes, CPU devices.

Bad input ends with one line on stderr naming the key, flag or file and the
fix, and exit status 2; nothing on disk is touched first.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn

from absl import app, flags, logging

from triax.errors import ConfigError

EXIT_BAD_INPUT = 2

# name -> what it does (`python -m triax` lists them; each is triax/cli/NAME.py).
COMMANDS = {
  'train': 'train a config on this machine, or resume its workdir',
  'schedule': 'build, check, simulate and draw a pipeline schedule',
  'plan': 'plan data x tensor x pipeline parallelism on a cluster',
  'sweep': 'run a grid of configs and plot what they measured',
  'sample': "generate text from a run's checkpoint",
  'budget': 'rank layouts by their compiled memory on this machine',
  'tokenizer': 'train a byte-level BPE tokenizer from local text',
  'prepare': 'tokenize text, jsonl, Parquet or Arrow into token shards',
  'convert': 'import a Hugging Face Llama checkpoint into a workdir, or export one',
}


def run(main: Callable[[list[str]], None], *, takes_arguments: bool = False) -> None:
  """Runs an entry point's main under absl, with our flag errors and quiet logging.

  absl logs at INFO unless told otherwise, so every run on a machine without
  a TPU would print JAX's "Unable to initialize backend 'tpu'" line; set
  before app.run, WARNING still shows warnings and errors (and --verbosity
  can still raise it). Words that are not flags exit 2 unless the command
  `takes_arguments` (tokenizer's `train`).
  """

  def parser(argv: list[str]) -> list[str]:
    rest = parse_flags(argv)
    if not takes_arguments and len(rest) > 1:
      fail('flags', f'unexpected arguments {rest[1:]}; flags look like --name=value')
    return rest

  logging.set_verbosity(logging.WARNING)
  app.run(main, flags_parser=parser)


def fail(key: str, message: str) -> NoReturn:
  print(f'error: {key}: {message}', file=sys.stderr)
  sys.exit(EXIT_BAD_INPUT)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, but a bad flag or config override exits 2 with one line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    # A ConfigError raised by a config file's get_config arrives wrapped
    # (absl re-raises it with a traceback as text): report the original.
    cause, original = e, None
    while cause is not None:
      if isinstance(cause, ConfigError):
        original = cause
      cause = cause.__cause__ or cause.__context__
    if original is not None:
      fail(original.key, original.message)
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    fail('flags', f'{first_line} (see --helpfull)')
  except ConfigError as e:
    fail(e.key, e.message)
  except (AttributeError, KeyError) as e:
    # A misspelt --config.x override (the config is locked) or a config file bug.
    text = _unquote(str(e))
    for arg in argv[1:]:
      name = arg.split('=', 1)[0]
      parts = name[len('--config.') :].split('.')
      if name.startswith('--config.') and any(
        f"'{part}'" in text or part == text for part in parts
      ):
        hint = text.splitlines()[-1] if 'Did you mean' in text else 'check the spelling'
        fail(name, f'unknown config key ({hint})')
    fail('--config', f'{type(e).__name__}: {text.splitlines()[0] if text else e!r}')
  except (
    FileNotFoundError,
    IsADirectoryError,
    SyntaxError,
    ImportError,
    TypeError,
    ValueError,
  ) as e:
    # config_flags executes the config file while parsing: report the file.
    fail('--config', f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}')


def config_value(holder):
  """The parsed config of a config_flags flag; a file that failed to load exits 2.

  config_flags defers a load failure until the value is first read.
  """
  try:
    cfg = holder.value
    if cfg is not None:
      cfg.keys()  # touching it raises the deferred error
    return cfg
  except (OSError, SyntaxError, ImportError, AttributeError, TypeError, ValueError) as e:
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    detail = lines[-1] if lines else repr(e)
    fail('--config', f'could not load the config file: {detail}')


def _unquote(text: str) -> str:
  # KeyError/AttributeError messages arrive repr()-quoted, sometimes twice.
  for _ in range(3):
    if len(text) > 1 and text[0] == text[-1] and text[0] in '\'"':
      text = text[1:-1].encode().decode('unicode_escape')
  return text


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
    print(
      f'warning: --cpu_devices={count} ignored: running on {jax.default_backend()}', file=sys.stderr
    )
