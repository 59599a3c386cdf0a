"""FP8 weight matmuls (model.fp8): current scaling (tensorwise, rowwise) or delayed.

`einsum` is what common.matmul runs for a weight matmul when the spec says
fp8: both operands quantized to E4M3 with scales from their own amax this
step, the product taken on the FP8 operands (`preferred_element_type` the
compute dtype, so XLA:GPU emits an FP8 GEMM), the scales applied to the
output. Its backward quantizes the cotangent to E5M2 (the range gradients
need; `grad`, model.fp8_grad: E4M3, the precision, as DeepSeek-V3 trains)
for both GEMMs, dx = g w^T and dw = x^T g, each again FP8 x FP8.

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

moe.py's routed experts run `einsum` with the expert axis as a batch label
(capacity's 'becd,edf->becf': one GEMM per expert) and `ragged_dot`
(dropless's grouped matmuls, with its own VJP); inside their shard_maps
`split` names the mesh axes an amax must span.

The weights, their gradients and the optimizer stay in param_dtype; only the
GEMMs' operands are FP8. Quantizing is flax's (`flax.linen.fp8_ops`); the
scales are powers of two, so dividing by one and multiplying back are exact
in any dtype, and the scales (hence the FP8 bytes) do not depend on how a
tensor is sharded: an amax over a sharded axis is a max across its shards,
which GSPMD inserts for `jnp.max`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from triax import sharding

# Forward operands keep precision (3 mantissa bits, max 448); gradients range (2 bits, max 57344).
FORWARD = jnp.float8_e4m3fn
BACKWARD = jnp.float8_e5m2
# model.fp8_grad: the cotangents' format in the backward's GEMMs, by name.
GRAD_FORMATS = {'e5m2': BACKWARD, 'e4m3': FORWARD}


@dataclasses.dataclass(frozen=True)
class Recipe:
  """What a model's weight matmuls run on: `scaling`, model.fp8 ('none': the
  compute dtype, no FP8), and `grad`, model.fp8_grad (the cotangents'
  format, a GRAD_FORMATS name). What the layers pass to `einsum` and
  `ragged_dot` as their `recipe` and `grad`."""

  scaling: str = 'none'
  grad: str = 'e5m2'

  @property
  def on(self) -> bool:
    return self.scaling != 'none'


# No FP8: the layers' default.
NONE = Recipe()


def einsum(
  equation: str,
  x,
  w,
  dtype,
  recipe: str = 'tensorwise',
  probe=None,
  split=(),
  history=None,
  grad: str = 'e5m2',
):
  """einsum(equation, x, w) with FP8 operands, in `dtype`; gradients in x's and w's dtypes.

  `equation` is a weight matmul's ('bsd,dnk->bsnk'): every label in exactly
  two of x, w and the output, or in all three (a batch label: the experts'
  'e' in 'becd,edf->becf', one GEMM per expert), so both backward GEMMs are
  einsums too.
  `recipe`: tensorwise or rowwise (what a scale covers), or delayed: one
  scale per tensor from `history` (fp32 [3, H], the x, w and cotangent
  rows of its site's past amaxes, model/fp8_delayed.py; `delayed_scale`),
  whose gradient is this call's amaxes in column 0 (`observed`); without
  a history (evaluation, sampling, the routed experts) delayed is
  tensorwise. The backward keeps x and w as they arrive and quantizes
  them again (the same bytes where the scale depends on the tensor only),
  rather than keep FP8 copies: as common.recast keeps w rather than its cast. `probe` (an fp32
  [2], or None) takes no part in the product; its gradient is the
  backward's E5M2 casts' (elements over E5M2's max, elements): a count
  the forward cannot see (fp8_metrics.py). `split`, inside a shard_map:
  (label, mesh axes) pairs, the manual axes each label's dimension is split
  over, so that an amax spanning it is a max over its shards too and every
  layout quantizes as one device does (outside one, GSPMD's `jnp.max` is
  already whole). `grad`: the cotangent's format (GRAD_FORMATS) in both
  backward GEMMs, its casts' overflow counts and delayed's g row."""
  if history is not None and recipe != 'delayed':
    raise ValueError(f"a history is delayed scaling's; fp8 recipe {recipe!r} takes none")
  if history is None and recipe == 'delayed':
    recipe = 'tensorwise'
  g_dtype = _grad_dtype(grad)
  return _einsum(equation, jnp.dtype(dtype), recipe, tuple(split), g_dtype, x, w, probe, history)


def _grad_dtype(grad: str):
  if grad not in GRAD_FORMATS:
    raise ValueError(f'fp8 gradient format {grad!r}: one of {", ".join(GRAD_FORMATS)}')
  return GRAD_FORMATS[grad]


def quantize(t, q_dtype, axes: tuple[int, ...] | None = None, mesh_axes: tuple = ()):
  """(t / scale in q_dtype, scale): scale (fp32) the smallest power of two
  that brings max|t| within q_dtype's range, the max over `axes` (kept as
  size-1 dimensions, so the scale broadcasts against t) or, with None,
  over all of t (a scalar scale), and over `mesh_axes`' shards (`amax`).
  1 where the amax is zero or not finite (a NaN stays one, for the
  bad-step guard to see)."""
  scale = scale_of(amax(t, axes, mesh_axes), q_dtype)
  return fp8_ops.quantize(t, q_dtype, scale, t.dtype), scale


def amax(t, axes: tuple[int, ...] | None = None, mesh_axes: tuple = ()):
  """max|t| (fp32) over `axes` (kept as size-1 dimensions), or over all of t
  with None; inside a shard_map also over the shards of `mesh_axes` (pmax)."""
  m = jnp.max(jnp.abs(t), axis=axes, keepdims=axes is not None).astype(jnp.float32)
  return jax.lax.pmax(m, mesh_axes) if mesh_axes else m


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
    if sum(label in term for term in (xs, ws, out)) < 2:
      raise ValueError(f'{equation}: {label!r} must be in exactly two of its three terms, or all')
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


def spanned_mesh_axes(labels: str, axes: tuple[int, ...] | None, split) -> tuple:
  """The mesh axes that, by `split` ((label, mesh axes) pairs, `einsum`'s),
  split the dimensions `axes` (None: all) of an operand labelled `labels`."""
  spanned = labels if axes is None else ''.join(labels[i] for i in axes)
  return tuple(dict.fromkeys(a for label, mesh in split if label in spanned for a in mesh))


def _gemm(equation: str, a, b, q_dtypes: tuple, recipe: str, dtype, split=(), scales=None):
  """einsum(equation, a, b) on a and b quantized to `q_dtypes` (scales per
  `recipe`, over `split`'s shards, or the scalar `scales` given: delayed's),
  in `dtype`, times the outer product of their scales."""
  ins, out = equation.split('->')
  operands, scale = [], jnp.ones((), jnp.float32)
  for i, (t, labels, q_dtype) in enumerate(zip((a, b), ins.split(','), q_dtypes)):
    if scales is None:
      axes = scaled_axes(labels, out, recipe)
      q, s = quantize(t, q_dtype, axes, spanned_mesh_axes(labels, axes, split))
    else:
      q, s = fp8_ops.quantize(t, q_dtype, scales[i], t.dtype), scales[i]
    operands.append(q)
    scale = scale * _in_output(s, labels, out)
  return jnp.einsum(equation, *operands, preferred_element_type=dtype) * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _einsum(equation: str, dtype, recipe: str, split: tuple, g_dtype, x, w, probe, history):
  del probe, g_dtype
  return _forward(equation, dtype, recipe, split, x, w, history)[0]


def _forward(equation: str, dtype, recipe: str, split: tuple, x, w, history):
  """(the product, x's and w's amax [2] under delayed, else None)."""
  if history is None:
    return _gemm(equation, x, w, (FORWARD, FORWARD), recipe, dtype, split), None
  seen = jnp.stack([amax(x), amax(w)])
  scales = [delayed_scale(history[i], seen[i], FORWARD) for i in (0, 1)]
  return _gemm(equation, x, w, (FORWARD, FORWARD), recipe, dtype, scales=scales), seen


def _einsum_fwd(equation: str, dtype, recipe: str, split: tuple, g_dtype, x, w, probe, history):
  del g_dtype
  out, seen = _forward(equation, dtype, recipe, split, x, w, history)
  return out, (x, w, probe, history, seen)


def _einsum_bwd(equation: str, dtype, recipe: str, split: tuple, g_dtype, residuals, g):
  x, w, probe, history, seen = residuals
  dx_equation, dw_equation = transposed(equation)
  if history is None:
    dx = _gemm(dx_equation, g, w, (g_dtype, FORWARD), recipe, dtype, split)
    dw = _gemm(dw_equation, x, g, (FORWARD, g_dtype), recipe, dtype, split)
    casts = None if probe is None else _casts(equation, g, recipe, g_dtype)
    return _like(dx, x), _like(dw, w), casts, None
  # The forward's scales again (scalars of the same values), and g's from its own row.
  g_amax = amax(g)
  x_scale, w_scale = (delayed_scale(history[i], seen[i], FORWARD) for i in (0, 1))
  g_scale = delayed_scale(history[2], g_amax, g_dtype)
  dx = _gemm(dx_equation, g, w, (g_dtype, FORWARD), recipe, dtype, scales=(g_scale, w_scale))
  dw = _gemm(dw_equation, x, g, (FORWARD, g_dtype), recipe, dtype, scales=(x_scale, g_scale))
  casts = None if probe is None else _casts(equation, g, recipe, g_dtype, g_scale)
  return _like(dx, x), _like(dw, w), casts, observed(history, seen[0], seen[1], g_amax)


def _like(grad, primal):
  """grad in primal's dtype, summed over the manual mesh axes it varies over
  and primal does not (inside a checked shard_map: where autodiff would
  transpose the implicit pvary of a replicated operand, as jax.vjp does)."""
  extra = tuple(a for a in sharding.varying_axes(grad) if a not in sharding.varying_axes(primal))
  return (jax.lax.psum(grad, extra) if extra else grad).astype(primal.dtype)


def observed(history, x_amax, w_amax, g_amax):
  """A history's gradient: this call's amaxes (x, w, g) in column 0, zeros elsewhere."""
  return jnp.zeros_like(history).at[:, 0].set(jnp.stack([x_amax, w_amax, g_amax]))


def _casts(equation: str, g, recipe: str, g_dtype, scale=None):
  """(elements over g_dtype's max, elements) of the cotangent's casts in the
  backward's two GEMMs, each scaled along its own contracting axes (or by
  `scale`, delayed's, in both)."""
  ins, out = equation.split('->')
  counts = jnp.zeros((), jnp.float32)
  for other in ins.split(','):
    # g's contracting axes in a backward GEMM: its labels not in that GEMM's output.
    axes = scaled_axes(out, other, recipe)
    s = scale_of(amax(g, axes), g_dtype) if scale is None else scale
    counts = counts + overflow(g, s, g_dtype)
  return jnp.stack([counts, jnp.float32(2 * g.size)])


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


# The routed experts' grouped matmul (moe.py's dropless): rows x [n, k]
# sorted by expert, sizes [E] rows each, through w [E, k, o]. A scale spans
# what it spans in the einsum of one GEMM per expert ('nk,eko->no' with n
# inside one expert): tensorwise, each whole operand; rowwise, each row of
# x and each (expert, column) of w over k in the forward, dx's g per row
# and w per (expert, row of k) over o, dw's x and g per (expert, column)
# over that expert's rows. The per-expert scales reach the output rows by
# each row's expert (`_row_groups`); rows past the groups give 0.


def ragged_dot(x, w, sizes, dtype, recipe: str = 'tensorwise', split=(), grad: str = 'e5m2'):
  """jax.lax.ragged_dot(x [n, k], w [E, k, o], sizes [E]) with FP8 operands,
  in `dtype`; gradients in x's and w's dtypes, none for `sizes`.

  As `einsum`: E4M3 operands forward, the cotangent in `grad` in both backward
  GEMMs, dx = ragged_dot(g, w^T) and dw = per expert x^T g (ragged_dot_general,
  the groups in the contracting rows); x and w kept as they arrive. `split`:
  (label, mesh axes) pairs for the labels 'n' (rows), 'e' (experts), 'k' and
  'o', as `einsum`'s. With the experts split, a device's rows are its own
  experts' (moe.py's exchange): a whole-tensor amax of x or g spans 'e''s
  axes too, a per-expert one only 'n''s. delayed is tensorwise here: the
  experts keep no history (model/fp8_delayed.py's sites are the layer's
  dense matmuls)."""
  recipe = 'tensorwise' if recipe == 'delayed' else recipe
  return _ragged(jnp.dtype(dtype), recipe, tuple(split), _grad_dtype(grad), x, w, sizes)


def _row_groups(sizes, n: int):
  """Each of n rows' group [n] (int32): E for rows past the last group. The
  groups' ends a row is past, counted (jnp.searchsorted fails on the
  pipeline executor's varying types in jax 0.10)."""
  ends = jnp.cumsum(sizes)
  return jnp.sum(
    jnp.arange(n, dtype=sizes.dtype)[:, None] >= ends[None, :], axis=1, dtype=jnp.int32
  )


def _mesh(split, labels: str) -> tuple:
  return spanned_mesh_axes(labels, None, split)


def _per_group_rows(t, groups, num_groups: int, q_dtype, mesh_axes: tuple):
  """t [n, c] quantized with a scale per (group, column) over the group's
  rows: (t / its rows' scales in q_dtype, the scales [E, c])."""
  t_amax = jax.ops.segment_max(jnp.abs(t).astype(jnp.float32), groups, num_groups)
  if mesh_axes:
    t_amax = jax.lax.pmax(t_amax, mesh_axes)
  scale = scale_of(t_amax, q_dtype)
  rows = jnp.take(scale, groups, axis=0, mode='clip')
  return fp8_ops.quantize(t, q_dtype, rows, t.dtype), scale


def _ragged_product(x, w, sizes, groups, q_dtypes, recipe: str, labels: str, split, dtype):
  """ragged_dot(x [n, c], w [E, c, o]) on FP8 operands (`ragged_dot`'s
  forward, and its dx with w transposed), scaled as `ragged_dot` says;
  `labels`: c's and o's in `split` ('ko' forward, 'ok' for dx)."""
  c, o = labels
  if recipe == 'rowwise':
    qx, sx = quantize(x, q_dtypes[0], (1,), _mesh(split, c))  # [n, 1]
    qw, sw = quantize(w, q_dtypes[1], (1,), _mesh(split, c))  # [E, 1, o]
    scale = sx * jnp.take(sw[:, 0], groups, axis=0, mode='clip')  # [n, o]
  else:
    qx, sx = quantize(x, q_dtypes[0], None, _mesh(split, 'ne' + c))
    qw, sw = quantize(w, q_dtypes[1], None, _mesh(split, 'e' + c + o))
    scale = sx * sw
  out = jax.lax.ragged_dot(qx, qw, sizes, preferred_element_type=dtype)
  return out * scale.astype(dtype)


# dw's ragged_dot_general: x [n, k] and g [n, o] contracted over their rows, group by group.
_PER_GROUP = jax.lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def _ragged_weight_grad(x, g, sizes, groups, recipe: str, split, dtype, g_dtype):
  """dw [E, k, o] = per group x^T g, x in E4M3 and g in `g_dtype`."""
  if recipe == 'rowwise':
    rows = _mesh(split, 'n')
    qx, sx = _per_group_rows(x, groups, sizes.shape[0], FORWARD, rows)  # [E, k]
    qg, sg = _per_group_rows(g, groups, sizes.shape[0], g_dtype, rows)  # [E, o]
    scale = sx[:, :, None] * sg[:, None, :]
  else:
    qx, sx = quantize(x, FORWARD, None, _mesh(split, 'nek'))
    qg, sg = quantize(g, g_dtype, None, _mesh(split, 'neo'))
    scale = sx * sg
  dw = jax.lax.ragged_dot_general(qx, qg, sizes, _PER_GROUP, preferred_element_type=dtype)
  return dw * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ragged(dtype, recipe: str, split: tuple, g_dtype, x, w, sizes):
  del g_dtype
  groups = _row_groups(sizes, x.shape[0])
  return _ragged_product(x, w, sizes, groups, (FORWARD, FORWARD), recipe, 'ko', split, dtype)


def _ragged_fwd(dtype, recipe: str, split: tuple, g_dtype, x, w, sizes):
  return _ragged(dtype, recipe, split, g_dtype, x, w, sizes), (x, w, sizes)


def _ragged_bwd(dtype, recipe: str, split: tuple, g_dtype, residuals, g):
  x, w, sizes = residuals
  groups = _row_groups(sizes, x.shape[0])
  # g [n, o] through w^T [E, o, k]: its scales per row over o, w's per (expert, k).
  wt = jnp.swapaxes(w, 1, 2)
  dx = _ragged_product(g, wt, sizes, groups, (g_dtype, FORWARD), recipe, 'ok', split, dtype)
  dw = _ragged_weight_grad(x, g, sizes, groups, recipe, split, dtype, g_dtype)
  return _like(dx, x), _like(dw, w), None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)
