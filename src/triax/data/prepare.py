"""Text files -> token shards: what `python -m triax prepare` runs.

A prepared directory holds, per split (`train`, `val`):

* `SPLIT-NNNNN.tokens`: the split's documents, each followed by the
  end-of-document id, as raw little-endian uint16 (when every id fits) or
  uint32, cut into shards at document boundaries;
* `SPLIT-NNNNN.docs`: int64 offsets of each document's first token in its shard;

and `manifest.json`, written last and atomically: the request (tokenizer
fingerprint, input files with sizes and sha256, text key, validation
fraction, shard size) and every output file's size and sha256. A directory
without a manifest is a prepare that did not finish. Rerunning on the same
request with intact outputs does nothing; anything else (other inputs,
another tokenizer, a shard of the wrong size or checksum) rebuilds it. The
loader (data/sources.py) reads nothing without a manifest whose sizes match.

Documents are split by position: every round(1/val_fraction)-th document
goes to validation, so the split is exact, stable for the same inputs, and
spread over all the files.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import shutil
from collections.abc import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from triax.data import documents
from triax.data import tokenizer as tokenizer_lib
from triax.errors import ConfigError

FORMAT = 'triax-tokens'
VERSION = 1
MANIFEST = 'manifest.json'
SPLITS = ('train', 'val')
# 256 Mi tokens (512 MiB of uint16) per shard: few files, each well under any file-size limit.
DEFAULT_SHARD_TOKENS = 2**28
# Documents handed to a worker at once: big enough to amortise the inter-process hop.
_CHUNK_DOCS = 256
# Where a prepare writes until it has finished, inside the output directory (same file system).
_STAGING = '.prepare-staging'
_OUTPUT = re.compile(r'^(train|val)-\d{5}\.(tokens|docs)$')


def dtype_for(vocab_size: int) -> np.dtype:
  return np.dtype('<u2') if vocab_size <= 2**16 else np.dtype('<u4')


def prepare(
  inputs: Sequence[str],
  out: str,
  tokenizer: str = tokenizer_lib.BYTES,
  text_key: str = 'text',
  val_fraction: float = 0.05,
  workers: int = 0,
  shard_tokens: int = DEFAULT_SHARD_TOKENS,
  progress: bool = True,
) -> dict:
  """Tokenizes `inputs` into `out` unless it already holds this request, intact.

  Args:
    inputs: files or directories (text, .jsonl, .parquet, .arrow).
    out: the output directory (created; may hold only a previous prepare's files).
    tokenizer: 'bytes', a tokenizer.json or a sentencepiece .model.
    text_key: the text field of .jsonl/.parquet/.arrow records.
    val_fraction: share of documents held out for validation, in (0, 0.5].
    workers: tokenizing processes; 0 = one per CPU, 1 = in this process.
    shard_tokens: most tokens per shard (a longer document gets a shard of its own).
    progress: show a progress bar.

  Returns:
    The manifest, with 'rebuilt': whether anything was written.

  Raises:
    ConfigError: on the flag at fault ('--input', '--out', '--tokenizer', ...); `out` untouched.
  """
  if not 0 < val_fraction <= 0.5:
    raise ConfigError('--val_fraction', f'must be in (0, 0.5], got {val_fraction}')
  if shard_tokens < 1:
    raise ConfigError('--shard_tokens', f'must be >= 1, got {shard_tokens}')
  if workers < 0:
    raise ConfigError('--workers', f'must be >= 0 (0 = one per CPU), got {workers}')
  try:
    tok = tokenizer_lib.load(tokenizer)
  except ConfigError as e:
    raise ConfigError('--tokenizer', e.message) from None
  files = documents.list_inputs(inputs)
  _check_out(out)
  request = {
    'tokenizer': tok.record(),
    'inputs': [{'name': f.name, 'size': f.size, 'sha256': _sha256(f.path)} for f in files],
    'text_key': text_key,
    'val_fraction': val_fraction,
    'shard_tokens': shard_tokens,
  }
  old = read_manifest(out)
  if old is not None and old.get('request') == request and not verify(out, old, checksums=True):
    return dict(old, rebuilt=False)

  created = not os.path.exists(out)
  staging = os.path.join(out, _STAGING)
  shutil.rmtree(staging, ignore_errors=True)  # left by a prepare that was killed
  os.makedirs(staging)
  try:
    splits = _write_splits(
      tokenizer, tok, files, text_key, val_fraction, workers, shard_tokens, staging, progress
    )
  except BaseException:
    # Bad input found mid-way (a record without the text key, ...): what was there stays.
    shutil.rmtree(out if created else staging, ignore_errors=True)
    raise
  # The old manifest goes first: until the new one is written the directory reads as unfinished.
  if os.path.exists(os.path.join(out, MANIFEST)):
    os.remove(os.path.join(out, MANIFEST))
  for name in os.listdir(out):
    if _OUTPUT.match(name):
      os.remove(os.path.join(out, name))
  for name in os.listdir(staging):
    os.replace(os.path.join(staging, name), os.path.join(out, name))
  os.rmdir(staging)
  manifest = write_manifest(out, request, dtype_for(tok.vocab_size), splits)
  return dict(manifest, rebuilt=True)


def _write_splits(spec, tok, files, text_key, val_fraction, workers, shard_tokens, where, progress):
  """Tokenizes every document into `where`; returns the manifest's per-split records."""
  writers = {s: SplitWriter(where, s, dtype_for(tok.vocab_size), shard_tokens) for s in SPLITS}
  every = max(2, round(1 / val_fraction))
  n = 0
  # Closed on an error too: closing ends the bar's line, so the error line starts its own.
  with tqdm(desc='prepare', unit=' docs', disable=not progress, dynamic_ncols=True) as bar:
    for ids in _tokenize(spec, _texts(files, text_key), workers):
      n += 1
      writers['val' if n % every == 0 else 'train'].add(ids, tok.eod_id)
      bar.update(1)
  for split in SPLITS:
    if not writers[split].documents:
      raise ConfigError(
        '--val_fraction' if split == 'val' else '--input',
        f'the {n} input documents leave the {split} split empty (every {every}th document is '
        'held out); give more documents (a plain-text file is one) or raise --val_fraction',
      )
  return {s: writers[s].close() for s in SPLITS}


def write_manifest(out: str, request: dict, dtype: np.dtype, splits: dict) -> dict:
  """Writes `out`'s manifest atomically (the last file a prepare writes); returns it."""
  manifest = {
    'format': FORMAT,
    'version': VERSION,
    'request': request,
    'dtype': np.dtype(dtype).name,
    'splits': splits,
  }
  _write_json(os.path.join(out, MANIFEST), manifest)
  return manifest


def read_manifest(out: str) -> dict | None:
  """The manifest of a prepared directory, or None if absent or unreadable."""
  try:
    with open(os.path.join(out, MANIFEST)) as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(manifest, dict) or manifest.get('format') != FORMAT:
    return None
  return manifest


def verify(out: str, manifest: dict, checksums: bool = False) -> str | None:
  """What is wrong with a prepared directory's files, or None when they match the manifest.

  Sizes always; sha256 too with `checksums` (a full read: prepare does it,
  the trainer checks sizes, which catches a partial or truncated file).
  """
  if manifest.get('version') != VERSION:
    return f'format version {manifest.get("version")}, this triax reads {VERSION}'
  for split in SPLITS:
    for shard in manifest['splits'][split]['shards']:
      for kind in ('tokens', 'docs'):
        path = os.path.join(out, shard[kind])
        if not os.path.isfile(path):
          return f'{path} is missing'
        if os.path.getsize(path) != shard[f'{kind}_bytes']:
          return (
            f'{path} has {os.path.getsize(path)} bytes, the manifest says {shard[f"{kind}_bytes"]}'
          )
        if checksums and _sha256(path) != shard[f'{kind}_sha256']:
          return f'{path} does not match its checksum'
  return None


class SplitWriter:
  """Appends documents to a split's shards; each shard file is renamed into place when full."""

  def __init__(self, out: str, split: str, dtype: np.dtype, shard_tokens: int):
    self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
    self.shards: list[dict] = []
    self.documents = 0
    self.tokens = 0
    self.max_id = -1
    self._parts: list[np.ndarray] = []
    self._starts: list[int] = []
    self._size = 0

  def add(self, ids: list[int], eod: int) -> None:
    doc = np.empty(len(ids) + 1, dtype=self.dtype)
    doc[:-1] = ids
    doc[-1] = eod
    if self._size and self._size + doc.size > self.shard_tokens:
      self._flush()
    self._starts.append(self._size)
    self._parts.append(doc)
    self._size += doc.size
    self.documents += 1
    self.tokens += doc.size
    if doc.size:
      self.max_id = max(self.max_id, int(doc.max()))

  def _flush(self) -> None:
    base = f'{self.split}-{len(self.shards):05d}'
    record = {'tokens': f'{base}.tokens', 'docs': f'{base}.docs'}
    for kind, array in (
      ('tokens', np.concatenate(self._parts)),
      ('docs', np.asarray(self._starts, dtype='<i8')),
    ):
      path = os.path.join(self.out, record[kind])
      data = array.tobytes()
      with open(path + '.tmp', 'wb') as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
      os.replace(path + '.tmp', path)
      record[f'{kind}_bytes'] = len(data)
      record[f'{kind}_sha256'] = hashlib.sha256(data).hexdigest()
    record['num_tokens'] = self._size
    record['num_docs'] = len(self._starts)
    self.shards.append(record)
    self._parts, self._starts, self._size = [], [], 0

  def close(self) -> dict:
    if self._parts:
      self._flush()
    return {
      'shards': self.shards,
      'tokens': self.tokens,
      'documents': self.documents,
      'max_id': self.max_id,
    }


def _texts(files: list[documents.Input], text_key: str) -> Iterator[str]:
  for f in files:
    yield from documents.read(f, text_key)


_worker_tokenizer = None


def _init_worker(spec: str) -> None:
  global _worker_tokenizer
  # Each worker tokenizes one document at a time; the library's own threads would only contend.
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'
  _worker_tokenizer = tokenizer_lib.load(spec)


def _encode_chunk(texts: list[str]) -> list[list[int]]:
  tok = _worker_tokenizer
  out = []
  for text in texts:
    if tok.kind == tokenizer_lib.BYTES and '\0' in text:
      raise ConfigError(
        '--tokenizer',
        'a document holds a NUL character, which the bytes tokenizer uses as '
        'end-of-document; use a BPE tokenizer (python -m triax tokenizer train) or remove it',
      )
    out.append(tok.encode(text))
  return out


def _chunks(texts: Iterator[str]) -> Iterator[list[str]]:
  chunk = []
  for text in texts:
    chunk.append(text)
    if len(chunk) == _CHUNK_DOCS:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


def _tokenize(spec: str, texts: Iterator[str], workers: int) -> Iterator[list[int]]:
  """Token ids of each text, in order, from `workers` processes (1: this one)."""
  workers = workers or os.cpu_count() or 1
  if workers == 1:
    _init_worker(spec)
    for chunk in _chunks(texts):
      yield from _encode_chunk(chunk)
    return
  # forkserver, not fork: the caller may have started threads (JAX's, a test
  # runner's, filelock's), and a forked child inherits their locks held. The
  # server process is new and single-threaded; workers fork from it and import
  # this module once each.
  with multiprocessing.get_context('forkserver').Pool(workers, _init_worker, (spec,)) as pool:
    for ids in pool.imap(_encode_chunk, _chunks(texts)):
      yield from ids


def _check_out(out: str) -> None:
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError('--out', f'{out} is a file; give a directory')
  if os.path.isdir(out):
    foreign = [n for n in os.listdir(out) if n not in (MANIFEST, _STAGING) and not _OUTPUT.match(n)]
    if foreign:
      raise ConfigError(
        '--out',
        f'{out} holds files prepare did not write ({", ".join(sorted(foreign)[:3])}); '
        'give a new or empty directory',
      )
  parent = os.path.dirname(os.path.abspath(out))
  if not os.path.isdir(parent):
    raise ConfigError('--out', f'{parent} does not exist; create it first')


def _sha256(path: str) -> str:
  return tokenizer_lib.file_sha256(path)


def _write_json(path: str, obj) -> None:
  with open(path + '.tmp', 'w') as f:
    json.dump(obj, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + '.tmp', path)


def summary(out: str, manifest: dict) -> str:
  """One line: what the directory holds and whether this run wrote it."""
  s = manifest['splits']
  verb = 'wrote' if manifest['rebuilt'] else 'up to date (inputs and tokenizer unchanged):'
  return (
    f'{out}: {verb} {s["train"]["tokens"]:,} train tokens in {s["train"]["documents"]:,} '
    f'documents, {s["val"]["tokens"]:,} val tokens in {s["val"]["documents"]:,} documents '
    f'({manifest["dtype"]}, {manifest["request"]["tokenizer"]["kind"]} tokenizer, '
    f'{len(manifest["request"]["inputs"])} input files); train with '
    f'--config.data.source=tokens --config.data.path={out}'
  )
