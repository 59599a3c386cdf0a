"""Token streams the loader cuts into windows: the byte corpus, prepared shards, Megatron pairs.

A `TokenStream` is one split's tokens as one sequence (over any number of
memory-mapped shards) with the offsets where its documents start. Opening a
source checks what can be wrong with it before anything is compiled or
written: missing or unfinished files, sizes that disagree with their
index, a tokenizer other than the one the tokens were made with, ids the
model's vocabulary does not hold.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Sequence

import numpy as np

from triax.data import prepare as prepare_lib
from triax.data import tokenizer as tokenizer_lib
from triax.errors import ConfigError


class TokenStream:
  """A split's tokens as one sequence over consecutive arrays, with document starts.

  Attributes:
    size: tokens in all parts.
    doc_starts: int64 offsets of each document's first token (sorted, from 0),
      or None where documents are not recorded (the byte corpus).
    dtype: the tokens' storage dtype.
  """

  def __init__(self, parts: Sequence[np.ndarray], doc_starts: np.ndarray | None = None):
    self._parts = [p for p in parts if p.size]
    self._bounds = np.cumsum([0] + [p.size for p in self._parts])
    self.size = int(self._bounds[-1])
    self.doc_starts = doc_starts
    self.dtype = self._parts[0].dtype if self._parts else np.dtype(np.uint8)

  @property
  def num_documents(self) -> int | None:
    return None if self.doc_starts is None else int(self.doc_starts.size)

  def read(self, start: int, length: int) -> np.ndarray:
    """Tokens [start, start + length), crossing shard boundaries where a window does."""
    i = int(np.searchsorted(self._bounds, start, side='right')) - 1
    offset = start - int(self._bounds[i])
    part = self._parts[i]
    if offset + length <= part.size:
      return part[offset : offset + length]
    pieces, need = [], length
    while need:
      piece = self._parts[i][offset : offset + need]
      pieces.append(piece)
      need -= piece.size
      i, offset = i + 1, 0
    return np.concatenate(pieces)

  def segment_ids(self, start: int, length: int) -> np.ndarray:
    """int32 document number of each of the tokens [start, start + length), from 0 in the window."""
    if self.doc_starts is None:
      raise ValueError('this stream records no document boundaries')
    doc = np.searchsorted(self.doc_starts, np.arange(start, start + length), side='right')
    return (doc - doc[0]).astype(np.int32)

  def head(self, n: int) -> np.ndarray:
    """The first min(n, size) tokens (for statistics that need not read everything)."""
    return self.read(0, min(n, self.size)) if self.size else np.zeros(0, self.dtype)


@dataclasses.dataclass
class Split:
  """A source's train and validation streams and what they are, in words."""

  train: TokenStream
  val: TokenStream
  what: str  # e.g. 'tokens DIR (huggingface tokenizer (8192 ids) tok.json): 3 shards'
  vocab_size: int  # ids are below this (the tokenizer's vocabulary, or 256 for bytes)


def _memmap(path: str, dtype, key: str) -> np.ndarray:
  size = os.path.getsize(path)
  if size == 0:
    return np.zeros(0, dtype)
  if size % np.dtype(dtype).itemsize:
    raise ConfigError(key, f'{path} has {size} bytes, not a whole number of {np.dtype(dtype)}')
  return np.memmap(path, dtype=dtype, mode='r')


