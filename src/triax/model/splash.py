"""Causal attention with the TPU's splash kernel (`model.attention=splash`).

XLA's attention on TPU keeps the [b, n, t, t] scores of every layer it
differentiates (fp32 softmax, a bf16 copy, a transposed one): at 2048
positions most of a 1B model's temporary memory. Pallas's splash kernel
(jax.experimental.pallas.ops.tpu.splash_attention, a flash attention with
block-sparse causal masks) keeps only the output and a log-sum-exp per
query row, and recomputes the scores block by block in the backward.

The kernel is a custom call GSPMD cannot split, so it runs under a
`shard_map` over the mesh axes the active logical rules split 'batch' and
'heads' over (each device: its rows and heads, no communication); inside the
pipeline executor, already manual over `pipe`, that shard_map nests.
`interpret=True` (model.splash_interpret) runs the same kernel through
Pallas's interpreter on any backend: how the CPU tests check it against XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import PartitionSpec as P

from triax import sharding

# The kernel's tile, along queries and keys: the largest of these dividing the
# sequence (config.validate asks for a multiple of 128, the TPU's lanes).
_BLOCKS = (512, 256, 128)


def block_size(seq_len: int) -> int:
  """The kernel's tile for `seq_len` positions, a multiple of 128."""
  return next(b for b in _BLOCKS if seq_len % b == 0)


def attention(q, k, v, segments=None, *, interpret: bool = False):
  """Causal attention of q, k, v [b, t, n, hd] (K/V already one per query head).

  With `segments` [b, t] (the document of each position of a packed row), a
  query attends only within its document. Returns [b, t, n, hd] in q's dtype.
  """
  mesh = jax.sharding.get_abstract_mesh()
  local = lambda q, k, v, *seg: _local(q, k, v, seg[0] if seg else None, interpret)
  args = (q, k, v) + (() if segments is None else (segments,))
  if mesh.empty:
    return local(*args)  # no mesh: plain arrays on one device
  # Every automatic axis becomes manual here (those the rules do not split q
  # over see the same rows and heads on each device, as GSPMD would compute
  # them); the kernel's outputs declare no varying axes, hence check_vma off.
  spec = sharding.active_spec(('batch', 'seq', 'heads', 'kv')) or P()
  rows = P(*(tuple(spec) + (None, None))[:2])
  seg_specs = () if segments is None else (rows,)
  per_device = functools.partial(
    jax.shard_map,
    mesh=mesh,
    axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
    check_vma=False,
  )
  forward = per_device(local, in_specs=(spec, spec, spec) + seg_specs, out_specs=spec)
  if not mesh.manual_axes:
    return forward(*args)

  def grads(q, k, v, *rest):
    *seg, g = rest
    _, vjp = jax.vjp(lambda q, k, v: local(q, k, v, *seg), q, k, v)
    return vjp(g)

  # Gradients of values typed without varying axes: passed through an
  # identity shard_map first (times one: an output that is its input
  # unchanged keeps the input's type), whose outputs carry none.
  backward = per_device(
    grads, in_specs=(spec, spec, spec) + seg_specs + (spec,), out_specs=(spec, spec, spec)
  )
  untyped = {
    s: per_device(lambda x: x * jnp.ones((), x.dtype), in_specs=s, out_specs=s)
    for s in {spec, rows}
  }
  plain = lambda *xs: tuple(untyped[s](x) for s, x in zip((spec,) * 3 + seg_specs + (spec,), xs))
  return _typed(forward, lambda *xs: backward(*plain(*xs)), *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _typed(forward, backward, *args):
  """Attention inside a shard_map that is manual over some axes already (the
  pipeline executor's). A shard_map without its vma check cannot be
  differentiated there (its transpose's cotangents carry no varying axes),
  so the backward is its own shard_map, which reruns the kernel's forward
  for its residuals (one more attention forward: a few per cent of a
  layer); outputs and gradients get the queries' varying axes (every row
  and head is its own device's)."""
  return _vary_like(forward(*args), args[0])


def _typed_fwd(forward, backward, *args):
  return _typed(forward, backward, *args), args


def _typed_bwd(forward, backward, args, g):
  del forward
  q = args[0]
  dq, dk, dv = (_vary_like(d, q) for d in backward(*args, g))
  return (dq, dk, dv) + (None,) * (len(args) - 3)  # document ids take no gradient


_typed.defvjp(_typed_fwd, _typed_bwd)


def _varying_axes(x) -> tuple:
  aval = jax.typeof(x)
  varying = getattr(aval, 'vma', None)
  if varying is None and hasattr(aval, 'manual_axis_type'):
    varying = aval.manual_axis_type.varying
  return tuple(varying or ())


def _vary_like(x, like):
  missing = tuple(a for a in _varying_axes(like) if a not in _varying_axes(x))
  return jax.lax.pcast(x, missing, to='varying') if missing else x


def _local(q, k, v, segments, interpret: bool):
  """One device's rows and heads: the kernel, vmapped over the rows."""
  _, t, n, hd = q.shape
  b = block_size(t)
  blocks = kernel_lib.BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    use_fused_bwd_kernel=True,
  )
  mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((t, t))] * n)
  kernel = kernel_lib.make_splash_mha(
    mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
  )
  # The kernel takes [heads, t, hd] and applies no 1/sqrt(hd): scale q first,
  # as dot_product_attention does.
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)
  q = heads_first(q * jnp.asarray(hd**-0.5, q.dtype))
  k, v = heads_first(k), heads_first(v)
  if segments is None:
    out = jax.vmap(kernel)(q, k, v)
  else:
    ids = segments.astype(jnp.int32)
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=kernel_lib.SegmentIds(s, s)))(
      q, k, v, ids
    )
  return heads_first(out).astype(q.dtype)
