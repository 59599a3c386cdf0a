"""Context parallelism: a sequence split over the `context` mesh axis.

The rules put the 'seq' logical axis on `context`, so every activation of a layer holds
s/c positions per device. The sequence is cut into 2c chunks and rank i holds chunks i and
2c-1-i (Megatron-Core's and Llama 3's load balancing for causal attention):
`positions(s, c)` is that order and `permute` applies it. The trainer permutes a batch's
tokens, targets and document ids into it, and the model reads each slot's true position
from it (RoPE angles, learned position rows, the causal mask: `bias` compares positions,
never slot indices), so the loss is unchanged.

Attention meets the other ranks' keys one of two ways (model.context_attention):
  allgather  `allgather_attention`: K and V gathered over `context` by GSPMD; each rank
             computes its own queries' rows of the [s/c, s] scores.
  ring       `ring_attention`: K/V blocks passed around the ring, c per rank, combined
             by an online softmax; the backward is flash attention's, around the ring.
             No [s/c, s] scores exist in either pass: a step's fp32 scores are
             [b, n, s/c, KEY_TILE]. The blocks move by one of TRANSPORTS, which the
             trainer picks for the devices (ModelSpec.ring_transport).

Why so: docs/design/models.md."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from triax import sharding
from triax.model import per_device
from triax.model.window import ring_steps

# Where a query may not attend: a large negative bias, finite so that a row
# that has seen no key yet (a ring block entirely after it) stays NaN-free.
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)

# How a ring step moves each rank's block to the next rank:
#   ppermute   one collective-permute (GPU and TPU; CPU outside pipeline stages).
#   allgather  every rank's block gathered, the previous rank's kept: the same
#              blocks in the same order for c times the bytes. For XLA:CPU inside
#              pipeline stages, whose collective-permute waits for every device
#              of the program, also those of stages on another branch of the
#              executor's per-tick cond (it hangs or pairs unrelated transfers);
#              its all-gather waits only for the gathering group, like allgather
#              attention's.
TRANSPORTS = ('ppermute', 'allgather')

# Keys of a ring block scored at once against a rank's queries. A whole
# block's fp32 scores (and their probabilities, and the backward's three
# arrays like them) grow with (s/c)^2: 512 MiB each per rank at 32k
# positions over 8 ranks, and 8 forced CPU devices share one host's memory.
# 512 keys bound them to [b, n, s/c, 512] (64 MiB there); a block of at most
# this many keys is scored whole, in the same operations as before tiling.
KEY_TILE = 512


def positions(seq_len: int, shards: int) -> jax.Array:
  """The position each slot of a sequence holds when it is split over
  `shards` context ranks with causal load balancing (int32 [seq_len]).

  Computed from an iota, not held as a constant: a constant would enter the
  pipeline's split backward as a value varying over no axis, beside ones
  that vary over the executor's (its rebinding refuses the mix)."""
  slots = jnp.arange(seq_len, dtype=jnp.int32)
  if shards == 1:
    return slots
  size = seq_len // (2 * shards)
  chunk, within = slots // size, slots % size
  rank, second = chunk // 2, chunk % 2
  return jnp.where(second == 0, rank, 2 * shards - 1 - rank) * size + within


def permute(x: jax.Array, shards: int, axis: int = 1) -> jax.Array:
  """x with its sequence axis in the load-balanced order (slot j <- position
  positions()[j]): what the trainer does to tokens, targets and document ids."""
  if shards == 1:
    return x
  return jnp.take(x, positions(x.shape[axis], shards), axis=axis)


def within(distance, window):
  """Whether a key `distance` positions before its query is in a sliding
  window of `window` positions (the query's own included; window <= 0: any
  is). `window` a Python int or a traced one (a scanned layer's)."""
  if isinstance(window, int):
    return distance < window if window > 0 else jnp.ones(jnp.shape(distance), bool)
  return (distance < window) | (window <= 0)


