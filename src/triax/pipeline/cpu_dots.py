"""Weight-gradient matmuls XLA:CPU can run in its YNNPACK kernels.

XLA:CPU folds a transpose into the dot that reads it wherever its Eigen dot
takes that operand transposed, and a dot so folded cannot join a YNNPACK
fusion, which wants a left operand contracted over its last dimensions. A
weight gradient, x^T g over a micro-batch's tokens, is such a dot whenever
the tokens flatten to one dimension, as a pipeline's one-sequence
micro-batch's do: it ran as an Eigen thunk, slower per FLOP than the fusions
beside it by an order of magnitude with 8 devices on 2 cores (the split
backward's W and the edges' head, docs/bench_peers.md).

Under `row_major()`, the executor's re-evaluated backward (split_backward's
interpreter) lays out such a dot's operands itself, transposed behind an
optimization barrier that XLA cannot fold through. The executor turns it on
for CPU meshes only: XLA:TPU and XLA:GPU choose dot layouts themselves, and
their programs stay as they were.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp

_ACTIVE = contextvars.ContextVar('triax_row_major_dots', default=False)


@contextlib.contextmanager
def row_major(on: bool = True):
  """Within: `active()` is `on` (a trace-time switch; nothing runs differently)."""
  token = _ACTIVE.set(on)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active() -> bool:
  return _ACTIVE.get()


def dot_general(primitive, lhs, rhs, params: dict):
  """primitive.bind(lhs, rhs, **params), a dot_general, made from operands
  laid out as [batch..., rows, contracted] (free and contracted dimensions
  each merged into one) where they are not already: the same product, the
  same output dimensions. Both operands, as XLA may swap them (a transpose of
  the product folds into the dot)."""
  (l_contract, r_contract), (l_batch, r_batch) = params['dimension_numbers']
  l_free = _free(lhs, l_batch, l_contract)
  r_free = _free(rhs, r_batch, r_contract)
  if _laid_out(lhs, l_batch, l_free) and _laid_out(rhs, r_batch, r_free):
    return primitive.bind(lhs, rhs, **params)
  batch = tuple(range(len(l_batch)))
  last = len(batch) + 1
  numbers = (((last,), (last,)), (batch, batch))
  out = primitive.bind(
    _as_rows(lhs, l_batch, l_free, l_contract),
    _as_rows(rhs, r_batch, r_free, r_contract),
    **dict(params, dimension_numbers=numbers),
  )
  shape = [lhs.shape[d] for d in l_batch] + [lhs.shape[d] for d in l_free]
  return out.reshape(shape + [rhs.shape[d] for d in r_free])


def _free(x, batch, contract) -> list[int]:
  return [d for d in range(x.ndim) if d not in contract and d not in batch]


def _laid_out(x, batch, free) -> bool:
  """Whether x is [batch..., free..., contracted...] already."""
  n = len(batch) + len(free)
  return tuple(batch) + tuple(free) == tuple(range(n))


def _as_rows(x, batch, free, contract) -> jax.Array:
  """x as [batch..., prod(free), prod(contract)], made behind a barrier."""
  x = jnp.transpose(x, (*batch, *free, *contract))
  rows = math.prod(x.shape[len(batch) : len(batch) + len(free)])
  x = x.reshape(x.shape[: len(batch)] + (rows, -1))
  return jax.lax.optimization_barrier(x)
