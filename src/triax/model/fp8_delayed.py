"""model.fp8=delayed: each FP8 matmul site's amax history, what reads it, how a step updates it.

A site is one FP8 einsum call in a layer, named by its kind
(fp8_metrics.kind) and its place among that kind's calls in the layer:
attn_in_0, attn_in_1, attn_in_2 (q, k, v), attn_out_0, ... `sites` finds
them by tracing the model once. Each keeps a history, fp32 [3, H] (H =
model.fp8_amax_history): rows x and w (the forward's E4M3 operands) and g
(the cotangent, in model.fp8_grad's format), column 0 the newest step. The state is
{'layers': {site: [L, 3, H]}}, stacked over the layer stack as its weights
are, so it lays out, shards and relayouts as they do (training/step.py).

A step scales each operand by fp8.delayed_scale of its row (its own amax
while the row is all zero: the first step). Its observed amaxes leave as
the history's gradient (fp8.observed), and `updated` shifts each row one
column and puts them in front: a step's scales depend only on the steps
before it. Only the layer stack has sites (deepseek.py refuses delayed with
its blocks outside it), and only a step with the state open (`with_state`)
reads them; evaluation and sampling scale as tensorwise does. Under the
pipeline executor each chunk reads its own layers' histories (`staged`),
and the executor keeps the max of what its micro-batches and replicas
observed (its `observations`), which `updated` rolls in as here.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp

from triax.model import fp8_metrics

# Rows of a site's history: the forward's operands and the backward's cotangent.
ROWS = ('x', 'w', 'g')


class _Open:
  """A step's state ({'layers': {site: [L, 3, H]}}), or None while `sites` traces."""

  def __init__(self, state):
    self.state = state
    self.found: dict[str, None] = {}  # ordered; a body traced twice names its sites again
    self.taken = False


class _Layer:
  """One layer's histories ({site: [3, H]}, None while tracing for `sites`) and its calls so far."""

  def __init__(self, top: _Open, histories):
    self.top, self.histories = top, histories
    self.calls: collections.Counter = collections.Counter()

  def take(self, equation: str):
    kind = fp8_metrics.kind(equation)
    site = f'{kind}_{self.calls[kind]}'
    self.calls[kind] += 1
    if self.histories is None:
      self.top.found[site] = None
      return None
    return self.histories[site]


_OPEN: contextvars.ContextVar[_Open | None] = contextvars.ContextVar('fp8_open', default=None)
_LAYER: contextvars.ContextVar[_Layer | None] = contextvars.ContextVar('fp8_layer', default=None)


@contextlib.contextmanager
def _set(var, value):
  token = var.set(value)
  try:
    yield value
  finally:
    var.reset(token)


def history(equation: str):
  """The history [3, H] of the next FP8 call of `equation` in this layer;
  None outside a step's state (evaluation, sampling: tensorwise)."""
  layer = _LAYER.get()
  if layer is not None:
    return layer.take(equation)
  if _OPEN.get() is not None:
    raise ValueError(f'{equation}: model.fp8=delayed keeps histories for the layer stack only')
  return None


def scanned(layer, stacked):
  """(layer, stacked) for the layer scan: with a state open, layer((p,
  histories), h) reads its own layer's histories, scanned beside `stacked`."""
  top = _OPEN.get()
  if top is None:
    return layer, stacked
  if top.taken:
    raise ValueError('model.fp8=delayed: one layer stack per step')
  top.taken = True

  def run(p, h):
    p, histories = p
    with _set(_LAYER, _Layer(top, histories)):
      return layer(p, h)

  return run, (stacked, None if top.state is None else top.state['layers'])


def with_state(objective):
  """objective(params, *args) -> objective((params, state), *args), its FP8
  matmuls reading `state`'s histories: the gradient of state is what each
  site observed (fp8.observed), for `updated`."""

  def run(params_and_state, *args):
    params, state = params_and_state
    with _set(_OPEN, _Open(state)):
      return objective(params, *args)

  return run


def staged(chunk):
  """chunk(params, x, ...) -> chunk((params, histories), x, ...), its FP8
  matmuls reading `histories` ({site: [layers, 3, H]}, the chunk's own
  layers'): the pipeline executor's chunk function under delayed scaling."""

  def run(params_and_histories, x, *args, **kwargs):
    params, histories = params_and_histories
    with _set(_OPEN, _Open({'layers': histories})):
      return chunk(params, x, *args, **kwargs)

  return run


def updated(state, observed):
  """Each history shifted one step older, this step's `observed` amaxes (column 0) in front."""
  return jax.tree.map(
    lambda h, o: jnp.concatenate([o[..., :1], h[..., :-1]], axis=-1), state, observed
  )


def sites(loss, params_shapes: Any, tokens) -> tuple[str, ...]:
  """The FP8 sites of one layer, in call order, of loss(params, tokens, tokens) traced once."""
  top = _Open(None)
  with _set(_OPEN, top):
    jax.eval_shape(loss, params_shapes, tokens, tokens)
  return tuple(top.found)


def init(site_names: tuple[str, ...], layers: int, length: int) -> Any:
  """The state before the first step: every history zero (no amax seen yet)."""
  return {'layers': {s: jnp.zeros((layers, len(ROWS), length), jnp.float32) for s in site_names}}


def logical_axes(site_names: tuple[str, ...]) -> Any:
  """`init`'s tree with each leaf's logical axes: stacked over 'layers' as the weights are."""
  return {'layers': {s: ('layers', None, None) for s in site_names}}