def open_tokens(
  path: str, tokenizer: str, model_vocab_size: int, tensor: int, vocab_used: int = 0
) -> Split:
  """A directory `triax prepare` wrote, checked against its manifest and the tokenizer.

  Raises:
    ConfigError: data.path (missing, unfinished or damaged), data.tokenizer (not the
      one the tokens were made with), model.vocab_size (too small for its ids),
      model.vocab_used (not the tokenizer's id count, tokenizer_lib.check_vocab).
  """
  if not os.path.isdir(path):
    raise ConfigError(
      'data.path',
      f'{path} is not a directory; give the --out directory of python -m triax prepare',
    )
  manifest = prepare_lib.read_manifest(path)
  if manifest is None:
    raise ConfigError(
      'data.path',
      f'{path} has no {prepare_lib.MANIFEST} (not a prepared directory, or a prepare that did '
      'not finish); run python -m triax prepare --out=' + path,
    )
  problem = prepare_lib.verify(path, manifest)
  if problem:
    raise ConfigError(
      'data.path',
      f'{path} is damaged: {problem}; rerun the same python -m triax prepare to rebuild it',
    )
  made_with = manifest['request']['tokenizer']
  tok = tokenizer_lib.load(tokenizer)
  if tok.fingerprint != made_with['fingerprint']:
    raise ConfigError(
      'data.tokenizer',
      f'{path} was written with the {made_with["kind"]} tokenizer {made_with["name"]} '
      f'({made_with["vocab_size"]} ids), not with {tok.describe()}; set '
      f'data.tokenizer={made_with["name"]}',
    )
  tokenizer_lib.check_vocab(tok, model_vocab_size, tensor, vocab_used)
  streams = {}
  for split in prepare_lib.SPLITS:
    record = manifest['splits'][split]
    parts, starts = [], []
    for shard in record['shards']:
      parts.append(_memmap(os.path.join(path, shard['tokens']), manifest['dtype'], 'data.path'))
      docs = np.fromfile(os.path.join(path, shard['docs']), dtype='<i8')
      starts.append(docs + sum(p.size for p in parts[:-1]))
    streams[split] = TokenStream(parts, np.concatenate(starts) if starts else None)
  shards = sum(len(manifest['splits'][s]['shards']) for s in prepare_lib.SPLITS)
  files = len(manifest['request']['inputs'])
  return Split(
    train=streams['train'],
    val=streams['val'],
    what=f'tokens {path} ({tok.describe()}; {files} input files in {shards} shards)',
    vocab_size=tok.vocab_size,
  )


# Megatron-LM's MMapIndexedDataset index (megatron/core/datasets/indexed_dataset.py):
# header, version <Q (1), dtype code <B, sequence count <Q, document count <Q, then
# int32 sizes[sequences], int64 pointers[sequences] (byte offsets into .bin) and
# int64 document_indices[documents] (sequence index where each document starts, plus
# the sequence count as a sentinel, so documents = entries - 1).
MEGATRON_HEADER = b'MMIDIDX\x00\x00'
MEGATRON_DTYPES = {
  1: np.uint8,
  2: np.int8,
  3: np.int16,
  4: np.int32,
  5: np.int64,
  6: np.float64,
  7: np.float32,
  8: np.uint16,
}
# Megatron's default split holds out a few percent of the documents, contiguously at the end;
# we hold out the last 5% (at least one document).
MEGATRON_VAL_FRACTION = 0.05
# Ids are checked against the model's vocabulary in blocks of this many tokens.
_SCAN_BLOCK = 2**26


def megatron_prefix(path: str) -> str:
  for suffix in ('.bin', '.idx'):
    if path.endswith(suffix):
      return path[: -len(suffix)]
  return path


def read_megatron_index(idx_path: str) -> dict:
  """The fields of a Megatron `.idx` file.

  Raises:
    ConfigError: on data.path, when it is not one.
  """
  with open(idx_path, 'rb') as f:
    head = f.read(len(MEGATRON_HEADER) + 8 + 1 + 8 + 8)
    if len(head) < 34 or not head.startswith(MEGATRON_HEADER):
      raise ConfigError(
        'data.path', f'{idx_path} is not a Megatron MMapIndexedDataset index (no MMIDIDX header)'
      )
    version, code, n_seq, n_doc = struct.unpack('<QBQQ', head[len(MEGATRON_HEADER) :])
  if version != 1 or code not in MEGATRON_DTYPES:
    raise ConfigError(
      'data.path', f'{idx_path}: index version {version}, dtype code {code}; triax reads version 1'
    )
  offset = len(head)
  need = offset + n_seq * 4 + n_seq * 8 + n_doc * 8
  if os.path.getsize(idx_path) < need:
    raise ConfigError(
      'data.path',
      f'{idx_path} has {os.path.getsize(idx_path)} bytes, its header promises {need} (truncated?)',
    )
  sizes = np.memmap(idx_path, np.int32, 'r', offset, (n_seq,))
  pointers = np.memmap(idx_path, np.int64, 'r', offset + n_seq * 4, (n_seq,))
  doc_idx = np.memmap(idx_path, np.int64, 'r', offset + n_seq * 12, (n_doc,))
  return {'dtype': np.dtype(MEGATRON_DTYPES[code]), 'sizes': sizes, 'pointers': pointers,
          'doc_idx': doc_idx}  # fmt: skip


