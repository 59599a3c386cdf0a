"""The train state between two layouts, one leaf at a time.

Saving converts the state from the pipeline's layout ([p, v, Lmax, ...] stacks) to the
checkpoint's (model layer order, split over `pipe`), and restoring converts it back. What
that adds per device is bounded three ways:

- where chunks change stage (interleaved, ZB-V's V) with an even split, each chunk moves by
  its own `ppermute` over `pipe` (`StackLayout.chunk_moves`), not XLA's all-to-all or
  all-gather of the whole leaf;
- one small program per leaf, run in turn, bounds the temporaries by the largest leaf;
  leaves of one shape, dtype and sharding pair share a program;
- the checkpoint's layout lives in host memory (step.py's `_canonical_shardings`), so the
  device never holds the state in both layouts.

What XLA did otherwise: docs/design/training.md."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from triax import sharding
from triax.pipeline.layout import StackLayout, under_layers


def _chunk_mover(layout: StackLayout, mesh, to_model: bool):
  """Model order split over `pipe` <-> pipeline order, by ppermutes of whole chunks."""
  groups = layout.chunk_moves()
  v, lmax = layout.virtual, layout.max_layers

  def to_pipeline(x):  # this stage's [v * Lmax, ...] of model order
    x = x.reshape((v, lmax) + x.shape[1:])
    out = [jnp.zeros_like(x[0]) for _ in range(v)]
    for (index, slot), pairs in groups.items():
      # Stages outside the permutation receive zeros; each slot is filled once.
      out[slot] = out[slot] + jax.lax.ppermute(x[index], 'pipe', pairs)
    return jnp.stack(out)[None]

  def to_model_order(x):  # this stage's [1, v, Lmax, ...]
    x = x[0]
    out = [jnp.zeros_like(x[0]) for _ in range(v)]
    for (index, slot), pairs in groups.items():
      back = [(dst, src) for src, dst in pairs]
      out[index] = out[index] + jax.lax.ppermute(x[slot], 'pipe', back)
    return jnp.stack(out).reshape((v * lmax,) + x.shape[2:])

  return jax.shard_map(
    to_model_order if to_model else to_pipeline,
    mesh=mesh,
    axis_names={'pipe'},
    in_specs=P('pipe'),
    out_specs=P('pipe'),
  )


def converter(layout: StackLayout, model_sharding: NamedSharding, to_model: bool):
  """The conversion of one layer stack, for a leaf whose model-order sharding is
  `model_sharding`: chunk ppermutes where model order splits into whole
  chunks over `pipe` (its layer axis split over `pipe`), else the layout's
  own index permutation (an uneven split)."""
  spec = tuple(model_sharding.spec)
  whole_chunks = (
    layout.chunk_moves() is not None
    and spec[:1] == ('pipe',)
    and model_sharding.mesh.shape['pipe'] == layout.stages
  )
  if whole_chunks and layout.stages > 1:
    return _chunk_mover(layout, model_sharding.mesh, to_model)
  return layout.to_model_order if to_model else layout.to_pipeline


def tree_to_model_order(layout: StackLayout, mesh, tree):
  """`tree`'s layer stacks in model order, inside the caller's program: with
  an even split, split over `pipe` by layer, each chunk moved whole (for a
  V or interleaved placement the index permutation gathers whole stacks on
  every device); else the layout's own permutation."""
  move = converter(layout, NamedSharding(mesh, P('pipe')), to_model=True)
  return jax.tree_util.tree_map_with_path(
    lambda path, a: move(a) if under_layers(path) else a, tree
  )


def _on_device(convert, in_sharding: NamedSharding):
  """`convert` of a leaf kept in host memory (the checkpoint's layout, an
  offloaded optimizer state), run on its device copy: XLA computes on device memory only (the output goes back
  where the program's out_shardings put it)."""
  if in_sharding.memory_kind in (None, 'device'):
    return convert
  on_device = in_sharding.with_memory_kind('device')
  return lambda x: convert(jax.device_put(x, on_device))


