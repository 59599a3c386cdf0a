"""The entry points (`python -m triax COMMAND`, one module each here) and what
they share: start-up, flag-error handling, exit codes, CPU devices.

Bad input ends with one line on stderr naming the key, flag or file and the
fix, and exit status 2; nothing on disk is touched first.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn

from absl import app, flags, logging

from triax.errors import ConfigError

EXIT_BAD_INPUT = 2
# A compile for a slice that is not here (train --topology) whose peak exceeds the chip's HBM.
EXIT_DOES_NOT_FIT = 3

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
  'supervise': 'run train as N processes; on a failure, re-plan for the devices left and resume',
  'goodput': "split a run's wall time into productive steps, compile, data, saves, losses",
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
    if asks_for_help(argv):
      _print_help(command_help(sys.modules[main.__module__]))
    rest = parse_flags(argv)
    if not takes_arguments and len(rest) > 1:
      fail('flags', f'unexpected arguments {rest[1:]}; flags look like --name=value')
    return rest

  logging.set_verbosity(logging.WARNING)
  skip_absent_tpu()
  app.run(main, flags_parser=parser)


HELP_FLAGS = ('-h', '-help', '--help', '-helpshort', '--helpshort', '-?')


def asks_for_help(argv: list[str]) -> bool:
  words = argv[1 : argv.index('--')] if '--' in argv else argv[1:]
  return any(word in HELP_FLAGS for word in words)


def command_help(module) -> str:
  """The usage line of a command's docstring and its own flags, one line each.

  absl's own --help shows __main__'s docstring and the flags of the module
  named by sys.argv[0]: under `python -m triax COMMAND` that is the
  dispatcher, under a console script no module at all, so neither showed the
  command's flags. Both are read from the command's module instead.
  """
  own = sorted(flags.FLAGS.get_key_flags_for_module(module), key=lambda flag: flag.name)
  lines = [_usage(module.__doc__ or ''), '', 'flags:'] + [f'  {_flag_line(flag)}' for flag in own]
  return '\n'.join(lines + ['', '--helpfull also lists the flags of absl and the libraries.'])


def _usage(doc: str) -> str:
  # The docstring down to its command line; what follows is for readers of the code.
  paragraphs = doc.strip().split('\n\n')
  for i, paragraph in enumerate(paragraphs):
    if 'python -m triax' in paragraph:
      return '\n\n'.join(paragraphs[: i + 1])
  return paragraphs[0]


def _print_help(text: str) -> NoReturn:
  try:
    print(text, flush=True)
  except BrokenPipeError:  # `--help | head` stopped reading: nothing more to say
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  sys.exit(0)


def _flag_line(flag: flags.Flag) -> str:
  name = f'--[no]{flag.name}' if isinstance(flag, flags.BooleanFlag) else f'--{flag.name}'
  text = ' '.join(flag.help.split())
  default = (flag.default_as_str or '').strip("'")
  if default not in ('', 'None'):
    text += f' (default: {default})'
  return f'{name}: {text}'


def skip_absent_tpu() -> None:
  """Starts JAX on the CPU alone where libtpu is installed but nothing else could start.

  The tpu and test extras install libtpu (for `train --topology`). On a host
  with no TPU chips JAX still loads it at start-up, and it prints a screen of
  warnings about TPU environment variables before JAX falls back to the CPU.
  With no chips and no GPU plugin the CPU is all there is, so JAX is told so
  first; JAX_PLATFORMS, when set, decides instead. A topology compile loads
  libtpu on its own (topology.py).
  """
  import glob
  import importlib.util
  import pkgutil

  if os.environ.get('JAX_PLATFORMS') or glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'):
    return
  if importlib.util.find_spec('libtpu') is None:
    return
  plugins = importlib.util.find_spec('jax_plugins')
  if plugins is not None and any(pkgutil.iter_modules(plugins.submodule_search_locations)):
    return  # a GPU (or other) plugin could start
  os.environ['JAX_PLATFORMS'] = 'cpu'
  if 'jax' in sys.modules:
    sys.modules['jax'].config.update('jax_platforms', 'cpu')


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
def config_errors_exit(quiet: bool = False) -> Iterator[None]:
  """A ConfigError in the block is one `error: KEY: ...` line and exit 2; `quiet`: exit 2
  without the line (a multi-process run's other processes: process 0 says it once)."""
  try:
    yield
  except ConfigError as e:
    if quiet:
      sys.exit(EXIT_BAD_INPUT)
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