def open_megatron(
  path: str, tokenizer: str, model_vocab_size: int, tensor: int, vocab_used: int = 0
) -> Split:
  """A Megatron-LM `.bin`/`.idx` pair (PREFIX, PREFIX.bin or PREFIX.idx).

  The sequences are read in file order as one token stream, so windows are
  packed across documents as in Megatron's GPTDataset (docs/data.md says how
  the sample order differs); the last 5% of documents are validation.

  Without data.tokenizer (bytes) the ids' vocabulary is unknown: only its
  largest id is, which model.vocab_used (when set) must hold; with one, the
  tokenizer's id count decides model.vocab_used (tokenizer_lib.check_vocab).

  Raises:
    ConfigError: data.path (missing, malformed, sizes that disagree), data.tokenizer /
      model.vocab_size / model.vocab_used (ids beyond the model's vocabulary or its
      unpadded part).
  """
  prefix = megatron_prefix(path)
  for suffix in ('.bin', '.idx'):
    if not os.path.isfile(prefix + suffix):
      raise ConfigError(
        'data.path',
        f'{prefix + suffix} does not exist; give the PREFIX of a Megatron PREFIX.bin/PREFIX.idx pair',
      )
  index = read_megatron_index(prefix + '.idx')
  dtype, sizes, pointers, doc_idx = (index[k] for k in ('dtype', 'sizes', 'pointers', 'doc_idx'))
  if not np.issubdtype(dtype, np.integer):
    raise ConfigError('data.path', f'{prefix}.idx holds {dtype} values, not token ids')
  lengths = sizes.astype(np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths)])
  total = int(starts[-1])
  # Megatron's builder writes sequences back to back; a merged or hand-made index might not.
  if not np.array_equal(np.asarray(pointers), starts[:-1] * dtype.itemsize):
    raise ConfigError(
      'data.path',
      f'{prefix}.idx: sequences are not stored back to back in {prefix}.bin; triax reads only '
      'contiguous pairs (as Megatron tools/preprocess_data.py writes them)',
    )
  if os.path.getsize(prefix + '.bin') != total * dtype.itemsize:
    raise ConfigError(
      'data.path',
      f'{prefix}.bin has {os.path.getsize(prefix + ".bin")} bytes; its index says '
      f'{total * dtype.itemsize} ({total} {dtype} tokens): damaged or not its pair',
    )
  docs = np.asarray(doc_idx)
  if docs.size < 2 or docs[0] != 0 or docs[-1] != sizes.size or np.any(np.diff(docs) < 0):
    raise ConfigError(
      'data.path', f'{prefix}.idx: its document index is not 0 ... {sizes.size} ascending'
    )
  doc_starts = starts[docs[:-1]]
  n_docs = doc_starts.size
  if n_docs < 2:
    raise ConfigError(
      'data.path', f'{prefix} holds {n_docs} document: too few to hold one out for validation'
    )
  tokens = _memmap(prefix + '.bin', dtype, 'data.path')
  tok = tokenizer_lib.load(tokenizer)
  if tok.kind != tokenizer_lib.BYTES:
    tokenizer_lib.check_vocab(tok, model_vocab_size, tensor, vocab_used)
  top = max(
    (int(tokens[i : i + _SCAN_BLOCK].max()) for i in range(0, total, _SCAN_BLOCK)), default=0
  )
  if top >= model_vocab_size:
    raise ConfigError(
      'model.vocab_size',
      f'{model_vocab_size} cannot hold token id {top} of {prefix}.bin; set model.vocab_size='
      f'{tokenizer_lib.padded_vocab_size(top + 1, tensor)} (or the padded size of its tokenizer)',
    )
  if tok.kind != tokenizer_lib.BYTES and top >= tok.vocab_size:
    raise ConfigError(
      'data.tokenizer',
      f'{prefix}.bin holds token id {top}, beyond the {tok.describe()}: it was made with another '
      'tokenizer; name that one',
    )
  if vocab_used and top >= vocab_used:
    raise ConfigError(
      'model.vocab_used',
      f'{vocab_used} marks id {top} of {prefix}.bin as padding (masked out of the loss); '
      f"set model.vocab_used to its tokenizer's id count (> {top}), or name data.tokenizer",
    )
  n_val = max(1, int(n_docs * MEGATRON_VAL_FRACTION))
  cut = int(doc_starts[n_docs - n_val])
  train = TokenStream([tokens[:cut]], doc_starts[: n_docs - n_val])
  val = TokenStream([tokens[cut:]], doc_starts[n_docs - n_val :] - cut)
  return Split(
    train=train,
    val=val,
    what=f'megatron {prefix}.bin/.idx ({dtype} ids up to {top}; last {n_val} documents held out)',
    vocab_size=tok.vocab_size if tok.kind != tokenizer_lib.BYTES else top + 1,
  )
