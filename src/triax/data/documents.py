"""Documents from local files: plain text, JSON lines, Parquet, Arrow.

A plain-text file is one document; a `.jsonl` line, a Parquet row or an
Arrow row is one document, its text in the `text_key` field. Directories
are expanded to the files in them (sorted, hidden files and VCS/cache
directories skipped), so the document order is the same on every machine.
Parquet and Arrow are read with pyarrow only (no Hugging Face hub access):
a `datasets` cache directory holds Arrow stream files, which read here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence

from triax.data.corpus import TEXT_SUFFIXES
from triax.errors import ConfigError

JSONL_SUFFIXES = ('.jsonl',)
PARQUET_SUFFIXES = ('.parquet',)
ARROW_SUFFIXES = ('.arrow',)
_SKIP_DIRS = frozenset({'__pycache__', 'site-packages', 'node_modules'})


@dataclasses.dataclass(frozen=True)
class Input:
  """One input file: its path, a stable name (relative to what was given), its kind."""

  path: str
  name: str
  kind: str  # 'text', 'jsonl', 'parquet' or 'arrow'
  size: int


def _kind(filename: str) -> str | None:
  suffix = os.path.splitext(filename)[1].lower()
  if suffix in JSONL_SUFFIXES:
    return 'jsonl'
  if suffix in PARQUET_SUFFIXES:
    return 'parquet'
  if suffix in ARROW_SUFFIXES:
    return 'arrow'
  if suffix in TEXT_SUFFIXES or not suffix:
    return 'text'
  return None


def list_inputs(paths: Sequence[str], key: str = '--input') -> list[Input]:
  """The input files `paths` name, in order; directories expanded and sorted.

  A file named directly is read whatever it holds (its suffix picks the
  reader: .jsonl, .parquet, .arrow, else plain text); in a directory only
  files with a known suffix (or none) are read.

  Raises:
    ConfigError: on `key`, for a missing path, an empty file, or no files at all.
  """
  found: list[Input] = []
  for given in paths:
    if not os.path.exists(given):
      raise ConfigError(key, f'{given} does not exist; give text, .jsonl, .parquet or .arrow files')
    if os.path.isfile(given):
      found.append(Input(given, os.path.basename(given), _kind(given) or 'text', _size(given, key)))
      continue
    for dirpath, dirnames, filenames in os.walk(given):
      dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith('.'))
      for filename in sorted(filenames):
        kind = _kind(filename)
        if filename.startswith('.') or kind is None:
          continue
        full = os.path.join(dirpath, filename)
        rel = os.path.relpath(full, given).replace(os.sep, '/')
        found.append(Input(full, f'{os.path.basename(given.rstrip("/"))}/{rel}', kind, 0))
  if not found:
    raise ConfigError(
      key,
      f'no input files in {", ".join(paths)}: give *{", *".join(TEXT_SUFFIXES)}, *.jsonl, '
      '*.parquet or *.arrow files',
    )
  return [dataclasses.replace(i, size=_size(i.path, key)) for i in found]


def _size(path: str, key: str) -> int:
  size = os.path.getsize(path)
  if size == 0:
    raise ConfigError(key, f'{path} is empty; remove it or give it text')
  return size


def read(inp: Input, text_key: str = 'text') -> Iterator[str]:
  """The documents of one input file, in file order.

  Raises:
    ConfigError: on '--text_key' when a record lacks the field or it is not text;
      on '--input' for a file its reader cannot parse.
  """
  if inp.kind == 'text':
    with open(inp.path, 'rb') as f:
      yield _utf8(f.read(), inp.path)
  elif inp.kind == 'jsonl':
    with open(inp.path, 'rb') as f:
      for n, raw in enumerate(f, 1):
        line = _utf8(raw, f'{inp.path}:{n}')
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ConfigError('--input', f'{inp.path}:{n}: not a JSON line ({e.msg})') from None
        yield _field(record, text_key, f'{inp.path}:{n}')
  else:
    for n, text in enumerate(_arrow_column(inp, text_key)):
      yield _field({text_key: text}, text_key, f'{inp.path} row {n}')


def _utf8(data: bytes, where: str) -> str:
  # Strict: replacing bad bytes would change the text without a word, and a file
  # that is not UTF-8 is usually not text at all (or needs converting first).
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as e:
    raise ConfigError(
      '--input',
      f'{where} is not UTF-8 text (byte {e.start}); convert it (e.g. iconv -t UTF-8) or remove it',
    ) from None


def _field(record, text_key: str, where: str) -> str:
  if not isinstance(record, dict) or text_key not in record:
    keys = ', '.join(sorted(record)) if isinstance(record, dict) else type(record).__name__
    raise ConfigError('--text_key', f'{where} has no field {text_key!r} (it has: {keys})')
  text = record[text_key]
  if not isinstance(text, str):
    raise ConfigError('--text_key', f'{where}: {text_key!r} is {type(text).__name__}, not text')
  return text


def _arrow_column(inp: Input, text_key: str) -> Iterator[str]:
  import pyarrow as pa
  import pyarrow.parquet as pq

  try:
    if inp.kind == 'parquet':
      pf = pq.ParquetFile(inp.path)
      names = pf.schema_arrow.names
      batches = pf.iter_batches(columns=[text_key]) if text_key in names else None
    else:
      # An Arrow IPC file, or the stream format Hugging Face datasets caches in.
      try:
        reader = pa.ipc.open_file(inp.path)
        names = reader.schema.names
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
      except pa.ArrowInvalid:
        reader = pa.ipc.open_stream(inp.path)
        names = reader.schema.names
        batches = iter(reader)
  except (pa.ArrowInvalid, OSError) as e:
    raise ConfigError('--input', f'{inp.path}: cannot read it as {inp.kind} ({e})') from None
  if text_key not in names:
    raise ConfigError(
      '--text_key', f'{inp.path} has no column {text_key!r} (it has: {", ".join(names)})'
    )
  for batch in batches:
    yield from batch.column(batch.schema.get_field_index(text_key)).to_pylist()
