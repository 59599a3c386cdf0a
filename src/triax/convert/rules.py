"""How a family's HF tensors and triax's parameter leaves correspond, as data
(`TensorRule`, one list per family from hf_llama and hf_deepseek), and what
both directions of a conversion do with it, one leaf at a time.

A leaf of the parameter tree is made of blocks: the leaf itself (an
embedding), one block per layer of a stacked [L, ...] leaf, one per layer
and expert of an [L, E, ...] one. Each block is made from one HF tensor
(and each HF tensor from blocks at one index of one or more leaves:
DeepSeek's kv_a_proj_with_mqa holds two of our leaves' blocks). So an
import makes a leaf block by block, reading one tensor per block
(`import_blocks`), and an export writes each tensor from one index of its
leaves (`export_tensors`); neither needs more of the model than that.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import numpy as np

from triax.errors import ConfigError

Path = tuple[str, ...]


class TensorRule(NamedTuple):
  """HF tensors <-> blocks of the leaves `paths`.

  `names` is an array of HF tensor names over the blocks (0-d: the leaf is
  one block; [L]: one per layer; [L, E]: one per layer and expert), each
  tensor of `hf_shape`; leaf k is `names.shape + shapes[k]`, imported as
  `dtypes[k]`. `to_ours(tensor)` gives one block of each leaf, in `paths`'
  order; `to_hf(*blocks)` the tensor back, by indexing, transposes and
  reshapes only (a round trip is bit-identical).
  """

  names: np.ndarray
  hf_shape: tuple[int, ...]
  paths: tuple[Path, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]
  to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
  to_hf: Callable[..., np.ndarray]


def names_array(names) -> np.ndarray:
  """An object array of HF names (nested lists, or one name)."""
  out = np.empty(np.shape(names), dtype=object)
  out[...] = names
  return out


def linear(name, path: Path, shape: tuple[int, ...], dtype, ins: int = 1) -> TensorRule:
  """PyTorch's Linear weights [out, in] (`name`, as `names_array` takes it) <->
  blocks of `shape` whose first `ins` dims are the inputs."""
  i, o = int(np.prod(shape[:ins])), int(np.prod(shape[ins:]))
  return TensorRule(
    names_array(name),
    (o, i),
    (path,),
    (tuple(shape),),
    (np.dtype(dtype),),
    lambda a: (a.T.reshape(shape),),
    lambda w: w.reshape(i, o).T,  # a view: ShardWriter copies it a row block at a time
  )


def reshaped(name, path: Path, shape: tuple[int, ...], dtype, hf_shape=None) -> TensorRule:
  """Tensors of `hf_shape` (default: flat) <-> blocks of `shape`, the same
  values in the same order (embeddings, norms, biases)."""
  hf_shape = tuple(hf_shape or (int(np.prod(shape)),))
  return TensorRule(
    names_array(name),
    hf_shape,
    (path,),
    (tuple(shape),),
    (np.dtype(dtype),),
    lambda a: (a.reshape(shape),),
    lambda w: w.reshape(hf_shape),
  )


def sources(rules: list[TensorRule]) -> dict[str, tuple[int, ...]]:
  """Every HF tensor the rules read, with the shape it must have."""
  return {name: rule.hf_shape for rule in rules for name in rule.names.flat}


def check_sources(rules: list[TensorRule], shards, ignored: set[str], family: str) -> None:
  """Refuses a checkpoint (`shards`: names and shapes) that lacks a tensor the
  rules read, holds one of another shape, or holds one they do not read
  (besides `ignored`). Reads no tensor.

  Raises:
    ConfigError('--hf_dir', ...): the first such tensor.
  """
  wanted = sources(rules)
  for name, shape in wanted.items():
    if name not in shards:
      raise ConfigError('--hf_dir', f'the checkpoint has no tensor {name}')
    if tuple(shards.shape(name)) != shape:
      raise ConfigError(
        '--hf_dir', f'{name} has shape {tuple(shards.shape(name))}, config.json implies {shape}'
      )
  left = sorted(set(shards.names()) - set(wanted) - ignored)
  if left:
    raise ConfigError(
      '--hf_dir', f'tensors this {family} config does not use: {", ".join(left[:3])}'
    )


class Leaf(NamedTuple):
  """One leaf an import makes: its path, shape and dtype, its blocks' number
  of leading coordinates, and `blocks(read)`, which makes them one at a
  time, `read(name)` giving an HF tensor."""

  path: Path
  shape: tuple[int, ...]
  dtype: np.dtype
  block_ndim: int
  blocks: Callable[[Callable[[str], np.ndarray]], Iterator[tuple[tuple[int, ...], np.ndarray]]]


def import_leaves(rules: list[TensorRule]) -> list[Leaf]:
  """The leaves the rules make. A tensor that makes blocks of several
  leaves is read once for each (they are small: DeepSeek's kv projections)."""
  return [
    Leaf(path, rule.names.shape + shape, dtype, rule.names.ndim, _blocks(rule, k))
    for rule in rules
    for k, (path, shape, dtype) in enumerate(zip(rule.paths, rule.shapes, rule.dtypes))
  ]


def _blocks(rule: TensorRule, k: int):
  def blocks(read):
    for index in np.ndindex(rule.names.shape):
      block = rule.to_ours(read(rule.names[index]))[k]
      # A view of the tensor read where it can be (a transpose): one copy fewer held.
      yield index, block.astype(rule.dtypes[k], copy=False)

  return blocks


def export_specs(rules: list[TensorRule], dtype_of: Callable[[Path], np.dtype]) -> list:
  """(name, shape, dtype) of every HF tensor the rules write, in transformers'
  order (the embedding, then layer by layer, then the rest); a tensor's dtype
  is its first leaf's (`dtype_of(path)`)."""
  specs = [
    (rule.names[index], rule.hf_shape, np.dtype(dtype_of(rule.paths[0])))
    for rule in rules
    for index in np.ndindex(rule.names.shape)
  ]
  return sorted(specs, key=lambda spec: _hf_order(spec[0]))  # stable: rules' order in a layer


_LAYER = re.compile(r'model\.layers\.(\d+)\.')


def _hf_order(name: str) -> tuple[int, int]:
  layer = _LAYER.match(name)
  if layer:
    return 1, int(layer.group(1))
  return (0, 0) if name.startswith('model.embed_tokens') else (2, 0)


def export_tensors(
  rule: TensorRule, leaves: tuple[np.ndarray, ...]
) -> Iterator[tuple[str, np.ndarray]]:
  """(name, tensor) of each HF tensor of `rule`, from its leaves (in `paths`' order)."""
  for index in np.ndindex(rule.names.shape):
    yield rule.names[index], rule.to_hf(*(np.asarray(leaf[index]) for leaf in leaves))


def get(tree: Mapping, path: Path):
  for key in path:
    tree = tree[key]
  return tree


def put(tree: dict, path: Path, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def params_to_hf(rules: list[TensorRule], params: Mapping) -> dict[str, np.ndarray]:
  """Every HF tensor of a parameter tree held in memory (in the rules' order)."""
  out = {}
  for rule in rules:
    out.update(export_tensors(rule, tuple(get(params, path) for path in rule.paths)))
  return out
