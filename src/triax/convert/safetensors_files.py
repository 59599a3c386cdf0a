"""Hugging Face checkpoint files (safetensors, one file or shards with their index),
read one tensor at a time and written one tensor at a time.

The format (huggingface/safetensors' README): an 8-byte little-endian header
size N, N bytes of JSON ({name: {dtype, shape, data_offsets: [begin, end]}},
offsets into the data after the header, and an optional `__metadata__`),
then the tensors' bytes. It is read and written here rather than through
`safetensors.numpy`, whose numpy has no bfloat16 (the dtype of most released
checkpoints) and whose writer takes a whole shard's tensors at once: a
tensor's bytes are read on their own (`Shards.read`), and a shard's header
is written first from the tensors' names, shapes and dtypes, their bytes
then written into place as each is made (`ShardWriter`), so neither holds
more than the tensor in hand.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping

import ml_dtypes
import numpy as np

from triax.errors import ConfigError

INDEX_FILE = 'model.safetensors.index.json'
SINGLE_FILE = 'model.safetensors'
# transformers' save_pretrained default (max_shard_size='5GB', decimal).
MAX_SHARD_BYTES = 5 * 10**9

# safetensors' dtype names <-> numpy's (bfloat16 and the fp8s from ml_dtypes).
_DTYPES = {
  'F64': np.dtype(np.float64),
  'F32': np.dtype(np.float32),
  'F16': np.dtype(np.float16),
  'BF16': np.dtype(ml_dtypes.bfloat16),
  'F8_E4M3': np.dtype(ml_dtypes.float8_e4m3fn),
  'F8_E5M2': np.dtype(ml_dtypes.float8_e5m2),
  'I64': np.dtype(np.int64),
  'I32': np.dtype(np.int32),
  'I16': np.dtype(np.int16),
  'I8': np.dtype(np.int8),
  'U8': np.dtype(np.uint8),
  'BOOL': np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
# The header is padded with spaces to this many bytes, as safetensors pads it.
_ALIGN = 8
# The most bytes of a tensor copied at once to write it.
_WRITE_BYTES = 16 << 20


def checkpoint_files(hf_dir: str) -> list[str]:
  """The safetensors files of an HF checkpoint directory: its index's shards, or its one file.

  Raises:
    ConfigError('--hf_dir', ...): neither, or a shard the index names is missing.
  """
  index = os.path.join(hf_dir, INDEX_FILE)
  if os.path.isfile(index):
    with open(index) as f:
      names = sorted(set(json.load(f)['weight_map'].values()))
  elif os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
    names = [SINGLE_FILE]
  else:
    raise ConfigError(
      '--hf_dir', f'{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE} (safetensors only)'
    )
  for name in names:
    if not os.path.isfile(os.path.join(hf_dir, name)):
      raise ConfigError('--hf_dir', f'{INDEX_FILE} names {name}, which is missing')
  return [os.path.join(hf_dir, name) for name in names]


def _header(path: str) -> tuple[dict, int]:
  """(a safetensors file's header, where its data starts).

  Raises:
    ConfigError('--hf_dir', ...): not a safetensors file, or a dtype numpy cannot hold.
  """
  try:
    with open(path, 'rb') as f:
      (size,) = struct.unpack('<Q', f.read(8))
      header = json.loads(f.read(size))
    header.pop('__metadata__', None)
    for name, entry in header.items():
      if entry['dtype'] not in _DTYPES:
        raise ValueError(f'{name} is of dtype {entry["dtype"]}, which triax does not read')
      begin, end = entry['data_offsets']
      count = int(np.prod(entry['shape'], dtype=np.int64))
      if end - begin != count * _DTYPES[entry['dtype']].itemsize:
        raise ValueError(f'{name} has {end - begin} bytes for shape {entry["shape"]}')
  except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
    raise ConfigError('--hf_dir', f'{path}: not a readable safetensors file ({e})') from None
  return header, 8 + size


class Shards:
  """The tensors of an HF checkpoint directory: their names, shapes and dtypes
  from the files' headers alone (nothing else is read on opening), and one
  tensor's bytes when it is read.

  Raises (on construction):
    ConfigError('--hf_dir', ...): no checkpoint, a missing shard, or an unreadable file.
  """

  def __init__(self, hf_dir: str):
    # name -> (path, dtype, shape, offset of its bytes in path)
    self._where: dict[str, tuple[str, np.dtype, tuple[int, ...], int]] = {}
    for path in checkpoint_files(hf_dir):
      header, start = _header(path)
      for name, entry in header.items():
        dtype, shape = _DTYPES[entry['dtype']], tuple(entry['shape'])
        self._where[name] = (path, dtype, shape, start + entry['data_offsets'][0])

  def names(self) -> list[str]:
    return list(self._where)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def shape(self, name: str) -> tuple[int, ...]:
    return self._where[name][2]

  def read(self, name: str) -> np.ndarray:
    """Tensor `name`, read from its file alone (its bytes, nothing around them)."""
    path, dtype, shape, offset = self._where[name]
    count = int(np.prod(shape, dtype=np.int64))
    return np.fromfile(path, dtype=dtype, count=count, offset=offset).reshape(shape)


def read_tensors(hf_dir: str) -> dict[str, np.ndarray]:
  """Every tensor of an HF checkpoint directory, as numpy (all of them at once:
  for tests and small checkpoints; a conversion reads `Shards` tensor by tensor)."""
  shards = Shards(hf_dir)
  return {name: shards.read(name) for name in shards.names()}


class ShardWriter:
  """Writes the tensors named in advance (name, shape, dtype; in that order) as
  transformers does: `model.safetensors` when they fit in `max_shard_bytes`,
  else shards of at most that (`model-0000k-of-0000n.safetensors`, a tensor
  larger than the limit alone in its own) and their index. Each file's header
  is written on construction, each tensor's bytes into their place by
  `write`, in any order; `close` checks that every one was written and then
  writes the index (files mode 0644, as HF's are shared).
  """

  def __init__(
    self, out_dir: str, specs: Iterable[tuple[str, tuple, np.dtype]], max_shard_bytes: int
  ):
    specs = [(name, tuple(shape), np.dtype(dtype)) for name, shape, dtype in specs]
    self._out_dir = out_dir
    self._slots: dict[str, tuple[str, int, tuple, np.dtype]] = {}
    self._written: set[str] = set()
    total = sum(_nbytes(shape, dtype) for _, shape, dtype in specs)
    groups = _shards(specs, max_shard_bytes) if total > max_shard_bytes else [specs]
    self._files = []
    for k, group in enumerate(groups):
      single = total <= max_shard_bytes
      name = SINGLE_FILE if single else f'model-{k + 1:05d}-of-{len(groups):05d}.safetensors'
      self._files.append((name, [tensor for tensor, _, _ in group]))
      self._start(os.path.join(out_dir, name), group)
    self._total = total

  def _start(self, path: str, group) -> None:
    """Writes `path`'s header and sizes it; records where each tensor's bytes go."""
    header, offset = {'__metadata__': {'format': 'pt'}}, 0
    for name, shape, dtype in group:
      if dtype not in _NAMES:
        raise ValueError(f'{name}: dtype {dtype} has no safetensors name')
      end = offset + _nbytes(shape, dtype)
      header[name] = {'dtype': _NAMES[dtype], 'shape': list(shape), 'data_offsets': [offset, end]}
      offset = end
    text = json.dumps(header, separators=(',', ':')).encode()
    text += b' ' * (-len(text) % _ALIGN)
    start = 8 + len(text)
    with open(path, 'wb') as f:
      f.write(struct.pack('<Q', len(text)) + text)
      f.truncate(start + offset)
    os.chmod(path, 0o644)
    for name, shape, dtype in group:
      self._slots[name] = (path, start + header[name]['data_offsets'][0], shape, dtype)

  def write(self, name: str, array: np.ndarray) -> None:
    """Writes tensor `name` (of the shape and dtype it was named with) into its place."""
    path, offset, shape, dtype = self._slots[name]
    if array.shape != shape or array.dtype != dtype:
      raise ValueError(f'{name}: {array.dtype}{list(array.shape)}, announced {dtype}{list(shape)}')
    with open(path, 'r+b') as f:
      f.seek(offset)
      # Row blocks of at most _WRITE_BYTES: a strided view (a transpose) is
      # copied a block at a time, never whole.
      flat = array.reshape(1, -1) if array.ndim < 2 else array.reshape(array.shape[0], -1)
      rows = max(1, _WRITE_BYTES // max(1, flat[:1].nbytes))
      for start in range(0, flat.shape[0], rows):
        f.write(np.ascontiguousarray(flat[start : start + rows]).reshape(-1).view(np.uint8))
    self._written.add(name)

  def close(self) -> list[str]:
    """Writes the index (shards only); returns the files' names.

    Raises:
      ValueError: a tensor named on construction was never written.
    """
    missing = [name for name in self._slots if name not in self._written]
    if missing:
      raise ValueError(f'tensors never written: {", ".join(missing[:3])}')
    names = [name for name, _ in self._files]
    if names != [SINGLE_FILE]:
      weight_map = {tensor: name for name, tensors in self._files for tensor in tensors}
      index = {'metadata': {'total_size': self._total}, 'weight_map': weight_map}
      path = os.path.join(self._out_dir, INDEX_FILE)
      with open(path, 'w') as f:
        json.dump(index, f, indent=2)
      os.chmod(path, 0o644)
      names.append(INDEX_FILE)
    return names


def _nbytes(shape, dtype: np.dtype) -> int:
  return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _shards(specs, max_shard_bytes: int) -> list[list]:
  """The tensors cut, in order, into groups of at most `max_shard_bytes`."""
  groups, current, size = [], [], 0
  for spec in specs:
    nbytes = _nbytes(spec[1], spec[2])
    if current and size + nbytes > max_shard_bytes:
      groups.append(current)
      current, size = [], 0
    current.append(spec)
    size += nbytes
  groups.append(current)
  return groups


def write_tensors(
  tensors: Mapping[str, np.ndarray], out_dir: str, max_shard_bytes: int
) -> list[str]:
  """Writes tensors held in memory, as `ShardWriter` does; returns the files' names."""
  writer = ShardWriter(
    out_dir, [(n, a.shape, a.dtype) for n, a in tensors.items()], max_shard_bytes
  )
  for name, array in tensors.items():
    writer.write(name, array)
  return writer.close()


def shard_bytes(size: str) -> int:
  """Bytes of a shard size as transformers' max_shard_size reads it: an integer,
  or a number with KB/MB/GB (powers of 1000) or KiB/MiB/GiB (of 1024).

  Raises:
    ConfigError('--max_shard_size', ...): anything else, or not positive.
  """
  units = {'KIB': 2**10, 'MIB': 2**20, 'GIB': 2**30, 'KB': 10**3, 'MB': 10**6, 'GB': 10**9, 'B': 1}
  text = str(size).strip().upper()
  unit = next((u for u in units if text.endswith(u)), '')
  try:
    value = int(float(text[: len(text) - len(unit)]) * units.get(unit, 1))
  except ValueError:
    value = 0
  if value <= 0:
    raise ConfigError(
      '--max_shard_size', f'{size!r}: give bytes, or a size such as 5GB, 500MB or 2GiB'
    )
  return value