def bias(q_pos: jax.Array, k_pos: jax.Array, q_seg=None, k_seg=None, window=0) -> jax.Array:
  """[1 or b, 1, tq, tk] float32: 0 where a query may attend (a key at an
  earlier or equal position, in the same document, fewer than `window`
  positions back when it is > 0), a large negative elsewhere."""
  allowed = q_pos[:, None] >= k_pos[None, :]
  if not isinstance(window, int) or window > 0:
    allowed = allowed & within(q_pos[:, None] - k_pos[None, :], window)
  allowed = allowed[None, None]
  if q_seg is not None:
    allowed = allowed & (q_seg[:, :, None] == k_seg[:, None, :])[:, None]
  return jnp.where(allowed, 0.0, _NEG).astype(jnp.float32)


def masked_attention(q, k, v, pos, segments=None, recompute: bool = False, window=0):
  """XLA's attention of q over k, v [b, t, n, hd] (one K/V per query head),
  causal by the slots' positions `pos` [t], within documents with `segments`,
  within a sliding window of `window` positions (`bias`'s).
  With `recompute` (model.remat=attention) the core is its own checkpoint:
  its backward recomputes the logits and probabilities from q and k, so
  its residuals are its inputs and no [b, n, t, t] value is kept.

  An additive bias rather than a mask: `where(mask, logits, -big)` keeps
  the broadcast [b, n, t, t] mask among the residuals of every layer (a
  pipeline stashes it per micro-batch), an addition keeps nothing. The
  logits and gradients are the mask's exactly (exp underflows to 0 at
  masked positions either way). The logits and softmax are fp32; the
  probabilities are the only [b, n, t, t] residual, in the activations'
  dtype (`_probabilities`), as jax.nn.dot_product_attention computes them
  otherwise."""
  if recompute:
    # The window closed over: a Python int stays static (no mask when 0).
    core = jax.checkpoint(
      lambda *a: _masked_core(*a, window), policy=jax.checkpoint_policies.nothing_saveable
    )
    return core(q, k, v, pos, segments)
  return _masked_core(q, k, v, pos, segments, window)


