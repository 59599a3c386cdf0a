"""Next-token cross-entropy over a vocabulary-parallel output layer."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def mask_padding(logits: jax.Array, vocab_used: int) -> jax.Array:
  """logits [..., V] with the ids >= vocab_used (Megatron's vocabulary padding) at -inf.

  The padding then has zero probability in a softmax, hence zero gradient
  into the output layer's padded rows, and a sampler never draws it. An
  iota compare and a select: elementwise, so it splits over `tensor` with
  the logits (each rank compares its own slice's global ids). vocab_used 0
  (or V): nothing is padding and the logits are returned untouched.
  """
  if not vocab_used or vocab_used >= logits.shape[-1]:
    return logits
  ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.where(ids < vocab_used, logits, -jnp.inf)


def _summed(logits: jax.Array, targets: jax.Array, vocab_used: int) -> jax.Array:
  # A one-hot contraction, not a gather, picks the target logit: with the
  # vocabulary split over `tensor` it partitions into a local product and
  # an all-reduce (Megatron's vocab-parallel cross-entropy); XLA's SPMD
  # partitioner rejects a gather along the split axis inside the pipeline.
  one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
  if vocab_used and vocab_used < logits.shape[-1]:
    logits = mask_padding(logits, vocab_used)
    # A select, not a product: -inf * 0 would be NaN at every padded id. A
    # padded target (the data layer never makes one) costs +inf, not a
    # silently finite loss.
    target_logit = jnp.sum(jnp.where(one_hot > 0, logits, 0.0), axis=-1)
  else:
    target_logit = jnp.sum(logits * one_hot, axis=-1)
  return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - target_logit)


def cross_entropy_sum(
  logits_fn: Callable[[jax.Array], jax.Array],
  x: jax.Array,
  targets: jax.Array,
  chunk: int = 0,
  vocab_used: int = 0,
) -> jax.Array:
  """Sum over tokens of -log softmax(logits_fn(x))[target], fp32.

  x [b, s, d] are the final hidden states, logits_fn maps them to fp32
  logits [b, s, V]. With `chunk` (dividing s), the logits of only `chunk`
  positions at a time exist: a scan over sequence chunks, each under
  jax.checkpoint so the backward recomputes a chunk's logits instead of
  saving them. At V = 128k the logits, their one-hot and their gradient are
  what dominates a step's temporaries otherwise. chunk 0 (or >= s): at once.
  With `vocab_used` (0 < vocab_used < V) the ids from it on are padding:
  masked to -inf before the logsumexp (`mask_padding`).
  """
  b, s = targets.shape
  if not chunk or chunk >= s:
    return _summed(logits_fn(x), targets, vocab_used)
  n = s // chunk
  xs = jnp.swapaxes(x.reshape(b, n, chunk, x.shape[-1]), 0, 1)
  ts = jnp.swapaxes(targets.reshape(b, n, chunk), 0, 1)

  @jax.checkpoint
  def piece(x_c, t_c):
    return _summed(logits_fn(x_c), t_c, vocab_used)

  # Per-chunk sums as the scan's outputs, not a carried total: a carry would
  # have to match the manual axes x varies over inside the pipeline.
  _, sums = jax.lax.scan(lambda _, xt: (None, piece(*xt)), None, (xs, ts))
  return jnp.sum(sums)
