"""Next-token cross-entropy over a vocabulary-parallel output layer."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _summed(logits: jax.Array, targets: jax.Array) -> jax.Array:
  # A one-hot contraction, not a gather, picks the target logit: with the
  # vocabulary split over `tensor` it partitions into a local product and
  # an all-reduce (Megatron's vocab-parallel cross-entropy); XLA's SPMD
  # partitioner rejects a gather along the split axis inside the pipeline.
  target_logit = jnp.sum(
    logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1
  )
  return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - target_logit)


def cross_entropy_sum(
  logits_fn: Callable[[jax.Array], jax.Array], x: jax.Array, targets: jax.Array, chunk: int = 0
) -> jax.Array:
  """Sum over tokens of -log softmax(logits_fn(x))[target], fp32.

  x [b, s, d] are the final hidden states, logits_fn maps them to fp32
  logits [b, s, V]. With `chunk` (dividing s), the logits of only `chunk`
  positions at a time exist: a scan over sequence chunks, each under
  jax.checkpoint so the backward recomputes a chunk's logits instead of
  saving them. At V = 128k the logits, their one-hot and their gradient are
  what dominates a step's temporaries otherwise. chunk 0 (or >= s): at once.
  """
  b, s = targets.shape
  if not chunk or chunk >= s:
    return _summed(logits_fn(x), targets)
  n = s // chunk
  xs = jnp.swapaxes(x.reshape(b, n, chunk, x.shape[-1]), 0, 1)
  ts = jnp.swapaxes(targets.reshape(b, n, chunk), 0, 1)

  @jax.checkpoint
  def piece(x_c, t_c):
    return _summed(logits_fn(x_c), t_c)

  # Per-chunk sums as the scan's outputs, not a carried total: a carry would
  # have to match the manual axes x varies over inside the pipeline.
  _, sums = jax.lax.scan(lambda _, xt: (None, piece(*xt)), None, (xs, ts))
  return jnp.sum(sums)
