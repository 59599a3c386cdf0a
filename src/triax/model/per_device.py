"""Attention computed per device, under a shard_map, inside GSPMD programs.

Two attentions cannot be left to GSPMD: splash (a Pallas custom call it
cannot split) and ring attention (collectives over `context` it would not
write). Both run as a function of one device's rows, heads and positions
under a `shard_map` over every automatic mesh axis, laid out by the active
logical rules; the pipeline executor's own shard_map is already manual over
some axes, and this one nests inside it.

Their shard_maps are unchecked (`check_vma=False`): a kernel's outputs
declare no varying axes, and a checked one that JAX partially evaluates
inside the executor gets residual shardings XLA's verifier refuses. An
unchecked shard_map cannot be differentiated there (its transpose's
cotangents carry no varying axes), so `attention(..., own_backward=True)`
differentiates it with its own shard_map, which reruns the forward for its
residuals: flash attention's trade (one more attention forward, nothing
kept between the passes but the inputs), and outputs and gradients get the
queries' varying axes (every row and head is its own device's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from triax import sharding

QKV_AXES = ('batch', 'seq', 'heads', 'kv')


def attention(
  local: Callable,
  q,
  k,
  v,
  extras: Sequence = (),
  extra_axes: Sequence[tuple] = (),
  own_backward: bool = False,
):
  """local(q, k, v, *extras) on each device's share of q, k, v [b, t, n, hd]
  (split as the rules split QKV_AXES) and of `extras` (not differentiated;
  split by their logical `extra_axes`). Without a mesh, local on the whole."""
  if jax.sharding.get_abstract_mesh().empty:
    return local(q, k, v, *extras)  # no mesh: plain arrays on one device
  spec = sharding.active_spec(QKV_AXES) or P()
  specs = (spec,) * 3 + tuple(sharding.active_spec(a) or P() for a in extra_axes)
  return apply(local, (q, k, v) + tuple(extras), specs, spec, 3, own_backward)


def apply(
  local: Callable, args: Sequence, specs: Sequence, out_spec, diff: int, own_backward: bool = True
):
  """local(*args) on each device's share of `args` (split by `specs` over the
  automatic mesh axes) giving one array split by `out_spec`; the first
  `diff` args are differentiated, the rest are not. Inside a shard_map
  manual over some axes (the pipeline executor's), or with `own_backward`,
  its backward is its own shard_map, which reruns the forward."""
  mesh = jax.sharding.get_abstract_mesh()
  args, specs = tuple(args), tuple(specs)
  per_device = functools.partial(
    jax.shard_map,
    mesh=mesh,
    axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
    check_vma=False,
  )
  forward = per_device(local, in_specs=specs, out_specs=out_spec)
  if not mesh.manual_axes and not own_backward:
    return forward(*args)

  def grads(*rest):
    *inputs, g = rest
    _, vjp = jax.vjp(lambda *d: local(*d, *inputs[diff:]), *inputs[:diff])
    return vjp(g)

  backward = per_device(grads, in_specs=specs + (out_spec,), out_specs=specs[:diff])
  # Gradients of values typed without varying axes: passed through an
  # identity shard_map first (times one: an output that is its input
  # unchanged keeps the input's type), whose outputs carry none.
  untyped = {
    s: per_device(lambda x: x * jnp.ones((), x.dtype), in_specs=s, out_specs=s)
    for s in set(specs + (out_spec,))
  }
  plain = lambda *xs: tuple(untyped[s](x) for s, x in zip(specs + (out_spec,), xs))  # noqa: E731
  return _typed(forward, lambda *xs: backward(*plain(*xs)), diff, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _typed(forward, backward, diff, *args):
  return sharding.vary_like(forward(*args), args[0])


def _typed_fwd(forward, backward, diff, *args):
  return _typed(forward, backward, diff, *args), args


def _typed_bwd(forward, backward, diff, args, g):
  del forward
  grads = tuple(sharding.vary_like(d, a) for d, a in zip(backward(*args, g), args))
  return grads + (None,) * (len(args) - diff)  # the rest take no gradient


_typed.defvjp(_typed_fwd, _typed_bwd)
