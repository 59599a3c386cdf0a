"""Runs a lowered pipeline schedule as one SPMD program.

`shard_map` is manual over `pipe`, and over `data` when the trainer asks
(`data_axis`); `tensor` stays automatic (GSPMD) inside each stage. A
`lax.scan` walks the schedule's ticks. In each tick every device reads its
own row of the schedule table and:

  phase 0  forward of (micro-batch, chunk) under `lax.cond`, so idle slots
           execute nothing. `jax.vjp` gives the chunk's output and a
           residual pytree; its array leaves go into a slot of the stash.
           On the last chunk the loss and its gradient are computed at once
           (so the head's residuals are never stashed).
  phase 1  backward: the residuals are read back from their slot, unflattened
           into the vjp function and applied to the arriving gradient; the
           weight gradient is accumulated, the input gradient sent on.
           Zero-bubble schedules split it: B keeps only the input gradient
           (XLA drops the unused weight-gradient matmuls), and
  phase 2  W re-applies the same residuals and output gradient later and
           keeps only the weight gradient.
  phase 3  `ppermute` moves activations to stage s+1 and gradients to stage
           s-1 (cyclically, which is how interleaved schedules hand chunk
           outputs from the last device back to the first); arrivals are
           written into the buffer slot the schedule assigned. BPipe's
           evictions and loads move whole residual sets between partner
           stages (s <-> p-1-s) in the same phase, into the shared stash pool.

Stash, activation and gradient buffers have as many slots as the schedule's
lowering says, so activation memory is bounded by the schedule, not by the
number of micro-batches. Residual leaves that are the chunk's own weights
(forwarded by JAX, not copies) are not stashed: they are re-sliced from the
parameters at the backward.

Data parallelism: with `data` manual, each replica's weight gradients
accumulate unreduced over the step's micro-batches and are summed over
`data` once, after the scan (the papers' and Megatron's one all-reduce per
step). Left automatic, GSPMD would all-reduce every micro-batch's
contribution inside its backward, m times per step: the accumulator is
replicated over `data`, so each addition to it must be.

The executor does not import the model: it receives the three functions it
places (`StageFns`) and the lowered `Program`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from triax.pipeline import schedule as sched

Params = Any


@dataclasses.dataclass(frozen=True)
class StageFns:
  """What the executor places on stages.

  embed(embed_params, tokens[mb, s]) -> x[mb, s, d]       first chunk's input
  chunk(chunk_params, x[, num_layers]) -> y                one chunk's layers (the
      first num_layers of its padded stack, when the split is uneven)
  head_loss(head_params, y, targets[mb, s]) -> scalar     summed token loss
  """
  embed: Callable[[Params, jax.Array], jax.Array]
  chunk: Callable[[Params, jax.Array], jax.Array]
  head_loss: Callable[[Params, jax.Array, jax.Array], jax.Array]


def _varying(tree, axes=('pipe',)):
  """Marks values as varying over the manual `axes` (each device holds its
  own): fresh carries, and weights whose gradients must stay per device."""
  def cast(a):
    aval = jax.typeof(a)
    # jax 0.10 names the varying axes `manual_axis_type.varying`, older ones `vma`.
    varying = getattr(aval, 'vma', None)
    if varying is None:
      varying = aval.manual_axis_type.varying
    missing = tuple(x for x in axes if x not in varying)
    if not missing:
      return a
    return jax.lax.pcast(a, missing, to='varying')
  return jax.tree.map(cast, tree)


def _zeros_like_varying(tree, axes=('pipe',)):
  return _varying(jax.tree.map(jnp.zeros_like, tree), axes)


def _take(tree, index):
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False), tree)


def _put(buffers, index, values):
  return [b.at[index].set(v) for b, v in zip(buffers, values)]


def pipeline_loss_and_grad(fns: StageFns, program: 'sched.Program', mesh: Mesh,
                           act_shape: tuple[int, ...], act_dtype: Any, loss_scale: float,
                           act_spec: P = P(), chunk_layers: tuple[int, ...] | None = None,
                           compute_idle: bool = False, data_axis: str | None = None):
  """Builds f(stage_params, embed_params, head_params, inputs, targets).

  Args:
    fns: the functions to place.
    program: the lowered schedule (ticks, slot tables, buffer sizes).
    mesh: the mesh; `pipe` must have `program.schedule.stages` devices.
    act_shape: one micro-batch's activation shape [mb, s, d] (global mb).
    act_dtype: activation dtype.
    loss_scale: multiplies the summed loss (1 / global token count), so that
      gradients are those of the mean loss, as on one device.
    act_spec: how one activation [mb, s, d] is split over the automatic axes
      (e.g. P('data')). Every branch output and buffer is pinned to it: XLA
      requires a conditional's branches to agree on their outputs' sharding.
    chunk_layers: layers of each model chunk when the split is uneven (the
      stacks are padded to the longest); None for an even split.
    compute_idle: an ablation for benchmarks: idle slots run the forward or
      backward on a placeholder row and discard the result, as pipelines
      that differentiate through a scan do (MaxText, praxis). Same numbers,
      more work.
    data_axis: the mesh axis the batch is split over, made manual too so
      that weight gradients are reduced over it once per step; the
      functions in `fns` then see one replica's rows, and act_spec must not
      name it. None: left to GSPMD (reduced per micro-batch).

  Returns:
    f(stage_params, embed_params, head_params, inputs, targets) ->
    (loss, (stage_grads, embed_grads, head_grads)). `stage_params` leaves are
    [pipe, v, layers_per_chunk, ...] sharded over `pipe`; inputs and targets
    are [m, mb, s].
  """
  schedule = program.schedule
  p, v = schedule.stages, schedule.virtual_stages
  last_chunk = p * v - 1
  if mesh.shape['pipe'] != p:
    raise ValueError(f'mesh has pipe={mesh.shape["pipe"]} but the schedule has {p} stages')
  manual = ('pipe',) + ((data_axis,) if data_axis else ())
  if data_axis:
    replicas = mesh.shape[data_axis]
    if act_shape[0] % replicas:
      raise ValueError(f'micro-batch of {act_shape[0]} rows does not split over '
                       f'{data_axis}={replicas}')
    act_shape = (act_shape[0] // replicas,) + tuple(act_shape[1:])
  # One spare slot at the end of each receiving buffer takes writes the table
  # marks as "nothing arrives" (-1), so arrivals need no branch.
  moves = program.partner is not None
  n_act, n_grad = program.num_act_slots + 1, program.num_grad_slots + 1
  n_stash = program.num_stash_slots
  spare = lambda table, n: jnp.asarray(np.where(table < 0, n - 1, table), jnp.int32)
  recv = np.asarray(program.recv)
  tables = dict(
      fwd=jnp.asarray(program.fwd, jnp.int32), bwd=jnp.asarray(program.bwd, jnp.int32),
      recv_act=spare(recv[..., sched.R_ACT], n_act),
      recv_grad=spare(recv[..., sched.R_GRAD], n_grad))
  if program.split_backward:
    tables['wgt'] = jnp.asarray(program.wgt, jnp.int32)
  if moves:
    tables.update(_residual_moves(program))
    partner_pairs = [(s, q) for s, q in enumerate(program.partner) if s != q]
  to_next = [(i, (i + 1) % p) for i in range(p)]
  to_prev = [(i, (i - 1) % p) for i in range(p)]
  info = {}
  counts = None if chunk_layers is None else jnp.asarray(chunk_layers, jnp.int32)

  def run_chunk(chunk_params, x, chunk):
    if counts is None:
      return fns.chunk(chunk_params, x)
    return fns.chunk(chunk_params, x, counts[chunk])

  def pin(x):
    return jax.lax.with_sharding_constraint(x, act_spec)

  def pin_buffer(x):
    return jax.lax.with_sharding_constraint(x, P(None, *act_spec))

  def scaled_head_loss(head_params, y, targets):
    return fns.head_loss(head_params, y, targets) * loss_scale

  def body(stage_params, embed_params, head_params, inputs, targets):
    local = jax.tree.map(lambda a: a[0], stage_params)     # [v, layers_per_chunk, ...]
    # Replicated weights become per-device values here, outside any branch
    # and the scan: a vjp inside a branch w.r.t. a pipe-invariant value would
    # transpose into a psum over `pipe` that only some stages reach (a
    # deadlock), and one w.r.t. a data-invariant value into a psum over
    # `data` in every backward. Cast here, they transpose into one psum each,
    # after the scan.
    local = _varying(local, manual)
    embed_params, head_params = _varying((embed_params, head_params), manual)
    stage = jax.lax.axis_index('pipe')
    x_zero = pin(_varying(jnp.zeros(act_shape, act_dtype), manual))

    # Trace one chunk's vjp abstractly to learn the residual structure: which
    # leaves are the chunk's own weights (not stashed) and the shapes of the rest.
    layout = {}

    def chunk_vjp(chunk_params, x, chunk):
      return jax.vjp(lambda cp, h: run_chunk(cp, h, chunk), chunk_params, x)

    def probe(chunk_params, x, chunk):
      _, vjp_fn = chunk_vjp(chunk_params, x, chunk)
      leaves, layout['treedef'] = jax.tree.flatten(vjp_fn)
      weights = jax.tree.leaves(chunk_params)
      layout['weight_of'] = [next((j for j, w in enumerate(weights) if w is leaf), None)
                             for leaf in leaves]
      return [leaf for leaf, j in zip(leaves, layout['weight_of']) if j is None]

    # The chunk index is traced here as in the real forward, so an uneven
    # split's layer count is a residual in both (same residual structure).
    stash_shapes = jax.eval_shape(probe, _take(local, 0), x_zero, stage)
    stash = _varying([jnp.zeros((n_stash,) + s.shape, s.dtype) for s in stash_shapes], manual)
    info['residual_bytes'] = sum(s.size * s.dtype.itemsize for s in stash_shapes)

    def split_residuals(vjp_fn, chunk_params):
      leaves, weights = jax.tree.leaves(vjp_fn), jax.tree.leaves(chunk_params)
      # The probe's structure must hold for this trace too, or the stash would
      # silently pair residuals with the wrong slots.
      if len(leaves) != len(layout['weight_of']) or any(
          j is not None and leaf is not weights[j] for leaf, j in zip(leaves, layout['weight_of'])):
        raise AssertionError('chunk vjp residuals differ from the probe trace')
      return [leaf for leaf, j in zip(leaves, layout['weight_of']) if j is None]

    def join_residuals(stashed, chunk_params):
      weights, stashed = jax.tree.leaves(chunk_params), iter(stashed)
      leaves = [next(stashed) if j is None else weights[j] for j in layout['weight_of']]
      return jax.tree.unflatten(layout['treedef'], leaves)

    carry0 = dict(
        act=pin_buffer(_varying(jnp.zeros((n_act,) + act_shape, act_dtype), manual)),
        grad=pin_buffer(_varying(jnp.zeros((n_grad,) + act_shape, act_dtype), manual)),
        stash=stash,
        g_stage=_zeros_like_varying(local, manual),
        g_embed=_zeros_like_varying(embed_params, manual),
        g_head=_zeros_like_varying(head_params, manual),
        loss=_varying(jnp.zeros((), jnp.float32), manual),
    )
    if moves:
      carry0['landing'] = _varying([jnp.zeros(s.shape, s.dtype) for s in stash_shapes], manual)
      carry0['landing_slot'] = _varying(jnp.int32(-1), manual)

    def forward(c, row):
      mb, chunk = row[sched.F_MB], row[sched.F_CHUNK]
      chunk_params = _take(local, chunk // p)
      x = jax.lax.cond(chunk == 0,
                       lambda: pin(fns.embed(embed_params, inputs[mb]).astype(act_dtype)),
                       lambda: pin(c['act'][row[sched.F_ACT]]))
      y, vjp_fn = chunk_vjp(chunk_params, x, chunk)
      c = dict(c, stash=_put(c['stash'], row[sched.F_STASH],
                             split_residuals(vjp_fn, chunk_params)))

      def loss_and_seed(c):
        loss, (g_head, dy) = jax.value_and_grad(scaled_head_loss, argnums=(0, 1))(
            head_params, y, targets[mb])
        return dict(c, loss=c['loss'] + loss,
                    g_head=jax.tree.map(jnp.add, c['g_head'], g_head),
                    grad=c['grad'].at[row[sched.F_GRAD]].set(pin(dy.astype(act_dtype))))

      c = jax.lax.cond(chunk == last_chunk, loss_and_seed, lambda c: c, c)
      return c, pin(y.astype(act_dtype))

    def apply_vjp(c, local_chunk, stash_slot, grad_slot):
      stashed = [s[stash_slot] for s in c['stash']]
      vjp_fn = join_residuals(stashed, _take(local, local_chunk))
      return vjp_fn(pin(c['grad'][grad_slot]))

    def accumulate(c, local_chunk, g_chunk):
      return dict(c, g_stage=jax.tree.map(lambda g, d: g.at[local_chunk].add(d),
                                          c['g_stage'], g_chunk))

    def weight_grad(c, row):
      local_chunk = row[sched.W_CHUNK] // p
      g_chunk, _ = apply_vjp(c, local_chunk, row[sched.W_STASH], row[sched.W_GRAD])
      return accumulate(c, local_chunk, g_chunk)

    def backward(c, row):
      mb, chunk = row[sched.B_MB], row[sched.B_CHUNK]
      local_chunk = chunk // p
      g_chunk, dx = apply_vjp(c, local_chunk, row[sched.B_STASH], row[sched.B_GRAD])
      if not program.split_backward:
        c = accumulate(c, local_chunk, g_chunk)

      def embed_backward(c):
        _, embed_vjp = jax.vjp(lambda e: fns.embed(e, inputs[mb]).astype(act_dtype),
                               embed_params)
        (g_embed,) = embed_vjp(dx)
        return dict(c, g_embed=jax.tree.map(jnp.add, c['g_embed'], g_embed))

      c = jax.lax.cond(chunk == 0, embed_backward, lambda c: c, c)
      return c, pin(dx.astype(act_dtype))

    def idle(c, row):
      del row
      return c, x_zero

    def run_slot(valid, work, c, row, placeholder):
      """Runs `work` when the slot is valid; the ablation computes it anyway."""
      if not compute_idle:
        return jax.lax.cond(valid, work, idle, c, row)
      c_new, out = work(c, jnp.where(valid, row, placeholder))
      keep = lambda new, old: jnp.where(valid, new, old)
      return jax.tree.map(keep, c_new, c), keep(out, x_zero)

    # A row an idle slot may compute in the ablation: this stage's first
    # chunk, slots 0 (the results are discarded).
    placeholder = {
        'fwd': jnp.array([1, 0, 0, 0, 0, 0], jnp.int32).at[sched.F_CHUNK].set(stage),
        'bwd': jnp.array([1, 0, 0, 0, 0], jnp.int32).at[sched.B_CHUNK].set(stage)}

    def tick(c, rows):
      row = {name: table[stage] for name, table in rows.items()}
      if moves:
        c = jax.lax.cond(c['landing_slot'] >= 0, land, lambda c: c, c)
      c, y = run_slot(row['fwd'][sched.F_VALID] > 0, forward, c, row['fwd'], placeholder['fwd'])
      c, dx = run_slot(row['bwd'][sched.B_VALID] > 0, backward, c, row['bwd'], placeholder['bwd'])
      if program.split_backward:
        c = jax.lax.cond(row['wgt'][sched.W_VALID] > 0, weight_grad, lambda c, _: c,
                         c, row['wgt'])
      y = jax.lax.ppermute(y, 'pipe', to_next)
      dx = jax.lax.ppermute(dx, 'pipe', to_prev)
      if moves:
        # Every tick, outside any branch (a stage with nothing to move sends
        # a slot it does not need and the receiver drops it): inside a cond,
        # XLA:CPU (jax 0.10.2) mixed this ppermute's rendezvous up (NaN
        # gradients, or a check failure counting 5 participants of 4).
        landing, slot = move_residuals(c['stash'], row)
        c = dict(c, landing=landing, landing_slot=slot)
      c = dict(c, act=c['act'].at[row['recv_act']].set(y),
               grad=c['grad'].at[row['recv_grad']].set(dx))
      return c, None

    def land(c):
      """Stores the residual set that arrived at the end of the previous tick.

      Written now rather than then: the stash is then never sliced (to send)
      and updated (to receive) in one step, which would make XLA copy the
      whole pool; and a slot sent last tick may be the one received into.
      """
      return dict(c, stash=_put(c['stash'], c['landing_slot'], c['landing']))

    def move_residuals(stash, row):
      # BPipe never has a stage evict and load in the same tick, so one
      # ppermute over the partner pairs carries either direction.
      sent = [s[row['move_send']] for s in stash]
      return jax.lax.ppermute(sent, 'pipe', partner_pairs), _varying(row['move_recv'], manual)

    c, _ = jax.lax.scan(tick, carry0, tables)
    # The step's only reductions: over every manual axis for the loss and the
    # replicated embedding/head, over `data` for the stage's own layers.
    replicas = manual[1:]
    loss = jax.lax.psum(c['loss'], manual)
    g_embed = jax.lax.psum(c['g_embed'], manual)
    g_head = jax.lax.psum(c['g_head'], manual)
    g_stage = c['g_stage']
    if replicas:
      g_stage = jax.lax.psum(g_stage, replicas)
    g_stage = jax.tree.map(lambda g: g[None], g_stage)
    return loss, (g_stage, g_embed, g_head)

  rows = P(None, data_axis) if data_axis else P()
  run = jax.shard_map(
      body, mesh=mesh, axis_names=set(manual),
      in_specs=(P('pipe'), P(), P(), rows, rows),
      out_specs=(P(), (P('pipe'), P(), P())))
  return PipelineStep(run, info)


def _residual_moves(program: 'sched.Program') -> dict:
  """BPipe's evict and load tables folded into one send/receive table."""
  evict, load = np.asarray(program.evict), np.asarray(program.load)
  for col, what in ((sched.X_SEND, 'sends'), (sched.X_RECV, 'receives')):
    if ((evict[..., col] >= 0) & (load[..., col] >= 0)).any():
      raise NotImplementedError(f'a stage both evicts and loads (it {what} two residual sets) '
                                'in one tick; the executor moves one set per tick')
  send = np.where(evict[..., sched.X_SEND] >= 0, evict[..., sched.X_SEND], load[..., sched.X_SEND])
  recv = np.where(evict[..., sched.X_RECV] >= 0, evict[..., sched.X_RECV], load[..., sched.X_RECV])
  return dict(move_send=jnp.asarray(np.maximum(send, 0), jnp.int32),
              move_recv=jnp.asarray(recv, jnp.int32))


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
