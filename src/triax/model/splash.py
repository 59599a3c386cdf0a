"""Causal attention with the TPU's splash kernel (`model.attention=splash`).

XLA's attention on TPU keeps the [b, n, t, t] scores of every layer it
differentiates (fp32 softmax, a bf16 copy, a transposed one): at 2048
positions most of a 1B model's temporary memory. Pallas's splash kernel
(jax.experimental.pallas.ops.tpu.splash_attention, a flash attention with
block-sparse causal masks) keeps only the output and a log-sum-exp per
query row, and recomputes the scores block by block in the backward.

The kernel is a custom call GSPMD cannot split, so it runs per device
(model/per_device.py: each device its rows and heads, no communication).
`interpret=True` (model.splash_interpret) runs the same kernel through
Pallas's interpreter on any backend: how the CPU tests check it against XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

from triax.model import per_device

# The kernel's tile, along queries and keys: the largest of these dividing the
# sequence (config.validate asks for a multiple of 128, the TPU's lanes).
_BLOCKS = (512, 256, 128)


def block_size(seq_len: int) -> int:
  """The kernel's tile for `seq_len` positions, a multiple of 128."""
  return next(b for b in _BLOCKS if seq_len % b == 0)


def attention(q, k, v, segments=None, *, interpret: bool = False, window: int = 0):
  """Causal attention of q, k, v [b, t, n, hd] (K/V already one per query head).

  With `segments` [b, t] (the document of each position of a packed row), a
  query attends only within its document; with `window` > 0, to the
  `window` latest positions only (its own included): a local block-sparse
  mask, whose blocks wholly outside every window the kernel skips.
  Returns [b, t, n, hd] in q's dtype.
  """
  local = lambda q, k, v, *seg: _local(q, k, v, seg[0] if seg else None, interpret, window)  # noqa: E731
  extras = () if segments is None else (segments,)
  return per_device.attention(local, q, k, v, extras, (('batch', 'seq'),) * len(extras))


def _local(q, k, v, segments, interpret: bool, window: int):
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
  causal = (
    mask_lib.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
    if window
    else mask_lib.CausalMask((t, t))
  )
  mask = mask_lib.MultiHeadMask([causal] * n)
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
