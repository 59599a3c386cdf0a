"""Checkpoint leaves written and read block by block: what lets `triax
convert` move a checkpoint larger than the host's memory.

A `Deferred` stands in a state tree (Checkpointer.save_canonical) for an
array that is never whole in memory. Its `blocks()` yield (index, block)
pairs that tile it, `leaf[index] = block` with `index` a tuple of its first
`len(index)` coordinates (`block_ndim` fewer dimensions than the leaf; () for
a leaf made in one piece), made one at a time. `HANDLER_REGISTRY`'s handler
writes each block as it comes, in chunks of at most CHUNK_BYTES, each chunk's
write finished (encoded and committed to the OCDBT store) before the next
starts, and drops the block before asking for the next: a save holds one
block and one chunk's encoding, whatever the leaf's size. (One write of a
whole block would hold its encoding too: zstd's output and OCDBT's buffer of
it, measured at about 3x the block.)

On disk such a leaf is what orbax writes for a numpy array (value type
`np.ndarray`, zarr chunks of the leaf's chunk shape), so every reader of the
checkpoint restores it as it restores any other leaf, into any sharding.

`read_blocks` reads a stored leaf back a slab of its stored chunks at a time
(zarr decodes whole chunks, so no read is smaller): one layer of a leaf an
import wrote, a pipeline stage's layers of a pipe-sharded one, the whole
leaf where it was stored in one chunk.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

# The largest chunk written at once (one chunk of the stored array).
CHUNK_BYTES = 8 << 20


class Deferred:
  """A leaf of `shape` and `dtype` whose `blocks()` make it, block by block
  (see the module docstring); `block_ndim`: how many leading coordinates each
  block's index fixes."""

  def __init__(
    self,
    shape: tuple[int, ...],
    dtype,
    blocks: Callable[[], Iterator[tuple[tuple[int, ...], np.ndarray]]],
    block_ndim: int = 0,
  ):
    self.shape, self.dtype = tuple(shape), np.dtype(dtype)
    self.blocks, self.block_ndim = blocks, block_ndim

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * self.dtype.itemsize


def chunk_shape(shape: tuple[int, ...], itemsize: int, limit: int = CHUNK_BYTES) -> tuple:
  """The stored chunks of a block of `shape`: the block itself if it is at
  most `limit` bytes, else cut along its leading axes (whole rows kept as far
  as they fit)."""
  chunk = list(shape)
  for axis in range(len(shape)):
    inner = itemsize * math.prod(shape[axis + 1 :])
    if inner * chunk[axis] <= limit:
      break
    chunk[axis] = max(1, limit // inner)
    if inner <= limit:
      break
  return tuple(chunk)


def _chunk_slices(shape: tuple[int, ...], chunk: tuple[int, ...]) -> Iterator[tuple]:
  ranges = [range(0, size, step) for size, step in zip(shape, chunk)]
  for starts in itertools.product(*ranges):
    yield tuple(slice(s, min(s + c, n)) for s, c, n in zip(starts, chunk, shape))


class DeferredHandler(ocp.type_handlers.NumpyHandler):
  """Writes `Deferred` leaves as numpy arrays, block by block (module docstring)."""

  def __init__(self):
    super().__init__(deepcopy_host_arrays=False)  # nothing to copy: blocks are made at write time

  async def _background_serialize(self, values, infos, args=None):
    for value, info, arg in zip(values, infos, args):
      await info.await_path_creation()
      if jax.process_index() == 0:  # as orbax writes numpy leaves: one process, whole
        await self._write(value, info, arg)

  async def _write(self, value: Deferred, info, arg) -> None:
    block = value.shape[value.block_ndim :]
    chunk = (1,) * value.block_ndim + chunk_shape(block, value.dtype.itemsize)
    spec = ts_utils.build_array_write_spec(
      info=info,
      arg=arg,
      global_shape=value.shape,
      local_shape=chunk,  # orbax makes the write shape the chunk shape
      dtype=value.dtype,
      use_ocdbt=info.is_ocdbt_checkpoint,
      process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint),
      metadata_key=self._metadata_key,
    ).json
    store = await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
    for index, array in value.blocks():
      if array.shape != block or array.dtype != value.dtype:
        raise ValueError(
          f'{info.name}{list(index)}: a block of {array.dtype}{list(array.shape)}, '
          f'not {value.dtype}{list(block)}'
        )
      for part in _chunk_slices(block, chunk[value.block_ndim :]):
        await store[index + part].write(array[part])
      del array  # before the next block is made


def handler_registry():
  """orbax's default type handlers, and DeferredHandler for `Deferred` leaves."""
  defaults = [(ty, ocp.type_handlers.get_type_handler(ty)) for ty in _DEFAULT_TYPES]
  # Deferred first: its handler's typestr ('np.ndarray') is then NumpyHandler's again.
  return ocp.type_handlers.create_type_handler_registry((Deferred, DeferredHandler()), *defaults)


_DEFAULT_TYPES = tuple(ocp.type_handlers.supported_types())


# The OCDBT B-tree nodes a read may cache: orbax's reads keep up to 100 MB
# (measured: reading a 256 MiB leaf layer by layer kept 140 MiB more);
# reading each leaf once, in order, needs far less.
_BTREE_CACHE_BYTES = 8 << 20


@functools.cache
def _read_context() -> ts.Context:
  """One TensorStore context for every read (a context per leaf would keep a cache per leaf)."""
  return ts.Context(
    {
      'file_io_concurrency': {'limit': 128},
      'cache_pool#ocdbt': {'total_bytes_limit': _BTREE_CACHE_BYTES},
    }
  )


def read_blocks(
  item_dir: str, path: tuple[str, ...], block_ndim: int
) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
  """The blocks of leaf `path` of the pytree orbax saved in `item_dir` (a
  step's state item), (index, leaf[index]) over its first `block_ndim`
  axes in order, read a slab of stored chunks at a time (module docstring)."""
  with open(os.path.join(item_dir, '_METADATA')) as f:
    use_zarr3 = bool(json.load(f).get('use_zarr3', False))
  info = ocp.type_handlers.ParamInfo(
    name='.'.join(path),  # orbax's name of a leaf: its keys joined by dots
    parent_dir=epath.Path(item_dir),
    is_ocdbt_checkpoint=os.path.exists(os.path.join(item_dir, 'manifest.ocdbt')),
    use_zarr3=use_zarr3,
    ts_context=_read_context(),
  )
  spec = ts_utils.build_array_read_spec(info, use_ocdbt=info.is_ocdbt_checkpoint).json
  store = ts.open(ts.Spec(spec), open=True, context=info.ts_context).result()
  lead = store.shape[:block_ndim]
  step = store.chunk_layout.read_chunk.shape[:block_ndim]
  for starts in itertools.product(*(range(0, n, s) for n, s in zip(lead, step))):
    box = tuple(slice(a, min(a + s, n)) for a, s, n in zip(starts, step, lead))
    slab = store[box].read().result()
    for inner in np.ndindex(slab.shape[:block_ndim]):
      yield tuple(a + i for a, i in zip(starts, inner)), slab[inner]
    del slab
