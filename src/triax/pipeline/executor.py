"""Runs a lowered pipeline schedule as one SPMD program: `pipeline_loss_and_grad`.

`shard_map` is manual over `pipe`, and over `data` when the trainer asks (`data_axis`);
`tensor` stays automatic (GSPMD) inside each stage. A `lax.scan` walks the program's ticks
(lower.py); each tick every device reads its own row of the tables and runs one `lax.cond`
per kind (F, B, W, and a fused tick's B W F), so an idle slot executes nothing. A tick's
outputs travel by one `ppermute` per stage offset the placement uses, into the slot the
receiver's table names; BPipe's residual moves open the tick in one more ppermute; a packed
program (rounds.py) sends only after each round's last tick.

Invariants:
- stash, message and cut pools have the slots the lowering assigns, so activation memory
  is bounded by the schedule, not by the number of micro-batches;
- B and W together execute the fused backward's equations once each (split_backward.py);
- with `data` manual, weight gradients accumulate unreduced and are summed over `data`
  once per step, after the scan;
- with `observations`, what chunks observe (model.fp8=delayed's amaxes) is kept as the
  max over micro-batches and replicas, never a sum;
- with `offload_stash` the stash pool lives in host memory: an F's residual set is copied
  out at the end of its tick and copied back at the start of its B's and W's, at the
  tick's top level (not inside a `cond`), so the device holds about two sets.

The executor does not import the model: it receives the functions it places (`StageFns`)
and the lowered `Program`. Why it is built so: docs/design/executor.md."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from triax import sharding
from triax.pipeline import lower as lower_lib
from triax.pipeline.split_backward import SplitBackward, row_major_call

Params = Any


@dataclasses.dataclass(frozen=True)
class StageFns:
  """What the executor places on stages.

  `edges` are the parameters of the pipeline's two ends (embedding and head),
  one tree, so that a weight both ends use (a tied embedding table) has one
  gradient buffer, into which both ends' gradients are added.

  embed(edges, tokens[mb, s], segments) -> x[mb, s, d]       first chunk's input
  chunk(chunk_params, x[, num_layers][, segments=]) -> (y, (shares, maxima))
      one chunk's layers (the first num_layers of its padded stack, when the
      split is uneven; with segments[mb, s], attention stays inside each
      packed document), and what it reports: two trees of figures, summed
      (shares) and maximised (maxima) over every chunk, micro-batch and
      replica of the step (a MoE's router losses; empty for a dense model)
  head_loss_and_grad(edges, y, targets[mb, s], acc, scale[, input_grad]) -> (loss, acc, dy):
      scale x the summed token loss, `acc` (a gradient tree like edges) with
      that loss's gradient w.r.t. edges added, and its gradient w.r.t. y. The
      accumulator is handed in so that no second vocabulary-sized gradient
      exists beside it (model/loss.py adds each chunk's share as it goes).
      `acc` None: no gradient w.r.t. edges (None returned); a leaf of
      `acc` None: none w.r.t. that leaf (loss.partial_vjp); input_grad
      False: none w.r.t. y. Either is then not computed. With loss_terms
      n > 1 the loss is [n] terms summed apart (DeepSeek's MTP beside the
      cross-entropy), each scaled by `scale`; the gradient is the
      objective's (the model weighs the terms itself).
  """

  embed: Callable[[Params, jax.Array, jax.Array | None], jax.Array]
  chunk: Callable[[Params, jax.Array], jax.Array]
  head_loss_and_grad: Callable[..., tuple[jax.Array, Params, jax.Array]]
  loss_terms: int = 1


# Named scopes that mark each cond's branches, so that the work a compiled step
# executes can be counted branch by branch (compiled/hlo_work.py, from the
# op_name metadata; `branch_counts` says how often each runs). Metadata only:
# no numerics and no program structure change. A branch inside another reads
# as their path, e.g. 'triax_F/triax_head'.
MARK_F = 'triax_F'  # a tick's F
MARK_B = 'triax_B'  # a tick's B
MARK_W = 'triax_W'  # a tick's W
MARK_FUSED = 'triax_FBW'  # a fused tick: B, W, then another micro-batch's F
MARK_MOVE = 'triax_move'  # the partner ppermute of residual sets (BPipe)
MARK_LAND = 'triax_land'  # in a move: the arriving set written to its slot
MARK_SEND = 'triax_send'  # a packed round's send over one offset: MARK_SEND + f'{o:+d}'
MARK_EMBED = 'triax_embed'  # in an F: the first chunk's embedding
MARK_HEAD = 'triax_head'  # in an F: the last chunk's loss and seed gradient
MARK_EMBED_GRAD = 'triax_embed_grad'  # in a B: the first chunk's embedding gradient
MARK_EDGE_ROW = 'triax_edge_row'  # after the loop: one micro-batch's edge gradients


def send_marker(offset: int) -> str:
  return f'{MARK_SEND}{offset:+d}'


# Where an offloaded stash pool lives and where its sets are used (offload_stash).
HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def edge_grads_after_loop(
  setting: str, microbatches: int, stages: int, act_bytes: float, edge_grad_bytes: float
) -> bool:
  """Whether the embedding's and head's weight gradients are made after the
  tick loop rather than in it (see `_Stage.edge_gradients`).

  In the loop they take an fp32 accumulator of every edge weight (a 128k
  vocabulary's table: 1 GiB at d = 2048), carried through all the ticks by
  every stage. After it, the loop carries two pools instead, each with one
  activation per micro-batch (the last chunk's outputs and the first
  chunk's input gradients, `act_bytes` each, padded to a multiple of the
  stages), and each stage then takes 1/stages of them. 'auto' picks the
  fewer bytes (the pools grow with the micro-batches, the table does not),
  on more than one stage: one stage alone would run the head's forward
  again for every micro-batch, with no stage to share it.
  """
  if setting != 'auto':
    return setting == 'after'
  return stages > 1 and edge_pool_bytes(microbatches, stages, act_bytes) < edge_grad_bytes


def edge_rows(microbatches: int, stages: int) -> int:
  """Micro-batches whose edge gradients each stage makes after the loop."""
  return -(-microbatches // stages)


def edge_pool_bytes(microbatches: int, stages: int, act_bytes: float) -> float:
  """Bytes making the edges' gradients after the loop holds: its two pools
  (a row per micro-batch, padded to a multiple of the stages) and a stage's
  share of each."""
  return 2 * (stages + 1) * edge_rows(microbatches, stages) * act_bytes


def _varying(tree, axes=('pipe',)):
  """Marks values as varying over the manual `axes` (each device holds its
  own): fresh carries, and weights whose gradients must stay per device."""

  def cast(a):
    varying = sharding.varying_axes(a)
    missing = tuple(x for x in axes if x not in varying)
    if not missing:
      return a
    return jax.lax.pcast(a, missing, to='varying')

  return jax.tree.map(cast, tree)


def _zeros_like_varying(tree, axes=('pipe',)):
  return _varying(jax.tree.map(jnp.zeros_like, tree), axes)


def _split_by_rank(tree, matrices: bool):
  """`tree` with None for its leaves of rank 2 and up (matrices False) or
  below 2 (matrices True): a partial gradient accumulator (loss.partial_vjp).

  When the edges' gradients are made after the loop, the head's vectors
  (a final norm's scale) take theirs in the loop, from the product by the
  head's matrix the input gradient makes anyway; the rows after the loop
  then make the matrices' alone, without that product (a third of a row's
  vocabulary-sized matmuls).
  """
  return jax.tree.map(lambda a: a if (a.ndim >= 2) == matrices else None, tree)


def _overlay(full, partial, add: bool = False):
  """full with partial's leaves where they are not None (added to full's with `add`)."""
  leaves, tree = jax.tree.flatten(full)
  parts = tree.flatten_up_to(partial)
  merged = [a if p is None else (a + p if add else p) for a, p in zip(leaves, parts, strict=True)]
  return tree.unflatten(merged)


def _all_reduce(x, axes: tuple[str, ...], sizes: dict[str, int], spec: P | None):
  """psum over `axes`, as a reduce-scatter then an all-gather where it can be.

  `sizes`: every mesh axis's size; `spec`: how x is split over the
  automatic axes.

  The same bytes on the wire as one all-reduce (a ring all-reduce is these
  two), but the operand is dead once scattered, so the gathered result takes
  its memory: XLA:TPU gives a psum's result a buffer beside its operand,
  which for the vocabulary-sized gradient of the embedding and head (1 GiB
  at 128k x 2048 in fp32) is a second one at the step's end. The split
  dimension's share stays a multiple of TPU's 128 lanes (a share that is not
  made XLA pad a copy of the whole). Only for values `spec` leaves whole: GSPMD does not carry an automatic
  split through these collectives over manual axes (a vocabulary split over
  `tensor` came out whole, 2 GiB a table at Llama 3.1 8B's size), so those
  take the psum.
  """
  n = math.prod(sizes[a] for a in axes)
  split = lambda entry: math.prod(sizes[a] for a in ((entry,) if isinstance(entry, str) else entry))  # noqa: E731
  whole = spec is not None and all(entry is None or split(entry) == 1 for entry in spec)
  fits = [d for d in range(x.ndim) if x.shape[d] % (128 * n) == 0]
  if n == 1:
    return _invariant(x, axes)
  if not whole or not fits:
    return jax.lax.psum(x, axes)
  dim = fits[-1]
  part = jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
  return jax.lax.all_gather(part, axes, axis=dim, tiled=True, to='invarying')


def _invariant(x, axes: tuple[str, ...]):
  """x made invariant over manual `axes`, where every manual axis has one
  device: nothing to sum, so an all-gather of one. A psum there, of a value
  split over an automatic axis (a gradient split over `tensor` under
  micro-batches alone), failed XLA's SPMD partitioner ('Cross-partition
  allreduce must be in (partial) manual partitioning mode'; jax 0.10)."""
  if not x.ndim:
    return jax.lax.psum(x, axes)
  return jax.lax.all_gather(x, axes, axis=0, tiled=True, to='invarying')


def _scatter_rows(pool, mesh: Mesh):
  """Each stage's rows of a pool that one stage wrote (a reduce-scatter over
  `pipe`: the other stages' rows are zeros, so the sum is exact in any dtype).

  On XLA:CPU a bf16 pool goes through f32: its compiler aborts on a bf16
  reduce-scatter ("Invalid binary instruction opcode copy": the pass that
  widens bf16 reductions clones a reducer whose root is a copy; jax 0.10-0.12).
  """
  if pool.dtype == jnp.bfloat16 and mesh.devices.flat[0].platform == 'cpu':
    wide = jax.lax.psum_scatter(pool.astype(jnp.float32), 'pipe', scatter_dimension=0, tiled=True)
    return wide.astype(pool.dtype)
  return jax.lax.psum_scatter(pool, 'pipe', scatter_dimension=0, tiled=True)


def _take(tree, index):
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False), tree)


def _put(buffers, index, values):
  # A one-slot pool is replaced, not updated: XLA then keeps the new value's
  # buffer instead of copying it into the old one (one cut set less at the
  # peak of 1f1b, whose W follows its B at once).
  # Typed as the pool: a cut made by an unchecked shard_map (per_device's
  # backward) carries no varying axes, the pool all of them.
  return [
    sharding.vary_like(v[None].astype(b.dtype), b) if b.shape[0] == 1 else b.at[index].set(v)
    for b, v in zip(buffers, values)
  ]


def pipeline_loss_and_grad(
  fns: StageFns,
  program: lower_lib.Program,
  mesh: Mesh,
  act_shape: tuple[int, ...],
  act_dtype: Any,
  loss_scale: float,
  act_spec: P = P(),
  chunk_layers: tuple[int, ...] | None = None,
  data_axis: str | None = None,
  transfer_spec: P | None = None,
  segments: bool = False,
  edge_specs: Any = None,
  edge_grads: str = 'auto',
  offload_stash: bool = False,
  chunk_first: tuple[int, ...] | None = None,
  observations: bool = False,
):
  """Builds f(stage_params, edge_params, inputs, targets[, segments]).

  Args:
    fns: the functions to place.
    program: the lowered schedule (ticks, slot tables, buffer sizes).
    mesh: the mesh; `pipe` must have `program.schedule.stages` devices.
    act_shape: one micro-batch's activation shape [mb, s, d] (global mb).
    act_dtype: activation dtype.
    loss_scale: multiplies the summed loss (1 / global token count), so that
      gradients are those of the mean loss, as on one device.
    act_spec: how one activation [mb, s, d] is split over the automatic axes
      (e.g. P('tensor') nowhere, by default). Every branch output and buffer
      is pinned to it: XLA requires a conditional's branches to agree on
      their outputs' sharding.
    chunk_layers: layers of each model chunk when the split is uneven (the
      stacks are padded to the longest); None for an even split.
    data_axis: the mesh axis the batch is split over, made manual too so
      that weight gradients are reduced over it once per step; the
      functions in `fns` then see one replica's rows, and act_spec must not
      name it. None: left to GSPMD (reduced per micro-batch).
    edge_specs: how each edge parameter is split over the automatic axes
      (a tree of PartitionSpecs like edge_params'), which decides how their
      gradients are summed (see `_all_reduce`) and what a device holds of
      them; None: one psum each, whole on every device.
    edge_grads: where the edges' weight gradients are made: 'loop',
      'after' the loop, or 'auto' (`edge_grads_after_loop`).
    offload_stash: keep the stash pool in host memory (module docstring);
      not with a schedule that moves residual sets between stages (BPipe).
    chunk_first: the stack entry each model chunk starts at, passed to
      the chunk function as `first=` (for layers that differ by where they
      sit in the model: a sliding-window pattern); None: not passed.
    transfer_spec: how an activation or gradient is split while it travels
      between stages and waits in the message pool (Megatron's
      scatter/gather, e.g. P(None, None, 'tensor'): each tensor rank sends
      1/t of it, and the reader all-gathers it); None: as act_spec.
    observations: stage_params is a pair (weights, observations), both laid
      out alike and handed to the chunk function together; the second's
      gradient is what a chunk observed (values >= 0, model.fp8=delayed's
      amaxes: model/fp8_delayed.py), combined by max over the chunk's
      micro-batches and over replicas rather than summed.

  Returns:
    f(stage_params, edge_params, inputs, targets) -> ((loss, (shares,
    maxima)), (stage_grads, edge_grads)). `stage_params` leaves are
    [pipe, v, layers_per_chunk, ...] sharded over `pipe`, local chunk i of
    stage s at [s, i]; inputs and targets are [m, mb, s].
  """
  p = program.schedule.stages
  if mesh.shape['pipe'] != p:
    raise ValueError(f'mesh has pipe={mesh.shape["pipe"]} but the schedule has {p} stages')
  if offload_stash and program.partner is not None:
    raise ValueError(
      f'{program.schedule.name} moves residual sets between stages; offload_stash keeps them on the host'
    )
  if offload_stash and program.fused:
    raise ValueError(
      f'{program.schedule.name} fuses overlapped pairs into one tick; offload_stash copies one '
      'set a tick'
    )
  manual = ('pipe',) + ((data_axis,) if data_axis else ())
  setup = _Setup(
    fns=fns,
    program=program,
    manual=manual,
    act_shape=_replica_shape(act_shape, mesh, data_axis),
    act_dtype=act_dtype,
    loss_scale=loss_scale,
    act_spec=act_spec,
    message_spec=act_spec if transfer_spec is None else transfer_spec,
    chunk_layers=chunk_layers,
    chunk_first=chunk_first,
    mesh=mesh,
    edge_specs=edge_specs,
    edge_grads=edge_grads,
    offload_stash=offload_stash,
    observations=observations,
  )
  tables = _device_tables(program)
  info = {}

  def body(stage_params, edges, inputs, targets, *docs):
    stage = _Stage(setup, stage_params, edges, inputs, targets, docs[0] if docs else None)
    info['residual_bytes'], info['cut_bytes'] = (
      stage.residuals.stash_bytes,
      stage.residuals.cut_bytes,
    )
    info['edge_grads_after_loop'] = stage.after
    c, _ = jax.lax.scan(stage.tick, stage.initial_carry(), tables)
    if stage.after:
      c = stage.edge_gradients(c)
    return _reduce_over_replicas(c, manual, mesh, edge_specs, observations)

  return PipelineStep(_per_stage(body, mesh, manual, data_axis, segments), info)


def _replica_shape(act_shape, mesh: Mesh, data_axis: str | None) -> tuple[int, ...]:
  """One micro-batch's activation shape as one replica of `data_axis` holds it."""
  if not data_axis:
    return tuple(act_shape)
  replicas = mesh.shape[data_axis]
  if act_shape[0] % replicas:
    raise ValueError(
      f'micro-batch of {act_shape[0]} rows does not split over {data_axis}={replicas}'
    )
  return (act_shape[0] // replicas,) + tuple(act_shape[1:])


def _per_stage(body, mesh: Mesh, manual, data_axis: str | None, segments: bool):
  """`body` shard_mapped: a stage's parameters, every edge, its replica's rows."""
  rows = P(None, data_axis) if data_axis else P()
  return jax.shard_map(
    body,
    mesh=mesh,
    axis_names=set(manual),
    in_specs=(P('pipe'), P(), rows, rows) + ((rows,) if segments else ()),
    out_specs=((P(), P()), (P('pipe'), P())),
  )


@dataclasses.dataclass(frozen=True)
class _Setup:
  """What every stage's trace shares, fixed before tracing (see
  `pipeline_loss_and_grad` for the fields; act_shape is one replica's)."""

  fns: StageFns
  program: lower_lib.Program
  manual: tuple[str, ...]
  act_shape: tuple[int, ...]
  act_dtype: Any
  loss_scale: float
  act_spec: P
  message_spec: P
  chunk_layers: tuple[int, ...] | None
  chunk_first: tuple[int, ...] | None
  mesh: Mesh
  edge_specs: Any
  edge_grads: str
  offload_stash: bool
  observations: bool

  def pin(self, x):
    return jax.lax.with_sharding_constraint(x, self.act_spec)

  def pin_message(self, x):
    return jax.lax.with_sharding_constraint(x, self.message_spec)

  def pin_buffer(self, x):
    return jax.lax.with_sharding_constraint(x, P(None, *self.message_spec))

  @property
  def row_major_dots(self) -> bool:
    """Whether the backward's matmuls take cpu_dots' layout: on XLA:CPU."""
    return self.mesh.devices.flat[0].platform == 'cpu'


def _device_tables(program: lower_lib.Program) -> dict[str, jax.Array]:
  """The program's per-tick tables as the scan's xs ([ticks, stages] each).

  A write the table marks as "nothing arrives" (-1) goes to the index just
  past the message pool and is dropped (`mode='drop'`), so arrivals need no
  branch and no spare slot (one message less than writing into a spare).
  """
  n_msg = program.slots['msg']
  dropped = lambda table: jnp.asarray(np.where(table < 0, n_msg, table), jnp.int32)  # noqa: E731
  tables = {
    name: jnp.asarray(np.maximum(program.table[name], 0), jnp.int32)
    for name in ('kind', 'mb', 'chunk', 'local', 'src', 'loss', 'stash', 'cut')
  }
  tables.update({f'recv{o}': dropped(program.recv[o]) for o in program.offsets})
  if program.fused:
    tables['lane2'] = {
      name: jnp.asarray(np.maximum(program.lane2[name], 0), jnp.int32) for name in lower_lib.LANE2
    }
    tables['fused'] = jnp.asarray(program.lane2['mb'] >= 0, jnp.int32)
    tables.update({f'recv2_{o}': dropped(program.recv2[o]) for o in program.recv2})
  if program.packed:
    # The slot each output for another stage waits in, the slot each send
    # reads (per offset; -1 sends slot 0, which nobody keeps), and whether
    # any stage sends over the offset in the tick (the same on every device).
    tables['pend'] = dropped(program.table['pend'])
    for o, box in program.outbox.items():
      tables[f'out{o}'] = jnp.asarray(np.maximum(box, 0), jnp.int32)
      anyone = np.broadcast_to((box >= 0).any(axis=1, keepdims=True), box.shape)
      tables[f'send{o}'] = jnp.asarray(anyone, jnp.int32)
  if program.partner is not None:
    tables['move_send'] = jnp.asarray(np.maximum(program.table['move_send'], 0), jnp.int32)
    tables['move_recv'] = jnp.asarray(program.table['move_recv'], jnp.int32)
    # Whether any stage moves a set in the tick: the same on every device.
    anyone = (program.table['move_send'] >= 0).any(axis=1, keepdims=True)
    tables['any_move'] = jnp.asarray(
      np.broadcast_to(anyone, program.table['move_send'].shape), jnp.int32
    )
  return tables


def branch_counts(program: lower_lib.Program, edge_grads_after: bool) -> list[dict[str, int]]:
  """Per pipe stage, how many times each marked branch of the step's conds
  runs in one step (the MARK_* paths hlo_work.work's branch_counts takes;
  every replica of a stage over the other axes runs the same).

  `edge_grads_after`: whether the edges' gradients are made after the loop
  (the traced step's `PipelineStep.edge_grads == 'after'`), where a stage's
  padded rows skip theirs.

  Read from the tables as `tick` reads them: an F runs where kind is RUN_F
  and the tick is not fused, the fused branch where `mb2` is set, a move in
  every tick where any stage moves (and lands where its own table says), a
  send over an offset in every tick where any stage sends over it.
  """
  t = program.table
  p, last = program.schedule.stages, program.schedule.num_chunks - 1
  fused = program.lane2['mb'] >= 0 if program.fused else np.zeros_like(t['kind'], bool)
  f = (t['kind'] == lower_lib.RUN_F) & ~fused
  b = t['kind'] == lower_lib.RUN_B
  sums = {
    MARK_F: f,
    f'{MARK_F}/{MARK_EMBED}': f & (t['chunk'] == 0),
    f'{MARK_F}/{MARK_HEAD}': f & (t['chunk'] == last),
    MARK_B: b,
    f'{MARK_B}/{MARK_EMBED_GRAD}': b & (t['chunk'] == 0),
    MARK_W: t['kind'] == lower_lib.RUN_W,
  }
  if program.fused:
    sums.update(
      {
        MARK_FUSED: fused,
        f'{MARK_FUSED}/{MARK_EMBED}': fused & (t['chunk'] == 0),
        f'{MARK_FUSED}/{MARK_HEAD}': fused & (t['chunk'] == last),
        f'{MARK_FUSED}/{MARK_EMBED_GRAD}': fused & (program.lane2['chunk'] == 0),
      }
    )
  if program.partner is not None:
    moving = (t['move_send'] >= 0).any(axis=1, keepdims=True)
    sums[MARK_MOVE] = np.broadcast_to(moving, t['move_send'].shape)
    sums[f'{MARK_MOVE}/{MARK_LAND}'] = moving & (t['move_recv'] >= 0)
  if program.packed:
    for o, box in program.outbox.items():
      sums[send_marker(o)] = np.broadcast_to((box >= 0).any(axis=1, keepdims=True), box.shape)
  counts = [{k: int(v[:, s].sum()) for k, v in sums.items()} for s in range(p)]
  if edge_grads_after:
    m = program.schedule.microbatches
    rows = edge_rows(m, p)
    for s in range(p):
      counts[s][MARK_EDGE_ROW] = sum(1 for j in range(rows) if s * rows + j < m)
  return counts


class _Residuals:
  """Which leaves of a chunk's vjp are stashed, and the split of its backward.

  Learnt from one probe trace of a chunk's vjp: residual leaves that are the
  chunk's own weights (forwarded by JAX, not copies) are not stashed but
  re-sliced from the parameters at the backward; the rest are stash slots'
  shapes. The probe's values are unused (XLA drops them).
  """

  def __init__(self, vjp_fn, chunk_params, y, pin, row_major_dots: bool):
    leaves, self._treedef = jax.tree.flatten(vjp_fn)
    weights = jax.tree.leaves(chunk_params)
    self._weight_of = [
      next((j for j, w in enumerate(weights) if w is leaf), None) for leaf in leaves
    ]
    self.stash_shapes = [leaf for leaf, j in zip(leaves, self._weight_of) if j is None]
    self.split = SplitBackward(
      lambda res, g: jax.tree.unflatten(self._treedef, res)(g), leaves, pin(y), row_major_dots
    )
    self.cut_shapes, self.cut_tree = jax.tree.flatten(self.split.cut_shapes)
    self.stash_bytes = sum(s.size * s.dtype.itemsize for s in self.stash_shapes)
    self.cut_bytes = sum(s.size * s.dtype.itemsize for s in self.cut_shapes)

  def stashed(self, vjp_fn, chunk_params) -> list:
    """The leaves of `vjp_fn` to stash."""
    leaves, weights = jax.tree.leaves(vjp_fn), jax.tree.leaves(chunk_params)
    # The probe's structure must hold for this trace too, or the stash would
    # silently pair residuals with the wrong slots.
    if len(leaves) != len(self._weight_of) or any(
      j is not None and leaf is not weights[j] for leaf, j in zip(leaves, self._weight_of)
    ):
      raise AssertionError('chunk vjp residuals differ from the probe trace')
    return [leaf for leaf, j in zip(leaves, self._weight_of) if j is None]

  def joined(self, stashed, chunk_params) -> list:
    """All residual leaves again: the stashed ones and the chunk's weights."""
    weights, stashed = jax.tree.leaves(chunk_params), iter(stashed)
    return [next(stashed) if j is None else weights[j] for j in self._weight_of]


class _HostStash:
  """Which stashed leaves live in host memory (offload_stash), and their pool.

  The host pool has a slot more than the lowering's, which every tick
  without an F writes (`_Stage.spill`). Leaves with fewer than two
  dimensions over one stay in the device pool: XLA:TPU's host copies do not
  update a slot that falls inside a tile (scalars, vectors; a few bytes).
  """

  def __init__(self, shapes, offload: bool):
    host = [offload and sum(d > 1 for d in a.shape) >= 2 for a in shapes]
    self.host = [i for i, h in enumerate(host) if h]
    self.kept = [i for i, h in enumerate(host) if not h]
    self.host_shapes = [shapes[i] for i in self.host]
    self.kept_shapes = [shapes[i] for i in self.kept]

  def split(self, leaves) -> tuple[list, list]:
    """A set's leaves: (those kept on the device, those sent to the host)."""
    return [leaves[i] for i in self.kept], [leaves[i] for i in self.host]

  def joined(self, kept, host) -> list:
    leaves = [None] * (len(kept) + len(host))
    for i, leaf in zip(self.kept + self.host, list(kept) + list(host)):
      leaves[i] = leaf
    return leaves

  def pool(self, slots: int, manual) -> list:
    # Broadcast from one host slot, so that XLA:TPU allocates the pool on the
    # host; zeros made whole on the device would be held there, then copied out.
    pool = []
    for a in self.host_shapes:
      one = jax.device_put(_varying(jnp.zeros((1,) + a.shape, a.dtype), manual), HOST)
      pool.append(jnp.broadcast_to(one, (slots,) + a.shape))
    return pool

  def zeros(self) -> list:
    return [jnp.zeros(a.shape, a.dtype) for a in self.host_shapes]

  def write(self, pool: list, values: list, slot) -> list:
    return [
      jax.lax.dynamic_update_index_in_dim(p, jax.device_put(v.astype(p.dtype), HOST), slot, 0)
      for p, v in zip(pool, values)
    ]

  def read(self, pool: list, slot) -> list:
    return [jax.device_put(p[slot], DEVICE) for p in pool]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carry:
  """What one device's tick loop carries. A field the run's options leave out
  is None (no leaves): `heads` and `embeds` only when the edges' gradients
  are made after the loop (`g_edges` then holds the head's vectors' alone,
  `_split_by_rank`, until `edge_gradients` adds the rest), `host_stash`
  only with an offloaded stash, `spill` only inside a tick, from its F to
  `spill`."""

  msg: Any  # [slots, act]: activations and gradients between stages
  stash: list  # per kept residual leaf, [slots, ...]
  cut: list  # per cut leaf, [slots, ...]: B's hand-over to W
  g_stage: Any  # the stage's layers' gradients
  loss: Any  # the summed loss
  figures: Any  # the chunks' (summed, maximum) figures
  heads: Any = None  # [rows, act]: the last chunk's outputs
  embeds: Any = None  # [rows, act]: the first chunk's input gradients
  g_edges: Any = None  # the embedding's and head's gradients
  host_stash: Any = None  # the offloaded stash pool
  spill: Any = None  # the F's set on its way to host memory


class _Stage:
  """One device's trace of the tick loop: its carry and what each kind does.

  Built inside the shard_map, so `stage_params` and the batch are this
  device's (and this replica's) shares.
  """

  def __init__(self, setup: _Setup, stage_params, edges, inputs, targets, doc_ids):
    self.setup, self.fns = setup, setup.fns
    self.inputs, self.targets, self.doc_ids = inputs, targets, doc_ids
    manual = setup.manual
    local = jax.tree.map(lambda a: a[0], stage_params)  # [v, layers_per_chunk, ...]
    # Replicated weights become per-device values here, outside any branch
    # and the scan: a vjp inside a branch w.r.t. a pipe-invariant value would
    # transpose into a psum over `pipe` that only some stages reach (a
    # deadlock), and one w.r.t. a data-invariant value into a psum over
    # `data` in every backward. Cast here, they transpose into one psum each,
    # after the scan.
    self.local = _varying(local, manual)
    self.edges = _varying(edges, manual)
    self.stage = jax.lax.axis_index('pipe')
    self.x_zero = setup.pin(_varying(jnp.zeros(setup.act_shape, setup.act_dtype), manual))
    self.counts = None if setup.chunk_layers is None else jnp.asarray(setup.chunk_layers, jnp.int32)
    self.firsts = None if setup.chunk_first is None else jnp.asarray(setup.chunk_first, jnp.int32)
    # Trace one chunk's vjp to learn the residual structure and to split its
    # backward program into B and W. The chunk index is traced as in the real
    # forward, so an uneven split's layer count is a residual in both.
    probe_params = _take(self.local, 0)
    y_probe, vjp_probe, figures = self.chunk_vjp(
      probe_params, self.x_zero, self.stage, self.segments(0)
    )
    self.no_figures = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), figures)
    self.residuals = _Residuals(
      vjp_probe, probe_params, y_probe.astype(setup.act_dtype), setup.pin, setup.row_major_dots
    )
    self.y_like = jax.ShapeDtypeStruct(y_probe.shape, y_probe.dtype)
    self.after = self._edge_grads_after_loop()
    self.host_stash = _HostStash(self.residuals.stash_shapes, setup.offload_stash)
    # Per leaf of the stage's params, whether its gradient is an observation (a max).
    self.maxed = [False] * len(jax.tree.leaves(local))
    if setup.observations:
      weights = len(jax.tree.leaves(local[0]))
      self.maxed = [i >= weights for i in range(len(self.maxed))]

  def _edge_grads_after_loop(self) -> bool:
    s = self.setup
    specs = s.edge_specs or jax.tree.map(lambda _: P(), self.edges)
    # The accumulator is like the edges: their bytes, as each device holds them.
    edge_bytes = sharding.per_device_bytes(
      self.edges, jax.tree.map(lambda spec: NamedSharding(s.mesh, spec), specs)
    )
    act = jax.ShapeDtypeStruct(s.act_shape, s.act_dtype)
    act_bytes = sharding.per_device_bytes(act, NamedSharding(s.mesh, s.message_spec))
    m = self.inputs.shape[0]
    return edge_grads_after_loop(s.edge_grads, m, s.program.schedule.stages, act_bytes, edge_bytes)

  @property
  def rows(self) -> int:
    """Micro-batches whose edge gradients each stage makes after the loop."""
    return edge_rows(self.inputs.shape[0], self.setup.program.schedule.stages)

  def segments(self, mb):
    return None if self.doc_ids is None else self.doc_ids[mb]

  def chunk_vjp(self, chunk_params, x, chunk, seg):
    # A micro-batch's document ids enter the forward only: what the backward
    # needs of them (the mask) is among the vjp's residuals.
    extra = {} if seg is None else {'segments': seg}
    if self.firsts is not None:
      extra['first'] = self.firsts[chunk]
    if self.counts is None:
      run = lambda cp, h: self.fns.chunk(cp, h, **extra)  # noqa: E731
    else:
      run = lambda cp, h: self.fns.chunk(cp, h, self.counts[chunk], **extra)  # noqa: E731
    return jax.vjp(run, chunk_params, x, has_aux=True)

  def initial_carry(self) -> Carry:
    s, manual, program = self.setup, self.setup.manual, self.setup.program
    pool = lambda n, shapes: _varying([jnp.zeros((n,) + a.shape, a.dtype) for a in shapes], manual)  # noqa: E731
    msg = jnp.zeros((program.slots['msg'],) + s.act_shape, s.act_dtype)
    terms = s.fns.loss_terms
    extra = {}
    if self.after:
      # One row per micro-batch (padded to a multiple of the stages): the
      # last chunk's output and the first chunk's input gradient, kept for
      # `edge_gradients`, split over `tensor` as messages are.
      rows = self.rows * program.schedule.stages
      for name, like in (('heads', self.y_like), ('embeds', self.x_zero)):
        extra[name] = s.pin_buffer(_varying(jnp.zeros((rows,) + like.shape, like.dtype), manual))
      extra['g_edges'] = _zeros_like_varying(_split_by_rank(self.edges, False), manual)
    else:
      extra['g_edges'] = _zeros_like_varying(self.edges, manual)
    if self.host_stash.host:
      extra['host_stash'] = self.host_stash.pool(program.slots['stash'] + 1, manual)
    carry = Carry(
      msg=s.pin_buffer(_varying(msg, manual)),
      stash=pool(program.slots['stash'], self.host_stash.kept_shapes),
      cut=pool(program.slots['cut'], self.residuals.cut_shapes),
      g_stage=_zeros_like_varying(self.local, manual),
      loss=_varying(jnp.zeros(() if terms == 1 else (terms,), jnp.float32), manual),
      figures=_varying(self.no_figures, manual),
      **extra,
    )
    return jax.lax.optimization_barrier(carry)

  def tick(self, c, rows):
    row = jax.tree.map(lambda table: table[self.stage], rows)
    c, outs = self.compute(c, row)
    if not self.setup.program.packed:
      return self.send(c, row, outs), None
    c = self.hold(c, row, self.setup.pin_message(outs['recv']))
    return self.land(c, row, self.send_pending(c, row)), None

  def compute(self, c, row):
    """One tick's work on this device, without its sends: (carry, the
    outputs to send)."""
    if 'any_move' in row:
      c = jax.lax.cond(row['any_move'] > 0, self.move, lambda c, row: c, c, row)
    # One cond per kind rather than one switch over all four: a switch whose
    # branches write (F) and read (B, W) the stash made XLA copy the whole
    # pool (tests/test_pipeline_memory.py bounds the temporaries).
    kind = row['kind']
    offload = bool(self.host_stash.host)
    if offload:
      # This tick's B or W reads its set (an F tick's read goes unused), and
      # an F's set is written out after it; top-level copies, see the module.
      row = dict(row, fetched=self.host_stash.read(c.host_stash, row['stash']))
      c = dataclasses.replace(c, spill=_varying(self.host_stash.zeros(), self.setup.manual))
    runs_f = kind == lower_lib.RUN_F
    if 'fused' in row:
      fused = row['fused'] > 0
      runs_f = runs_f & ~fused
    c, y = jax.lax.cond(runs_f, self.forward, self.idle, c, row)
    if offload:
      c = self.spill(c, row)
    c, dx = jax.lax.cond(kind == lower_lib.RUN_B, self.backward, self.idle, c, row)
    c, _ = jax.lax.cond(kind == lower_lib.RUN_W, self.weight, self.idle, c, row)
    outs = {'recv': jnp.where(kind == lower_lib.RUN_F, y, dx)}
    if 'fused' in row:
      c, (y, outs['recv2_'], kept) = jax.lax.cond(fused, self.overlapped, self.idle_fused, c, row)
      outs['recv'] = jnp.where(fused, y, outs['recv'])
      # The fused F's set is written here, not in the branch that reads the
      # B's: a branch that reads and writes the pool made XLA copy it whole
      # (seen in scripts/bench_moe.py's DualPipeV at pipe 4).
      # A tick without one writes past the pool, which drops it.
      slot = jnp.where(fused, row['stash'], self.setup.program.slots['stash'])
      c = dataclasses.replace(
        c, stash=[b.at[slot].set(v.astype(b.dtype), mode='drop') for b, v in zip(c.stash, kept)]
      )
    return c, outs

  def hold(self, c, row, out):
    """A packed tick's output: for another stage, into a slot of its own
    stage's pool (`pend`) to wait for the send that carries it; for a chunk
    of this stage, where that chunk reads it."""
    msg = c.msg.at[row['pend']].set(out, mode='drop')
    if 0 in self.setup.program.recv:
      msg = msg.at[row['recv0']].set(out, mode='drop')
    return dataclasses.replace(c, msg=msg)

  def send_pending(self, c, row) -> list:
    """A packed round's send, after its last tick: per stage offset its
    messages use, the waiting outputs (`outbox`; a stage with none sends a
    slot nobody keeps) to the stages it names, under a cond every device
    takes alike (the `send{o}` table: whether any stage sends over o at
    this tick); zeros elsewhere."""
    program = self.setup.program
    p = program.schedule.stages
    out = []
    for o in sorted(program.outbox):
      pairs = [(i, (i + o) % p) for i in range(p)]

      def sending(msg, o=o, pairs=pairs):
        with jax.named_scope(send_marker(o)):
          return jax.lax.ppermute(msg[row[f'out{o}']], 'pipe', pairs)

      out.append(
        jax.lax.cond(row[f'send{o}'] > 0, sending, lambda msg: jnp.zeros_like(msg[0]), c.msg)
      )
    return out

  def land(self, c, row, arrived):
    """What a round's send brought, where the receivers' tables name."""
    msg = c.msg
    for o, x in zip(sorted(self.setup.program.outbox), arrived):
      msg = msg.at[row[f'recv{o}']].set(x, mode='drop')
    return dataclasses.replace(c, msg=msg)

  def spill(self, c, row):
    """Writes the tick's F's set (c.spill) to its host slot; a tick without
    an F writes its zeros to the spare slot past the lowering's."""
    spare = self.setup.program.slots['stash']
    slot = jnp.where(row['kind'] == lower_lib.RUN_F, row['stash'], spare)
    host_stash = self.host_stash.write(c.host_stash, c.spill, slot)
    return dataclasses.replace(c, host_stash=host_stash, spill=None)

  def send(self, c, row, outs: dict):
    """The tick's outputs to the stages that read them, into their message slots.

    `outs`: receive-table prefix -> output: 'recv' for the tick's F or B,
    'recv2_' for a fused tick's B. Outputs that travel the same offset go
    in one ppermute.
    """
    program, msg = self.setup.program, c.msg
    p = program.schedule.stages
    # Scatter: each tensor rank keeps (and sends) its 1/t of the output; the
    # reader's pin() all-gathers it.
    outs = {k: self.setup.pin_message(v) for k, v in outs.items()}
    tables = {'recv': program.recv, 'recv2_': program.recv2}
    for o in sorted({o for x in outs for o in tables[x]}):
      lanes = [x for x in outs if o in tables[x]]
      out = [outs[x] for x in lanes]
      if o:
        out = jax.lax.ppermute(out, 'pipe', [(i, (i + o) % p) for i in range(p)])
      for x, arrived in zip(lanes, out):
        msg = msg.at[row[f'{x}{o}']].set(arrived, mode='drop')
    return dataclasses.replace(c, msg=msg)

  def idle(self, c, row):
    return c, self.x_zero

  def idle_fused(self, c, row):
    nothing = [jnp.zeros(a.shape, a.dtype) for a in self.host_stash.kept_shapes]
    return c, (self.x_zero, self.x_zero, _varying(nothing, self.setup.manual))

  def overlapped(self, c, row):
    """A fused tick: one micro-batch's B and W, then another's F, in one
    computation (so that XLA may run one's collectives under the other's
    compute). The B's cut goes straight to its W, through no slot; the F's
    residual set is returned for `tick` to stash."""
    with jax.named_scope(MARK_FUSED):
      return self._overlapped(c, row)

  def _overlapped(self, c, row):
    lane2 = dict(row, **row['lane2'])
    c, dx, cut = self.input_gradient(c, lane2)
    g_stage = self.residuals.split.w(
      self.stashed_residuals(c, lane2), cut, (c.g_stage, lane2['local']), self.maxed
    )
    c, y, kept = self.forward_unstashed(dataclasses.replace(c, g_stage=g_stage), row)
    return c, (y, dx, kept)

  def forward(self, c, row):
    with jax.named_scope(MARK_F):
      c, y, kept = self.forward_unstashed(c, row)
      return dataclasses.replace(c, stash=_put(c.stash, row['stash'], kept)), y

  def forward_unstashed(self, c, row):
    """F, but its residual set (the leaves kept on the device) is returned
    instead of stashed."""
    pin, mb, chunk = self.setup.pin, row['mb'], row['chunk']
    chunk_params = _take(self.local, row['local'])

    def embed():
      with jax.named_scope(MARK_EMBED):
        x = self.fns.embed(self.edges, self.inputs[mb], self.segments(mb))
        return pin(x.astype(self.setup.act_dtype))

    x = jax.lax.cond(chunk == 0, embed, lambda: pin(c.msg[row['src']]))
    y, vjp_fn, (shares, maxima) = self.chunk_vjp(chunk_params, x, chunk, self.segments(mb))
    kept, host = self.host_stash.split(self.residuals.stashed(vjp_fn, chunk_params))
    if host:
      c = dataclasses.replace(c, spill=_varying(host, self.setup.manual))  # written out by `spill`
    summed, top = c.figures
    figures = (jax.tree.map(jnp.add, summed, shares), jax.tree.map(jnp.maximum, top, maxima))
    c = dataclasses.replace(c, figures=figures)
    last = self.setup.program.schedule.num_chunks - 1
    c = jax.lax.cond(chunk == last, lambda c: self.loss_and_seed(c, row, y), lambda c: c, c)
    return c, pin(y.astype(self.setup.act_dtype)), kept

  def unhoisted_edges(self, mb):
    """The edges times a one XLA cannot fold (it depends on the micro-batch).

    Otherwise XLA hoists the head's bf16 cast of its table out of the loop
    around the head and holds it for the whole loop (0.5 GiB at 128k x
    2048) rather than while the head runs. The product fuses into the cast,
    and its gradient into the accumulation.
    """
    one = (mb >= 0).astype(jnp.float32)
    return jax.tree.map(lambda a: a * one.astype(a.dtype), self.edges)

  def loss_and_seed(self, c, row, y):
    """The last chunk's loss, its edges' gradient (or its output, kept for
    `edge_gradients`) and the B's seed gradient."""
    with jax.named_scope(MARK_HEAD):
      return self._loss_and_seed(c, row, y)

  def _loss_and_seed(self, c, row, y):
    mb, s = row['mb'], self.setup
    loss, g_edges, dy = self.head_loss_and_grad(
      self.unhoisted_edges(mb), y, self.targets[mb], c.g_edges, input_grad=True
    )
    kept = dict(heads=c.heads.at[mb].set(s.pin_message(y))) if self.after else {}
    return dataclasses.replace(
      c,
      **kept,
      g_edges=g_edges,
      loss=c.loss + loss,
      msg=c.msg.at[row['loss']].set(s.pin_message(dy.astype(s.act_dtype))),
    )

  def head_loss_and_grad(self, edges, y, targets, acc, input_grad: bool):
    """The model's head_loss_and_grad at the setup's loss scale; on CPU its
    weight gradient is a dot cpu_dots lays out."""
    s = self.setup

    def head(edges, y, targets, acc):
      return s.fns.head_loss_and_grad(edges, y, targets, acc, s.loss_scale, input_grad=input_grad)

    if s.row_major_dots:
      return row_major_call(head, edges, y, targets, acc)
    return head(edges, y, targets, acc)

  def stashed_residuals(self, c, row):
    kept = [s[row['stash']] for s in c.stash]
    stashed = self.host_stash.joined(kept, row.get('fetched', []))
    return self.residuals.joined(stashed, _take(self.local, row['local']))

  def backward(self, c, row):
    with jax.named_scope(MARK_B):
      c, dx, cut = self.input_gradient(c, row)
      return dataclasses.replace(c, cut=_put(c.cut, row['cut'], jax.tree.leaves(cut))), dx

  def input_gradient(self, c, row):
    """B: the input gradient (and, on chunk 0, the embedding's part) and the cut."""
    pin, mb, act_dtype = self.setup.pin, row['mb'], self.setup.act_dtype
    dx, cut = self.residuals.split.b(self.stashed_residuals(c, row), pin(c.msg[row['src']]))

    def embed_backward(c):
      with jax.named_scope(MARK_EMBED_GRAD):
        if self.after:
          embeds = c.embeds.at[mb].set(self.setup.pin_message(dx.astype(act_dtype)))
          return dataclasses.replace(c, embeds=embeds)
        return dataclasses.replace(c, g_edges=self.embed_gradient(c.g_edges, mb, dx))

    c = jax.lax.cond(row['chunk'] == 0, embed_backward, lambda c: c, c)
    return c, pin(dx.astype(act_dtype)), cut

  def embed_gradient(self, acc, mb, dx):
    """acc + the embedding's gradient for micro-batch mb's input gradient dx."""
    act_dtype = self.setup.act_dtype
    _, embed_vjp = jax.vjp(
      lambda e: self.fns.embed(e, self.inputs[mb], self.segments(mb)).astype(act_dtype), self.edges
    )
    (g_edges,) = embed_vjp(dx.astype(act_dtype))
    return jax.tree.map(jnp.add, acc, g_edges)

  def edge_gradients(self, c):
    """The edges' weight gradients, after the tick loop, from its two pools.

    A reduce-scatter over `pipe` hands each stage `rows` of the pools'
    micro-batches (only the stages that ran the first and the last chunk
    wrote theirs; the others' rows are zeros), and each stage makes their
    head and embedding gradients, one micro-batch at a time. The head runs
    its forward again, and its weight gradient is made here rather than on
    the last stage in the loop: that stage's ticks lose a third of the
    head's work, and the stages share the rest (the balance Yeung et al.'s
    vocabulary parallelism, 2024, gets by splitting the vocabulary's rows;
    here by micro-batches, which leaves the model's head as it is).
    """
    s, rows, m = self.setup, self.rows, self.inputs.shape[0]
    pools = [_scatter_rows(pool, s.mesh) for pool in (c.heads, c.embeds)]

    def one(acc, j):
      mb = self.stage * rows + j

      def add(acc):
        with jax.named_scope(MARK_EDGE_ROW):
          y, dx = (s.pin(pool[j]) for pool in pools)
          edges = self.unhoisted_edges(mb)
          matrices = _split_by_rank(acc, True)
          _, matrices, _ = self.head_loss_and_grad(
            edges, y, self.targets[mb], matrices, input_grad=False
          )
          acc = _overlay(acc, matrices)
          return self.embed_gradient(acc, mb, dx)

      # Rows past the last micro-batch pad the pools to a multiple of the stages.
      padded = rows * s.program.schedule.stages > m
      return (jax.lax.cond(mb < m, add, lambda a: a, acc) if padded else add(acc)), None

    g_edges, _ = jax.lax.scan(one, _zeros_like_varying(self.edges, s.manual), jnp.arange(rows))
    g_edges = _overlay(g_edges, c.g_edges, add=True)  # the head's vectors', made in the loop
    return dataclasses.replace(c, heads=None, embeds=None, g_edges=g_edges)

  def weight(self, c, row):
    with jax.named_scope(MARK_W):
      return self._weight(c, row)

  def _weight(self, c, row):
    cut = jax.tree.unflatten(self.residuals.cut_tree, [s[row['cut']] for s in c.cut])
    # Added into the stage's gradients as W makes them (layer by layer in
    # its scan): the chunk's gradients never exist on their own beside them.
    g_stage = self.residuals.split.w(
      self.stashed_residuals(c, row), cut, (c.g_stage, row['local']), self.maxed
    )
    if self.setup.program.slots['cut'] == 1:
      # The one-slot pool handed back through W, ordered after it: XLA:TPU
      # otherwise keeps a copy of the set for the loop's carry beside the one
      # W reads. Not for a pool of several slots, whose W reads a slice:
      # there it made XLA:TPU's zb_h1 step larger.
      g_stage, pool = jax.lax.optimization_barrier((g_stage, c.cut))
      c = dataclasses.replace(c, cut=pool)
    return dataclasses.replace(c, g_stage=g_stage), self.x_zero

  def move(self, c, row):
    """The partner ppermute: sends a residual set and lands the one arriving.

    Entered only in ticks where some stage moves a set, under a predicate
    every device evaluates alike, so all of them enter the branch and its
    ppermute together (a stage with nothing to move sends a slot it does
    not need and the receiver keeps nothing). A predicate that differed
    between devices made XLA:CPU mix this ppermute's
    rendezvous up with the tick's others (NaN gradients, or a check
    failure counting 5 participants of 4).

    It opens the tick, before F, B and W, so the slice it sends is the
    step's only read of the stash before a write, and that write depends
    on it. Run after B and W, whose reads nothing orders before a later
    write, landing in the same step made XLA copy the whole pool, and
    landing in the next step kept a landing set between steps.
    """
    with jax.named_scope(MARK_MOVE):
      partner = self.setup.program.partner
      pairs = [(s, q) for s, q in enumerate(partner) if s != q]
      arrived = jax.lax.ppermute([s[row['move_send']] for s in c.stash], 'pipe', pairs)

      def land(c):
        with jax.named_scope(MARK_LAND):
          return dataclasses.replace(c, stash=_put(c.stash, row['move_recv'], arrived))

      return jax.lax.cond(row['move_recv'] >= 0, land, lambda c: c, c)


