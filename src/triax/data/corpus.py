"""A byte-level text corpus: vocabulary 256, one token per byte.

Two sources, both available offline:

* ``'stdlib'``: the Python standard library's own ``.py`` files, present on
  every machine that runs triax, so the default run needs no download.
* ``'text'``: a text file, or a directory of text files, that the user names
  with ``data.path``.

Train and validation are split by file wherever there are enough files, so
the validation loss measures text the model has never seen rather than the
other half of a file it trained on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sysconfig
import zlib

import numpy as np

from triax.errors import ConfigError

# 16 MiB is ample for the small models triax trains on one host and bounds
# start-up time and host memory on machines with unusually large trees.
DEFAULT_MAX_BYTES = 16 * 2**20

# Placed between files so a file's first bytes are not predicted from the
# previous file's last line as if they were one text.
SEPARATOR = b'\n\n'

# A file whose crc32(relative path) % VAL_MODULUS == 0 goes to validation:
# about 5%, stable across machines and independent of which other files exist.
VAL_MODULUS = 20

# Below this many files a by-file split is too lumpy (one file may be most of
# the text), so the last VAL_FRACTION of the bytes go to validation instead.
MIN_FILES_FOR_FILE_SPLIT = 20
VAL_FRACTION = 0.05

# Directory names never read. Tests are excluded from the stdlib corpus to keep
# it ordinary library code; hidden directories hold VCS data, not text.
_SKIP_DIRS = frozenset(
  {'__pycache__', 'site-packages', 'dist-packages', 'test', 'tests', 'idle_test'}
)

# Suffixes read when data.path is a directory. Files without a suffix (README,
# LICENSE, plain dumps) are included too; binary files among them are dropped
# by the NUL-byte check. A file named directly is read whatever its suffix.
TEXT_SUFFIXES = ('.txt', '.md', '.rst', '.py')


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Train and validation token streams.

  Attributes:
    train: uint8 tokens for training.
    val: uint8 tokens for validation.
    description: one human-readable line saying what was loaded.
    files: number of non-empty files read.
    train_files: relative paths of the training files, in order.
    val_files: relative paths of the validation files, in order; empty when
      validation is the tail of the bytes rather than whole files.
  """

  train: np.ndarray
  val: np.ndarray
  description: str
  files: int
  train_files: tuple[str, ...] = ()
  val_files: tuple[str, ...] = ()


