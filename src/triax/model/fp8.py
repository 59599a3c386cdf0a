"""FP8 weight matmuls (model.fp8): current scaling (tensorwise, rowwise) or delayed.

`einsum` is what common.matmul runs for a weight matmul when the spec says
fp8: both operands quantized to E4M3 with scales from their own amax this
step, the product taken on the FP8 operands (`preferred_element_type` the
compute dtype, so XLA:GPU emits an FP8 GEMM), the scales applied to the
output. Its backward quantizes the cotangent to E5M2 (the range gradients
need) for both GEMMs, dx = g w^T and dw = x^T g, each again FP8 x FP8.

The recipe says what one scale covers. tensorwise: the whole operand (one
scalar each). rowwise (torchtitan's float8 "rowwise"): one row of the GEMM,
the amax taken over that GEMM's contracting axes only, so each operand gets
a scale per index of its non-contracted axes and the output is multiplied by
the outer product of the two scale vectors. An outlier row then costs only
its own row precision; under tensorwise it shrinks every row's values
towards E4M3's subnormals. Each backward GEMM scales along its own
contracting axes: dx's g per token and w per input feature, dw's x and g per
feature column. delayed scales per tensor too, each operand by the amax
history its matmul site keeps (model/fp8_delayed.py) rather than its own
amax this step; the step's observed amax leaves as the history's gradient.

The weights, their gradients and the optimizer stay in param_dtype; only the
GEMMs' operands are FP8. Quantizing is flax's (`flax.linen.fp8_ops`); the
scales are powers of two, so dividing by one and multiplying back are exact
in any dtype, and the scales (hence the FP8 bytes) do not depend on how a
tensor is sharded: an amax over a sharded axis is a max across its shards,
which GSPMD inserts for `jnp.max`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

# Forward operands keep precision (3 mantissa bits, max 448); gradients range (2 bits, max 57344).
FORWARD = jnp.float8_e4m3fn
BACKWARD = jnp.float8_e5m2


def einsum(equation: str, x, w, dtype, recipe: str = 'tensorwise', probe=None, history=None):
  """einsum(equation, x, w) with FP8 operands, in `dtype`; gradients in x's and w's dtypes.

  `equation` is a weight matmul's ('bsd,dnk->bsnk'): every label in exactly
  two of x, w and the output, so both backward GEMMs are einsums too.
  `recipe`: tensorwise or rowwise (what a scale covers), or delayed: one
  scale per tensor from `history` (fp32 [3, H], the x, w and cotangent
  rows of its site's past amaxes, model/fp8_delayed.py; `delayed_scale`),
  whose gradient is this call's amaxes in column 0 (`observed`); without
  a history (evaluation, sampling) delayed is tensorwise. The backward
  keeps x and w as they arrive and quantizes them again (the same bytes
  where the scale depends on the tensor only), rather than keep FP8
  copies: as common.recast keeps w rather than its cast. `probe` (an fp32
  [2], or None) takes no part in the product; its gradient is the
  backward's E5M2 casts' (elements over E5M2's max, elements): a count
  the forward cannot see (fp8_metrics.py)."""
  if history is not None and recipe != 'delayed':
    raise ValueError(f"a history is delayed scaling's; fp8 recipe {recipe!r} takes none")
  if history is None and recipe == 'delayed':
    recipe = 'tensorwise'
  return _einsum(equation, jnp.dtype(dtype), recipe, x, w, probe, history)


def quantize(t, q_dtype, axes: tuple[int, ...] | None = None):
  """(t / scale in q_dtype, scale): scale (fp32) the smallest power of two
  that brings max|t| within q_dtype's range, the max over `axes` (kept as
  size-1 dimensions, so the scale broadcasts against t) or, with None,
  over all of t (a scalar scale). 1 where the amax is zero or not finite
  (a NaN stays one, for the bad-step guard to see)."""
  scale = scale_of(amax(t, axes), q_dtype)
  return fp8_ops.quantize(t, q_dtype, scale, t.dtype), scale


def amax(t, axes: tuple[int, ...] | None = None):
  """max|t| (fp32) over `axes` (kept as size-1 dimensions), or over all of t with None."""
  return jnp.max(jnp.abs(t), axis=axes, keepdims=axes is not None).astype(jnp.float32)


def scale_of(t_amax, q_dtype):
  """`quantize`'s power-of-two scale for an amax (any shape)."""
  fp8_max = fp8_ops.get_fp8_max(q_dtype, jnp.float32)
  scale = fp8_ops.compute_scale(t_amax, jnp.ones((), jnp.float32), fp8_max)
  mantissa, exponent = jnp.frexp(scale)
  # scale = mantissa * 2^exponent, mantissa in [0.5, 1): 0.5 is already a power of two.
  return jnp.ldexp(jnp.float32(1), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def delayed_scale(history, t_amax, q_dtype):
  """The scale delayed scaling gives a tensor: `scale_of` its history's
  max (`history` its row of past amaxes), or of its own amax `t_amax` while
  the history holds none yet (all zero: the first step, current scaling)."""
  past = jnp.max(history)
  return scale_of(jnp.where(past > 0, past, t_amax), q_dtype)


def overflow(t, scale, q_dtype):
  """How many elements of t / scale are beyond q_dtype's max, before
  `quantize` saturates them (fp32). Under current scaling none are but
  beside an inf: its scale falls back to 1, so the inf counts and so does
  every finite value over the max under the same scale (a NaN does not)."""
  fp8_max = fp8_ops.get_fp8_max(q_dtype, jnp.float32)
  return jnp.sum(jnp.abs(t.astype(jnp.float32)) / scale > fp8_max, dtype=jnp.float32)


@functools.cache
def transposed(equation: str) -> tuple[str, str]:
  """(dx's equation (g, w -> x), dw's equation (x, g -> w)) of a weight matmul's `equation`."""
  ins, out = equation.split('->')
  xs, ws = ins.split(',')
  for label in set(xs + ws + out):
    if sum(label in term for term in (xs, ws, out)) != 2:
      raise ValueError(f'{equation}: {label!r} must be in exactly two of its three terms')
  return f'{out},{ws}->{xs}', f'{xs},{out}->{ws}'


def scaled_axes(labels: str, out: str, recipe: str) -> tuple[int, ...] | None:
  """The axes of a GEMM operand (its `labels`) that one scale spans, for
  `quantize`: all (None) under tensorwise and delayed; under rowwise the
  GEMM's contracting axes (the labels not in its output `out`)."""
  if recipe in ('tensorwise', 'delayed'):
    return None
  if recipe == 'rowwise':
    return tuple(i for i, label in enumerate(labels) if label not in out)
  raise ValueError(f'fp8 recipe {recipe!r}: tensorwise, rowwise or delayed')


def _in_output(scale, labels: str, out: str):
  """An operand's scale (`quantize`'s, over an operand labelled `labels`)
  laid out to broadcast against the GEMM's output labelled `out`."""
  if scale.ndim == 0:
    return scale
  kept = [label for label in labels if label in out]
  scale = scale.reshape([n for n, label in zip(scale.shape, labels) if label in out])
  scale = jnp.transpose(scale, [kept.index(label) for label in out if label in kept])
  return jnp.expand_dims(scale, [i for i, label in enumerate(out) if label not in kept])


def _gemm(equation: str, a, b, q_dtypes: tuple, recipe: str, dtype, scales=None):
  """einsum(equation, a, b) on a and b quantized to `q_dtypes` (scales per
  `recipe`, or the scalar `scales` given: delayed's), in `dtype`, times the
  outer product of their scales."""
  ins, out = equation.split('->')
  operands, scale = [], jnp.ones((), jnp.float32)
  for i, (t, labels, q_dtype) in enumerate(zip((a, b), ins.split(','), q_dtypes)):
    if scales is None:
      q, s = quantize(t, q_dtype, scaled_axes(labels, out, recipe))
    else:
      q, s = fp8_ops.quantize(t, q_dtype, scales[i], t.dtype), scales[i]
    operands.append(q)
    scale = scale * _in_output(s, labels, out)
  return jnp.einsum(equation, *operands, preferred_element_type=dtype) * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum(equation: str, dtype, recipe: str, x, w, probe, history):
  del probe
  return _forward(equation, dtype, recipe, x, w, history)[0]


def _forward(equation: str, dtype, recipe: str, x, w, history):
  """(the product, x's and w's amax [2] under delayed, else None)."""
  if history is None:
    return _gemm(equation, x, w, (FORWARD, FORWARD), recipe, dtype), None
  seen = jnp.stack([amax(x), amax(w)])
  scales = [delayed_scale(history[i], seen[i], FORWARD) for i in (0, 1)]
  return _gemm(equation, x, w, (FORWARD, FORWARD), recipe, dtype, scales), seen


def _einsum_fwd(equation: str, dtype, recipe: str, x, w, probe, history):
  out, seen = _forward(equation, dtype, recipe, x, w, history)
  return out, (x, w, probe, history, seen)


def _einsum_bwd(equation: str, dtype, recipe: str, residuals, g):
  x, w, probe, history, seen = residuals
  dx_equation, dw_equation = transposed(equation)
  if history is None:
    dx = _gemm(dx_equation, g, w, (BACKWARD, FORWARD), recipe, dtype)
    dw = _gemm(dw_equation, x, g, (FORWARD, BACKWARD), recipe, dtype)
    casts = None if probe is None else _casts(equation, g, recipe)
    return dx.astype(x.dtype), dw.astype(w.dtype), casts, None
  # The forward's scales again (scalars of the same values), and g's from its own row.
  g_amax = amax(g)
  x_scale, w_scale = (delayed_scale(history[i], seen[i], FORWARD) for i in (0, 1))
  g_scale = delayed_scale(history[2], g_amax, BACKWARD)
  dx = _gemm(dx_equation, g, w, (BACKWARD, FORWARD), recipe, dtype, (g_scale, w_scale))
  dw = _gemm(dw_equation, x, g, (FORWARD, BACKWARD), recipe, dtype, (x_scale, g_scale))
  casts = None if probe is None else _casts(equation, g, recipe, g_scale)
  return dx.astype(x.dtype), dw.astype(w.dtype), casts, observed(history, seen[0], seen[1], g_amax)


def observed(history, x_amax, w_amax, g_amax):
  """A history's gradient: this call's amaxes (x, w, g) in column 0, zeros elsewhere."""
  return jnp.zeros_like(history).at[:, 0].set(jnp.stack([x_amax, w_amax, g_amax]))


def _casts(equation: str, g, recipe: str, scale=None):
  """(elements over E5M2's max, elements) of the cotangent's casts in the
  backward's two GEMMs, each scaled along its own contracting axes (or by
  `scale`, delayed's, in both)."""
  ins, out = equation.split('->')
  counts = jnp.zeros((), jnp.float32)
  for other in ins.split(','):
    # g's contracting axes in a backward GEMM: its labels not in that GEMM's output.
    axes = scaled_axes(out, other, recipe)
    s = scale_of(amax(g, axes), BACKWARD) if scale is None else scale
    counts = counts + overflow(g, s, BACKWARD)
  return jnp.stack([counts, jnp.float32(2 * g.size)])


_einsum.defvjp(_einsum_fwd, _einsum_bwd)