def _reduce_over_replicas(c, manual, mesh: Mesh, edge_specs, observations: bool):
  """The step's only reductions: over every manual axis for the loss and the
  replicated embedding/head, over `data` for the stage's own layers (a max
  for their `observations`)."""
  replicas = manual[1:]
  loss = jax.lax.psum(c.loss, manual)
  sizes = dict(mesh.shape)
  leaves, tree = jax.tree.flatten(c.g_edges)
  # The reduce-scatter and all-gather are for XLA:TPU (see `_all_reduce`);
  # elsewhere one psum each.
  on_tpu = mesh.devices.flat[0].platform == 'tpu'
  specs = (
    jax.tree.leaves(edge_specs, is_leaf=lambda x: isinstance(x, P))
    if on_tpu and edge_specs is not None
    else [None] * len(leaves)
  )
  g_edges = tree.unflatten(
    [_all_reduce(g, manual, sizes, spec) for g, spec in zip(leaves, specs, strict=True)]
  )
  g_stage = c.g_stage
  if replicas and math.prod(sizes[a] for a in manual) == 1:
    g_stage = jax.tree.map(lambda g: _invariant(g, replicas), g_stage)
  elif replicas and observations:
    g_stage = (jax.lax.psum(g_stage[0], replicas), jax.lax.pmax(g_stage[1], replicas))
  elif replicas:
    g_stage = jax.lax.psum(g_stage, replicas)
  g_stage = jax.tree.map(lambda g: g[None], g_stage)
  shares, maxima = c.figures
  figures = (jax.lax.psum(shares, manual), jax.lax.pmax(maxima, manual))
  return (loss, figures), (g_stage, g_edges)


class PipelineStep:
  """The shard_mapped pipeline function, with facts learnt when it is traced.

  `residual_bytes`: bytes of one stash slot (one micro-batch's residuals of
  one chunk, global shape), known once the function has been traced; BPipe's
  bytes moved per step are this times `schedule.transfers_per_step`.
  """

  def __init__(self, fn, info: dict):
    self._fn, self._info = fn, info

  def __call__(self, *args):
    return self._fn(*args)

  @property
  def residual_bytes(self) -> int | None:
    return self._info.get('residual_bytes')

  @property
  def cut_bytes(self) -> int | None:
    """Bytes of one cut slot (what a B hands its W), once traced."""
    return self._info.get('cut_bytes')

  @property
  def edge_grads(self) -> str | None:
    """Where the edges' weight gradients are made ('loop' or 'after' the
    tick loop: what pipeline.edge_grads, 'auto' included, came to), once traced."""
    after = self._info.get('edge_grads_after_loop')
    return None if after is None else ('after' if after else 'loop')