def _in_turn(leaves, shardings):
  """What makes the conversion's programs run one after another.

  On XLA:CPU each device runs its share of a program on a thread of its own
  when the inputs are ready, so programs dispatched back to back, on
  independent leaves, run at once; every one holds collectives of all the
  devices, and devices that entered different programs wait for each other
  (a mixtral with moe_every=2 at data 4 x pipe 2 aborted its first save so,
  7 of 8 devices in one program's collective-permute). Each program is
  awaited there. GPU and TPU run a device's programs in launch order; traced
  (inside a caller's jit) there is one program.
  """
  traced = any(isinstance(x, jax.core.Tracer) for _, x in leaves)
  on_cpu = any(d.platform == 'cpu' for s in shardings for d in s.device_set)
  return jax.block_until_ready if on_cpu and not traced else lambda x: x


class Relayout:
  """The state converted leaf by leaf, one program each, run in turn: the
  layer stacks (the leaves under 'layers': parameters and Adam moments) to
  model order (`to_model`) or to pipeline order, every other leaf only
  resharded (`in_shardings` to `out_shardings`).

  A leaf in host memory comes to the device inside its program, and an
  output the shardings place there leaves it inside its program: with the
  checkpoint's layout in host memory (step.py's `_canonical_shardings`), a
  save or restore holds the train state and one leaf's conversion on the
  device, never a second copy of the state."""

  def __init__(self, layout: StackLayout, in_shardings: Any, out_shardings: Any, *, to_model: bool):
    self._layout = layout
    self._to_model = to_model
    self._in = in_shardings
    self._out = out_shardings
    self._programs: dict = {}

  def _parts(self, tree):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    ins = treedef.flatten_up_to(self._in)
    outs = treedef.flatten_up_to(self._out)
    return leaves, treedef, list(zip(leaves, ins, outs))

  def _program(self, path, leaf, in_sharding, out_sharding):
    stack = under_layers(path)
    key = (stack, leaf.shape, leaf.dtype, in_sharding, out_sharding)
    if key not in self._programs:
      convert = lambda x: x  # noqa: E731
      if stack:
        model_sharding = out_sharding if self._to_model else in_sharding
        convert = converter(self._layout, model_sharding, self._to_model)
      convert = _on_device(convert, in_sharding)
      self._programs[key] = jax.jit(convert, in_shardings=in_sharding, out_shardings=out_sharding)
    return self._programs[key]

  def __call__(self, tree):
    leaves, treedef, parts = self._parts(tree)
    in_turn = _in_turn(leaves, [i for _, i, _ in parts])
    result = [in_turn(self._program(path, x, i, o)(x)) for (path, x), i, o in parts]
    return jax.tree_util.tree_unflatten(treedef, result)

  def peak_bytes(self, abstract) -> int:
    """Per device, the most device memory the conversion of `abstract` holds
    at once: every input leaf in device memory (the caller keeps them), the
    outputs made so far in device memory (they stay: the checkpoint writes
    them, or they are the restored state), and the running program's
    temporaries and output. Host memory (step.HOST) is not counted."""
    leaves, _, parts = self._parts(abstract)
    held = sum(_device_bytes(x, i) for (_, x), i, _ in parts)
    peak = held
    for (path, x), i, o in parts:
      program = self._program(path, x, i, o)
      temp = program.lower(x).compile().memory_analysis().temp_size_in_bytes
      out = _device_bytes(jax.eval_shape(program, x), o)
      peak = max(peak, held + temp + out)
      held += out
    return peak


def _device_bytes(leaf, leaf_sharding: NamedSharding) -> int:
  """Bytes of `leaf` one device holds in its device memory (0 in host memory)."""
  on_device = leaf_sharding.memory_kind in (None, 'device')
  return sharding.per_device_bytes(leaf, leaf_sharding) if on_device else 0