def load_corpus(source: str, path: str = '', max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
  """Loads a byte-level corpus and splits it into train and validation.

  Files are taken in sorted order of their relative paths, which makes the
  corpus identical on every machine with the same files. For 'stdlib', at
  most `max_bytes` of file content is read (the file that crosses the limit is
  truncated, and the description says so); a 'text' path holding more is refused.

  Args:
    source: 'stdlib' or 'text'.
    path: for 'text', a file or directory; ignored for 'stdlib'.
    max_bytes: cap on the file content read, before separators (data.max_text_bytes for text).

  Returns:
    The corpus.

  Raises:
    ConfigError: unknown source, missing path, or no usable text.
  """
  if source == 'stdlib':
    root = sysconfig.get_paths()['stdlib']
    names = _list_files(root, suffixes=('.py',), allow_no_suffix=False)
    what = f'stdlib .py files under {root}'
  elif source == 'text':
    if not path:
      raise ConfigError('data.path', 'data.source=text needs data.path=FILE_OR_DIR')
    if not os.path.exists(path):
      raise ConfigError(
        'data.path',
        f'{path} does not exist; give an existing text file or '
        'directory, or use data.source=stdlib',
      )
    if os.path.isdir(path):
      root = path
      names = _list_files(root, suffixes=TEXT_SUFFIXES, allow_no_suffix=True)
      what = f'text files under {path}'
    else:
      root, name = os.path.split(path)
      names = [name]
      what = f'{path}'
  else:
    raise ConfigError('data.source', f"unknown source '{source}'; use 'stdlib' or 'text'")

  if source == 'text':
    # A user's text is read whole or refused: training on a silent prefix of it misleads.
    total = sum(os.path.getsize(os.path.join(root, n)) for n in names)
    if total > max_bytes:
      raise ConfigError(
        'data.max_text_bytes',
        f'{path} holds {total:,} bytes in {len(names)} files, more than data.max_text_bytes='
        f'{max_bytes:,}; raise it to read them all, or tokenize them once with python -m '
        'triax prepare and train with data.source=tokens',
      )
  contents = _read_files(root, names, max_bytes)
  skipped = len(names) - len(contents)
  if source == 'text' and not contents:
    if os.path.isdir(path):
      need = (
        f'non-empty files without NUL bytes named *{", *".join(TEXT_SUFFIXES)} or without a suffix'
      )
    else:
      need = 'a non-empty file without NUL bytes'
    raise ConfigError('data.path', f'no text found in {path}: give {need}')
  if not contents:
    raise ConfigError(
      'data.source',
      f'found no stdlib .py files under {root}; use data.source=text with data.path=FILE_OR_DIR',
    )

  train_names, val_names = _split_names(list(contents))
  if train_names and val_names:
    train = _join([contents[n] for n in train_names])
    val = _join([contents[n] for n in val_names])
    how = f'{len(val_names)} files held out for validation'
  else:
    train_names, val_names = list(contents), []
    text = _join(list(contents.values()))
    n_val = max(1, int(len(text) * VAL_FRACTION))
    train, val = text[:-n_val], text[-n_val:]
    how = f'last {n_val} bytes held out for validation'

  if source == 'stdlib' and sum(len(c) for c in contents.values()) >= max_bytes:
    what += f' (the first {max_bytes / 2**20:g} MiB in path order)'
  if skipped and source == 'text':
    what += f' ({skipped} empty or binary files skipped)'
  description = (
    f'{what}: {len(contents)} files, {train.size:,} train bytes, {val.size:,} val bytes ({how})'
  )
  return Corpus(
    train=train,
    val=val,
    description=description,
    files=len(contents),
    train_files=tuple(train_names),
    val_files=tuple(val_names),
  )


def _list_files(root: str, suffixes: tuple[str, ...], allow_no_suffix: bool) -> list[str]:
  """Sorted POSIX-style relative paths of candidate files under `root`."""
  names = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith('.')]
    for filename in filenames:
      if filename.startswith('.'):
        continue
      suffix = os.path.splitext(filename)[1]
      if not (suffix in suffixes or (allow_no_suffix and not suffix)):
        continue
      full = os.path.join(dirpath, filename)
      if not os.path.isfile(full):
        continue
      names.append(os.path.relpath(full, root).replace(os.sep, '/'))
  # Sorting the whole list (not per directory) fixes one global order.
  return sorted(names)


def _read_files(root: str, names: list[str], max_bytes: int) -> dict[str, bytes]:
  """Reads files in order until `max_bytes`; drops empty and binary files."""
  contents: dict[str, bytes] = {}
  budget = max_bytes
  for name in names:
    if budget <= 0:
      break
    with open(os.path.join(root, name), 'rb') as f:
      data = f.read(budget)
    if not data or b'\0' in data:
      continue
    contents[name] = data
    budget -= len(data)
  return contents


def _split_names(names: list[str]) -> tuple[list[str], list[str]]:
  """Splits file names into (train, val) by a stable hash of each name.

  Returns an empty validation list when there are too few files for a
  by-file split; the caller then splits by bytes.
  """
  if len(names) < MIN_FILES_FOR_FILE_SPLIT:
    return names, []
  # crc32, not hash(): Python's str hash is salted per process.
  val = [n for n in names if zlib.crc32(n.encode()) % VAL_MODULUS == 0]
  val_set = set(val)
  return [n for n in names if n not in val_set], val


def _join(parts: list[bytes]) -> np.ndarray:
  return np.frombuffer(SEPARATOR.join(parts), dtype=np.uint8).copy()


def unigram_entropy_nats(tokens: np.ndarray) -> float:
  """Entropy in nats per token of the empirical byte distribution of `tokens`.

  This is the loss of the best model that ignores context, so a language model
  whose loss is not well below it has learned nothing beyond byte frequencies.
  """
  tokens = np.asarray(tokens).ravel()
  if tokens.size == 0:
    raise ValueError('entropy of an empty token array is undefined')
  counts = np.bincount(tokens, minlength=256)
  p = counts[counts > 0] / tokens.size
  return float(-(p * np.log(p)).sum())


def unigram_entropy_bits(tokens: np.ndarray) -> float:
  """Entropy in bits per byte of the empirical byte distribution of `tokens`."""
  return unigram_entropy_nats(tokens) / math.log(2)
