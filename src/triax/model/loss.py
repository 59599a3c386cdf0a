"""Next-token cross-entropy over a vocabulary-parallel output layer."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# The logit of a padded id. Finite, not -inf: the target's one-hot product
# below would make -inf * 0 = NaN at every padded id. exp(-1e30 - max) is 0
# in fp32, so the padding still has exactly zero probability and gradient.
PADDING_LOGIT = -1e30


def mask_padding(logits: jax.Array, vocab_used: int) -> jax.Array:
  """fp32 logits [..., V] with the ids >= vocab_used (Megatron's vocabulary padding) at
  PADDING_LOGIT: zero probability in a softmax, hence zero gradient into the output
  layer's padded rows, and never drawn by a sampler (argmax, temperature or top-k).

  An add of a [V] bias, not a select: its gradient is the identity, so the
  backward keeps no mask (a select made XLA hold another chunk of logits,
  +42% of the chunked loss's temporaries at V = 128k), and it splits over
  `tensor` with the logits. vocab_used 0 (or V): returned untouched.
  """
  v = logits.shape[-1]
  if not vocab_used or vocab_used >= v:
    return logits
  bias = jnp.where(jnp.arange(v) < vocab_used, 0.0, PADDING_LOGIT).astype(logits.dtype)
  return logits + bias


def _summed(logits: jax.Array, targets: jax.Array, vocab_used: int, counted=None) -> jax.Array:
  ce = token_cross_entropy(logits, targets, vocab_used)
  return jnp.sum(ce if counted is None else jnp.where(counted, ce, 0.0))


def token_cross_entropy(logits: jax.Array, targets: jax.Array, vocab_used: int) -> jax.Array:
  """Each position's -log softmax(logits)[target] [..., s] (fp32), padded ids masked."""
  logits = mask_padding(logits, vocab_used)
  # A one-hot contraction, not a gather, picks the target logit: with the
  # vocabulary split over `tensor` it partitions into a local product and
  # an all-reduce (Megatron's vocab-parallel cross-entropy); XLA's SPMD
  # partitioner rejects a gather along the split axis inside the pipeline.
  # (A padded target, which the data layer never makes, would cost ~1e30.)
  target_logit = jnp.sum(
    logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1
  )
  return jax.nn.logsumexp(logits, axis=-1) - target_logit


def cross_entropy_sum(
  logits_fn: Callable[[jax.Array], jax.Array],
  x: jax.Array,
  targets: jax.Array,
  chunk: int = 0,
  vocab_used: int = 0,
  counted: jax.Array | None = None,
) -> jax.Array:
  """Sum over tokens of -log softmax(logits_fn(x))[target], fp32; with
  `counted` (bool [b, s]), over the tokens it marks only.

  x [b, s, d] are the final hidden states, logits_fn maps them to fp32
  logits [b, s, V]. With `chunk` (dividing s), the logits of only `chunk`
  positions at a time exist: a scan over sequence chunks, each under
  jax.checkpoint so the backward recomputes a chunk's logits instead of
  saving them. At V = 128k the logits, their one-hot and their gradient are
  what dominates a step's temporaries otherwise. chunk 0 (or >= s): at once.
  With `vocab_used` (0 < vocab_used < V) the ids from it on are padding,
  masked before the logsumexp (`mask_padding`).
  """
  b, s = targets.shape
  if not chunk or chunk >= s:
    return _summed(logits_fn(x), targets, vocab_used, counted)
  n = s // chunk
  by_chunk = lambda a: jnp.swapaxes(a.reshape(b, n, chunk, *a.shape[2:]), 0, 1)  # noqa: E731
  pieces = (by_chunk(x), by_chunk(targets), None if counted is None else by_chunk(counted))

  @jax.checkpoint
  def piece(x_c, t_c, c_c):
    return _summed(logits_fn(x_c), t_c, vocab_used, c_c)

  # Per-chunk sums as the scan's outputs, not a carried total: a carry would
  # have to match the manual axes x varies over inside the pipeline.
  _, sums = jax.lax.scan(lambda _, xtc: (None, piece(*xtc)), None, pieces)
  return jnp.sum(sums)


def cross_entropy_and_grad(
  logits_fn: Callable,
  params,
  x: jax.Array,
  targets: jax.Array,
  acc,
  scale: float,
  chunk: int = 0,
  vocab_used: int = 0,
  input_grad: bool = True,
):
  """(scale x the summed cross-entropy, acc + its gradient w.r.t. params, its gradient w.r.t. x).

  logits_fn(params, x) -> fp32 logits; `acc` is a gradient tree like params
  (the caller's accumulator). With `chunk` (dividing s), one chunk of
  positions at a time: a scan whose carry is `acc`, each chunk's forward and
  backward run together and its parameter gradient added at once. Neither
  the micro-batch's logits nor a second parameter gradient exist then; the
  gradient of a vocabulary-sized table (1 GiB in fp32 at 128k x 2048) has
  the caller's buffer only, and each chunk's logits are computed once (the
  checkpointed scan of `cross_entropy_sum` computes them again in its
  backward).

  Either gradient can be left out, and is then never computed: `acc` None
  gives no parameter gradient (None in its place), `input_grad` False none
  w.r.t. x (the pipeline makes the two at different times, executor.py).
  A leaf of `acc` that is None (`partial_vjp`) leaves that parameter's
  gradient out alone.
  """

  def piece(p, h, t):
    return _summed(logits_fn(p, h), t, vocab_used) * scale

  def grads(acc, h, t):
    loss, acc, dh = partial_vjp(lambda p, h: piece(p, h, t), params, h, acc, input_grad)
    return acc, loss, dh

  b, s = targets.shape
  if not chunk or chunk >= s:
    acc, loss, dx = grads(acc, x, targets)
    return loss, acc, dx
  n = s // chunk
  xs = jnp.swapaxes(x.reshape(b, n, chunk, x.shape[-1]), 0, 1)
  ts = jnp.swapaxes(targets.reshape(b, n, chunk), 0, 1)

  def step(acc, xt):
    acc, loss, dh = grads(acc, *xt)
    return acc, (loss, dh)

  acc, (losses, dxs) = jax.lax.scan(step, acc, (xs, ts))
  dx = None if dxs is None else jnp.swapaxes(dxs, 0, 1).reshape(x.shape)
  return jnp.sum(losses), acc, dx


def partial_vjp(fn: Callable, params, x, acc, input_grad: bool = True, weight: float = 1.0):
  """(fn(params, x), acc + weight x its gradient w.r.t. params, weight x its
  gradient w.r.t. x or None).

  fn returns a scalar. `acc` is a tree like params whose None leaves mark
  the parameters not to differentiate (`acc` None: none of them; None is
  returned in its place): they stay None, and no work their gradient alone
  needs is done (the pipeline takes a head's vector
  parameters' gradients with its input gradient, and its matrices' after
  the tick loop, without the product by the matrix an input gradient is).
  """
  leaves, tree = jax.tree.flatten(params)
  accs = [None] * len(leaves) if acc is None else tree.flatten_up_to(acc)
  chosen = [i for i, a in enumerate(accs) if a is not None]

  def of(picked, h):
    full = list(leaves)
    for i, leaf in zip(chosen, picked, strict=True):
      full[i] = leaf
    return fn(tree.unflatten(full), h)

  picked = [leaves[i] for i in chosen]
  if input_grad:
    value, vjp = jax.vjp(of, picked, x)
    g, dx = vjp(jnp.full_like(value, weight))
  else:
    value, vjp = jax.vjp(lambda p: of(p, x), picked)
    (g,), dx = vjp(jnp.full_like(value, weight)), None
  for i, gi in zip(chosen, g, strict=True):
    accs[i] = accs[i] + gi
  return value, None if acc is None else tree.unflatten(accs), dx