def _masked_core(q, k, v, pos, segments, window):
  logits = jnp.einsum('btnh,bsnh->bnts', q, k, preferred_element_type=jnp.float32)
  logits = logits * (q.shape[-1] ** -0.5) + bias(pos, pos, segments, segments, window)
  return jnp.einsum('bnts,bsnh->btnh', _probabilities(logits, k.dtype), v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _probabilities(logits, dtype):
  """softmax(logits) cast to `dtype`, whose backward reads that cast only.

  Autodiff of softmax-then-cast keeps both the fp32 probabilities (the
  softmax's residual) and their bf16 cast (the value matmul's): under bf16
  3 bytes per score of a layer where Megatron's fused softmax keeps 2
  (Korthikanti et al.'s 2as^2b). In fp32 the one residual is the same array."""
  return jax.nn.softmax(logits, axis=-1).astype(dtype)


def _probabilities_fwd(logits, dtype):
  probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
  return probs, probs


def _probabilities_bwd(dtype, probs, g):
  del dtype
  y, g = probs.astype(jnp.float32), g.astype(jnp.float32)
  return (y * (g - jnp.sum(g * y, axis=-1, keepdims=True)),)


_probabilities.defvjp(_probabilities_fwd, _probabilities_bwd)


def allgather_attention(
  q, k, v, pos, segments=None, transport='ppermute', recompute: bool = False, window=0
):
  """q [b, s, n, hd] split over `context` along s; k, v (one per query head)
  made whole along s, so each rank scores its queries against every key.
  `recompute`, `window`: masked_attention's (the gathered K/V are then its
  residuals, not gathered again in the backward). A constant window that
  leaves some rank's block out of every query's reach gathers only the
  blocks within it (`_near_attention`), moved by `transport` (the ring's)."""
  axis = _context_axis()
  if axis is not None and isinstance(window, int):
    steps = ring_steps(_axis_size(axis), q.shape[1] // _axis_size(axis), window)
    if len(steps) < _axis_size(axis):
      return _per_rank(_near_attention, q, k, v, pos, segments, axis, transport, window, steps)
  whole = ('batch', None, 'heads', 'kv')
  k, v = sharding.constrain(k, whole), sharding.constrain(v, whole)
  return masked_attention(q, k, v, pos, segments, recompute, window)


def _context_axis() -> str | None:
  """The mesh axis the active rules split the sequence over, if it has more than one device."""
  spec = sharding.active_spec(per_device.QKV_AXES)
  axis = spec[1] if spec is not None else None
  return axis if axis is not None and _axis_size(axis) > 1 else None


def _axis_size(axis: str) -> int:
  return jax.sharding.get_abstract_mesh().shape[axis]


def ring_attention(
  q, k, v, pos, segments=None, transport: str = 'ppermute', recompute: bool = False, window=0
):
  """Ring attention of q, k, v [b, s, n, hd] (K/V one per query head), the
  sequence split over the mesh axis the 'seq' rule names; each device's
  rows, heads and positions under a shard_map (model/per_device.py), which
  differentiates it with its own backward (no ring state kept between the
  passes but the inputs). `transport`: one of TRANSPORTS; `recompute`:
  allgather_attention's, where the sequence is whole after all; `window`:
  `bias`'s sliding window, a constant: the steps whose block is out of every
  query's reach (`ring_steps`) are neither computed nor moved, each other
  block fetched from its rank directly. `pos` must be `positions`' order."""
  axis = _context_axis()
  if axis is None:
    return allgather_attention(q, k, v, pos, segments, transport, recompute, window)
  steps = ring_steps(_axis_size(axis), q.shape[1] // _axis_size(axis), window)
  return _per_rank(_ring, q, k, v, pos, segments, axis, transport, window, steps)


def _per_rank(fn, q, k, v, pos, segments, axis: str, transport: str, window: int, steps):
  """fn(q, k, v, pos[, segments], axis=, transport=, tile=, window=, steps=) on
  each device's share, differentiated by its own backward (per_device.attention)."""
  # Typed like the queries: inside the pipeline executor they are residuals
  # its stash holds beside varying ones (a constant would type it otherwise).
  extras, axes = (sharding.vary_like(pos, q),), (('seq',),)
  if segments is not None:
    extras, axes = extras + (segments,), axes + (('batch', 'seq'),)
  local = functools.partial(
    fn, axis=axis, transport=transport, tile=KEY_TILE, window=window, steps=steps
  )
  return per_device.attention(local, q, k, v, extras, axes, own_backward=True)


def _ring(
  q, k, v, pos, segments=None, *, axis: str, transport: str, tile: int, window=0, steps=None
):
  """One context rank: its queries against each rank's K/V block in turn,
  `tile` keys at a time, within `window` (`bias`'s), meeting the blocks of
  `steps` only (`ring_steps`; None: all)."""
  c = jax.lax.axis_size(axis)
  steps = tuple(range(c)) if steps is None else tuple(steps)
  return _ring_attention(q, k, v, pos, segments, window, steps, axis, transport, tile)


def _near_attention(q, k, v, pos, segments=None, *, axis, transport, tile, window, steps):
  """One context rank's windowed all-gather kind: the K/V blocks of `steps`
  (`ring_steps`) fetched, one masked attention over them."""
  del tile
  block = (k, v, pos, segments)
  near = [block] + [_fetched(block, j, axis, transport) for j in steps if j]
  k, v, k_pos = (jnp.concatenate([b[i] for b in near], axis=0 if i == 2 else 1) for i in range(3))
  k_seg = None if segments is None else jnp.concatenate([b[3] for b in near], axis=1)
  logits = jnp.einsum('btnh,bsnh->bnts', q, k, preferred_element_type=jnp.float32)
  logits = logits * (q.shape[-1] ** -0.5) + bias(pos, k_pos, segments, k_seg, window)
  return jnp.einsum('bnts,bsnh->btnh', _probabilities(logits, k.dtype), v)


def _fetch(axis: str, transport: str, offset: int):
  """x -> rank r-offset's x on rank r: one collective-permute, or (transport
  allgather) every rank's gathered and the one wanted kept."""
  c = jax.lax.axis_size(axis)
  if transport == 'ppermute':
    pairs = [(i, (i + offset) % c) for i in range(c)]
    return lambda x: jax.lax.ppermute(x, axis, pairs)
  return lambda x: jax.lax.all_gather(x, axis)[(jax.lax.axis_index(axis) - offset) % c]


def _fetched(block, offset: int, axis: str, transport: str):
  """`block` (a tuple, None entries kept) as rank r-offset holds it."""
  fetch = _fetch(axis, transport, offset)
  return tuple(None if x is None else fetch(x) for x in block)


def _shift(axis: str, transport: str):
  """Sends a value to the next rank of the ring (receives the previous one's),
  and how the ring's first blocks are typed for that transport.

  An all_gather inside the per-device shard_map (unchecked) returns a value
  typed as varying over no manual axis, whatever its input; a scan whose
  carry it feeds must start from blocks typed alike.
  """
  send = _fetch(axis, transport, 1)
  if transport == 'ppermute':
    return send, lambda block: block

  def untyped(block):
    # Any operation under the unchecked map drops the type; XLA folds this one away.
    return jax.tree.map(lambda x: jax.lax.select(jnp.ones(x.shape, bool), x, x), block)

  return send, untyped


def _scores(q, q_pos, q_seg, k, k_pos, k_seg, window):
  """Scaled, masked scores of one query block against one key block: fp32 [b, n, tq, tk]."""
  scale = q.shape[-1] ** -0.5
  scores = jnp.einsum('bqnd,bknd->bnqk', q, k, preferred_element_type=jnp.float32) * scale
  return scores + bias(q_pos, k_pos, q_seg, k_seg, window)


# The key axis of each array a ring block carries: k, v, their positions,
# their document ids (and in the backward the K/V gradients, like k and v).
_KEY_AXES = (1, 1, 0, 1, 1, 1)


def _tile_size(keys: int, tile: int) -> int:
  """The largest divisor of `keys` that is at most `tile`."""
  return max(d for d in range(1, min(keys, tile) + 1) if keys % d == 0)


def _by_key_tiles(fn, carry, block, tile: int):
  """fn(carry, piece) -> (carry, piece's outputs) over `block` cut into tiles
  of keys, in key order; the outputs joined back along the keys. A block of
  at most `tile` keys is one piece, and fn sees it uncut."""
  keys = block[0].shape[1]
  size = _tile_size(keys, tile)
  if size == keys:
    return fn(carry, block)

  def cut(x, axis):
    if x is None:
      return None
    x = x.reshape(x.shape[:axis] + (keys // size, size) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)

  def join(x):  # [tiles, b, size, ...] -> [b, keys, ...]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[:1] + (keys,) + x.shape[3:])

  pieces = tuple(cut(x, axis) for x, axis in zip(block, _KEY_AXES))
  carry, outs = jax.lax.scan(fn, carry, pieces)
  return carry, jax.tree.map(join, outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _ring_attention(q, k, v, pos, segments, window, steps, axis, transport, tile):
  return _ring_forward(q, k, v, pos, segments, window, steps, axis, transport, tile)[0]


def _ring_forward(q, k, v, pos, segments, window, steps, axis, transport, tile):
  """(output [b, tq, n, hd], log-sum-exp of each query row's scores [b, n, tq])."""
  b, tq, n, _ = q.shape
  send, start = _shift(axis, transport)
  acc = (
    jnp.zeros(q.shape, jnp.float32),
    jnp.full((b, n, tq), _NEG, jnp.float32),
    jnp.zeros((b, n, tq), jnp.float32),
  )

  def absorb(acc, keys):
    """The online softmax's update by some keys: the unnormalised output,
    the running max and sum of each row."""
    out, peak, total = acc
    k, v, k_pos, k_seg = keys
    scores = _scores(q, pos, segments, k, k_pos, k_seg, window)
    new_peak = jnp.maximum(peak, scores.max(-1))
    fade = jnp.exp(peak - new_peak)
    probs = jnp.exp(scores - new_peak[..., None])
    mixed = jnp.einsum(
      'bnqk,bknd->bqnd', probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    out = out * jnp.swapaxes(fade, 1, 2)[..., None] + mixed
    return (out, new_peak, total * fade + probs.sum(-1)), None

  def step(acc, block):
    return _by_key_tiles(absorb, acc, block, tile)[0]

  def body(carry, _):
    acc, block = carry
    incoming = jax.tree.map(send, block)  # issued first: overlaps this block's work
    return (step(acc, block), incoming), None

  if len(steps) < jax.lax.axis_size(axis):  # windowed: only the blocks in reach, each fetched
    for j in steps:
      acc = step(
        acc, _fetched((k, v, pos, segments), j, axis, transport) if j else (k, v, pos, segments)
      )
    out, peak, total = acc
  else:
    block = start((k, v, pos, segments))
    (acc, block), _ = jax.lax.scan(body, (acc, block), None, length=jax.lax.axis_size(axis) - 1)
    out, peak, total = step(acc, block)
  out = out / jnp.swapaxes(total, 1, 2)[..., None]
  return out.astype(q.dtype), peak + jnp.log(total)


def _ring_fwd(q, k, v, pos, segments, window, steps, axis, transport, tile):
  out, lse = _ring_forward(q, k, v, pos, segments, window, steps, axis, transport, tile)
  return out, (q, k, v, pos, segments, out, lse)


def _ring_bwd(window, steps, axis, transport, tile, res, g):
  """Flash attention's backward around the ring: each K/V block travels with
  its gradient accumulators; a rank adds its queries' share to them, and
  after c steps they are home. Per block: the probabilities from the saved
  log-sum-exp, never a running softmax."""
  q, k, v, pos, segments, out, lse = res
  scale = q.shape[-1] ** -0.5
  send, start = _shift(axis, transport)
  g32 = g.astype(jnp.float32)
  # D = rowsum(dO * O): the softmax's Jacobian term for each query row [b, n, tq].
  rows = jnp.swapaxes(jnp.sum(g32 * out.astype(jnp.float32), -1), 1, 2)

  def gradients(dq, keys):
    """This rank's share of the gradients of some keys; dq accumulated."""
    k, v, k_pos, k_seg, dk, dv = keys
    probs = jnp.exp(_scores(q, pos, segments, k, k_pos, k_seg, window) - lse[..., None])
    dv = dv + jnp.einsum('bnqk,bqnd->bknd', probs, g32)
    dprobs = jnp.einsum('bqnd,bknd->bnqk', g32, v, preferred_element_type=jnp.float32)
    dscores = probs * (dprobs - rows[..., None]) * scale
    dq = dq + jnp.einsum('bnqk,bknd->bqnd', dscores, k, preferred_element_type=jnp.float32)
    dk = dk + jnp.einsum('bnqk,bqnd->bknd', dscores, q, preferred_element_type=jnp.float32)
    return dq, (dk, dv)

  def step(dq, block):
    dq, grads = _by_key_tiles(gradients, dq, block, tile)
    return dq, block[:4] + grads

  def body(carry, _):
    dq, block = carry
    incoming = jax.tree.map(send, block[:4])  # K/V go on while this block's work runs
    dq, block = step(dq, block)
    return (dq, incoming + tuple(send(a) for a in block[4:])), None

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  c = jax.lax.axis_size(axis)
  if len(steps) < c:
    dq, dk, dv = _windowed_bwd(step, zeros, (q, k, v, pos, segments), steps, axis, transport)
  else:
    block = start((k, v, pos, segments, zeros(k), zeros(v)))
    (dq, block), _ = jax.lax.scan(body, (zeros(q), block), None, length=c - 1)
    dq, block = step(dq, block)
    dk, dv = (send(a) for a in block[4:])  # the c-th move brings each block's gradients home
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


def _windowed_bwd(step, zeros, inputs, steps, axis: str, transport: str):
  """(dq, dk, dv) of a windowed ring: each block in reach fetched from rank
  r-j as the forward did, its gradients made here and sent straight home
  (rank r-j receives them from rank r: offset -j)."""
  q, k, v, pos, segments = inputs
  dq, dk, dv = zeros(q), zeros(k), zeros(v)
  for j in steps:
    block = (k, v, pos, segments)
    block = _fetched(block, j, axis, transport) if j else block
    dq, out = step(dq, block + (zeros(k), zeros(v)))
    grads = _fetched(out[4:], -j, axis, transport) if j else out[4:]
    dk, dv = dk + grads[0], dv + grads[1]
  return dq, dk, dv


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
