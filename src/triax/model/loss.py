"""Next-token cross-entropy over a vocabulary-parallel output layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Sum over tokens of -log softmax(logits)[target], fp32.

  A one-hot contraction, not a gather, picks the target logit: with the
  vocabulary split over `tensor` it partitions into a local product and an
  all-reduce (Megatron's vocab-parallel cross-entropy); XLA's SPMD
  partitioner rejects a gather along the split axis inside the pipeline.
  """
  target_logit = jnp.sum(
    logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1
  )
  return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - target_logit)
